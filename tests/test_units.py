"""Behaviour of the pieces: the batch search, --grid, sacct parsing, and local jobs' lifecycle."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from kit import REPO, SMALL, alive, kit, records, run_folder, spawned_ranks, wait_for
from paced import LASTING

from slurm_ddp_kit.core.settings.schema import ConfigError
from slurm_ddp_kit.core.slurm import parse_sacct
from slurm_ddp_kit.launch.cli import grid
from slurm_ddp_kit.train import largest_batch, stopping
from slurm_ddp_kit.train.largest_batch import CEILING, TOLERANCE, search
from slurm_ddp_kit.train.stopping import StopSignals

# --- largest_batch.search -----------------------------------------------------------------------


class Limit:
    """A fits() that holds up to `limit` and records every call."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.calls: list[int] = []

    def __call__(self, batch: int) -> bool:
        self.calls.append(batch)
        return batch <= self.limit


@pytest.mark.parametrize(
    ("limit", "start", "unit"),
    [
        (3000, 128, 4),
        (3000, 4096, 4),  # the first trial already fails: bisect down from it
        (3000, 1001, 8),  # start not a multiple of unit
        (777_777, 64, 8),
        (1023, 1, 1),
        (9, 3, 3),
        (5000, 5000, 4),
    ],
)
def test_search_finds_a_fitting_multiple_within_tolerance(
    limit: int, start: int, unit: int
) -> None:
    fits = Limit(limit)
    found, trials = search(fits, start=start, unit=unit)
    best = limit // unit * unit  # the true answer
    assert found is not None and found % unit == 0 and found <= limit
    assert found >= best * (1 - TOLERANCE) or best - found <= unit
    assert trials == [{"global_batch": b, "fits": b <= limit} for b in fits.calls]
    assert all(t["global_batch"] % unit == 0 and t["global_batch"] > 0 for t in trials)
    assert found == max(t["global_batch"] for t in trials if t["fits"])


def test_search_records_every_trial_in_order() -> None:
    fits = Limit(3000)
    found, trials = search(fits, start=128, unit=4)
    assert [t["global_batch"] for t in trials][:6] == [128, 256, 512, 1024, 2048, 4096]
    assert [t["fits"] for t in trials][:6] == [True] * 5 + [False]
    assert len({t["global_batch"] for t in trials}) == len(trials)  # no size tried twice
    assert found is not None and abs(3000 - found) / 3000 <= TOLERANCE


@pytest.mark.parametrize(("start", "unit"), [(128, 4), (1, 8), (7, 8)])
def test_search_returns_none_when_nothing_fits(start: int, unit: int) -> None:
    fits = Limit(unit - 1)
    found, trials = search(fits, start=start, unit=unit)
    assert found is None
    assert trials and not any(t["fits"] for t in trials)
    assert min(t["global_batch"] for t in trials) == unit  # the smallest size was tried


def test_search_stops_at_the_ceiling() -> None:
    fits = Limit(float("inf"))
    found, trials = search(fits, start=1000, unit=4)
    tried = [t["global_batch"] for t in trials]
    assert all(t["fits"] for t in trials)
    assert max(tried) <= CEILING < max(tried) * 2
    assert found == max(tried) == 1000 * 2 ** (len(tried) - 1)


def test_search_ceiling_is_the_module_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(largest_batch, "CEILING", 1000)
    found, trials = search(Limit(float("inf")), start=100, unit=10)
    assert found == 800 and [t["global_batch"] for t in trials] == [100, 200, 400, 800]


def test_search_starting_past_the_ceiling_starts_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(largest_batch, "CEILING", 1000)
    found, trials = search(Limit(float("inf")), start=5000, unit=8)
    assert found == 1000 and [t["global_batch"] for t in trials] == [1000]
    found, trials = search(Limit(600), start=5000, unit=8)
    assert found is not None and 600 * (1 - TOLERANCE) <= found <= 600


def test_search_start_below_unit_starts_at_unit() -> None:
    fits = Limit(100)
    search(fits, start=3, unit=8)
    assert fits.calls[0] == 8


# --- launch.cli.grid -----------------------------------------------------------------------


def test_grid_is_the_product_in_order() -> None:
    assert grid(["a=1,2", "b=x,y,z"]) == [
        ("a=1", "b=x"),
        ("a=1", "b=y"),
        ("a=1", "b=z"),
        ("a=2", "b=x"),
        ("a=2", "b=y"),
        ("a=2", "b=z"),
    ]
    assert grid(["train.epochs=3"]) == [("train.epochs=3",)]
    assert grid([]) == [()]  # no --grid: one run with the plain config


