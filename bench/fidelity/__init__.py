"""What the codec does to one gradient exchange, measured on real gradients without training:
fidelity per format and geometry (`round_trip`), the tuning sweep (`sweep`), the sketch, the
second hop, the tensor-core map's emulated precision, the delayed scale, and what the codec
costs (overhead, the bytes a body needs, kernel traffic, per-item codec, memory). It imports
`bench.lib` only; the convergence, step-model, cluster and GPU rooms build on it, and its
results live in `bench/results/fidelity/`."""
