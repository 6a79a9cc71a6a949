#!/usr/bin/env bash
# Techniques that could move the 2-bit point (docs/benchmarks.md, "Techniques at 2 bits"): each
# arm is the frontier arm it modifies plus one technique, on the frontier's design (reduce-scatter,
# 2 ranks, 120 steps, Muon, paired seeds 0-4), appended to bench/results/convergence/convergence_runs_techniques.jsonl
# (resumable: runs already there are skipped). The arms they are paired with are the frontier's
# (convergence_runs_frontier.jsonl, convergence_runs_rs.jsonl). The per-layer-bits arms read the
# allocation `python -m bench.convergence.bit_allocation` measured (bench/results/convergence/bit_allocation.json). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_techniques.jsonl}
# block rotation (`block_rotation=True`) on GIFT with leaky EF (the frontier's best 2-bit method) and
# on Euclidean; per-layer bits at int2's bytes (`layer_formats`) on the same two
for arms in \
  "gift-int2-ef-b9-dflt-rot,euclid-int2-rot" \
  "gift-int2-ef-b9-dflt-alloc,euclid-int2-alloc" ; do
  $PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 --arms "muon=$arms" --jsonl "$OUT"
done