@pytest.mark.parametrize("item", ["a", "a=", "=1,2", "a=1,,2", "a=1,", "a=,1"])
def test_grid_refuses_a_bad_item(item: str) -> None:
    with pytest.raises(ConfigError, match=r"is not of the form key=v1,v2, e\.g\. "):
        grid(["b=1", item])


# --- core.slurm.parse_sacct -----------------------------------------------------------------

SACCT = """\
JobID|State|Elapsed|NodeList
41|COMPLETED|00:01:02|node[1-2]
42|CANCELLED by 0|00:00:05|node1
43_3|RUNNING|00:00:10|node2
44|PENDING|00:00:00|None assigned
"""


def test_parse_sacct_keys_rows_by_job_id() -> None:
    rows = parse_sacct(SACCT)
    assert list(rows) == ["41", "42", "43_3", "44"]
    assert rows["41"] == {
        "JobID": "41",
        "State": "COMPLETED",
        "Elapsed": "00:01:02",
        "NodeList": "node[1-2]",
    }
    assert rows["42"]["State"] == "CANCELLED by 0"
    assert rows["43_3"]["State"] == "RUNNING"  # an array element keeps its full id


def test_parse_sacct_goes_by_the_header() -> None:
    text = "NodeList|Elapsed|JobID|State\nnode1|00:00:07|7|FAILED\n|00:00:00|8|PENDING\n"
    rows = parse_sacct(text)
    assert rows["7"] == {
        "JobID": "7",
        "State": "FAILED",
        "Elapsed": "00:00:07",
        "NodeList": "node1",
    }
    assert rows["8"]["NodeList"] == "" and rows["8"]["State"] == "PENDING"


@pytest.mark.parametrize("text", ["", "\n", "JobID|State|Elapsed|NodeList\n"])
def test_parse_sacct_of_nothing_is_empty(text: str) -> None:
    assert parse_sacct(text) == {}


# --- local jobs: status, cancel, sweeps ----------------------------------------------------

LOCAL = ["cluster.backend=local", "cluster.gpus_per_node=2"]
SMALL_NO_EPOCHS = [s for s in SMALL if not s.startswith("train.epochs=")]


