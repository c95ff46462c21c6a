#!/usr/bin/env bash
# Throughput of examples/synthetic_benchmark.py under each DistributedOptimizer
# scheduling option, same machine, same run. Usage: bash benchmarks/bench_torch_options.sh [model] [workers] [servers]
set -u
model=${1:-mlp}; w=${2:-2}; s=${3:-1}
for opts in "GRADHUB_SCHEDULING=fifo" "GRADHUB_SCHEDULING=priority" "GRADHUB_OVERLAP_FORWARD=1" \
            "GRADHUB_OPTIMIZER_ON_SERVER=1" "GRADHUB_OPTIMIZER_ON_SERVER=1 GRADHUB_OVERLAP_FORWARD=1"; do
  line=$(env $opts timeout 600 gradhub launch -w "$w" -s "$s" -- python examples/synthetic_benchmark.py \
      --model "$model" --batch-size 16 --num-warmup-batches 5 --num-batches-per-iter 10 --num-iters 5 2>&1 \
      | grep "Total img/sec" | sed 's/.*Total/Total/')
  printf '%-60s %s\n' "$opts" "$line"
done
