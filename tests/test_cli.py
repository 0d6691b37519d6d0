"""`python -m launch` refusing what it cannot do as asked: one line, exit 2, nothing made."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kit import MAINS, REPO, SMALL, kit, kit_here

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.cli import HeldSignals, Interrupted
from slurm_ddp_kit.core.settings.loading import load_config


@pytest.mark.parametrize(
    ("given", "named", "fix"),
    [
        (["--modes", "dp,ddp", "--mode", "zero"], "--mode zero", "--modes zero"),
        (["--modes", "dp,ddp", "mode=zero"], "mode=zero", "--modes zero"),
        (["--grid", "mode=dp,zero"], "mode=dp,zero", "--modes dp,zero"),
        (["--modes", "ddp,ddp"], "--modes ddp,ddp", "--modes ddp"),
    ],
)
def test_sweep_refuses_a_mode_besides_its_modes(
    tmp_path: Path, given: list[str], named: str, fix: str
) -> None:
    """Another mode would override each of --modes: identical runs, one per mode."""
    done = kit(
        "launch",
        "sweep",
        *given,
        "cluster.backend=local",
        *SMALL,
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and named in line and line.endswith(f"e.g. {fix}")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("grid", "named"),
    [
        (["train.lr=0.1,0.2", "train.lr=0.3"], "--grid train.lr is given twice"),
        (["train.lr=0.1,0.1"], "--grid train.lr=0.1,0.1 names one value twice (0.1 and 0.1)"),
        (
            ["train.lr=0.1,0.10,0.2"],
            "names one value twice (0.1 and 0.10): give each once, e.g. train.lr=0.1,0.2",
        ),
        (["cluster.exclusive=true,True"], "names one value twice (true and True)"),
        (
            ["train.lr=0.1,0.2", "--", "train.lr=0.5"],
            "train.lr=0.5 and --grid train.lr=0.1,0.2 both set train.lr",
        ),
        (
            [
                "train.seed=" + ",".join(map(str, range(101))),
                "train.lr=" + ",".join(f"0.{n:03}" for n in range(1, 101)),
            ],
            "--modes and --grid make 20,200 points: a sweep holds at most 10,000",
        ),
    ],
)
def test_sweep_refuses_a_grid_that_would_not_run_as_written(
    tmp_path: Path, grid: list[str], named: str
) -> None:
    items, _, settings = " ".join(grid).partition(" -- ")  # after `--`: settings, not a grid
    args = [arg for item in items.split() for arg in ("--grid", item)] + settings.split()
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data"]
    done = kit_here("launch", "sweep", *args, "cluster.backend=local", *SMALL, *where)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and named in line
    assert not (tmp_path / "runs").exists()


COMMANDS = [
    *(("launch", name) for name in ("config", "submit", "sweep", "prepare", "status", "resume")),
    ("launch", "cancel"),
    ("launch", "logs"),
    ("analysis", "summarize"),
    ("train", "run"),
    ("train", "prepare-data"),
    ("train", "fetch-mnist"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_version_verbose_and_quiet(command: tuple[str, str]) -> None:
    module, name = command
    done = kit_here(module, name, "--version")
    assert done.returncode == 0 and done.stdout.startswith(f"python -m {module} {name} "), done
    helped = kit_here(module, name, "--help").stdout
    assert "-v, --verbose" in helped and "-q, --quiet" in helped, helped


def test_sweep_help_lists_only_what_sweep_takes() -> None:
    helped = kit_here("launch", "sweep", "--help").stdout
    assert "--modes" in helped and "--mode " not in helped and "--mode {" not in helped


@pytest.mark.parametrize("script", ["ddp", "dp"])
def test_a_batch_script_run_outside_slurm_says_how_to_submit_it(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", str(REPO / f"slurm/{script}.sbatch")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: submit this script with sbatch (sbatch slurm/{script}")


def test_sweep_dry_run_prints_each_point_and_the_array_script(tmp_path: Path) -> None:
    done = kit_here(
        "launch", "sweep", "--dry-run", "--modes", "dp,ddp", "--grid", "train.lr=0.1,0.2",
        "cluster.backend=slurm", f"output.root={tmp_path}/runs",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == [
        "point 0: mode=dp train.lr=0.1",
        "point 1: mode=dp train.lr=0.2",
        "point 2: mode=ddp train.lr=0.1",
        "point 3: mode=ddp train.lr=0.2",
    ]
    assert sum(line.startswith("run folder (made on submit): ") for line in lines) == 4
    # DP's points ask for DP's allocation (one task with the node's CPUs), DDP's for a task per
    # GPU: an array each, and srun told each one's CPUs per task.
    dp, ddp = done.stdout.split("array of points 0-1:\n")[1].split("array of points 2-3:\n")
    for script, tasks, cpus in ((dp, 1, 8), (ddp, 4, 2)):
        assert "#SBATCH --array=0-1%2" in script
        assert f"#SBATCH --ntasks-per-node={tasks}\n" in script
        assert f"#SBATCH --cpus-per-task={cpus}\n" in script
        assert f"--kill-on-bad-exit=1 --cpus-per-task={cpus} " in script
    # Every element's tasks start as a job's do: the stop signals held before Python loads.
    assert "-m slurm_ddp_kit.train.start -u -m submitit.core._submit" in done.stdout
    assert not (tmp_path / "runs").exists()  # nothing made, nothing submitted


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """`… | head -1`: the command stops writing as a Unix tool does (128 + SIGPIPE), with no
    traceback on its stderr."""
    command = (
        f"{sys.executable} -m launch sweep --grid train.seed={','.join(map(str, range(300)))} "
        f"cluster.backend=local output.root={tmp_path} --dry-run 2>{tmp_path}/err | head -1; "
        'echo "${PIPESTATUS[0]}"'
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)  # fmt: skip
    first, code = done.stdout.splitlines()
    assert first == "point 0: mode=dp train.seed=0" and code == "141"
    assert (tmp_path / "err").read_text() == ""


def test_status_of_dot_names_the_run_and_a_file_as_root_is_named(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    done = kit_here("launch", "status", ".", cwd=run_dir)
    assert done.returncode == 0 and done.stdout.splitlines()[1].split()[0] == run_dir.name
    done = kit_here("launch", "status", "--root", str(run_dir / "run.json"))
    assert done.stderr == f"error: --root {run_dir}/run.json is a file: name the output root\n"


@pytest.mark.skipif(
    not shutil.which("sbatch") or Path("/etc/slurm/slurm.conf").exists(),
    reason="needs an sbatch that finds no cluster (no slurm.conf here)",
)
@pytest.mark.parametrize("command", ["submit", "sweep"])
def test_a_machine_without_slurm_is_named_and_no_folder_is_left(
    tmp_path: Path, command: str
) -> None:
    """sbatch that reaches no controller: the fix is another machine or the local backend, not
    the job's sizes; the output root made for the refused job is gone again."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    args = ["--mode", "ddp"] if command == "submit" else ["--grid", "train.lr=0.1,0.2"]
    done = subprocess.run(
        [sys.executable, "-m", "launch", command, *args, "cluster.backend=slurm",
         f"output.root={tmp_path}/deep/runs"],
        capture_output=True, text=True, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: sbatch could not reach Slurm")
    assert "or use cluster.backend=local" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _signalled(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # Python runs the handler between two instructions of this thread


def test_held_signals_wait_for_release_and_a_second_one_is_not_held() -> None:
    """While a job is submitted and recorded, Ctrl-C, SIGTERM and SIGHUP are held and taken
    afterwards; asked twice (a submission that hangs), the command ends at once."""
    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a command
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts one (a test
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # worker may have been left ignoring them)
    held = HeldSignals()
    held.hold()
    try:
        _signalled(signal.SIGHUP)  # ignored before: still without effect
        assert held.signum is None
        _signalled(signal.SIGTERM)
        assert held.signum == signal.SIGTERM
        with pytest.raises(Interrupted) as second:
            _signalled(signal.SIGINT)
        assert second.value.signum == signal.SIGTERM
    finally:
        held.release()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # as it was
        for signum, handler in before.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def test_a_slurm_conf_that_names_no_file_is_refused_at_once(tmp_path: Path) -> None:
    """sbatch would retry reading it for a minute, then fail in words about the file."""
    if not shutil.which("sbatch"):
        pytest.skip("needs Slurm's client commands")
    conf = tmp_path / "slurm.conf"
    done = kit(
        "launch", "submit", "--mode", "ddp", "cluster.backend=slurm", f"output.root={tmp_path}/runs",
        env={"SLURM_CONF": str(conf)}, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: SLURM_CONF={conf} names no file, so sbatch cannot reach Slurm (it would retry "
        "for a minute): point SLURM_CONF at the cluster's slurm.conf or unset it, or use "
        "cluster.backend=local\n"
    )
    assert not (tmp_path / "runs").exists()


def test_status_reads_a_folder_of_runs_as_cancel_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status SWEEP_ROOT` lists the runs the folder holds (a sweep's root), where it said the
    folder was not a run folder; a folder holding none is still named as such."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    cfg = load_config(overrides=[f"output.root={tmp_path}/sweep", "cluster.backend=local"])
    made = [runfolder.create(cfg, launcher="test", backend="local", command=[]) for _ in range(2)]
    out = kit_here("launch", "status", str(tmp_path / "sweep"))
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[1:3]] == sorted(
        run.name for run in made
    )
    (tmp_path / "empty").mkdir()
    empty = kit_here("launch", "status", str(tmp_path / "empty"))
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_an_interrupted_slurm_sweep_names_its_own_runs_not_the_whole_root() -> None:
    """The root may hold other runs: the hint follows and cancels the sweep's alone."""
    from types import SimpleNamespace

    from slurm_ddp_kit.launch.backends.slurm import SWEEP_RUNS_NAMED, _queued_words

    root = Path("/o/runs")
    few = [(root / f"r{i}", SimpleNamespace(job_id=f"71_{i}")) for i in range(2)]
    words = _queued_words([run for run, _ in few], few)
    assert "`python -m launch cancel /o/runs/r0 /o/runs/r1`" in words
    many = [(root / f"r{i}", SimpleNamespace(job_id=f"{70 + i // 4}_{i}")) for i in range(8)]
    assert len(many) > SWEEP_RUNS_NAMED
    words = _queued_words([run for run, _ in many], many)
    assert "in job array(s) 70 71:" in words and "`scancel 70 71` cancels them alone" in words


def _subcommands(module: str) -> dict[str, argparse.ArgumentParser]:
    parser = importlib.import_module(MAINS[module])._parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


HELPED = [(m, c) for m in ("launch", "analysis", "train") for c in _subcommands(m)]


@pytest.mark.parametrize(("module", "command"), HELPED, ids=[f"{m}-{c}" for m, c in HELPED])
def test_every_commands_help_ends_with_examples_its_parser_takes(module: str, command: str) -> None:
    """`--help` of each command shows how it is used; each example (less its note in
    parentheses, and a program after `--`) is taken by the command's own parser."""
    done = kit_here(module, command, "--help")
    assert done.returncode == 0 and "examples:\n" in done.stdout, done.stdout
    examples = done.stdout.split("examples:\n")[1].split("\n\n")[0].splitlines()
    prefix = f"python -m {module} {command}"
    assert examples and all(line.strip().startswith(prefix) for line in examples), examples
    for line in examples:
        words = shlex.split(re.sub(r"\s{2,}\(.*\)$", "", line.strip()))[3:]
        words = words[: words.index("--")] if "--" in words else words
        args = importlib.import_module(MAINS[module])._parser().parse_args(words)
        assert args.func is _subcommands(module)[command].get_default("func"), line
