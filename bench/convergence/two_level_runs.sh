#!/usr/bin/env bash
# The two-level exchange in the frontier (docs/benchmarks.md, "Two levels at 2 x 2"): 4 ranks as 2
# nodes x 2 (`GiftConfig.ranks_per_node=2`, arms `-2l`) against the same arm flat (one level), on
# the reduce-scatter path, 120 steps, paired seeds 0-4: the defaults at int2 (`gift-int2-dflt`),
# then the recipes `muon-nvfp4` (`gift-nvfp4-dflt`) and `muon-int2-leaky-ef`
# (`gift-int2-ef-b9-dflt-rot`). Their fp32 at 4 ranks is convergence_runs_rs4.jsonl's (seeds 0-4;
# the fp32 path has no GIFT code). Appended to bench/results/convergence/convergence_runs_two_level.jsonl
# (resumable; ~10 minutes per 4-rank run on 2 free cores). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_two_level.jsonl}
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 4 --seeds 0,1,2,3,4 \
  --arms "muon=gift-int2-dflt-2l,gift-int2-dflt,gift-nvfp4-dflt-2l,gift-nvfp4-dflt,gift-int2-ef-b9-dflt-rot-2l,gift-int2-ef-b9-dflt-rot" \
  --jsonl "$OUT"
