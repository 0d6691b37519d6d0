"""Start-up: from the command to the first training step, the kit against a bare `torchrun`.

Per repeat, on this machine: `python -m launch submit --mode ddp --wait` (local backend, one epoch)
and `torchrun docs/benchmarks/bare_ddp.py` (the same work up to the first step, no launcher), each
timed from the moment the command starts to the moment rank 0 is about to take its first step
(the kit: its start record). The kit's own start-up parts (from its start record) say where its
time goes. GPUs: all of this machine's (on CPU: 2 processes).

Usage: PYTHONPATH=. python docs/benchmarks/startup.py OUT [REPEATS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from slurm_ddp_kit.core import datafiles


def kit(out: Path, gpus: int) -> dict[str, float]:
    before = set((out / "kit").glob("*")) if (out / "kit").exists() else set()
    command = [sys.executable, "-m", "launch", "submit", "--mode", "ddp", "--nodes", "1",
               "cluster.backend=local", f"cluster.gpus_per_node={gpus}", f"output.root={out}/kit",
               f"data.root={out}/data", "train.checkpoint=false", "train.epochs=1", "--wait", "-q"]  # fmt: skip
    started = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (run,) = set((out / "kit").glob("*")) - before
    records = [json.loads(line) for line in (run / "metrics" / "rank-00000.jsonl").open()]
    start = next(r for r in records if r["kind"] == "start")
    task_began = start["time"] - start["startup_s"]
    return {"ready_s": start["time"] - started, "launcher_s": task_began - started,
            **start["startup_parts"]}  # fmt: skip


def bare(out: Path, gpus: int) -> dict[str, float]:
    folder = datafiles.dataset_dir("synthetic", out / "data", 0, 60000, 10000)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={gpus}", "docs/benchmarks/bare_ddp.py", str(folder)]  # fmt: skip
    started = time.time()
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    ready = next(
        float(line.split()[1]) for line in printed.splitlines() if line.startswith("ready")
    )
    return {"ready_s": ready - started}


def main() -> None:
    out, repeats = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
    gpus = torch.cuda.device_count() or 2
    os.environ.setdefault("PYTHONPATH", ".")
    kits, bares = [], []
    for _ in range(repeats):
        kits.append(kit(out, gpus))
        bares.append(bare(out, gpus))
    print(f"{gpus} ranks, {repeats} repeats, median seconds from the command to the first step:")
    for name, runs in (("kit (launch submit)", kits), ("bare torchrun", bares)):
        each = ", ".join(f"{r['ready_s']:.2f}" for r in runs)
        print(f"  {name:22s} {statistics.median(r['ready_s'] for r in runs):6.2f}  (each: {each})")
    print("  the kit's parts (median):")
    for part in kits[0]:
        if part != "ready_s":
            print(f"    {part:20s} {statistics.median(r[part] for r in kits):6.2f}")


if __name__ == "__main__":
    main()
