#!/usr/bin/env bash
# The strategies on the token workload (model.name=gpt on data.dataset=tokens, AdamW), on every
# GPU of one node through `launch submit` (local backend): per strategy, the largest model (the
# widest GPT of the depth below that trains at the batch below), the largest batch of the GPT of
# WIDTH, and a training run of that GPT (one that fails, out of memory, says so and goes on).
# Without WIDTH: halfway between DDP's and FSDP's largest models, so that sharding alone trains it.
# Usage: bash docs/benchmarks/transformer.sh OUT_ROOT [WIDTH] [key=value …]  (GPUs only)
set -euo pipefail
out=${1:?usage: transformer.sh OUT_ROOT [WIDTH] [key=value …]}
shift
width=
if [[ ${1:-} =~ ^[0-9]+$ ]]; then width=$1 && shift; fi
python=${KIT_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
((gpus > 0)) || { echo "transformer.sh measures GPU memory: no GPU here" >&2; exit 2; }
common=(--nodes 1 cluster.backend=local "cluster.gpus_per_node=$gpus" "output.root=$out"
        data.dataset=tokens model.name=gpt data.seq_len=1024 data.vocab=32768 model.depth=24
        model.heads=16 train.optimizer=adamw train.lr=0.0003 train.precision=bf16
        train.global_batch_size=16 data.train_size=1024 data.test_size=128 train.epochs=2
        train.checkpoint=false cluster.timeout_min=30)
run() { "$python" -m launch submit "${common[@]}" "$@" --wait -q || echo "run failed: $*" >&2; }
strategies=("--mode dp" "--mode ddp" "--mode zero" "--mode fsdp")
declare -A widest
for strategy in "${strategies[@]}"; do
    # shellcheck disable=SC2086  # a strategy is a list of arguments, split on purpose
    said=$("$python" -m launch submit "${common[@]}" $strategy task=largest_model \
        model.width=1024 "$@" --wait) || echo "run failed: $strategy task=largest_model" >&2
    echo "$said" | tail -1
    widest[$strategy]=$(echo "$said" | sed -n 's/.*widest model that trains.* model\.width=\([0-9]*\).*/\1/p')
done
if [[ -z $width ]]; then  # a multiple of the heads (16), halfway between DDP's and FSDP's
    width=$(((${widest[--mode ddp]:-2048} + ${widest[--mode fsdp]:-2048}) / 32 * 16))
fi
echo "model.width=$width for the batch searches and the training runs"
for strategy in "${strategies[@]}"; do
    # shellcheck disable=SC2086
    run $strategy task=largest_batch "model.width=$width" "$@"
    # shellcheck disable=SC2086
    run $strategy "model.width=$width" "$@"
done
"$python" -m analysis summarize "$out"