def _state(run_dir: Path) -> str:
    done = kit("launch", "status", str(run_dir))
    assert done.returncode == 0, done.stderr
    header, row = (line.split() for line in done.stdout.splitlines()[:2])
    return row[header.index("STATE")]


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _stop(pids: list[int]) -> None:
    """Leave no process of the test's job behind, whatever the test found."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        if wait_for(lambda: not any(alive(p) for p in pids), 10):
            return


def _submit_without_pipes(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`launch submit` without --wait, its output in a file: submitit's local controller inherits
    the submitting process's stdout and stderr, so through kit()'s pipes the call would last as
    long as the job."""
    log = tmp / "submit.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "launch", "submit", *args],
            cwd=REPO,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
                ),
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
            # As a script's `launch submit … &` starts: with SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    return subprocess.CompletedProcess(done.args, done.returncode, log.read_text(), "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_local_cancel_ends_a_running_job(tmp_path: Path) -> None:
    done = _submit_without_pipes(
        tmp_path,
        "--mode",
        "ddp",
        *LOCAL,
        *LASTING,
        "train.epochs=50",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
    )
    assert done.returncode == 0, done.stdout
    run_dir = run_folder(done.stdout)
    pid = int(json.loads((run_dir / "run.json").read_text())["job_id"])
    tasks: list[int] = []
    try:
        assert _state(run_dir) == "RUNNING"
        started = [run_dir / "metrics" / f"rank-{rank:05d}.jsonl" for rank in (0, 1)]
        assert wait_for(lambda: all(p.is_file() for p in started), 60), "the tasks never started"
        tasks = _children(pid)
        assert len(tasks) == 2  # one per rank

        cancelled = kit("launch", "cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"{run_dir.name}: cancelled local job {pid}"

        assert wait_for(lambda: _state(run_dir) == "CANCELLED", 60)  # seconds when quiet
        # The controller ends its tasks (SIGINT, then SIGKILL) before it ends itself; on a busy
        # machine the last of them may take a moment more to go.
        assert wait_for(lambda: not alive(pid) and not any(alive(t) for t in tasks), 15)
        assert "summary" not in [r["kind"] for r in records(run_dir)]
    finally:
        _stop([pid, *tasks])


def _sweep(tmp: Path, *args: str) -> list[Path]:
    """A local DDP sweep's run folders, one rank a run (the order of runs is what these tests
    read)."""
    done = kit(
        "launch",
        "sweep",
        "--modes",
        "ddp",
        *args,
        "cluster.backend=local",
        "cluster.gpus_per_node=1",
        *SMALL_NO_EPOCHS,
        f"output.root={tmp}/runs",
        f"data.root={tmp}/data",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("submitted job ")]
    return [Path(line.split("run folder: ", 1)[1]) for line in lines]


def _times(run_dir: Path) -> tuple[float, float]:
    """(first start, summary) of rank 0, from its records."""
    recs = records(run_dir)
    start = next(r["time"] for r in recs if r["kind"] == "start")
    summary = next(r["time"] for r in recs if r["kind"] == "summary")
    return start, summary


def test_local_sweep_parallel_lets_runs_overlap(tmp_path: Path) -> None:
    first, second = _sweep(tmp_path, "--grid", "train.epochs=4,1", "--parallel", "2")
    (first_start, first_done), (second_start, second_done) = _times(first), _times(second)
    # Loose on purpose: the second run was submitted before the first finished (run.json's
    # creation time has whole seconds), and both completed.
    created = json.loads((second / "run.json").read_text())["created"]
    assert datetime.fromisoformat(created).timestamp() < first_done
    assert first_start < first_done and second_start < second_done


class _BrokenInTraining(torch.nn.Linear):
    """Passes the launcher's trial (one forward in eval mode), fails once it trains."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise ValueError("a bug in this model (injected)")
        return super().forward(x.flatten(1))


def broken_model(shape: tuple[int, ...], classes: int) -> torch.nn.Module:
    return _BrokenInTraining(math.prod(shape), classes)


def test_a_local_sweep_runs_one_after_another_and_says_which_failed(tmp_path: Path) -> None:
    """In the grid's order, the second run started once the first had ended (so neither spoils
    the other's timings); the failed one is named, the tally says it, exit 1."""
    tests = Path(__file__).parent
    done = kit(
        "launch", "sweep", "--modes", "ddp", "--grid", "model.name=convnet,test_units:broken_model",
        "cluster.backend=local", "cluster.gpus_per_node=1", *SMALL_NO_EPOCHS, "train.epochs=1",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", env={"PYTHONPATH": os.pathsep.join([str(tests), str(REPO)])},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    submitted = [line for line in done.stdout.splitlines() if line.startswith("submitted job ")]
    assert len(submitted) == 2  # each with its grid point
    assert "  mode=ddp model.name=convnet  run folder: " in submitted[0]
    assert "  mode=ddp model.name=test_units:broken_model  run folder: " in submitted[1]
    lines = done.stdout.splitlines()  # then each completed run's result, and the tally
    first, second = (Path(line.split("run folder: ")[1]) for line in submitted)
    assert "name: convnet" in (first / "config.yaml").read_text()  # the grid's order
    # Each run.json keeps its own point's command, not the whole grid's.
    command = json.loads((first / "run.json").read_text())["command"]
    assert command[:4] == ["python", "-m", "launch", "sweep"] and "--grid" not in command
    assert command[-3:] == ["--modes", "ddp", "--grid=model.name=convnet"], command
    second_start = next(r["time"] for r in records(second) if r["kind"] == "start")
    assert second_start > _times(first)[1]  # after the first's summary: one after another
    assert any(line.startswith(f"{first.name}: test accuracy ") for line in lines), done.stdout
    assert lines[-1] == "1 of the sweep's 2 runs completed"
    failed = done.stderr.splitlines()
    assert "failed first: ValueError: a bug in this model (injected)" in failed[0]
    assert failed[1] == "1 of the sweep's 2 runs failed: see `python -m launch logs RUN`"


def test_gradient_buckets_are_views_backward_writes_into() -> None:
    """The captured step's buckets (built on any device): every `.grad` is a view of its bucket
    with its parameter's strides, channels_last included, and backward writes the same
    gradients into them as into a plain model's."""
    import copy

    import torch
    from torch.nn import functional as F

    from slurm_ddp_kit.train import steps
    from slurm_ddp_kit.train.model import ConvNet

    torch.manual_seed(0)
    plain = ConvNet().to(memory_format=torch.channels_last)
    bucketed = copy.deepcopy(plain)
    buckets = steps._bucket_gradients(list(bucketed.parameters()))
    x = torch.randn(8, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    for model in (plain, bucketed):
        torch.manual_seed(1)  # the same dropout masks
        F.cross_entropy(model(x), torch.arange(8)).backward()
    pointers = {b.untyped_storage().data_ptr() for b in buckets}
    for p, q in zip(plain.parameters(), bucketed.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None
        assert q.grad.stride() == q.stride() and q.grad.untyped_storage().data_ptr() in pointers
        assert torch.allclose(p.grad, q.grad)
    in_buckets = sum(float(b.abs().sum()) for b in buckets)
    assert in_buckets == pytest.approx(sum(float(p.grad.abs().sum()) for p in plain.parameters()))


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),
        ("", 0),
        ("0,1", 2),
        ("3", 1),
        ("1,7,2", 1),  # CUDA stops at the first index that names no device
        ("-1", 0),
        ("GPU-8f3c,GPU-11aa", 2),
        ("0,00", 0),  # a device named twice: torch sees none
    ],
)
def test_the_launcher_counts_visible_gpus_as_torch_does(visible: str | None, expected: int) -> None:
    from slurm_ddp_kit.launch.submit import visible_count

    assert visible_count(4, visible) == expected


# --- train.stopping.StopSignals: how often the ranks ask about a stop ---------------------------


def _asking_rank(rank: int, world: int, port: int, out: Any) -> None:
    """One rank of a gloo group of two: rank 0's steps take 2 s, rank 1's 5 ms, and rank 1 holds
    a real SIGTERM; what each rank agrees at three asks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method="env://")
    try:
        stops = StopSignals()
        stops.join()
        if rank == 1:  # held from StopSignals() on: noted, not fatal. Sent to this thread, which
            # blocks it: threads started before (torch's, gloo's) do not, and one of them would
            # take a process-wide SIGTERM, noted only once this thread runs the handler.
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        seen = []
        for steps, per_step in ((4, (2.0, 0.005)[rank]), (0, 0.0), (8, 0.005)):
            stops.asked_at = time.monotonic() - steps * per_step
            seen.append((stops.agreed(steps), stops.every))
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_to_ask_about_a_stop_as_often_as_the_slowest_steps_need() -> None:
    """Slow steps ask at every step, so a SIGTERM is acted on within a step of it (Slurm kills
    KillWait after); fast ones every MAX_ASK_EVERY; the epoch's end keeps the count. Every rank
    agrees on both the stop and the count, the slowest rank's, as the next ask must be shared."""
    seen = dict(spawned_ranks(_asking_rank, 2, answers=2))
    preempted = stopping.PREEMPTED  # seen once, it stands at every later ask
    expected = [(preempted, 1), (preempted, 1), (preempted, stopping.MAX_ASK_EVERY)]
    assert seen == {0: expected, 1: expected}


# --- what `launch submit --wait` says of a largest-batch search ----------------------------


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
    from slurm_ddp_kit.launch.submit import result_words

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
    from slurm_ddp_kit.launch.submit import _warm_up_words

    said = _warm_up_words(load_config(overrides=settings))
    assert said.startswith(words) and bool(said) == bool(words)


def test_an_array_element_that_never_started_takes_its_arrays_record() -> None:
    """Accounting has no row for a pending element: the array's pending record (`J_[3-9%2]`,
    `J_[1,4-5]`) stands for it; an element outside it, or of another array, finds none."""
    from slurm_ddp_kit.core.slurm import JobState, _array_records, _unstarted

    cancelled = JobState("CANCELLED", "00:00:00", "-")
    accounted = {"70_0": JobState("COMPLETED", "00:01:00", "n1"), "70_[3-9%2]": cancelled,
                 "71_[1,4-5]": cancelled}  # fmt: skip
    arrays = _array_records(accounted)
    found = {job: _unstarted(job, arrays) for job in ("70_3", "70_9", "70_2", "71_5", "71_3")}
    assert found == {"70_3": cancelled, "70_9": cancelled, "70_2": None, "71_5": cancelled,
                     "71_3": None}  # fmt: skip
    assert _unstarted("70", arrays) is None  # a plain job id is no element


def test_a_start_without_bytecode_is_said_with_its_fix(tmp_path: Path) -> None:
    """A rank whose Python writes no bytecode and finds none (PYTHONDONTWRITEBYTECODE and an
    empty PYTHONPYCACHEPREFIX: what a read-only install without caches gives) records it, and
    `--wait`'s start line says what it costs and how to fix it; a rank of the kit's own venv
    imports torch from its bytecode cache and says nothing of it."""
    from slurm_ddp_kit.launch.submit import _started_words

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


def test_a_rank_imports_torch_dynamo_aside() -> None:
    """A per-GPU rank imports torch._dynamo (which DDP's constructor needs) on a thread while it
    waits on the driver and its peers: after the join it is imported."""
    probe = (
        "import sys, torch; from slurm_ddp_kit.train import job\n"
        "had = 'torch._dynamo' in sys.modules\n"
        "job._import_dynamo_aside().join()\n"
        "print(had, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.stdout.split() == ["False", "True"], done.stderr


# --- steps.warm_up ------------------------------------------------------------------------------


def test_warm_up_leaves_model_optimizer_and_generators_as_it_found_them() -> None:
    """The compile warm-up trains on a random batch; afterwards weights, BatchNorm's statistics,
    gradients, optimizer state and the random generator are as before, so the first real step
    is the step a run without the warm-up takes (dropout masks included)."""
    import copy

    from torch import nn

    from slurm_ddp_kit.train import steps

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5),
        nn.Linear(4 * 26 * 26, 10),
    )  # fmt: skip
    twin = copy.deepcopy(model)
    step, twin_step = (
        steps.EagerStep(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        torch.amp.GradScaler(enabled=False), 1, steps.autocast(torch.device("cpu"), "fp32"))
        for m in (model, twin)
    )  # fmt: skip
    noise = (torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))
    rng = torch.get_rng_state()
    cast = steps.autocast(torch.device("cpu"), "fp32")
    steps.warm_up(step, model, model, noise, cast, ([8, 3], [8, 5]))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert not step.optimizer.state
    for name, tensor in twin.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    batch = (torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))
    rng = torch.get_rng_state()
    for s in (step, twin_step):
        torch.set_rng_state(rng)  # the same dropout masks for both
        for _ in range(2):  # the second step reads the momentum the first one made
            s.micro(*batch, last=True)
            s.update()
    for name, tensor in twin.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


