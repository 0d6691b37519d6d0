"""Each task inside a container (`cluster.container`): the words Apptainer and pyxis are given on
both launch paths, a job that trains through them, and what the launcher refuses.

This machine has neither Apptainer nor pyxis (no package for either, no root in a container
runtime). The local job runs through a stand-in `apptainer` that reads the words as `apptainer
exec` does (options, the image, then the command), logs them, and runs the command on the host:
what it shows is that the kit's task starts and trains from exactly those words. Pyxis is shown
refused by the test cluster's real srun, which has no pyxis plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO, SMALL, kit, records, run_folder
from slurm_cluster import SlurmCluster

STAND_IN = r"""#!/bin/bash
# A stand-in for `apptainer exec`: checks and logs its words, then runs the command on the host.
echo "$*" >> "$APPTAINER_LOG"
[[ $1 == exec ]] || { echo "FATAL: only exec" >&2; exit 255; }
shift
while [[ $1 == -* ]]; do
    case $1 in
        --env=*) export "${1#--env=}" ;;
        --pwd=*) cd "${1#--pwd=}" || exit 255 ;;
        --bind=* | --nv) ;;
        *) exit 255 ;;
    esac
    shift
done
[[ -e $1 ]] || { echo "FATAL: could not open image $1" >&2; exit 255; }
shift
exec "$@"
"""


@pytest.fixture
def apptainer(tmp_path: Path) -> dict[str, str]:
    return apptainer_env(tmp_path)


def apptainer_env(tmp_path: Path) -> dict[str, str]:
    """An environment with the stand-in first on PATH, logging to tmp_path/apptainer.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STAND_IN)
    (bin_dir / "apptainer").chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "APPTAINER_LOG": str(tmp_path / "apptainer.log"),
    }


def _container(tmp_path: Path, *more: str) -> list[str]:
    image = tmp_path / "pytorch.sif"
    image.touch()
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    return [f"cluster.container.image={image}", *where, *more]


def test_a_local_job_trains_inside_apptainer(tmp_path: Path, apptainer: dict[str, str]) -> None:
    """The image's Python (here this one) runs the task; the checkout, output and data roots are
    bound; the task starts in the run's code copy (inside output.root) and PYTHONPATH names the
    copy's kit and its copy of the launching folder (the stand-in exports what --env gives
    it, and starts the command in --pwd)."""
    settings = _container(tmp_path, f"cluster.container.python={sys.executable}")
    done = kit(
        "launch", "submit", "--mode", "ddp", *SMALL, "cluster.backend=local",
        "cluster.gpus_per_node=1", *settings, "--wait", env=apptainer,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    assert records(run_dir)[-1]["kind"] == "summary"
    (words,) = (tmp_path / "apptainer.log").read_text().splitlines()
    binds = f"{REPO},{tmp_path}/runs,{tmp_path}/data"
    code = run_dir / "code"
    assert words.startswith(
        f"exec --nv --env=PYTHONPATH={code}/kit:{code}/project --pwd={code}/project "
        f"--bind={binds} {tmp_path}/pytorch.sif {sys.executable} -u -m slurm_ddp_kit.train.start"
    ), words


PROJECT_WORKLOAD = """
import torch


def data(train):
    generator = torch.Generator().manual_seed(0 if train else 1)
    labels = torch.randint(0, 2, (256 if train else 64,), generator=generator)
    return labels[:, None].float() * 4 + torch.randn(len(labels), 4, generator=generator), labels


def model(sample_shape, classes):
    return torch.nn.Linear(sample_shape[0], classes)
"""


def test_a_users_code_on_pythonpath_is_mounted_and_imported_inside(
    tmp_path: Path, apptainer: dict[str, str]
) -> None:
    """The user's project folder, on the launching PYTHONPATH and holding a `train.py` of its own,
    is bound and on the task's PYTHONPATH after the kit's checkout: the ranks import the user's
    factories inside the container (the stand-in replaces PYTHONPATH as Apptainer's --env does)
    and the kit's own `train` package, not the project's `train.py`."""
    project = tmp_path / "project"
    (project / "myproj").mkdir(parents=True)
    (project / "myproj" / "__init__.py").write_text("")
    (project / "myproj" / "workload.py").write_text(PROJECT_WORKLOAD)
    (project / "train.py").write_text("raise SystemExit('the project train.py was imported')\n")
    env = {**apptainer, "PYTHONPATH": str(project)}
    settings = _container(tmp_path, f"cluster.container.python={sys.executable}")
    factories = ["model.name=myproj.workload:model", "data.dataset=myproj.workload:data"]
    done = kit(
        "launch", "submit", "--mode", "ddp", "train.epochs=1", "train.global_batch_size=32",
        "cluster.backend=local", "cluster.gpus_per_node=2", *factories, *settings, "--wait",
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    folder = run_folder(done.stdout)
    assert records(folder)[0]["dataset"] == "myproj.workload:data"
    assert records(folder, 1)[-1]["kind"] == "summary"
    words = (tmp_path / "apptainer.log").read_text().splitlines()[0]
    code = folder / "code"  # the copy's kit, the project as it is (code.folders would copy it)
    assert f"--env=PYTHONPATH={code}/kit:{project} --pwd={code}/project " in words, words
    assert f"--bind={REPO},{project},{tmp_path}/runs," in words


def test_code_folders_that_cannot_be_mounted_are_refused(tmp_path: Path) -> None:
    odd = tmp_path / "a,b"
    odd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(odd)}
    done = kit("launch", "submit", "--mode", "ddp", "cluster.backend=slurm",
               *_container(tmp_path), "--dry-run", env=env)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"error: the job needs {odd} inside the container, but a folder whose path holds ',' or "
        "':' cannot be mounted (the runtimes split mount lists on them): move or link the code to "
        "a path without them"
    ]


