#!/usr/bin/env bash
# The strategies side by side on three workloads: DP, DDP, DDP with the bf16 all-reduce hook,
# ZeRO and FSDP, each trained once and searched for its largest batch, on every GPU of one node
# through `launch submit` (local backend). The workloads:
#   1. the article's: the ConvNet on the embedded 60k/10k digits, global batch 512, 10 epochs;
#   2. torchvision's ResNet-18 on embedded 3 × 32² colour patterns (50k/10k, 10 classes), 3 epochs;
#   3. many classes: the ConvNet with a 100 000-class head on 1 × 28² patterns, 3 epochs; its
#      logits (400 kB a sample) are what DataParallel gathers on its main card.
# Without a GPU the same training runs go on 2 CPU workers, the GPU figures read n/m, and the
# largest-batch searches are left out (on CPU they measure nothing).
# Usage: bash docs/benchmarks/workloads.sh OUT_ROOT [key=value …]  (appended to every run)
set -euo pipefail
out=${1:?usage: workloads.sh OUT_ROOT [key=value …]}
shift
python=${KIT_PYTHON:-python3}
found=$("$python" -c 'import torch; print(torch.cuda.device_count())')
gpus=$((found > 0 ? found : 2))
common=(--nodes 1 cluster.backend=local "cluster.gpus_per_node=$gpus" "output.root=$out"
        train.checkpoint=false cluster.timeout_min=20)
# One run: the script's settings ($1, a list in one string) as a settings file that the user's
# key=value words (the rest) override; the kit refuses a setting given twice on one line.
run() {
    local mine=$1 file
    shift
    file=$(mktemp --suffix=.yaml)
    # shellcheck disable=SC2086  # the string is a list of settings, split on purpose
    if "$python" -m launch config "${common[@]}" $mine > "$file"; then
        "$python" -m launch submit --config "$file" "$@" --wait -q || echo "run failed: $mine $*" >&2
    else
        echo "run failed: $mine $*" >&2
    fi
    rm -f "$file"
}
strategies=("--mode dp" "--mode ddp" "--mode ddp dist.comm_hook=bf16" "--mode zero" "--mode fsdp")
workloads=(
    ""
    "model.name=resnet18 data.dataset=patterns data.train_size=50000 train.epochs=3"
    "data.dataset=patterns data.channels=1 data.image_size=28 data.classes=100000 train.epochs=3"
)
for workload in "${workloads[@]}"; do
    for strategy in "${strategies[@]}"; do
        run "$strategy $workload" "$@"
    done
    ((found > 0)) || continue
    for strategy in "${strategies[@]}"; do
        run "$strategy task=largest_batch $workload" "$@"
    done
done
