"""The code's shape, checked: imports go analysis → launch → train, readers start without torch,
and only train/runfolder.py spells the run folder's file names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

LAYERS = {"train": set(), "launch": {"train"}, "analysis": {"train", "launch"}}
RUN_FOLDER_NAMES = ("config.yaml", "run.json", "rank-", "metrics/", "checkpoints/", "_log.out")


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).glob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


@pytest.mark.parametrize("package", list(LAYERS))
def test_imports_go_one_way(package: str) -> None:
    for path in _modules(package):
        upward = _imported_packages(path) - LAYERS[package] - {package}
        assert not upward, f"{path.relative_to(REPO)} imports {sorted(upward)}"


def test_status_config_logs_and_analysis_start_without_torch() -> None:
    code = (
        "import sys, launch.cli, launch.jobs, analysis.load, analysis.table, analysis.__main__;"
        "sys.exit('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "torch was imported"


def test_only_the_run_folder_module_spells_its_file_names() -> None:
    owner = REPO / "train" / "runfolder.py"
    for path in [p for package in LAYERS for p in _modules(package) if p != owner]:
        strings = [
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        for name in RUN_FOLDER_NAMES:
            assert not any(name in s for s in strings), f"{path.relative_to(REPO)} spells {name!r}"
    for script in (REPO / "slurm").glob("*.sbatch"):
        lines = script.read_text().splitlines()
        body = "\n".join(line for line in lines if not line.startswith("#"))
        assert "launch prepare --shell" in body and "/logs" not in body, script.name
