"""The framework layer: where GIFT hooks into each way of training.

One adapter per way of training (the protocol in `adapter`, the table in `table`): plain
modules (`plain_sync`, over `routing`), DDP (`ddp`), FSDP2 (`fsdp2`, over `fsdp_internals`)
and SimpleFSDP's traced reduce-scatters (`simple_fsdp`); and what composes with them: HSDP's
replica hop (`hsdp`), tensor parallelism (`tensor_parallel`) and pipeline parts (`parts`). Imports the runtime and everything below it; `api` and the
torchtitan integration sit above (docs/architecture.md).
"""