# --- train.stopping.attempts_without_progress: requeued while each attempt saves progress ------


def _start(first_epoch: object, batch: object = 0, job: str = "7") -> dict[str, object]:
    return {"kind": "start", "job_id": job, "first_epoch": first_epoch, "resumed_at_batch": batch}


REQUEUED = {"kind": "stop", "requeue": "7"}  # the kit requeued the attempt
PREEMPTED = {"kind": "stop", "requeue": None, "slurm_state": "PREEMPTED"}  # Slurm ended it


@pytest.mark.parametrize(
    ("records", "resumed_from", "saved", "expected"),
    [
        ([_start(3, 2)], (3, 2), (3, 5), 0),  # this attempt saved beyond where it resumed
        ([_start(3, 2)], (3, 2), (4, 0), 0),
        ([_start(1)], (1, 0), (1, 0), 1),  # saved nothing (train.checkpoint=false: (1, 0))
        ([_start(2), REQUEUED, _start(2), REQUEUED, _start(2)], (2, 0), (2, 0), 3),
        # the row ends at the attempt that progressed (it saved epoch 1 whole)
        ([_start(1), REQUEUED, _start(2), REQUEUED, _start(2)], (2, 0), (2, 0), 2),
        # an earlier save lost: the attempt after it resumed from less, so that one saved nothing
        ([_start(3), REQUEUED, _start(2)], (2, 0), (2, 0), 2),
        # an attempt Slurm ended itself (a preemption) neither counts nor ends the row
        ([_start(2), REQUEUED, _start(2), PREEMPTED, _start(2)], (2, 0), (2, 0), 2),
        # only this job's attempts: an earlier job of the run folder (before a resume) is not
        ([_start(2, job="6"), _start(2, job="6"), _start(2)], (2, 0), (2, 0), 1),
        # a record of the wrong shape (a hand edit, a damaged file) tells nothing: the row ends
        ([_start(2), _start("two"), _start(2)], (2, 0), (2, 0), 1),
        ([_start(2), _start(2, batch=True), _start(2)], (2, 0), (2, 0), 1),
        ([_start(2), {"kind": "start"}, _start(2)], (2, 0), (2, 0), 1),
        ([], (2, 0), (2, 0), 1),  # no records at all: this attempt alone
    ],
)
def test_attempts_without_progress_counts_the_row_this_attempt_ends(
    records: list[dict[str, object]],
    resumed_from: tuple[int, int],
    saved: tuple[int, int],
    expected: int,
) -> None:
    assert stopping.attempts_without_progress(records, "7", resumed_from, saved) == expected
