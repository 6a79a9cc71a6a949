#!/usr/bin/env bash
# The whole gradient (docs/benchmarks.md, "The whole gradient"): the recipe-like arm
# `gift-int2-ef-b9-dflt-rot` (int2, leaky EF, block rotation, the product's map) with the embedding
# and output head at int2 (`-uw`: `excluded_format="same"`) and at bf16 (`-ubf`: the default),
# Muon, reduce-scatter path, 2 ranks, 120 steps, paired seeds 0-4; the same arm with them raw at
# fp32 and fp32 itself are the committed study runs (convergence_runs_techniques.jsonl,
# convergence_runs_rs.jsonl). Appended to bench/results/convergence/convergence_runs_whole_gradient.jsonl
# (resumable; ~3 minutes per run on 2 free cores). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_whole_gradient.jsonl}
$PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 \
  --arms "muon=gift-int2-ef-b9-dflt-rot-uw,gift-int2-ef-b9-dflt-rot-ubf" --jsonl "$OUT"
