"""Operate submitted runs: their state, cancelling them, their logs.

State comes from `sacct` (Slurm accounting), then `squeue`, then the run folder itself, each with a
short timeout, so `status` answers even when the controller does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launch import runs
from train.metrics import metrics_path, read_records

_TIMEOUT_S = 10


@dataclass
class RunStatus:
    run_id: str
    mode: str
    backend: str
    job_id: str
    state: str
    nodes: str
    elapsed: str
    last_epoch: str

    def row(self) -> list[str]:
        return [
            self.run_id,
            self.mode,
            self.backend,
            self.job_id,
            self.state,
            self.nodes,
            self.elapsed,
            self.last_epoch,
        ]


HEADER = ["RUN", "MODE", "BACKEND", "JOB", "STATE", "NODES", "ELAPSED", "EPOCH"]


def status(run_dir: Path) -> RunStatus:
    meta = runs.read_meta(run_dir)
    job_id = str(meta.get("job_id") or "-")
    if meta.get("submit_error"):
        return RunStatus(
            run_dir.name, meta["mode"], meta["backend"], job_id, "NOT-SUBMITTED", "-", "-", "-"
        )
    records = _rank0_records(run_dir)  # read once: state fall-back and last epoch both use it
    found = _slurm_state(job_id) if meta["backend"] == "slurm" else None
    state, elapsed, nodes = found or _folder_state(records, meta)
    return RunStatus(
        run_dir.name,
        meta["mode"],
        meta["backend"],
        job_id,
        state,
        nodes,
        elapsed,
        _last_epoch(records),
    )


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def cancel(run_dir: Path) -> str:
    """Cancel the run's job; returns what was done, in words."""
    meta = runs.read_meta(run_dir)
    job_id = meta.get("job_id")
    if not job_id:
        raise RuntimeError(f"{run_dir.name} has no job id yet: nothing to cancel")
    if meta["backend"] == "slurm":
        done = _slurm_command("scancel", str(job_id))
        if done is None or done.returncode != 0:
            raise RuntimeError(
                f"scancel {job_id} failed: {done.stderr.strip() if done else 'timed out'}"
            )
        return f"cancelled Slurm job {job_id}"
    try:
        os.kill(int(job_id), signal.SIGTERM)  # the local controller forwards it to every task
    except ProcessLookupError:
        return f"local job {job_id} had already ended"
    return f"cancelled local job {job_id}"


def log_files(run_dir: Path, rank: int) -> list[Path]:
    """The stdout/stderr files of one rank: submitit's names, or those slurm/*.sbatch writes."""
    job_id = runs.read_meta(run_dir).get("job_id")
    logs = run_dir / "logs"
    names = [f"{job_id}_{rank}_log.out", f"{job_id}_{rank}_log.err", f"rank-{rank}.out"]
    found = [logs / n for n in names if (logs / n).is_file()]
    if not found:
        raise FileNotFoundError(
            f"no logs for rank {rank} in {logs} (has the job started? see `python -m launch status`)"
        )
    return found


def _slurm_state(job_id: str) -> tuple[str, str, str] | None:
    """(state, elapsed, nodes) from accounting, else from the queue; None if neither answers."""
    queries = [
        ("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Elapsed,NodeList"),
        ("squeue", "-j", job_id, "-h", "-o", "%T|%M|%N"),
    ]
    for query in queries:
        done = _slurm_command(*query)
        if done and done.returncode == 0 and done.stdout.strip():
            state, elapsed, nodes = done.stdout.strip().splitlines()[0].split("|")
            return state.split()[0], elapsed, nodes or "-"  # "CANCELLED by 0" → CANCELLED
    return None


def _slurm_command(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _folder_state(
    records: list[dict[str, object]], meta: dict[str, object]
) -> tuple[str, str, str]:
    """What the run folder says: the summary means done; a live local controller means running."""
    summary = next((r for r in records if r["kind"] == "summary"), None)
    start = next((r for r in records if r["kind"] == "start"), None)
    elapsed = _clock(summary["total_seconds"]) if summary else "-"
    host = str(start["host"]) if start else "-"
    if summary:
        state = "COMPLETED"
    elif meta["backend"] == "local":
        state = "RUNNING" if _alive(str(meta.get("job_id"))) else "ENDED-WITHOUT-SUMMARY"
    else:
        state = "UNKNOWN"  # Slurm did not answer and the run folder holds no summary
    return state, elapsed, host


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _rank0_records(run_dir: Path) -> list[dict[str, object]]:
    path = metrics_path(run_dir, 0)
    return read_records(path)[0] if path.is_file() else []


def _last_epoch(records: list[dict[str, object]]) -> str:
    epochs = [r for r in records if r["kind"] == "epoch"]
    start = next((r for r in records if r["kind"] == "start"), None)
    if not epochs:
        return "-"
    return f"{epochs[-1]['epoch']}/{start['epochs'] if start else '?'}"


def _clock(seconds: object) -> str:
    total = int(float(str(seconds)))
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"
