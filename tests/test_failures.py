"""A rank that fails is named: the first rank that failed, its host and its error, in `--wait`,
in `status` and by default in `logs`, not the peer that lost its connection to it."""

from __future__ import annotations

from pathlib import Path

from kit import REPO, SMALL, kit, run_folder

# Loaded by every Python process started with it on PYTHONPATH: rank 1 of a job raises in its
# first epoch, as a bug in one rank's code would.
HOOK = """
import os
if os.environ.get("SUBMITIT_LOCAL_GLOBALID") == os.environ.get("KIT_TEST_FAILING_RANK"):
    import train.job

    def _fail(*args, **kwargs):
        raise RuntimeError("injected failure in this rank")

    train.job._train_epoch = _fail
"""


def test_the_rank_that_raised_is_named_and_the_run_resumes(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {"PYTHONPATH": f"{hook}:{REPO}", "KIT_TEST_FAILING_RANK": "1"}
    args = ["--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2", *SMALL]
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "dist.timeout_s=30"]
    done = kit("launch", "submit", *args, *where, "--wait", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    assert "failed: rank 1 on " in done.stdout and "injected failure in this rank" in done.stdout
    status = kit("launch", "status", str(run_dir)).stdout
    assert " FAILED " in status
    assert f"{run_dir.name}: rank 1 on " in status and "injected failure" in status
    logs = kit("launch", "logs", str(run_dir))
    assert logs.returncode == 0 and "_1_log.err <==" in logs.stdout
    assert "injected failure in this rank" in logs.stdout

    resumed = kit("launch", "resume", str(run_dir), "--wait")  # the bug fixed: no hook now
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert " COMPLETED " in kit("launch", "status", str(run_dir)).stdout
