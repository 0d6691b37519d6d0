"""Clocks: when this process started, and how long each training step took."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from slurm_ddp_kit.core import processes


def process_start_time() -> float:
    """When this process was created (Linux /proc), so start-up counts interpreter and imports."""
    try:
        fields = processes.stat(os.getpid()) or []
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time since boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(uptime_s - started_s, 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


class StepClock:
    """Per-step wall time (data wait + compute): CUDA events on a GPU, so no step is synchronised."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def percentiles(self) -> dict[str, float | None]:
        """Read after the device is synchronised."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        ms = [a.elapsed_time(b) if self.cuda else (b - a) * 1000 for a, b in pairs]
        if not ms:
            return {"step_ms_p50": None, "step_ms_p90": None, "step_ms_p99": None}
        q = torch.quantile(
            torch.tensor(ms, dtype=torch.float64),
            torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64),
        )
        return {"step_ms_p50": q[0].item(), "step_ms_p90": q[1].item(), "step_ms_p99": q[2].item()}
