#!/usr/bin/env bash
# The 2.5-bit pair on a study model about 4x larger (docs/benchmarks.md, "The frontier's pair on
# a larger model"): `--model x4` (`bench.convergence.arms.MODELS`: width 384, 6 layers, 13.8M
# parameters against the small model's 3.3M), Muon, GIFT + leaky EF with the product's defaults
# against Euclidean + leaky EF + block rotation at int2 with a scale per 16 elements, and fp32,
# reduce-scatter path, 2 ranks, 120 steps, paired seeds 0-4. Appended to
# bench/results/convergence/convergence_runs_x4.jsonl (resumable; ~12 minutes per run on 2 free cores). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_x4.jsonl}
$PY -m bench.convergence.runner --profile full --model x4 --path reduce-scatter --seeds 0,1,2,3,4 \
  --arms "muon=fp32,gift-int2b16-ef-b9-dflt,euclid-int2b16-ef-b9-rot" --jsonl "$OUT"
