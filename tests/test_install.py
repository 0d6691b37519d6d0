"""The kit beside a user's own project: its code lives under `slurm_ddp_kit`, so a project's
`train.py`, `core/`, `launch.py` or `analysis.py` (on the path, or the working folder) is never
taken for the kit's; `pip install` gives the `slurm-ddp-kit` command, and the wheel carries the
sbatch scripts and the examples, which `launch init` copies into a project."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from kit import COMMAND, REPO, in_project, kit_here, project, run_folder

EXAMPLE = REPO / "docs" / "examples" / "ddp_script.py"


def test_a_project_with_its_own_train_py_and_core_trains_both_kinds_and_summarizes(
    tmp_path: Path,
) -> None:
    """From the project's folder: the kit's own loop and the project's `train.py` as a program,
    each on two local ranks, then the table; nothing of the project is imported by the kit."""
    folder = project(tmp_path)
    small = ["cluster.backend=local", "cluster.gpus_per_node=2", "output.root=runs"]
    own = in_project(
        folder, "submit", "--mode", "ddp", *small, "data.train_size=256", "data.test_size=64",
        "train.global_batch_size=64",
        "train.epochs=1", "--wait",
    )  # fmt: skip
    assert own.returncode == 0, own.stdout + own.stderr
    program = in_project(
        folder, "submit", "--mode", "ddp", *small, "--wait", "--", sys.executable, "train.py",
        "--epochs", "1",
    )  # fmt: skip
    assert program.returncode == 0, program.stdout + program.stderr
    assert "2 rank(s) started" in program.stdout
    for done in (own, program):
        assert (folder / run_folder(done.stdout) / "run.json").is_file()
    table = in_project(folder, "summarize", "runs")
    assert table.returncode == 0 and "| metric |" in table.stdout, table.stdout + table.stderr
    assert "was imported by the kit" not in own.stderr + program.stderr + table.stderr


def test_python_m_launch_works_from_any_folder_but_one_holding_launch_py(tmp_path: Path) -> None:
    """`python -m launch` is the design's command: from a folder holding a `train.py` and a
    `core/` it works; a `launch.py` in the folder is Python's to run first, which the
    console command is for."""
    folder = project(tmp_path)
    (folder / "launch.py").unlink()
    env = {**os.environ, "PYTHONPATH": str(folder)}
    done = subprocess.run(
        [sys.executable, "-m", "launch", "config", "train.epochs=3"],
        cwd=folder, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "epochs: 3" in done.stdout, done.stderr


def test_init_copies_the_scripts_and_examples_and_keeps_what_is_there(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    (folder / "slurm").mkdir(parents=True)
    (folder / "slurm" / "ddp.sbatch").write_text("# my own\n")
    done = subprocess.run(
        [COMMAND, "init", str(folder)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert f"kept  {folder}/slurm/ddp.sbatch" in done.stdout.splitlines()
    assert (folder / "slurm" / "ddp.sbatch").read_text() == "# my own\n"
    assert (folder / "slurm" / "dp.sbatch").read_bytes() == (REPO / "slurm/dp.sbatch").read_bytes()
    for example in (REPO / "docs" / "examples").iterdir():
        assert (folder / "examples" / example.name).read_bytes() == example.read_bytes()
    assert os.access(folder / "slurm" / "dp.sbatch", os.X_OK)


def test_the_wheel_carries_the_command_the_scripts_and_the_examples(tmp_path: Path) -> None:
    """`pip wheel .` holds the kit under its own name, the three `python -m` names, the
    console command, the sbatch scripts and the examples; installed alone (no checkout beside
    it), its `launch init` hands out the same files."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "wheel"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"slurm_ddp_kit", "launch", "train", "analysis"}, tops
    assert {"slurm_ddp_kit/sbatch/ddp.sbatch", "slurm_ddp_kit/examples/two-nodes.yaml",
            "slurm_ddp_kit/examples/ddp_script.py", "launch/__main__.py"} <= names  # fmt: skip
    packages = {str(i.relative_to(REPO)) for i in (REPO / "slurm_ddp_kit").rglob("__init__.py")}
    assert packages <= names, sorted(packages - names)  # pyproject.toml lists each package
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "slurm-ddp-kit = slurm_ddp_kit.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "launch", "init", str(out)], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "slurm" / "ddp.sbatch").read_bytes() == (REPO / "slurm/ddp.sbatch").read_bytes()
    assert (out / "examples" / "ddp_script.py").read_bytes() == EXAMPLE.read_bytes()


def test_init_where_a_file_stands_for_a_folder_says_so_after_what_it_wrote(tmp_path: Path) -> None:
    """`slurm` is a file in the project: one line naming it, after the lines of the files
    written before it (nothing written is taken back)."""
    (tmp_path / "slurm").write_text("not a folder\n")
    done = kit_here("launch", "init", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"error: cannot write {tmp_path}/slurm/ddp.sbatch: {tmp_path}/slurm is a file, not a "
        "folder: move it, or choose another folder\n"
    )
    written = [line.split()[1] for line in done.stdout.splitlines()]
    assert written == [
        str(tmp_path / "examples" / p.name) for p in sorted(EXAMPLE.parent.iterdir())
    ]
    assert all(Path(p).is_file() for p in written)
