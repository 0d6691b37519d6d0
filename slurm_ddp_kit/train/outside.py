"""GPU figures of a user's program, sampled from outside it through NVML (no torch): the cards
its processes use, how busy they were, the program's memory on them, and their energy.

The task that starts a program knows no CUDA index of the program's (CUDA_VISIBLE_DEVICES and
Slurm's device binding renumber the cards, and the program may start processes of its own), so a
card counts as the program's once NVML lists one of its processes (the program or one it started)
among the card's compute processes; from then on it is sampled, every INTERVAL_S. The figures are
those of `train.gpustats` for the kit's own ranks, as far as NVML gives them from outside:

- util_pct: NVML's utilisation, the share of each sample period in which a kernel ran on the card
  (any process's), averaged over the samples taken while the program ran;
- nvml_used_mb_peak: the most memory the program's processes held on the card at a sample (the
  driver's count per process: CUDA context and the allocator's cache included);
- energy_j: the card's energy counter from the sample that first found the program on it to the
  program's end (other processes on the card counted too, as NVML cannot split them).

Where NVML is missing (no driver, no GPU, no pynvml) the task writes no figure, and the table reads
n/m. A program that is on a card for less than INTERVAL_S may not be seen at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from slurm_ddp_kit.core import processes

INTERVAL_S = 0.5


@dataclass
class _Card:
    name: str
    energy_mj: int | None  # the counter when the program was first seen on the card
    util: list[int] = field(default_factory=list)
    used_mb: float = 0.0


class OutsideSampler:
    """Samples, in a thread, the cards on which process `pid` or its descendants run."""

    def __init__(self, pid: int, interval_s: float = INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._nvml, self._handles = _nvml()
        self._cards: dict[int, _Card] = {}  # by NVML's index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outside-sampler", daemon=True)
        if self._handles:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One look at every card: the program's on each, and the cards it is on sampled."""
        nvml = self._nvml
        mine = {self.pid, *processes.descendants(self.pid)}
        for index, handle in enumerate(self._handles):
            try:
                found = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                used = [p.usedGpuMemory or 0 for p in found if p.pid in mine]
                card = self._cards.get(index)
                if card is None and not used:
                    continue
                if card is None:
                    card = self._cards[index] = _Card(_name(nvml, handle), _energy(nvml, handle))
                card.util.append(int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                card.used_mb = max(card.used_mb, sum(used) / 2**20)
            except nvml.NVMLError:  # a card that cannot say: left as it was
                continue

    def close(self) -> list[dict[str, Any]]:
        """The program's end: per card it used, in NVML's order, the figures of a summary's
        `gpus` (none where NVML is missing or no card was seen)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        figures = []
        for index, card in sorted(self._cards.items()):
            now, then = _energy(self._nvml, self._handles[index]), card.energy_mj
            joules = (now - then) / 1000 if now is not None and then is not None else None
            figures.append(
                {
                    "cuda_index": None,  # the program's own numbering is not known from outside
                    "name": card.name,
                    "util_pct": sum(card.util) / len(card.util) if card.util else None,
                    "util_samples": len(card.util),
                    "nvml_used_mb_peak": card.used_mb,
                    "energy_j": joules,
                }
            )
        return figures


def _nvml() -> tuple[Any, list[Any]]:
    """pynvml and a handle per card; (None, []) where NVML cannot be used here."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]
    except Exception:  # no driver, no library: no figure, never a failed task
        return None, []


def _name(nvml: Any, handle: Any) -> str:
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else str(name)


def _energy(nvml: Any, handle: Any) -> int | None:
    """The card's energy counter (mJ; Volta and later), None where it cannot be read."""
    try:
        return int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except nvml.NVMLError:
        return None
