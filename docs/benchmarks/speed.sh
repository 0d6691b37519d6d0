#!/usr/bin/env bash
# The speed benchmark: the kit's default DDP and DP (the article recipe's equivalent), each speed
# option added one at a time on DDP, the fast path (docs/examples/fast.yaml) on all GPUs and on
# one, at the article's settings (global batch 512, 10 epochs, lr 0.01, the embedded 60k/10k
# digits); then a compute-bound workload on all GPUs and on one. Through `launch submit` (local
# backend). Needs CUDA GPUs.
# Usage: bash docs/benchmarks/speed.sh OUT_ROOT [REPEATS]
set -euo pipefail
out=${1:?usage: speed.sh OUT_ROOT [REPEATS]}
repeats=${2:-2}
python=${KIT_PYTHON:-python3}
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
common=(--nodes 1 cluster.backend=local "output.root=$out" train.checkpoint=false cluster.timeout_min=10)
run() { "$python" -m launch submit "${common[@]}" "$@" --wait -q || echo "run failed: $*" >&2; }
fast=(--config docs/examples/fast.yaml)
for i in $(seq "$repeats"); do
    run --mode ddp "cluster.gpus_per_node=$gpus"
    run --mode dp "cluster.gpus_per_node=$gpus"
    run --mode ddp "cluster.gpus_per_node=$gpus" "${fast[@]}"
done
# One option at a time, added in the order of the fast path.
steps=(data.on_device=true train.precision=bf16 train.channels_last=true train.cudnn_benchmark=true train.cuda_graph=true)
options=()
for step in "${steps[@]}"; do
    options+=("$step")
    run --mode ddp "cluster.gpus_per_node=$gpus" "${options[@]}"
done
run --mode ddp cluster.gpus_per_node=1 "${fast[@]}"
# A compute-bound workload (item: scaling where launching kernels is not the limit): the fast path
# at a global batch of 16 000 over 240 000 digits (15 steps an epoch), on all GPUs and on one.
# compile_mode=default: max-autotune would compile minutes more for each new shape.
big=("${fast[@]}" train.global_batch_size=16000 data.train_size=240000 train.compile_mode=default)
run --mode ddp "cluster.gpus_per_node=$gpus" "${big[@]}"
run --mode ddp cluster.gpus_per_node=1 "${big[@]}"
run --mode ddp cluster.gpus_per_node=1
