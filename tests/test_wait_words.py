"""What `launch submit --wait` says: a largest-batch search's result, a long start, a start
without bytecode, and Ctrl-C in any command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

from slurm_ddp_kit.train.largest_batch import CEILING


@pytest.mark.parametrize(
    ("largest", "trials", "said"),
    [
        (None, [], "largest batch not measured (no GPU)"),
        (None, [(8, False)], "no batch fits: 8 samples ran out of memory"),
        (3000, [(2000, True), (4000, False), (3000, True)], "fits: 3000 (within 5 %)"),
        (CEILING, [(CEILING, True)], f"fits: at least {CEILING} (where the search stops)"),
    ],
)
def test_largest_batch_result_in_words(
    largest: int | None, trials: list[tuple[int, bool]], said: str
) -> None:
    from slurm_ddp_kit.launch.follow import result_words

    result = {
        "largest_global_batch": largest,
        "trials": [{"global_batch": b, "fits": ok} for b, ok in trials],
        "ceiling": CEILING,
    }
    assert result_words(result).endswith(said)


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from slurm_ddp_kit.core.cli import run_cli

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    assert run_cli(interrupted, argparse.Namespace()) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ([], ""),
        (["train.compile=true"], " compiled (torch.compile: minutes on a cold compile cache) on a"),
        (["train.cuda_graph=true"], " its step captured as CUDA graphs on a random batch"),
        (
            ["train.compile=true", "train.cuda_graph=true"],
            " compiled (torch.compile: minutes on a cold compile cache) and its step captured",
        ),
    ],
)
def test_wait_says_what_a_long_start_does(settings: list[str], words: str) -> None:
    """Said in the starting line of `--wait` (of the model), so a long start is not taken for a
    hang."""
    from slurm_ddp_kit.core.settings.loading import load_config
    from slurm_ddp_kit.launch.follow import _warm_up_words

    said = _warm_up_words(load_config(overrides=settings))
    assert said.startswith(words) and bool(said) == bool(words)


def test_a_start_without_bytecode_is_said_with_its_fix(tmp_path: Path) -> None:
    """A rank whose Python writes no bytecode and finds none (PYTHONDONTWRITEBYTECODE and an
    empty PYTHONPYCACHEPREFIX: what a read-only install without caches gives) records it, and
    `--wait`'s start line says what it costs and how to fix it; a rank of the kit's own venv
    imports torch from its bytecode cache and says nothing of it."""
    from slurm_ddp_kit.launch.follow import _started_words

    probe = "from slurm_ddp_kit.train.process import bytecode_cached; print(bytecode_cached())"
    bare = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path)}
    for env, expected in ((bare, "False"), (os.environ, "True")):
        done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.stdout.strip() == expected, done.stderr
    assert not any(tmp_path.iterdir())  # nothing written: the start would be as slow next time
    start = {"world_size": 2, "startup_s": 9.5, "device": "cuda:0"}
    said = _started_words({**start, "bytecode_cached": False})
    assert "torch was compiled from its sources" in said and "unset it" in said
    assert said.startswith(_started_words({**start, "bytecode_cached": True}))
    assert _started_words({**start, "bytecode_cached": True}) == _started_words(start)
