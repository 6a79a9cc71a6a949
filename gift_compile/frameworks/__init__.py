"""The framework layer: where GIFT hooks into each way of training.

Plain modules (`plain_sync`, `routing`, `mark` users), DDP (`ddp`), FSDP2 (`fsdp2`, over
`fsdp_internals`), HSDP's replica hop (`hsdp`), tensor parallelism (`tensor_parallel`) and
pipeline parts (`parts`). Imports the runtime and everything below it; `api` and the
torchtitan integration sit above (docs/architecture.md).
"""
