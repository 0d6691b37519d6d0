"""Jobs run the code as it was at submission (code.snapshot): a user's project edited while its
job waits runs as submitted, locally and through Slurm, on resume and in every run of a sweep;
the sbatch scripts' jobs start their tasks in the copy their first attempt made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO, kit, records, run_folder, wait_for
from slurm_cluster import SlurmCluster
from test_container import apptainer_env

# Waits for a flag file (the test edits the project first), then says which code it imported;
# its first attempt fails on purpose, so that the run can be resumed.
PROGRAM = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
import helper, slurm_ddp_kit
print("ran", helper.VERSION, os.path.realpath(helper.__file__),
      os.path.realpath(slurm_ddp_kit.__file__), os.path.realpath(os.getcwd()),
      os.path.realpath(__file__), flush=True)
tried = os.path.join(os.environ["KIT_RUN_DIR"], "tried")
if not os.path.exists(tried):
    open(tried, "w").close()
    sys.exit("the first attempt fails on purpose")
"""


def _project(tmp_path: Path) -> Path:
    """A git repository holding train.py (PROGRAM) and helper.py (VERSION = 1), committed."""
    repo = tmp_path / "project"
    repo.mkdir()
    (repo / "train.py").write_text(PROGRAM)
    (repo / "helper.py").write_text("VERSION = 1\n")
    (repo / ".gitignore").write_text("runs/\n")
    git = ["git", "-c", "user.name=kit", "-c", "user.email=kit@example.org"]
    for words in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "first"]):
        subprocess.run([*git, *words], cwd=repo, check=True)
    return repo


