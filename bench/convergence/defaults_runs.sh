#!/usr/bin/env bash
# The defaults table (docs/benchmarks.md, "What the defaults deliver"): the product's default arm
# (-dflt: GiftConfig(format="nvfp4", geometry="auto") with optimizer=) on both paths, the same
# default without the refresh warm-up (-dflt-nowarm) and the default before select_metric followed
# the optimizer (-dflt-euc-nowarm), appended to the study's runs files (n=5 paired seeds; runs
# already in a file are skipped). Then:
#   python -m bench.run --profile full --only convergence --merge --convergence-runs \
#     bench/results/convergence/convergence_runs.jsonl bench/results/convergence/convergence_runs_rs.jsonl \
#     bench/results/convergence/convergence_runs_rs4.jsonl bench/results/convergence/convergence_runs_long.jsonl --sweep ... && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
$PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 \
  --arms "muon=fp32,gift-nvfp4-dflt,gift-nvfp4-dflt-euc-nowarm,gift-nvfp4-dflt-nowarm;adamw=fp32,gift-nvfp4-dflt,gift-nvfp4-dflt-nowarm" \
  --jsonl bench/results/convergence/convergence_runs_rs.jsonl
# the README's 4-rank row on the defaults (the selection's cost side priced against the layer's
# step time keeps the map at 256 tokens per rank, where the FLOPs-only rule dropped every layer)
$PY -m bench.convergence.runner --profile full --path reduce-scatter --world 4 --seeds 0,1,2,3,4 \
  --arms "muon=gift-nvfp4-dflt" --jsonl bench/results/convergence/convergence_runs_rs4.jsonl
$PY -m bench.convergence.runner --profile full --path all-reduce --seeds 0,1,2,3,4 \
  --arms "muon=fp32,gift-nvfp4-dflt" --jsonl bench/results/convergence/convergence_runs.jsonl
