"""The exchange layer: how one bucket of gradients crosses the wire.

Plans (`plan`), byte accounting (`accounting`), the per-item codec (`item_codec`), the bucket
core and its compiled bodies (`bucket`, `compiled_bodies`), the plan agreement across ranks
(`agreement`), the collectives every framework hook and the FX pass call (`collectives`) and
the `gift::mark` op that carries a layer's plan into graphs (`mark`). Imports only the codec,
the config, `sync` and the geometry layer (docs/architecture.md).
"""
