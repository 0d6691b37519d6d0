"""One line per run of a folder, in the order they ran: what a time-to-accuracy benchmark reads
(docs/benchmarks/tta.sh), from the same rows `python -m analysis summarize` pools.

    python docs/benchmarks/tta_runs.py RUNS
"""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_ddp_kit.analysis.load import load_runs, resolve_run_dirs
from slurm_ddp_kit.core import runfolder

COLUMNS = {  # the row's column: its heading
    "startup_s": "start-up (s)",
    "first_epoch_s": "first epoch (s)",
    "epoch_s": "s/epoch (2..N)",
    "tta_epoch": "epoch reaching the target",
    "tta_s": "submission → target (s)",
    "tta_data_s": "first data → target (s)",
    "energy_run_j": "energy per run (J)",
    "gpu_seconds": "GPU-s per run",
    "final_test_accuracy": "final accuracy (%)",
}


def main(root: Path) -> None:
    frame, notes = load_runs(resolve_run_dirs([root], root))
    print("\n".join(notes), file=sys.stderr)
    heads = ["run", "preset", "compile cache", "warm-up (s)", *COLUMNS.values()]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for row in frame.sort_values("run_id").itertuples():
        start = runfolder.of_kind(runfolder.read_rank(Path(row.run_dir), 0), "start")[-1]
        warm_up = (start.get("startup_parts") or {}).get("warm_up")
        cells = [
            row.run_id,
            f"{row.mode}, {row.speed_options}",
            str(start.get("compile_cache") or "—"),
            "—" if warm_up is None else f"{warm_up:.2f}",
            *(f"{getattr(row, column):.2f}" for column in COLUMNS),
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
