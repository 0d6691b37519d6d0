"""Where a run's wall time goes between its epochs: for each run of a folder, rank 0's epochs
with their training seconds and the wall time from the end of one epoch's record to the next
one's (scoring the test split, the checkpoint, the compile cache's save, the records).

    python docs/benchmarks/epoch_gaps.py RUNS
"""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_ddp_kit.core import runfolder


def gaps(run_dir: Path) -> str:
    """One line: the start record's warm-up, then each epoch as `training s + between s`."""
    records = runfolder.read_rank(run_dir, 0)
    start = runfolder.of_kind(records, "start")[-1]
    epochs = runfolder.of_kind(records, "epoch")
    warm_up = (start.get("startup_parts") or {}).get("warm_up")
    cells, last = [], start["time"]
    for epoch in epochs:
        between = epoch["time"] - last - epoch["seconds"]
        cells.append(f"{epoch['seconds']:.2f}+{between:.2f}")
        last = epoch["time"]
    head = f"{run_dir.name}: warm-up {'—' if warm_up is None else f'{warm_up:.2f}'} s; epochs"
    return f"{head} {' '.join(cells)}"


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for run_dir in sorted(p.parent for p in root.glob("*/run.json")):
        print(gaps(run_dir))
