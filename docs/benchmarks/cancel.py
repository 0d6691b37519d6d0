"""Cancel: how long the rank processes of a 2-node Slurm job live after `launch cancel`.

Starts a test cluster (slurm/testcluster: 2 nodes, with TESTCLUSTER_NETNS=1 in network namespaces
of their own), then per repeat submits a 2-node DDP job through `launch submit` (one rank a node,
training flat out on the embedded digits), waits for its first epoch, runs `launch cancel RUN`
and times from that command's start until no process whose command line names the run folder
is left (the ranks, their task shells, srun and the batch script). Needs root (the daemons).

Usage: PYTHONPATH=. python docs/benchmarks/cancel.py OUT [REPEATS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "testcluster"


def tasks_of(run_dir: Path) -> list[int]:
    """Processes whose command line names the run folder."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir) in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def one_cancel(out: Path, env: dict[str, str], repeat: int) -> dict[str, float]:
    root = out / f"runs-{repeat}"
    command = [sys.executable, "-m", "launch", "submit", "--mode", "ddp", "--nodes", "2",
               "cluster.backend=slurm", "cluster.gpus_per_node=1", "cluster.cpus_per_task=1",
               "data.train_size=4096", "data.test_size=256", "train.epochs=200",
               f"output.root={root}", f"data.root={out}/data"]  # fmt: skip
    submitted = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    run_dir = Path(submitted.stdout.split("run folder: ")[1].split()[0])
    metrics = run_dir / "metrics" / "rank-00000.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and '"kind": "epoch"' in metrics.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"no first epoch in 600 s: {run_dir}")
        time.sleep(0.2)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "launch", "cancel", str(run_dir)], env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    said = time.monotonic() - started
    while tasks_of(run_dir):
        time.sleep(0.05)
    return {"cancel_command_s": said, "processes_gone_s": time.monotonic() - started}


def main(out: Path, repeats: int) -> None:
    cluster = out / "cluster"
    subprocess.run(["bash", str(CLUSTER / "start.sh"), str(cluster), "2"], check=True)
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "KIT_PYTHON": sys.executable,
           "PYTHONPATH": str(REPO)}  # fmt: skip
    try:
        figures = [one_cancel(out, env, r) for r in range(repeats)]
    finally:
        subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(cluster)], check=False)
    load = os.getloadavg()[0]
    summary = {key: statistics.median(f[key] for f in figures) for key in figures[0]}
    print(json.dumps({"load_1min_at_end": load, "median": summary, "runs": figures}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
