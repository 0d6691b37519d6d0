#!/usr/bin/env bash
# Each rank's place on a GPU machine: its CPUs and GPUs in its start record, and the one line said
# when ranks share a GPU (docs/placement.md). Run from the repository root on a machine with at
# least one CUDA GPU and the kit's packages importable:
#   bash docs/benchmarks/placement_gpu.sh [OUT_DIR]
set -euo pipefail
out=${1:-/tmp/placement}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
small=(data.train_size=4096 data.test_size=512 train.epochs=1 cluster.backend=local)
starts() {  # each rank's place, from its start record
    python3 - "$@" <<'EOF'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*/metrics/rank-*.jsonl")):
    start = next(json.loads(l) for l in path.open() if '"start"' in l)
    keys = ("rank", "device", "cpus", "cpus_usable", "cpus_asked", "threads", "gpu_ids", "placement")
    print(json.dumps({k: start.get(k) for k in keys}))
EOF
}
nvidia-smi -L
echo "== DDP, one rank per GPU (local backend, every GPU here)"
gpus=$(nvidia-smi -L | wc -l)
python3 -m launch submit --mode ddp cluster.gpus_per_node="$gpus" "${small[@]}" \
    output.root="$out/ddp" --wait
starts "$out/ddp"
echo "== DP, one process driving every GPU"
python3 -m launch submit --mode dp cluster.gpus_per_node="$gpus" "${small[@]}" \
    output.root="$out/dp" --wait
starts "$out/dp"
echo "== two ranks on one GPU (torchrun, gloo): they share it, and the kit says so"
run=$(python3 -m launch prepare --mode ddp cluster.gpus_per_node=2 dist.backend=gloo \
    "${small[@]}" output.root="$out/shared")
CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc-per-node 2 -m train run "$run"
starts "$out/shared"
python3 -m launch status "$run"
python3 -m analysis summarize "$out/ddp" "$out/dp" "$out/shared" | tail -n 4
