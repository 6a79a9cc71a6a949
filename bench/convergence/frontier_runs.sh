#!/usr/bin/env bash
# The rate-distortion frontier (docs/benchmarks.md, "The frontier"): reduce-scatter path, 2 ranks,
# Muon, paired seeds 0-4, appended to bench/results/convergence/convergence_runs_frontier.jsonl (runs already
# there are skipped, so it can be stopped and restarted). The fp32 arm and the NVFP4 / int2 study
# arms come from convergence_runs_rs.jsonl (same path, ranks, steps, seeds: the pairs match).
# GIFT arms run the product's defaults (`-dflt`: GiftConfig(format=F, geometry="auto") with
# optimizer=); Euclidean arms are geometry="none". Pairs are run in order of importance (the
# 2-bit region first: int2 with GIFT's defaults is the goal's point), each pair to n=5 before the
# next starts; GIFT + EF with a leaky residual (beta 0.9, `-b9`) right after it, the technique most
# likely to move the 2-bit point. Last, 2-bit codes with a scale per 16 elements (`int2b16`, 2.5
# bits: the goal's bit budget spent on finer scales rather than a wider code). Then:
#   python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_frontier.jsonl}
for arms in \
  "euclid-int3,gift-int3-dflt" \
  "gift-int2-dflt,gift-int2-ef-dflt" \
  "gift-int2-ef-b9-dflt" \
  "euclid-int3-ef,gift-int3-ef-dflt" \
  "euclid-ternary,gift-ternary-dflt" \
  "euclid-ternary-ef,gift-ternary-ef-dflt" \
  "euclid-int6,gift-int6-dflt" \
  "gift-nvfp4-ef-dflt,gift-int4-dflt" \
  "euclid-int4,euclid-fp8" \
  "gift-int2b16-ef-b9-dflt,euclid-int2b16-ef" \
  "gift-int2b16-dflt,euclid-int2b16" ; do
  $PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 --arms "muon=$arms" --jsonl "$OUT"
done
# AdamW (fp32, Euclidean nvfp4 / int2 (+EF) and GIFT nvfp4 come from the study's files): Muon's
# 2.5-bit point and the int3 pair that places each method's frontier between 4.5 and 2.5 bits.
for arms in \
  "gift-int2b16-ef-b9-dflt,euclid-int2b16-ef" \
  "gift-int3-dflt,euclid-int3" ; do
  $PY -m bench.convergence.runner --profile full --path reduce-scatter --seeds 0,1,2,3,4 --arms "adamw=$arms" --jsonl "$OUT"
done
