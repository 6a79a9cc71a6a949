"""Training studies: the convergence runner and its arms, summary and tuning runs, the
rate-distortion frontier, the per-layer bit allocation and the map-precision arms, with the
shell scripts that drive the committed runs (`*_runs.sh`, appending to
`bench/results/convergence/`). It imports `bench.lib` and `bench.fidelity` (the round trip and
the map emulation it trains with), never the pages that render it."""
