"""The single-GPU measurement `make gpu-check` runs (`check`, with its timers in `timing`, the
folded projection in `fold` and the GPU.md renderer in `report`); its committed H200 results
are `bench/results/gpu/gpu_h200/`. It imports `bench.lib` and `bench.fidelity` (the codec
bodies and their byte floor) and nothing above."""
