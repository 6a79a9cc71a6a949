#!/usr/bin/env bash
# GIFT against the strongest cheap alternatives (docs/benchmarks.md, "The frontier", the
# alternatives table): the production bar (a bf16 wire summed in fp32, to nearest and with
# stochastic rounding), Euclidean + leaky error feedback (beta 0.9) and Euclidean + leaky EF + a
# Hadamard rotation in each scale block, at int3, int2b16 (2.5 bits) and int2, both optimizers,
# and GIFT's counterparts where the frontier lacks them. The frontier's design (reduce-scatter, 2
# ranks, 120 steps, paired seeds 0-4), appended to bench/results/convergence/convergence_runs_alternatives.jsonl
# (resumable: runs already there are skipped). Order: Muon's 2.5-bit and 2-bit points first (the
# README's recommendation), the bf16 bar, then int3 and AdamW. Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_alternatives.jsonl}
for spec in \
  "muon=euclid-int2b16-ef-b9,euclid-int2b16-ef-b9-rot" \
  "muon=euclid-int2-ef-b9,euclid-int2-ef-b9-rot" \
  "muon=euclid-bf16,euclid-bf16-sr" \
  "muon=euclid-int3-ef-b9,euclid-int3-ef-b9-rot,gift-int3-ef-b9-dflt" \
  "adamw=euclid-bf16,euclid-bf16-sr" \
  "adamw=euclid-int2b16-ef-b9,euclid-int2b16-ef-b9-rot" \
  "adamw=euclid-int3-ef-b9,euclid-int3-ef-b9-rot,gift-int3-ef-b9-dflt" \
  "adamw=euclid-int2-ef-b9,euclid-int2-ef-b9-rot,gift-int2-ef-b9-dflt" ; do
  $PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 --arms "$spec" --jsonl "$OUT"
done