def _launch(repo: Path, *words: str, env: dict[str, str] | None = None, expect: int = 0) -> str:
    """`python -m launch WORDS` started in the project, its output from a file (a local job's
    controller would hold a pipe open); returns that output, once its exit code is `expect`."""
    log = repo.parent / "launch.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "launch", *words],
            cwd=repo,
            env={**os.environ, **(env or {}), "PYTHONPATH": f"{REPO}{os.pathsep}{repo}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    text = log.read_text()
    assert done.returncode == expect, text
    return text


def _ran(run_dir: Path, env: dict[str, str] | None = None) -> list[str]:
    """The words rank 0 printed for the last attempt (`launch logs`)."""
    logs = kit("launch", "logs", str(run_dir), "--rank", "0", env=env).stdout
    return [line.split()[1:] for line in logs.splitlines() if line.startswith("ran ")][-1]


def _state(run_dir: Path, env: dict[str, str] | None = None) -> str:
    """The STATE column of the run's row in `launch status`."""
    rows = kit("launch", "status", str(run_dir), env=env).stdout.splitlines()
    return next(row.split()[4] for row in rows if row.split()[0] == run_dir.name)


def _edit_then_run(
    repo: Path, settings: list[str], env: dict[str, str] | None = None, script: str = "train.py"
) -> Path:
    """Submit the project's program (`script`), edit helper.py and train.py once the job is
    queued, then let the program go on; returns the run folder once its first attempt has
    ended."""
    flag = repo.parent / "go"
    said = _launch(repo, "submit", "--mode", "ddp", "cluster.gpus_per_node=1", *settings,
                   f"output.root={repo}/runs", "--", "python", script, str(flag), env=env)  # fmt: skip
    run_dir = run_folder(said)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    copy = f"code: the copy made at submission ({run_dir}/code: "
    assert copy in said and f"; project {repo} at git {head.stdout[:7]}, copied " in said, said
    (repo / "helper.py").write_text("VERSION = 2\n")  # the checkout moves on
    (repo / "train.py").write_text("raise SystemExit('the edited train.py ran')\n")
    flag.touch()
    assert wait_for(lambda: _state(run_dir, env) == "FAILED", 240), _state(run_dir, env)
    return run_dir


def _assert_ran_the_copy(run_dir: Path, env: dict[str, str] | None = None) -> None:
    code = run_dir / "code"
    assert _ran(run_dir, env) == [
        "1",
        str(code / "project" / "helper.py"),
        str(code / "kit" / "slurm_ddp_kit" / "__init__.py"),
        str(code / "project"),
        str(code / "project" / "train.py"),
    ]


def test_a_local_job_and_its_resume_run_the_code_of_the_submission(tmp_path: Path) -> None:
    """The project's helper edited while the job waits: the job imports the copy (the project's
    and the kit's), and so does the resumed job, which says so; the copy holds what git lists
    (the ignored runs/ not)."""
    repo = _project(tmp_path)
    run_dir = _edit_then_run(repo, ["cluster.backend=local"])
    _assert_ran_the_copy(run_dir)
    assert not (run_dir / "code" / "project" / "runs").exists()
    resumed = _launch(repo, "resume", str(run_dir), "--wait")
    assert f"code: the copy made at submission ({run_dir}/code: " in resumed, resumed
    _assert_ran_the_copy(run_dir)
    assert (repo / "helper.py").read_text() == "VERSION = 2\n"


def test_a_program_named_by_its_absolute_path_runs_from_the_copy(tmp_path: Path) -> None:
    """`python /…/project/train.py`: the script the copy holds runs, not the edited one."""
    repo = _project(tmp_path)
    run_dir = _edit_then_run(repo, ["cluster.backend=local"], script=str(repo / "train.py"))
    _assert_ran_the_copy(run_dir)
    assert records(run_dir)[0]["program"][1] == str(run_dir / "code" / "project" / "train.py")


def test_a_container_job_runs_the_code_of_the_submission(tmp_path: Path) -> None:
    """Inside a container (a stand-in `apptainer`, `tests/test_container.py`): the task starts
    in the copy, which output.root's mount brings in, and imports it."""
    repo = _project(tmp_path)
    image = tmp_path / "pytorch.sif"
    image.touch()
    env = apptainer_env(tmp_path)
    settings = ["cluster.backend=local", f"cluster.container.image={image}",
                f"cluster.container.python={sys.executable}"]  # fmt: skip
    run_dir = _edit_then_run(repo, settings, env)
    _assert_ran_the_copy(run_dir, env)
    words = (tmp_path / "apptainer.log").read_text().splitlines()[0]
    code = run_dir / "code"
    pythonpath = f"{code}/kit:{REPO}:{code}/project"  # the launching one's, the project's copied
    assert f" --env=PYTHONPATH={pythonpath} --pwd={code}/project " in words, words


def test_without_a_copy_the_job_runs_the_checkout_and_says_so(tmp_path: Path) -> None:
    """code.snapshot=off: the live checkout runs (the edit shows), as the submission says."""
    repo = _project(tmp_path)
    flag = tmp_path / "go"
    said = _launch(repo, "submit", "--mode", "ddp", "cluster.gpus_per_node=1",
                   "cluster.backend=local", "code.snapshot=off", f"output.root={repo}/runs",
                   "--", "python", "train.py", str(flag))  # fmt: skip
    assert "code: the live checkout (no snapshot: code.snapshot=off)" in said, said
    run_dir = run_folder(said)
    (repo / "helper.py").write_text("VERSION = 2\n")
    flag.touch()
    assert wait_for(lambda: _state(run_dir) == "FAILED", 240)
    assert _ran(run_dir)[:2] == ["2", str(repo / "helper.py")]
    assert not (run_dir / "code" / "project").exists()


def test_a_sweeps_runs_share_one_copy(tmp_path: Path) -> None:
    """Two runs of a local sweep: each run folder holds the code, the same files (hard links),
    copied once. (Each first attempt fails on purpose: the sweep says so, exit 1.)"""
    repo = _project(tmp_path)
    (tmp_path / "go").touch()
    said = _launch(repo, "sweep", "--modes", "ddp", "--grid", "train.lr=0.1,0.2",
                   "cluster.backend=local", "cluster.gpus_per_node=1", f"output.root={repo}/runs",
                   "--", "python", "train.py", str(tmp_path / "go"), expect=1)  # fmt: skip
    run_dirs = sorted(Path(line.split("run folder: ")[1]) for line in said.splitlines()
                      if "run folder: " in line)  # fmt: skip
    assert len(run_dirs) == 2, said
    files = [run_dir / "code" / "project" / "helper.py" for run_dir in run_dirs]
    assert files[0].stat().st_ino == files[1].stat().st_ino
    assert all(json.loads((d / "code" / "manifest.json").read_text())["copied"] for d in run_dirs)


@pytest.mark.slurm
def test_a_slurm_job_and_the_sbatch_scripts_run_the_code_of_the_submission(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Through Slurm: `launch submit`'s job, its batch script starting the tasks in the copy,
    runs the project as submitted; the sbatch script's job makes its copy at its start, and its
    tasks run it."""
    repo = _project(tmp_path)
    env = {**slurm_cluster.env, "KIT_PYTHON": sys.executable}
    run_dir = _edit_then_run(repo, ["cluster.backend=slurm", "cluster.cpus_per_task=1"], env)
    _assert_ran_the_copy(run_dir, env)
    script = (run_dir / "logs").glob("*_submission.sh")
    assert f"cd {run_dir}/code/project" in next(script).read_text()

    # The sbatch script's job: its copy is made as it starts, before the program reads helper.
    (repo / "helper.py").write_text("VERSION = 1\n")
    (repo / "train.py").write_text(PROGRAM)
    flag = tmp_path / "go-batch"
    batch = slurm_cluster.run(
        "sbatch", "--parsable", "--cpus-per-task=1", "--ntasks-per-node=1", "--gpus-per-node=1",
        f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm/ddp.sbatch"),
        f"output.root={repo}/runs-batch", "--", "python", "train.py", str(flag),
        cwd=repo, env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{repo}"},
    )  # fmt: skip
    job_id = batch.stdout.strip().split(";")[0]
    assert job_id, batch.stderr
    copies = repo / "runs-batch"
    assert wait_for(lambda: any(copies.glob("*/code/manifest.json")), 120), batch.stderr
    (repo / "helper.py").write_text("VERSION = 3\n")
    flag.touch()
    assert slurm_cluster.wait_job(job_id) == "FAILED"  # the program's first attempt, on purpose
    (sbatch_run,) = copies.glob("*/code/manifest.json")
    _assert_ran_the_copy(sbatch_run.parent.parent, env)
