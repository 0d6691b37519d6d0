"""The benchmark script behind the published three-workload table runs on a machine without GPU
too: every strategy trained on every workload, one table each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO, kit


# 15 local jobs: 4 to 9 minutes on 2 cores beside the other workers, past pytest's 600 s default.
@pytest.mark.timeout(1500)
def test_workloads_script_on_cpu_gives_one_table_per_workload(tmp_path: Path) -> None:
    """docs/benchmarks/workloads.sh, at a tiny size: three workloads × five strategies, each a
    group of its own with every strategy's column (without a GPU the script leaves out the
    largest-batch searches, which measure nothing there: `make test`'s CPU search runs are in
    test_benchmark_script_on_cpu_reads_not_measured and tests/test_analysis.py). One rank a job
    (the settings after the script's own win): every strategy's ranks in step are
    test_strategies.py's, the convnet's and ResNet-18's on two ranks test_local_jobs.py's and
    test_workloads.py's, the many-class head's on GPUs test_gpu.py's."""
    tiny = ["data.train_size=64", "data.test_size=32", "train.epochs=1", f"data.root={tmp_path}"]
    done = subprocess.run(
        ["bash", str(REPO / "docs/benchmarks/workloads.sh"), str(tmp_path / "runs"), *tiny,
         "train.global_batch_size=32", "cluster.gpus_per_node=1"],
        env={**os.environ, "KIT_PYTHON": sys.executable, "PYTHONPATH": str(REPO),
             "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=1400,
    )  # fmt: skip
    assert done.returncode == 0 and "run failed" not in done.stderr, done.stdout + done.stderr
    table = kit("analysis", "summarize", str(tmp_path / "runs")).stdout
    headings = [line for line in table.splitlines() if line.startswith("## Group")]
    assert len(headings) == 3
    assert "convnet" in headings[0] and "synthetic" in headings[0]
    assert "resnet18" in headings[1] and "patterns 3×32² (10 classes)" in headings[1]
    assert "patterns 1×28² (100000 classes)" in headings[2]
    cpu_dp = "DP (one process, no DataParallel)"  # no GPU: DataParallel runs the bare model
    columns = f"| metric | {cpu_dp} | DDP | DDP + bf16 hook | ZeRO | FSDP | DDP vs {cpu_dp} |"
    assert table.count(columns) == 3, table
