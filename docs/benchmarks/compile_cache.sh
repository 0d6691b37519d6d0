#!/bin/bash
# The fast path twice on one GPU: the first job compiles (cold compile cache), the second loads
# what the first saved (warm). Prints each job's --wait lines; the run folders go to OUT/runs.
#   bash docs/benchmarks/compile_cache.sh OUT [more settings]
# A cold machine: run it where /tmp/torchinductor_$USER is empty (a fresh machine), else the
# node's own Inductor cache makes the first job warmer than a new node's.
set -euo pipefail
OUT=${1:?usage: compile_cache.sh OUT [settings]}
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for attempt in cold warm; do
    echo "== $attempt"
    /usr/bin/time -f "$attempt: %e s from submission to the end of the job" \
        python3 -m launch submit --mode ddp --config docs/examples/fast.yaml \
        cluster.backend=local "cluster.gpus_per_node=$GPUS" train.epochs=5 \
        "output.root=$OUT/runs" "data.root=$OUT/data" "$@" --wait
done
