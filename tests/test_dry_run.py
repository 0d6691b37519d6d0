"""Golden file: the batch script `launch submit --dry-run` prints for a two-node DDP job.

A change to it is a change to what every user submits: review the diff, then regenerate with
UPDATE_GOLDEN=1 pytest tests/test_dry_run.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from kit import REPO, kit

GOLDEN = REPO / "tests" / "golden" / "ddp-2nodes.txt"
ARGS = [
    "launch", "submit", "--dry-run", "--mode", "ddp", "--nodes", "2", "cluster.backend=slurm",
    "cluster.partition=gpu", "cluster.account=proj", "cluster.mem_gb=64", "cluster.gpu_type=a100",
    'cluster.setup=["module load cuda/12.4"]', "cluster.sbatch_extra.mail-type=END",
]  # fmt: skip


def test_dry_run_script_matches_the_golden_file(tmp_path: Path) -> None:
    done = kit(*ARGS, f"output.root={tmp_path}")
    assert done.returncode == 0, done.stderr
    text = done.stdout.replace(str(tmp_path.resolve()), "{ROOT}").replace(
        sys.executable, "{PYTHON}"
    )
    text = re.sub(r"\d{8}-\d{6}-ddp-2n4g-[0-9a-f]{4}", "{RUN}", text)  # named at submission
    # What the copy would hold depends on the checkout (files, size, commit): its words stay.
    text = re.sub(r"^(code: a copy made at submission) \(.*\)$", r"\1 ({CODE})", text, flags=re.M)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert not any(tmp_path.iterdir())  # a dry run creates no run folder


def test_dry_run_asks_slurm_for_an_expedited_requeue_where_set(tmp_path: Path) -> None:
    """cluster.requeue=expedite becomes sbatch's `--requeue=expedite` (Slurm 25.11: the requeued
    job may start again at once, first in the queue); a dry run shows it without asking Slurm."""
    done = kit(*ARGS, "cluster.requeue=expedite", f"output.root={tmp_path}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "#SBATCH --requeue=expedite" in lines and "#SBATCH --requeue" not in lines
