"""Run the kit's own commands the way a user does: a real process, its output and exit code."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Tiny but real: every figure and file of a full run, in seconds on a 2-core machine.
SMALL = ["data.train_size=1024", "data.test_size=256", "train.epochs=2", "cluster.timeout_min=10"]
# The token workload at a size a CPU test trains in seconds (seq_len/vocab/width/depth/heads).
TINY_GPT = [
    "data.dataset=tokens", "model.name=gpt", "data.seq_len=16", "data.vocab=16",
    "model.width=32", "model.depth=2", "model.heads=2",
]  # fmt: skip


def kit(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` in a fresh interpreter, output captured; a setting given twice is
    given once, the later value (`later_wins`)."""
    return subprocess.run(
        [sys.executable, "-m", *later_wins(args)],
        cwd=cwd or REPO,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kit_started(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python -m <args>` started in a fresh interpreter, not waited for; output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", *later_wins(args)],
        cwd=REPO,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


SETTING = re.compile(r"[a-z_]+(\.[A-Za-z0-9_-]+)*=")
_TAKES_VALUE = ("--grid", "--config", "--modes", "--mode", "--nodes", "--root", "--rank")


def later_wins(args: Sequence[str]) -> list[str]:
    """The words with each `key=value` setting given once, at its last place: a test passes the
    shared small settings (SMALL, …) and then its own, as a later key=value used to override an
    earlier one; the kit refuses a repeated setting (tests/test_bad_input.py shows it). A flag's
    value and a program's words after `--` are left as they are."""
    words, last, skip = list(args), {}, False
    end = words.index("--") if "--" in words else len(words)
    for at, word in enumerate(words[:end]):
        if not skip and SETTING.match(word):
            last[word.partition("=")[0]] = at
        skip = word in _TAKES_VALUE
    keep = set(last.values())
    return [
        word for at, word in enumerate(words)
        if at >= end or not SETTING.match(word) or at in keep or _flag_value(words, at)
    ]  # fmt: skip


def _flag_value(words: list[str], at: int) -> bool:
    return at > 0 and words[at - 1] in _TAKES_VALUE


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def submit_without_pipes(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`launch submit` without --wait, its output in a file: submitit's local controller inherits
    the submitting process's stdout and stderr, so through kit()'s pipes the call would last as
    long as the job."""
    log = tmp / "submit.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "launch", "submit", *args],
            cwd=REPO,
            env=_env(None),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
            # As a script's `launch submit … &` starts: with SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    return subprocess.CompletedProcess(done.args, done.returncode, log.read_text(), "")


def kit_here(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` run in this interpreter: the same `main` a process runs, its output
    and exit code, in milliseconds instead of a second of start-up. For commands that end in
    their own process anyway (settings refused, folders read); whatever the command imports,
    changes in os.environ, the working folder and the logging setup are put back after."""
    module, *argv = args
    main = importlib.import_module(MAINS[module]).main
    out, err = io.StringIO(), io.StringIO()
    modules, path, environ, folder = set(sys.modules), list(sys.path), dict(os.environ), os.getcwd()
    handlers = list(logging.getLogger().handlers)
    try:
        os.environ.update(env or {})
        os.chdir(cwd or REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = int(main(argv))
            except SystemExit as end:  # argparse's --help and usage errors
                code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    finally:
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if _users_own(sys.modules[name]):  # a factory: the next case may bring another
                del sys.modules[name]
        logging.getLogger().handlers[:] = handlers
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _users_own(module: Any) -> bool:
    """A module from neither the kit nor an installed package."""
    file = getattr(module, "__file__", None) or ""
    homes = (str(REPO), sys.prefix, sys.base_prefix)
    return bool(file) and not file.startswith(homes)


MAINS = {
    "launch": "slurm_ddp_kit.launch.cli",
    "analysis": "slurm_ddp_kit.analysis.__main__",
    "train": "slurm_ddp_kit.train.__main__",
}


COMMAND = str(Path(sys.executable).parent / "slurm-ddp-kit")  # the console command pip gives
CAUGHT = "raise SystemExit('the project’s own {} was imported by the kit')\n"


def project(tmp_path: Path) -> Path:
    """A user's project: its training script is `train.py` (the example DDP script), and it
    has modules named as the kit's packages once were, each failing loudly if imported."""
    folder = tmp_path / "project"
    (folder / "core").mkdir(parents=True)
    shutil.copy(REPO / "docs" / "examples" / "ddp_script.py", folder / "train.py")
    (folder / "core" / "__init__.py").write_text(CAUGHT.format("core/"))
    for name in ("launch", "analysis"):
        (folder / f"{name}.py").write_text(CAUGHT.format(f"{name}.py"))
    return folder


def in_project(
    folder: Path, *words: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The console command, started in the project with the project on PYTHONPATH."""
    return subprocess.run(
        [COMMAND, *words], cwd=folder, env={**os.environ, **(env or {}), "PYTHONPATH": str(folder)},
        capture_output=True, text=True, timeout=480,
    )  # fmt: skip


def run_folder(stdout: str) -> Path:
    """The run folder `launch submit` printed."""
    line = next(line for line in stdout.splitlines() if line.startswith("run folder: "))
    return Path(line.removeprefix("run folder: "))


def records(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / f"rank-{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(what: Callable[[], bool], seconds: float, every: float = 0.2) -> bool:
    """Poll every `every` seconds until `what()` holds or `seconds` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(every)
    return what()


def free_port() -> int:
    """A TCP port free on this host now: for a process group's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawned_ranks(target: Callable[..., None], world: int, *args: Any, answers: int) -> list[Any]:
    """Run `target(rank, world, port, *args, out)` in `world` fresh processes (spawn: no state of
    the test's own process), as a job's ranks on one free port; the first `answers` items they
    put on `out` (each within 240 s), once every process has ended with exit code 0."""
    import multiprocessing  # here: most tests start no such ranks

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)
    ]
    for p in ranks:
        p.start()
    got = [out.get(timeout=240) for _ in range(answers)]
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0, p.exitcode
    return got


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def load_split(folder: Path, train: bool) -> Any:
    """One split of an embedded dataset as the job sees it: a TensorDataset of normalised images
    and their labels (torch is imported here, not by the tests that only run the kit)."""
    import torch

    from slurm_ddp_kit.train import data

    images, labels = data.load_raw(folder, "synthetic", train)
    return torch.utils.data.TensorDataset(data.normalise(images), labels)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The exit code and shape every user error shares; returns the message."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]
