#!/bin/bash
# Start-up on CPU, two trees alternately: a 2-rank local DDP job of 2,000 digits, one epoch,
# from the command to rank 0's start record (written just before its first step), and the
# rank's start-up parts. Run from the repository root with the kit's venv.
#   bash docs/benchmarks/startup_cpu.sh OLD_TREE NEW_TREE [REPEATS]
set -euo pipefail
PY=${PY:-$PWD/.venv/bin/python}
for _ in $(seq "${3:-3}"); do
    for tree in "$1" "$2"; do
        root=$(mktemp -d)
        started=$(date +%s.%N)
        (cd "$tree" && PYTHONPATH=$tree "$PY" -m launch submit --mode ddp --nodes 1 \
            cluster.backend=local cluster.gpus_per_node=2 data.train_size=2000 data.test_size=500 \
            train.epochs=1 train.checkpoint=false "output.root=$root" data.root=/tmp/startup-cpu-data \
            -q --wait >/dev/null)
        "$PY" - "$root" "$started" "$tree" <<'PY'
import json, sys
from pathlib import Path
root, started, tree = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
(rank0,) = root.glob("*/metrics/rank-00000.jsonl")
start = next(r for r in map(json.loads, rank0.open()) if r["kind"] == "start")
parts = " ".join(f"{k} {v:.2f}" for k, v in start["startup_parts"].items())
print(f"{tree}: command -> first step {start['time'] - started:.2f} s ({parts})")
PY
        rm -rf "$root"
    done
done
