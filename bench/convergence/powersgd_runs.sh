#!/usr/bin/env bash
# torch's PowerSGD against GIFT on the all-reduce path (docs/benchmarks.md, "The frontier against
# PowerSGD"): torch's DistributedDataParallel with torch's own `powerSGD_hook` (error feedback and
# warm start on, compression from the end of the learning-rate warm-up, torch's default
# min_compression_rate), matrix_approximation_rank 4, 2, 8, 1, 16, paired seeds 0-4, 2 ranks, 120
# steps; the same model, data order, initialisation and optimizer as the study's all-reduce arms in
# convergence_runs.jsonl (fp32 and GIFT's all-reduce arms at n=5 under both optimizers), which they
# pair with. `fp32-ddp` (plain DDP, seed 0) checks that DDP's fp32 path trains as the study's fp32
# all-reduce arm does. Usage: bash bench/powersgd_runs.sh [muon|adamw|both] (default both, Muon
# first). Appended to bench/results/convergence/convergence_runs_powersgd.jsonl (resumable; ~3 minutes per run
# on 2 free cores). Then: python -m bench.convergence.frontier && python -m bench.pages.readme
source "$(dirname "$0")/runs_env.sh"
OUT=${OUT:-bench/results/convergence/convergence_runs_powersgd.jsonl}
WHICH=${1:-both}
ARMS=powersgd-r4,powersgd-r2,powersgd-r8,powersgd-r1,powersgd-r16
for opt in muon adamw; do
  if [ "$WHICH" != both ] && [ "$WHICH" != "$opt" ]; then continue; fi
  $PY -m bench.convergence.runner --profile full --path all-reduce --seeds 0 --arms "$opt=fp32-ddp" --jsonl "$OUT"
  $PY -m bench.convergence.runner --profile full --path all-reduce --seeds 0,1,2,3,4 --arms "$opt=$ARMS" --jsonl "$OUT"
done
