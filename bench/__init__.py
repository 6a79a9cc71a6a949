"""GIFT benchmarks: `python -m bench.run [--quick]` writes bench/results/REPORT.md, PNGs, results.json.

The bench is a package of rooms, lowest first; a room imports only rooms below it:
`bench.lib` (the study model, reference gradients and optimizers, settings, statistics,
formatting), `bench.fidelity` (what the codec does to one exchange and what it costs), then
`bench.convergence` (training studies and the frontier), `bench.step_model` (step-time models),
`bench.cluster` (multi-rank and topology experiments) and `bench.gpu` (the single-GPU check),
then `bench.pages` (page generators, which only read results), and `bench.run` (the command
that runs the report's sections) on top. Each room's `__init__` says what lives there; its
results live in `bench/results/<room>/`.
"""
