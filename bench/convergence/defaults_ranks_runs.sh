#!/usr/bin/env bash
# The defaults at more ranks after the selection's cost side was priced against the layer's step
# time (docs/benchmarks.md, "The frontier", more ranks): `gift-int2-dflt` (GiftConfig(format="int2",
# geometry="auto") with optimizer=, Muon) on the frontier's design at the same global batch, 4 ranks
# (256 tokens per rank and step) and 2 ranks with paired seeds 0-4 (both rules keep every layer at
# 512 tokens per rank, yet the seed-0 runs part at ~1e-5 from step 7, so the 2-rank row has its
# own runs), and at 8 ranks seeds 0-4 of fp32, Euclidean int2 and the defaults (128 tokens per
# rank; 5-6 minutes a run on 2 cores), appended to
# bench/results/convergence/convergence_runs_defaults_ranks.jsonl (resumable). The 4-rank fp32 and Euclidean
# arms it pairs with are in convergence_runs_rs4.jsonl / convergence_runs_frontier4.jsonl. Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_defaults_ranks.jsonl}
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 4 --seeds 0,1,2,3,4 --arms "muon=gift-int2-dflt" --jsonl "$OUT"
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 2 --seeds 0,1,2,3,4 --arms "muon=gift-int2-dflt" --jsonl "$OUT"
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 8 --seeds 0,1,2,3,4 --arms "muon=gift-int2-dflt,fp32,euclid-int2" --jsonl "$OUT"
