#!/bin/sh
# The plots of docs/planning.md, redrawn from the current model by
# `gradhub plan --plot` (needs matplotlib: pip install gradhub[bench]).
# Run from the repository root: sh docs/bench/plan/plots.sh
set -e
out=docs/bench/plan
# BytePS's setup, as the Scaling table of docs/planning.md: 8 machines of 8 GPUs at 25 Gbit/s,
# 8 threads per server, up to as many CPU-only machines.
for model in resnet50 vgg16 bert_large; do
    gradhub plan --model "$model" --hosts 8 --workers-per-host 8 --rate 25gbit --cpu-available 8 --server-threads 8 \
        --plot "$out/plan_$model.svg"
done
# docs/planning.md's first example, with prices: cost per sample too.
gradhub plan --model vgg19 --hosts 8 --workers-per-host 8 --rate 25gbit --cpu-available 4 \
    --gpu-price 24 --cpu-price 2 --plot "$out/plan_vgg19_prices.svg"
