"""GPU figures of one process: NVML utilisation and memory sampled in a thread, allocator peaks.

All figures cover the training phases only: `resume` and `pause` bracket each epoch's training.

Energy comes from NVML's counter of each card's consumption since the driver loaded
(`nvmlDeviceGetTotalEnergyConsumption`, millijoules; Volta and later), read when a training phase
starts and ends, and when the sampler is made and closed: per epoch the training phase's joules,
per run everything from the model's building to the end. The counter moves in steps of its update
interval (tens of milliseconds), so an epoch much shorter than that reads coarsely; the run's
total does not. Other processes on the same card are counted too, as NVML cannot split them.

NVML's utilisation is the share of time in the last sample period (1/6 s to 1 s, by GPU) during
which at least one kernel ran on the GPU; it says nothing of how full the GPU was. NVML's used
memory is the driver's view: the CUDA context, the allocator's cache and other processes included.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

INTERVAL_S = 0.05


class GpuSampler:
    """Samples utilisation and used memory of the given CUDA devices (this process's indices)."""

    def __init__(self, devices: list[int], interval_s: float = INTERVAL_S) -> None:
        self.devices = devices
        self.interval_s = interval_s
        self._handles = _nvml_handles(devices)
        self._util: list[list[int]] = [[] for _ in devices]
        self._used_mb: list[float] = [0.0 for _ in devices]
        self._allocated_mb: list[float] = [0.0 for _ in devices]
        self._reserved_mb: list[float] = [0.0 for _ in devices]
        self._made = self._energy_mj()  # per card, at the start of the run's GPU work
        self._phase: list[int | None] = [None for _ in devices]
        self.phase_j: float | None = None  # the last training phase's joules, all cards
        self._total_j: list[float | None] = [None for _ in devices]
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        if self._handles:
            self._thread.start()

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def resume(self) -> None:
        """Start a training phase: allocator peaks count from here (evaluation is left out)."""
        for device in self.devices:
            torch.cuda.reset_peak_memory_stats(device)
        self._phase = self._energy_mj()
        self._active.set()

    def pause(self) -> None:
        """End a training phase: its energy (`phase_j`) and the allocator's peaks."""
        self._active.clear()
        self.phase_j = _joules(self._phase, self._energy_mj())
        for i, device in enumerate(self.devices):
            self._allocated_mb[i] = max(
                self._allocated_mb[i], torch.cuda.max_memory_allocated(device) / 2**20
            )
            self._reserved_mb[i] = max(
                self._reserved_mb[i], torch.cuda.max_memory_reserved(device) / 2**20
            )

    def close(self) -> None:
        """The run's end: the energy since the sampler was made, per card."""
        now = self._energy_mj()
        self._total_j = [_joules([a], [b]) for a, b in zip(self._made, now, strict=True)]
        self._stop.set()
        self._active.set()  # wake the loop so it sees the stop
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def figures(self) -> list[dict[str, Any]]:
        """Per device: mean utilisation (%), NVML peak used memory, allocator peaks (MB)."""
        return [self._device_figures(i, device) for i, device in enumerate(self.devices)]

    def _device_figures(self, i: int, device: int) -> dict[str, Any]:
        samples = self._util[i]
        return {
            "cuda_index": device,
            "name": torch.cuda.get_device_name(device),
            "util_pct": sum(samples) / len(samples) if samples else None,
            "util_samples": len(samples),
            "nvml_used_mb_peak": self._used_mb[i] if self._handles else None,
            "max_allocated_mb": self._allocated_mb[i],
            "max_reserved_mb": self._reserved_mb[i],
            "energy_j": self._total_j[i],  # the whole run: model built to the end (close)
        }

    def _energy_mj(self) -> list[int | None]:
        """Each card's energy counter (mJ), None where it cannot be read."""
        if not self._handles:
            return [None for _ in self.devices]
        import pynvml

        readings: list[int | None] = []
        for handle in self._handles:
            try:
                readings.append(int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)))
            except pynvml.NVMLError:  # a card without the counter (before Volta)
                readings.append(None)
        return readings

    def _loop(self) -> None:
        import pynvml

        while not self._stop.is_set():
            self._active.wait()
            if self._stop.is_set():
                return
            for i, handle in enumerate(self._handles):
                with contextlib.suppress(pynvml.NVMLError):
                    self._util[i].append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                    self._used_mb[i] = max(self._used_mb[i], used)
            self._stop.wait(self.interval_s)


def _joules(before: list[int | None], after: list[int | None]) -> float | None:
    """The energy between two readings of the same cards, summed (J); None unless every card
    had both."""
    if not before or None in before or None in after or len(before) != len(after):
        return None
    return (
        sum(b - a for a, b in zip(before, after, strict=True) if a is not None and b is not None)
        / 1000
    )


def _nvml_handles(devices: list[int]) -> list[Any]:
    """NVML handles for CUDA indices; matched by UUID, since CUDA_VISIBLE_DEVICES renumbers GPUs."""
    if not devices:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        return [_handle_for(pynvml, device) for device in devices]
    except Exception:  # no driver, no library, or an unknown GPU: the figures read "not measured"
        return []


def _handle_for(pynvml: Any, device: int) -> Any:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
