"""Sweeps at scale: the time to submit an N-point sweep as one Slurm array, and to `launch status`
its N runs, then the same status once the array is cancelled while pending.

Starts a test cluster (slurm/testcluster, 2 nodes, with accounting), submits `launch sweep
--grid train.lr=…` of N values with `--begin=now+1hour` (so no element runs and the figures are
the launcher's and Slurm's alone), times the sweep command and `launch status --root` of its
runs, cancels the array with a plain `scancel`, waits until the queue has forgotten it, and
times `status` again (accounting then holds one record for the whole array). CPU is the
command's user + system time. Needs root (the daemons).

Usage: PYTHONPATH=. python docs/benchmarks/sweep_scale.py OUT [POINTS]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "testcluster"
ARRAY_SIZE = 10001  # a 10,000-point sweep is one array (Slurm's default MaxArraySize is 1001)


def timed(
    command: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, float]]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(
            f"{' '.join(command[:5])} … exited {done.returncode}: {done.stderr[-2000:]}"
        )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done, {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def states(status: str) -> dict[str, int]:
    return dict(Counter(line.split()[4] for line in status.splitlines()[1:]))


def main(out: Path, points: int) -> None:
    cluster = out / "cluster"
    started = {**os.environ, "TESTCLUSTER_MAX_ARRAY_SIZE": str(ARRAY_SIZE),
               "TESTCLUSTER_MAX_JOB_COUNT": str(2 * ARRAY_SIZE)}  # fmt: skip
    subprocess.run(["bash", str(CLUSTER / "start.sh"), str(cluster), "2"], check=True, env=started)
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHONPATH": str(REPO)}
    root = out / "runs"
    values = ",".join(f"{(n + 1) * 1e-5:.5f}" for n in range(points))
    python = [sys.executable, "-m", "launch"]
    try:
        swept, submit = timed([*python, "sweep", "--modes", "ddp", "--grid", f"train.lr={values}",
                               "cluster.backend=slurm", "cluster.gpus_per_node=1",
                               "cluster.cpus_per_task=1", "cluster.sbatch_extra.begin=now+3600",
                               f"output.root={root}"], env)  # fmt: skip
        array = swept.stdout.split()[2].split("_")[0]
        listed, pending = timed([*python, "status", "--root", str(root)], env)
        pending |= {"states": states(listed.stdout)}
        subprocess.run(["scancel", array], env=env, check=True)
        while subprocess.run(["squeue", "-h", "-j", array], env=env, capture_output=True,
                             text=True).stdout.strip():  # fmt: skip
            time.sleep(1)
        listed, cancelled = timed([*python, "status", "--root", str(root)], env)
        cancelled |= {"states": states(listed.stdout)}
        run_json = max(p.stat().st_size for p in root.glob("*/run.json"))
    finally:
        subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(cluster)], check=False)
    print(json.dumps({"points": points, "load_1min_at_end": os.getloadavg()[0],
                      "sweep": submit, "status_pending": pending,
                      "status_after_scancel": cancelled, "largest_run_json_bytes": run_json},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
