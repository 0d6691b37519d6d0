"""`python -m analysis summarize` over many runs: fast, output sized by groups, never torch.

The runs are copies of one real DP and one real DDP run, made by the benchmark script's own
helper (docs/benchmarks/summarize_speed.py), so this test and the published figures measure the
same thing. The time bound is generous: a CI box is noisy, and the point is to catch a slowdown
of several times (a DataFrame per run, say), not to benchmark.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest
from kit import REPO, kit

from slurm_ddp_kit.analysis import load


def _benchmark_script() -> ModuleType:
    path = REPO / "docs" / "benchmarks" / "summarize_speed.py"
    spec = importlib.util.spec_from_file_location("summarize_speed", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


speed = _benchmark_script()


@pytest.fixture(scope="module")
def sources(small_runs: dict[str, Path]) -> list[Path]:
    """A finished DP run and a finished DDP run of the same settings: one group."""
    return [small_runs["dp"], small_runs["ddp"]]


def _summarize(root: Path) -> str:
    done = kit("analysis", "summarize", str(root))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_copies_are_runs_of_their_own(sources: list[Path], tmp_path: Path) -> None:
    copies = speed.copy_runs(sources, 4, tmp_path / "runs")
    assert len({copy.name for copy in copies}) == 4
    for copy, source in zip(copies, sources * 2, strict=True):
        assert json.loads((copy / "run.json").read_text())["run_id"] == copy.name
        assert copy.name.split("-")[2:4] == source.name.split("-")[2:4]  # mode, shape
        assert not (copy / "checkpoints").exists()


def test_a_thousand_runs_are_read_into_one_group(sources: list[Path], tmp_path: Path) -> None:
    """Their time is a benchmark (docs/benchmarks/summarize_speed.py), not an assertion here: a
    loaded machine would fail a timed test that says nothing of the kit."""
    root = tmp_path / "runs"
    speed.copy_runs(sources, 1000, root)
    out = _summarize(root)
    assert (
        "Runs used: DP (one process, no DataParallel): 500 runs, " in out
        and "DDP: 500 runs, " in out
    )


def test_output_grows_with_groups_not_runs(sources: list[Path], tmp_path: Path) -> None:
    few, many = tmp_path / "few", tmp_path / "many"
    speed.copy_runs(sources, 50, few)
    speed.copy_runs(sources, 500, many)
    # "25 runs" against "250 runs" on the runs line and in the runs row, for DP and DDP
    assert abs(len(_summarize(few)) - len(_summarize(many))) <= 8


# Every run read in another process: small chunks, so each process gets several, the last short.
SPREAD = {"PARALLEL_FROM": 1, "CHUNK": 7, "_cpus": lambda: 2}


def _runs_with_notes(sources: list[Path], root: Path) -> list[Path]:
    """40 runs, of which some in every chunk never started: their notes must keep their order."""
    runs = speed.copy_runs(sources, 40, root)
    for run in runs[3::5]:
        shutil.rmtree(run / "metrics")
    return runs


def test_runs_read_by_spawned_processes_read_as_in_this_one(
    sources: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With another thread running (pandas' and numpy's, once they have started theirs; one of
    the test's own here, whichever tests ran before), the readers are spawned, not forked."""
    runs = _runs_with_notes(sources, tmp_path / "runs")
    alone, alone_notes = load.load_runs(runs)
    for name, value in SPREAD.items():
        monkeypatch.setattr(load, name, value)
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        if sys.platform.startswith("linux"):
            assert load._start_method() == "spawn"
        spread, spread_notes = load.load_runs(runs, parallel=True)
    finally:
        done.set()
        other.join()
    pd.testing.assert_frame_equal(alone, spread)
    assert alone_notes == spread_notes


def test_runs_read_by_forked_processes_print_the_same_table(
    sources: list[Path], tmp_path: Path
) -> None:
    """The command line reads before it loads pandas: on Linux its readers are forked."""
    root = tmp_path / "runs"
    _runs_with_notes(sources, root)
    alone = kit("analysis", "summarize", str(root), "--format", "csv")
    spread = subprocess.run(
        [sys.executable, "-c", FORKED, str(root)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert spread.returncode == 0, spread.stderr
    assert spread.stdout == alone.stdout and spread.stderr == alone.stderr
    assert alone.stderr.count("no metrics yet") == 8


FORKED = """
import sys
from slurm_ddp_kit.analysis import load
from slurm_ddp_kit.analysis.__main__ import main

load.PARALLEL_FROM, load.CHUNK, load._cpus = 1, 7, lambda: 2
assert load._start_method() == "fork" or not sys.platform.startswith("linux")
sys.exit(main(["summarize", sys.argv[1], "--format", "csv"]))
"""


def test_summarize_imports_neither_torch_nor_omegaconf(sources: list[Path]) -> None:
    done = kit(  # as `python -X importtime -m analysis summarize …`
        "analysis", "summarize", str(sources[0].parent), env={"PYTHONPROFILEIMPORTTIME": "1"}
    )
    assert done.returncode == 0, done.stderr
    modules = {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "pandas" in modules  # the check does see the imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "omegaconf"))
    assert not heavy, f"summarize imported {heavy[:5]}"
