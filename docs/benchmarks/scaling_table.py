"""The scaling table of a folder of runs (docs/benchmarks/scaling.sh): per path (strategy,
precision, speed options, global batch, dataset size) and number of GPUs, the median s/epoch and throughput of its
runs and the speed-up over the same path on one GPU, from the rows `python -m analysis
summarize` pools.

    python docs/benchmarks/scaling_table.py RUNS
"""

from __future__ import annotations

import sys
from pathlib import Path

from analysis.load import load_runs, resolve_run_dirs

PATH = ["mode", "precision", "speed_options", "global_batch", "train_samples", "nodes"]


def table(root: Path) -> str:
    frame, notes = load_runs(resolve_run_dirs([root], root))
    print("\n".join(notes), file=sys.stderr)
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
            speed_up = f"{one / seconds[gpus]:.2f}×" if one else "n/m"
            lines.append(
                f"| {mode}, {precision}, {options} | {batch} | {samples} | {gpus} | {len(runs)} | "
                f"{seconds[gpus]:.4f} | {runs['throughput'].median():.0f} | {speed_up} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
