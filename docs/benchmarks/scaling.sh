#!/usr/bin/env bash
# Scaling from one GPU to every GPU of this node (1, 2, 4, 8 as far as it has them), DDP through
# `launch submit` (local backend): the default path and the fast path at the article's settings
# (global batch 512, 10 epochs, lr 0.01, the embedded 60k/10k digits), and speed.sh's
# compute-bound workload (the fast path at a global batch of 16 000 over 240 000 digits); then
# the table of s/epoch and speed-up over one GPU per path (scaling_table.py). Needs CUDA GPUs.
# The fast path compiles with compile_mode=default: max-autotune would compile minutes more for
# each per-GPU batch. Usage: bash docs/benchmarks/scaling.sh OUT_ROOT [REPEATS]
set -euo pipefail
out=${1:?usage: scaling.sh OUT_ROOT [REPEATS]}
repeats=${2:-2}
python=${KIT_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
found=$("$python" -c 'import torch; print(torch.cuda.device_count())')
((found > 0)) || { echo "scaling.sh needs CUDA GPUs (none found)" >&2; exit 2; }
common=(--mode ddp --nodes 1 cluster.backend=local "output.root=$out" "data.root=$out/data"
        train.checkpoint=false cluster.timeout_min=15)
run() { "$python" -m launch submit "${common[@]}" "$@" --wait -q || echo "run failed: $*" >&2; }
fast=(--config docs/examples/fast.yaml train.compile_mode=default)
big=("${fast[@]}" train.global_batch_size=16000 data.train_size=240000)
for gpus in 1 2 4 8; do
    ((gpus <= found)) || break
    for _ in $(seq "$repeats"); do
        run "cluster.gpus_per_node=$gpus"
        run "cluster.gpus_per_node=$gpus" "${fast[@]}"
    done
    run "cluster.gpus_per_node=$gpus" "${big[@]}"
done
"$python" docs/benchmarks/scaling_table.py "$out"
