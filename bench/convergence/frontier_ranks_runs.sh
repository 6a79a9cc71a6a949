#!/usr/bin/env bash
# Does the 2-bit gap shrink with more data-parallel ranks? (docs/benchmarks.md, "The frontier",
# ranks.) Independent rounding on every rank averages down in the reduction, so at the same global
# batch 4 ranks should lose less than 2. Reduce-scatter path, Muon, 120 steps, paired seeds 0-4, 4
# gloo ranks on the profile's global batch (`--world 4` keeps it), appended to
# bench/results/convergence/convergence_runs_frontier4.jsonl (resumable). The 4-rank fp32 arm it pairs with is
# in convergence_runs_rs4.jsonl, the 2-rank int2 arms (euclid-int2, gift-int2) in
# convergence_runs_rs.jsonl. GIFT runs the study's arm (every layer transformed, refresh 20), not
# the defaults: at 4 ranks this model has 256 tokens per rank and step, so the rank-32 map's
# FLOPs ((2r + 1) / tokens = 0.254 of the layer's backward) pass the default selection's cap
# (`auto_max_overhead` = 0.25) and `gift-int2-dflt` kept no layer (seed 0, recorded in the file:
# bit-identical to Euclidean). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_frontier4.jsonl}
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 4 --seeds 0,1,2,3,4 \
  --arms "muon=euclid-int2,gift-int2" --jsonl "$OUT"
