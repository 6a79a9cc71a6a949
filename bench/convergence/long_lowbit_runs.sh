#!/usr/bin/env bash
# A longer horizon for the recommended low-bit configuration (docs/benchmarks.md, "The frontier"):
# Muon at 2.5 bits (int2, a scale per 16 elements), GIFT + leaky error feedback with the product's
# defaults against the best Euclidean arm at the same bits in the 120-step alternatives table
# (Euclidean + leaky EF + block rotation), at 4x the frontier's steps (480), paired seeds 0-2, on
# the reduce-scatter path, 2 ranks; the 480-step fp32 arm they pair with is in
# convergence_runs_long.jsonl. Appended to bench/results/convergence/convergence_runs_long_lowbit.jsonl
# (resumable; about 10 minutes per run on 2 cores). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_long_lowbit.jsonl}
LONG_OUT=${LONG_OUT:-bench/results/convergence/convergence_runs_long.jsonl}
$PY -m bench.convergence.runner --profile full --path reduce-scatter --steps 480 --seeds 0,1,2,3,4 \
  --arms "muon=gift-int2b16-ef-b9-dflt,euclid-int2b16-ef-b9-rot" --jsonl "$OUT"
$PY -m bench.convergence.runner --profile full --path reduce-scatter --steps 480 --seeds 0,1,2,3,4 \
  --arms "muon=fp32" --jsonl "$LONG_OUT"
