#!/usr/bin/env bash
# The convergence arms at the tensor-core map's precision (docs/benchmarks.md, "The map at TF32 /
# bf16 in training"): GIFT with the product's defaults (`-dflt`) and its low-rank map's matmul
# operands rounded as the CUDA kernels round them (`-tf32`: what `map_precision="auto"` runs on a
# GPU; `-bf16`), emulated on the CPU (`bench.fidelity.map_emulation`). Reduce-scatter path, 2 ranks, Muon,
# the full profile, seeds 0-4: the settings of the frontier's `gift-nvfp4-dflt` / `gift-int2-dflt`.
# The exact-map arms are run again here, with the same code as the precision arms they are paired
# with per seed: the committed exact runs (convergence_runs_rs.jsonl, _frontier.jsonl) predate
# code changes that move the loss from step 5 on, before any map is active, by about as much as
# TF32 might (`bench.convergence.map_precision_arms` shows that drift). Appended to
# bench/results/convergence/convergence_runs_map_precision.jsonl (runs already there are skipped, so it can be
# stopped and restarted); seeds outermost within each pair, TF32 first (the GPU default), nvfp4
# (the default format) before int2, bf16 last. Then:
#   python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_map_precision.jsonl}
for arms in gift-nvfp4-dflt-tf32,gift-nvfp4-dflt gift-int2-dflt-tf32,gift-int2-dflt gift-nvfp4-dflt-bf16 \
  gift-int2-dflt-bf16; do
  $PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 --arms "muon=$arms" --jsonl "$OUT"
done
