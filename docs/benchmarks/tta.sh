#!/bin/bash
# Time to accuracy and energy, cold and warm, per strategy and preset, on this machine's GPUs:
# DP and DDP on the default path, then each preset twice (cold: the first job of its workload;
# warm: the next one, which finds the first one's compile cache). Article settings otherwise.
#   bash docs/benchmarks/tta.sh OUT [more settings]
# REPEATS=N runs the default path's DP and DDP N times each (default 1); PRESETS="quick" leaves
# fast.yaml out (default "quick fast"), PRESETS="quick fast-default" runs fast.yaml with the
# default compile mode alone (max-autotune's cold compile takes minutes).
# Every job compiles into an Inductor folder of its own, as a job on another node would: what a
# warm job finds comes from the kit's compile cache (OUT/runs/compile-cache), nothing else.
set -euo pipefail
OUT=${1:?usage: tta.sh OUT [settings]}
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
submit() {  # NAME ROOT, then the submission's own arguments
    local name=$1 root=$2
    shift 2
    echo "== $name"
    TORCHINDUCTOR_CACHE_DIR="$OUT/inductor/$name" /usr/bin/time -f "$name: %e s submission to end" \
        python3 -m launch submit "$@" cluster.backend=local "cluster.gpus_per_node=$GPUS" \
        "output.root=$root" "data.root=$OUT/data" --wait
}
# The digits made once beforehand: no timed job pays for making them.
submit digits "$OUT/prepare" --mode ddp train.epochs=1 "$@"
for _ in $(seq "${REPEATS:-1}"); do
    submit dp "$OUT/runs" --mode dp "$@"
    submit ddp "$OUT/runs" --mode ddp "$@"
done
presets=" ${PRESETS:-quick fast} "
for preset in ${presets/fast-default/}; do
    for attempt in cold warm; do
        submit "$preset-$attempt" "$OUT/runs" --mode ddp --config "docs/examples/$preset.yaml" "$@"
    done
done
if [[ $presets == *" fast "* || $presets == *" fast-default "* ]]; then
    for attempt in cold warm; do  # fast.yaml with the default compile mode: no autotuning
        submit "fast-default-$attempt" "$OUT/runs" --mode ddp --config docs/examples/fast.yaml \
            train.compile_mode=default "$@"
    done
fi
python3 -m analysis summarize "$OUT/runs"
python3 docs/benchmarks/tta_runs.py "$OUT/runs"
