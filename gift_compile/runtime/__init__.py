"""The runtime layer: what GIFT keeps between steps and does once per step.

Per-layer state and `GiftState` (`layer`, `state`), the refresh engine (`refresh`), the
per-layer selection rule (`selection`), checkpointing (`checkpoint`), the end-of-backward
health checks (`health`) and telemetry (`telemetry`). Imports only the layers below
(docs/architecture.md): no framework adapter, no `api`.
"""
