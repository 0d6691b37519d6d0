"""A task's start: Python's cyclic collector waits out the imports (a rank's start-up is most of a
short job's CPU) and is back on, with start-up's objects frozen, once the rank has started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kit import REPO

PROBE = """
import gc
from slurm_ddp_kit.train import early
print("during start-up:", gc.isenabled())
early.resume_gc()
print("started:", gc.isenabled(), gc.get_freeze_count() > 0)
"""


def test_a_task_imports_with_the_collector_paused_and_trains_with_it_on(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "slurm_ddp_kit.train.start", "-m", "probe"],
        cwd=REPO,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["during start-up: False", "started: True True"]


def test_a_collector_someone_else_turned_off_stays_off() -> None:
    """resume_gc undoes only the kit's own pause."""
    done = subprocess.run(
        [sys.executable, "-c", "import gc; gc.disable(); from slurm_ddp_kit.train import early;"
         "early.pause_gc(); early.resume_gc(); print(gc.isenabled())"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.strip() == "False", done.stderr
