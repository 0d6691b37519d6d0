"""The scaling table of a folder of runs (docs/benchmarks/scaling.sh): per path (strategy,
precision, speed options, global batch, dataset size) and number of GPUs, the median s/epoch and throughput of its
runs and the speed-up over the same path on one GPU, from the rows `python -m analysis
summarize` pools.

    python docs/benchmarks/scaling_table.py RUNS
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from slurm_ddp_kit.analysis.load import RunDirError, load_runs, resolve_run_dirs

PATH = ["mode", "precision", "speed_options", "global_batch", "train_samples", "nodes"]


def table(root: Path) -> str:
    frame, notes = load_runs(resolve_run_dirs([root], root))
    print("\n".join(notes), file=sys.stderr)
    if frame.empty:
        return "no finished training run here"
    frame = frame[frame["task"] == "train"]
    frame = frame.assign(gpus_total=frame["nodes"] * frame["gpus_per_node"])
    lines = [
        "| path | global batch | train samples | GPUs | runs | s/epoch | samples/s | speed-up over 1 GPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, precision, options, batch, samples, _), group in frame.groupby(PATH, sort=True):
        by_gpus = group.groupby("gpus_total")
        seconds = by_gpus["epoch_s"].median()
        one = seconds.get(1)
        for gpus, runs in by_gpus:
            ratio = one / seconds[gpus] if one is not None and seconds[gpus] > 0 else math.nan
            speed_up = f"{ratio:.2f}×" if math.isfinite(ratio) else "n/m"
            lines.append(
                f"| {mode}, {precision}, {options} | {batch} | {samples} | {gpus} | {len(runs)} | "
                f"{seconds[gpus]:.4f} | {runs['throughput'].median():.0f} | {speed_up} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print(table(Path(sys.argv[1])))
    except RunDirError as err:
        sys.exit(f"error: {err}")
