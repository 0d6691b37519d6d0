"""The benchmark command behind the published table runs on a machine without GPU too: n/m there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kit import REPO, kit


def test_benchmark_script_on_cpu_reads_not_measured(tmp_path: Path) -> None:
    tiny = [
        "data.train_size=512",
        "data.test_size=128",
        "train.epochs=2",
        "cluster.gpus_per_node=2",  # after the script's own 4 CPU workers: the same commands
        f"data.root={tmp_path}/data",
    ]
    done = subprocess.run(
        ["bash", str(REPO / "docs/benchmarks/run.sh"), str(tmp_path / "runs"), "1", *tiny],
        env={
            **os.environ,
            "KIT_PYTHON": sys.executable,
            "PYTHONPATH": str(REPO),
            "CUDA_VISIBLE_DEVICES": "",
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("largest batch not measured (no GPU)") == 2
    table = kit("analysis", "summarize", str(tmp_path / "runs"))
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
        for line in table.stdout.splitlines()
        if line.startswith("| ")
    }
    assert rows["runs"][:2] == ["1", "1"]
    largest = next(v for k, v in rows.items() if k.startswith("largest batch"))
    assert largest[:2] == ["n/m", "n/m"]
    util = next(v for k, v in rows.items() if k.startswith("GPU util main card"))
    assert util[:2] == ["n/m", "n/m"]
    assert float(next(v for k, v in rows.items() if k.startswith("seconds per epoch"))[0]) > 0
