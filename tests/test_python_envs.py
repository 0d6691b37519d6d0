"""The kit run by a Python that a cluster's Environment Modules give (`module load`), not the
kit's own venv: the launcher started by it, every task of a local and of a Slurm job runs that
same interpreter, and a program's `python` is the module's too (docs/cluster.md, Installing).

The module's Python is a virtual environment of its own whose packages are the kit venv's (a
`.pth` that adds them, as a site's Python module with torch installed has its own): a Python
at another path, which only PATH from the module leads to. A conda environment is the same
shape (a prefix with bin/python, put first on PATH by its activation); this machine has no
conda to try it with."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from kit import REPO, records, run_folder
from slurm_cluster import SlurmCluster

MODULES_INIT = Path("/usr/share/modules/init/bash")

MODULEFILE = """#%Module1.0
prepend-path PATH {bin}
setenv KIT_SITE_PYTHON sitepy/1.0
"""

# Says which interpreter started it (the kit's task: its parent) and which it is.
PROBE = """
import os, sys
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")[0].decode()
print("task-python", parent, "program-python", sys.executable,
      "module", os.environ.get("KIT_SITE_PYTHON"), flush=True)
"""


@pytest.fixture
def site_python(tmp_path: Path) -> tuple[Path, list[str]]:
    """The module's Python and the shell lines that load its module."""
    if not MODULES_INIT.is_file():
        pytest.skip(
            "no Environment Modules here (make test installs them: slurm/testcluster/install.sh)"
        )
    env = tmp_path / "sitepy"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3.*/site-packages"))
    kit_site = sysconfig.get_paths()["purelib"]  # the kit venv's: torch, submitit, the kit
    (site / "kit-venv.pth").write_text(f"import site; site.addsitedir({kit_site!r})\n")
    modules = tmp_path / "modulefiles"
    (modules / "sitepy").mkdir(parents=True)
    (modules / "sitepy" / "1.0").write_text(MODULEFILE.format(bin=env / "bin"))
    load = [f"source {MODULES_INIT}", f"module use {modules}", "module load sitepy/1.0"]
    return env / "bin" / "python", load


def _launch_under_module(
    load: list[str], tmp_path: Path, settings: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`python -m launch submit …` in a login shell's way: the module loaded, then `python`."""
    (tmp_path / "probe.py").write_text(PROBE)
    words = ["python", "-m", "launch", "submit", "--mode", "ddp", "cluster.gpus_per_node=2",
             f"output.root={tmp_path}/runs", *settings, "--wait", "--",
             "python", str(tmp_path / "probe.py")]  # fmt: skip
    script = "\n".join([*load, f"cd {shlex.quote(str(REPO))}", shlex.join(words)])
    clean = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(
        ["bash", "-c", script], env=clean, capture_output=True, text=True, timeout=300
    )


def _ran_the_module_python(run_dir: Path, python: Path) -> None:
    for rank in (0, 1):
        start = records(run_dir, rank)[0]
        assert start["program"] == ["python", str(run_dir.parents[1] / "probe.py")]
    log = sorted((run_dir / "logs").glob("*_0_log.out"))[-1].read_text()
    said = next(line for line in log.splitlines() if line.startswith("task-python "))
    assert said.split() == ["task-python", str(python), "program-python", str(python),
                            "module", "sitepy/1.0"], log  # fmt: skip


def test_a_local_job_runs_the_python_of_a_loaded_module(
    site_python: tuple[Path, list[str]], tmp_path: Path
) -> None:
    python, load = site_python
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = _launch_under_module(load, tmp_path, ["cluster.backend=local"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    _ran_the_module_python(run_folder(done.stdout), python)


@pytest.mark.slurm
def test_a_slurm_job_runs_the_python_of_a_loaded_module(
    site_python: tuple[Path, list[str]], slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The job loads the module again before its tasks start (cluster.setup), as a site whose
    jobs start with a clean environment needs; its tasks run the launcher's interpreter."""
    python, load = site_python
    env = {**os.environ, **slurm_cluster.env, "PYTHONPATH": str(REPO)}
    setup = "cluster.setup=[" + ",".join(f'"{line}"' for line in load) + "]"
    done = _launch_under_module(
        load, tmp_path, ["cluster.backend=slurm", "cluster.cpus_per_task=1", setup], env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _ran_the_module_python(run_folder(done.stdout), python)