def _dry_run_code(srun: str) -> Path:
    """The code copy's folder of the run a dry run's srun line writes its logs into."""
    return Path(srun.split("--output ")[1].split("/logs/")[0]) / "code"


def test_the_dry_run_shows_the_container_on_the_srun_line(tmp_path: Path) -> None:
    """Apptainer wraps the task's command; pyxis is srun's options, PYTHONPATH passed in; either
    way the task starts in the run's code copy and imports it."""
    for runtime in ("apptainer", "pyxis"):
        settings = _container(tmp_path, f"cluster.container.runtime={runtime}")
        done = kit("launch", "submit", "--mode", "ddp", "cluster.backend=slurm", *settings,
                   "--dry-run")  # fmt: skip
        assert done.returncode == 0, done.stderr
        srun = next(line for line in done.stdout.splitlines() if line.startswith("srun "))
        code = _dry_run_code(srun)
        pythonpath = f"{code}/kit:{code}/project"
        expected = {
            "apptainer": f"kit-task apptainer exec --nv --env=PYTHONPATH={pythonpath} "
            f"--pwd={code}/project --bind={REPO},",
            "pyxis": f"--container-image={tmp_path}/pytorch.sif --container-mounts={REPO}:{REPO},",
        }[runtime]
        assert expected in srun and f"export PYTHONPATH={pythonpath}\n" in done.stdout, srun
        assert (f"--container-workdir={code}/project " in srun) == (runtime == "pyxis"), srun
        assert (" python3 -u -m slurm_ddp_kit.train.start" in srun) and sys.executable not in srun
    assert not (tmp_path / "runs").exists()


def test_a_programs_script_folder_and_working_folder_are_mounted(tmp_path: Path) -> None:
    """A user's program whose script lies outside the kit's checkout: the script's folder and
    the folder the job starts in are bound at the same paths; pyxis starts the task there."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_train.py").write_text("print('hello')\n")
    for runtime in ("apptainer", "pyxis"):
        settings = _container(tmp_path, f"cluster.container.runtime={runtime}")
        done = kit("launch", "submit", "--mode", "ddp", "cluster.backend=slurm", *settings,
                   "--dry-run", "--", "python", str(project / "my_train.py"))  # fmt: skip
        assert done.returncode == 0, done.stderr
        srun = next(line for line in done.stdout.splitlines() if line.startswith("srun "))
        bound = f"{project}:{project}" if runtime == "pyxis" else str(project)
        assert bound in srun and str(REPO) in srun, srun
        workdir = f"--container-workdir={_dry_run_code(srun)}/project "  # the copy of REPO
        assert (workdir in srun) == (runtime == "pyxis"), srun


def test_the_sbatch_scripts_get_the_same_words_from_prepare(tmp_path: Path) -> None:
    """`launch prepare --shell` hands the sbatch scripts srun's options and the task's command as
    bash arrays (empty where there is no container: the script runs its own $KIT_PYTHON)."""
    show = 'eval "$prepared"; printf "<%s>" "${container_srun[@]}"; echo; printf "<%s>" "${task_python[@]}"'
    for settings, srun, task in (
        ([f"output.root={tmp_path}/runs"], "", ""),
        (
            _container(tmp_path, "cluster.container.runtime=pyxis"),
            f"<--container-image={tmp_path}/pytorch.sif>",
            "<python3>",
        ),
        (_container(tmp_path), "", "<apptainer><exec><--nv><--env=PYTHONPATH="),
    ):
        prepared = kit("launch", "prepare", "--shell", "--mode", "ddp", *settings)
        assert prepared.returncode == 0, prepared.stderr
        shown = subprocess.run(
            ["bash", "-c", show], env={**os.environ, "prepared": prepared.stdout},
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()  # fmt: skip
        assert shown[0].startswith(srun) and shown[1].startswith(task), (shown, prepared.stdout)
        # Every task imports its run's code copy: pyxis's from srun's PYTHONPATH (exported for
        # the container, then for the tasks), Apptainer's from --env.
        exports = [w for w in prepared.stdout.splitlines() if w.startswith("export PYTHONPATH=")]
        copies = [w for w in exports if "/code/kit:" in w]
        contained = "container" in " ".join(settings)
        assert (len(exports), len(copies)) == ((2, 2) if contained else (1, 1)), prepared.stdout
        assert "/code/kit:" in shown[1] or "apptainer" not in shown[1], shown


@pytest.mark.slurm
def test_pyxis_on_a_cluster_without_it_is_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The test cluster's srun has no --container-image: refused before anything is made."""
    settings = _container(tmp_path, "cluster.container.runtime=pyxis", "cluster.backend=slurm")
    done = kit("launch", "submit", "--mode", "ddp", *settings, env=slurm_cluster.env)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "error: cluster.container.runtime=pyxis, but this cluster's srun has no "
        "--container-image (the pyxis plugin is not installed): use "
        "cluster.container.runtime=apptainer, or ask the cluster's admins for pyxis"
    ]
    assert not (tmp_path / "runs").exists()
