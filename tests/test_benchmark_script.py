"""The benchmark command behind the published table runs on a machine without GPU too: what it
cannot measure there is left out of the table, and said so."""

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
    # No GPU: the rows of what it cannot measure are left out, and named.
    assert not any(k.startswith(("largest batch", "GPU util")) for k in rows)
    left_out = next(line for line in table.stdout.splitlines() if line.startswith("Not measured"))
    assert "GPU util main card" in left_out and "largest batch" in left_out
    assert float(next(v for k, v in rows.items() if k.startswith("seconds per epoch"))[0]) > 0
