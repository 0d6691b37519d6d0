#!/usr/bin/env bash
# The benchmark behind the published comparison table: DP and DDP at the article's settings
# (global batch 512, 10 epochs, lr 0.01, the embedded 60k/10k digits), each repeated, plus the
# largest-batch search per strategy, on every GPU of one node, through `launch submit` (local
# backend). Without a GPU the same commands run with 4 CPU workers and the GPU figures read n/m.
# Usage: bash docs/benchmarks/run.sh OUT_ROOT [REPEATS [key=value …]]
set -euo pipefail
out=${1:?usage: run.sh OUT_ROOT [REPEATS [key=value …]]}
repeats=${2:-3}
shift $(($# < 2 ? $# : 2))
python=${KIT_PYTHON:-python3}
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count() or 4)')
common=(--nodes 1 cluster.backend=local "cluster.gpus_per_node=$gpus" "output.root=$out" train.checkpoint=false)
# The script's settings as a settings file that the user's key=value words override (the kit
# refuses a setting given twice on one line).
file=$(mktemp --suffix=.yaml)
trap 'rm -f "$file"' EXIT
submit() {
    "$python" -m launch config "${common[@]}" "$@" > "$file"
    "$python" -m launch submit --config "$file" "${user[@]}" --wait
}
user=("$@")
for i in $(seq "$repeats"); do
    for mode in dp ddp; do
        submit --mode "$mode"
    done
done
for mode in dp ddp; do
    submit --mode "$mode" task=largest_batch
done
