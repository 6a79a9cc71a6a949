"""GIFT benchmarks: `python -m bench.run [--quick]` writes bench/results/REPORT.md, PNGs, results.json.

One concern per module: `settings` (profile sizes), `reference` (train and cache the reference
model, collect real gradients and K-FAC factors), `fidelity` (round-trip, whitened-metric and
multi-rank errors), `overhead` (compiled codec kernel times and FLOP/byte accounting), `wire`
(bytes per step), `convergence` (2-rank gloo pretraining), `step_model` (64-GPU projection),
`plots` and `report` (figures and markdown), `run` (the command).
"""
