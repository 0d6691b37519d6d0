"""`--wait`: follow a job to its end, one line per epoch, through Slurm's requeues, and say how it
ended. What differs by backend (a queue's wait, the scheduler's word on the end, tasks that
outlive their controller, what Ctrl-C does) is the job's backend's (`launch.backends`)."""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import signal
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from slurm_ddp_kit.core import (
    runfolder,
    userfiles,
)
from slurm_ddp_kit.core.cli import (
    ENDING,
    EXIT_INTERRUPTED,
    interrupt_word,
    printable,
)
from slurm_ddp_kit.core.runfolder import failures
from slurm_ddp_kit.core.settings.schema import (
    Config,
)
from slurm_ddp_kit.launch import backends
from slurm_ddp_kit.launch.backends import SubmitError, Watch
from slurm_ddp_kit.launch.executor import EXIT_FAILED
from slurm_ddp_kit.launch.jobs import diverged_words


def _say(line: str) -> None:
    print(printable(line), flush=True)  # each line as it happens, also into a pipe or a file


def follow(
    job: submitit.Job[Any],
    run_dir: Path,
    say: Callable[[str], None] = _say,
    quiet: bool = False,
    resumed: bool = False,
) -> int:
    """Print one line per finished epoch (unless quiet) until the job ends; then its result or
    its error; returns the exit status: 0 done, 1 failed or stopped, 130 cancelled. `resumed`:
    a job resumed into the folder; the epochs done before are not shown again, and where it
    goes on from is said once it starts."""
    view = runfolder.read_rank(run_dir, 0) if resumed else []
    earlier = runfolder.of_kind(view, "start")  # the last attempt's start, if any
    said = runfolder.of_kind(view, "progress")[-1:]  # the stopped attempt's: not the new one's
    shown = _Shown(
        len(runfolder.of_kind(view, "epoch")),
        earlier[0]["time"] if earlier else None,
        said[0]["time"] if said else 0.0,
    )
    progress = (lambda line: None) if quiet else say
    watch = backends.of_job(job).watch(job, run_dir, say)
    # A job that starts at once: say what it does until rank 0 has started (a queued job's wait
    # is said by its backend's `waiting`, its start by the start line).
    if shown.attempt is None and watch.starts_at_once:
        cfg = runfolder.read_config(run_dir)
        progress(
            f"starting {job.num_tasks} task(s) of the program"
            if cfg.program
            else f"starting {job.num_tasks} task(s): Python and torch, the process group, the "
            f"model{_warm_up_words(cfg)}, the data (the first epoch follows)"
        )
    while not job.done() or watch.going_on():
        if watch.ended():
            break
        _show_epochs(run_dir, shown, progress)
        watch.waiting(progress)
        time.sleep(1.0)
    _show_epochs(run_dir, shown, progress)
    if _cancelled(watch, run_dir):  # by `launch cancel` (or scancel) from elsewhere
        say(f"job {job.job_id} was cancelled; {continue_words(run_dir)}")
        return EXIT_INTERRUPTED
    unstarted = watch.unstarted()
    if unstarted:  # submitit would wait for a result, then name a log file never made
        say(
            f"job {job.job_id} ended before it started its tasks ({unstarted}); "
            f"{continue_words(run_dir)}"
        )
        return EXIT_FAILED
    if watch.end_state and not job.done():  # no result from every task; submitit cannot see
        # the end without accounting, and would wait for the results for ever
        summary = runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary")
        if not summary:
            return _failed(job, run_dir, f"it ended ({watch.end_state}) without results", say)
        result = summary[-1]
    else:
        try:
            result = _result(job)  # every task must succeed; rank 0 holds the summary
        except SubmitError as err:
            return _failed(job, run_dir, str(err), say)
    if result.get("diverged_epoch") is not None:
        say(f"job {job.job_id} diverged: {diverged_words(result)}")
        return EXIT_FAILED
    say(f"job {job.job_id} done: {result_words(result)}")
    return 0


RESULT_WAIT_S = 30  # for a task's result file after its job ended (a slow shared file system)


def _result(job: submitit.Job[Any]) -> dict[str, Any]:
    """Rank 0's result once every task succeeded, read from submitit's result files as plain
    data (`userfiles.plain_data`: a pickle another user planted in the logs folder builds no
    object, where submitit's own reader would run its code); SubmitError naming a task that
    failed or left no result."""
    results = [_task_result(job.task(rank)) for rank in range(job.num_tasks)]
    return typing.cast("dict[str, Any]", results[0])


def _task_result(task: submitit.Job[Any]) -> Any:
    path = task.paths.result_pickle
    deadline = time.monotonic() + RESULT_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    try:
        outcome, value = userfiles.plain_data(path)
    except (OSError, ValueError, TypeError) as err:
        raise SubmitError(f"task {task.task_id} left no result to read ({err})") from None
    if outcome != "success":
        raise SubmitError(f"task {task.task_id} failed:\n{value}")
    return value


def saved_words(stop: dict[str, Any]) -> str:
    """What a stopped attempt saved: where the kit's loop stood, or whether a user's program
    saved anything new in its checkpoint folder."""
    if "epoch" in stop:
        return f"saved in epoch {stop['epoch']} after batch {stop.get('batches', 0)}"
    return "its program saved" if stop.get("saved") else "its program saved nothing new"


def _failed(job: submitit.Job[Any], run_dir: Path, error: str, say: Callable[[str], None]) -> int:
    """Say how a job that did not finish ended: stopped and saved, or its first failure (else
    `error`, what submitit or Slurm said)."""
    stop = _planned_stop(run_dir)
    if stop:  # stopped on purpose and saved: no failure, and no traceback
        why = f"; not requeued: {stop['not_requeued']}" if stop.get("not_requeued") else ""
        say(
            f"job {job.job_id} stopped ({stop['reason']}), {saved_words(stop)}{why}; "
            f"{continue_words(run_dir)}"
        )
        return EXIT_FAILED
    first = failures.first_failure(run_dir)
    if first:  # the rank that failed first, not a peer that lost its connection to it
        say(f"job {job.job_id} failed: {failures.failure_words(first)}")
        # A bug's traceback helps; a setting's message, or a lost peer's, says it all.
        if not first.get("kit_error") and not failures.lost_peer(first):
            say(first.get("traceback_tail", "").rstrip())
    else:
        say(f"job {job.job_id} failed: {error}")
    say(f"logs: python -m launch logs {run_dir}")
    return EXIT_FAILED


def _cancelled(watch: Watch, run_dir: Path) -> bool:
    """The job ended by a cancel, not of itself: marked by `launch cancel`, or cancelled by the
    scheduler's own command (scancel), so in its words."""
    if runfolder.of_kind(runfolder.read_rank(run_dir, 0), "summary"):
        return False
    if runfolder.read_meta(run_dir).get("cancel_requested"):
        return True
    return watch.cancelled()


def _planned_stop(run_dir: Path) -> dict[str, Any] | None:
    """The last attempt's stop record where it ended so (a signal, the time limit), unless it
    asked Slurm to requeue it (then the job goes on)."""
    view = runfolder.read_rank(run_dir, 0)
    stops = runfolder.of_kind(view, "stop")
    if not stops or runfolder.of_kind(view, "summary") or stops[-1].get("requeue"):
        return None
    return stops[-1]


def interrupted(job: submitit.Job[Any], run_dir: Path, err: KeyboardInterrupt | None = None) -> str:
    """After Ctrl-C (or SIGTERM, SIGHUP: `err`) while following a job: what became of it, in
    one line. The job's backend says (`Backend.interrupted`): a local job, in the terminal's
    process group, is cancelled and waited for; a Slurm job goes on."""
    for signum in ENDING:  # a second Ctrl-C does not cut this short
        with contextlib.suppress(ValueError):
            signal.signal(signum, signal.SIG_IGN)
    word = interrupt_word(err or KeyboardInterrupt())
    return backends.of_job(job).interrupted(job, run_dir, word)


def continue_words(run_dir: Path) -> str:
    """How a stopped run goes on, said from what is on disk: a Ctrl-C in the middle of the first
    save leaves no checkpoint (the partial file is removed)."""
    if runfolder.state_path(run_dir).is_file():
        return f"continue it from its last checkpoint with `python -m launch resume {run_dir}`"
    return f"it had saved no checkpoint yet: `python -m launch resume {run_dir}` starts it over"


def _widest_words(result: dict[str, Any]) -> str:
    """A largest-model search's result in words."""
    widest, trials = result["largest_width"], result.get("trials") or []
    at = f"at a global batch of {result.get('global_batch')}"
    if not trials:
        return "largest model not measured (no GPU)"
    if not widest:
        return (
            f"no width trains {at}: model.width={min(t['width'] for t in trials)} ran out of memory"
        )
    bound = "at least " if widest >= result.get("ceiling", float("inf")) else ""
    parameters = result.get("largest_model_parameters") or 0
    return (
        f"widest model that trains {at}: {bound}model.width={widest} "
        f"({parameters / 1e6:,.1f} M parameters, within 5 %)"
    )


def result_words(result: dict[str, Any]) -> str:
    """A finished run's result in words, from its first rank's summary."""
    if result.get("diverged_epoch") is not None:
        return f"diverged: {diverged_words(result)}"
    if "largest_global_batch" in result:
        largest, trials = result["largest_global_batch"], result.get("trials") or []
        if not trials:
            return "largest batch not measured (no GPU)"
        if not largest:
            smallest = min(t["global_batch"] for t in trials)
            return f"no batch fits: {smallest} samples ran out of memory"
        if largest >= result.get("ceiling", float("inf")):
            return f"largest global batch that fits: at least {largest} (where the search stops)"
        return f"largest global batch that fits: {largest} (within 5 %)"
    if "largest_width" in result:
        return _widest_words(result)
    if "program" in result:
        return f"the program ended with status 0 after {result.get('total_seconds') or 0:.1f} s"
    return (
        f"test accuracy {figure(result.get('final_test_accuracy'), '.2%')}, "
        f"test loss {figure(result.get('final_test_loss'), '.4f')}, "
        f"{figure(result.get('train_seconds'), '.1f')} s training{_over_attempts(result)}"
    )


def figure(value: object, spec: str) -> str:
    """A record's number as `spec` formats it, or n/m (not measured) where it has none: the
    record checks let every figure be null or absent (one evaluated nowhere, a hand edit)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return format(value, spec) if is_number else "n/m"


def _over_attempts(result: dict[str, Any]) -> str:
    """A resumed run's training time is its epochs' over every attempt: said so."""
    attempts, untimed = result.get("attempts") or 1, result.get("untimed") or 0
    if attempts < 2:
        return ""
    split = f"; {untimed} epoch(s) split across attempts not timed" if untimed else ""
    return f" (its epochs over {attempts} attempts, each epoch once{split})"


def _show_program(
    records: list[dict[str, Any]], start: dict[str, Any], shown: _Shown, say: Callable[[str], None]
) -> None:
    """A program's run: each attempt's start, then each record it logged (`slurm_ddp_kit.log`)."""
    if start["time"] != shown.attempt:
        if shown.attempt is not None:
            say("started again (requeued or resumed)")
        words = shlex.join(start.get("program") or [])
        say(f"{start.get('world_size', '?')} rank(s) started `{words}`")
        shown.attempt, shown.last = start["time"], 0
    logs = [r for r in runfolder.of_kind(records, "log") if r["time"] >= start["time"]]
    for record in logs[shown.last :]:
        say(", ".join(f"{key} {_value_words(value)}" for key, value in record["fields"].items()))
    shown.last = max(shown.last, len(logs))


def _value_words(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _started_words(start: dict[str, Any]) -> str:
    """What the job did before its first step, from rank 0's start record."""
    parts = start.get("startup_parts") or {}
    spent = ", ".join(
        f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in parts.items()
    )
    took = (
        f" in {start['startup_s']:.1f} s" if isinstance(start.get("startup_s"), int | float) else ""
    )
    return (
        f"{start.get('world_size', '?')} rank(s) started{took}" + (f" ({spent})" if spent else "")
        + f"; training on {start.get('device', '?')}"
        + (_NO_BYTECODE if start.get("bytecode_cached") is False else "")
    )  # fmt: skip


_NO_BYTECODE = (
    "; torch was compiled from its sources as each rank started (Python writes no bytecode "
    "here: PYTHONDONTWRITEBYTECODE or -B, and none was cached), seconds of every start: unset "
    "it in the job's environment, with PYTHONPYCACHEPREFIX set to a writable folder where "
    "site-packages is read-only"
)


def _warm_up_words(cfg: Config) -> str:
    """What the start-up does beyond the plain path, so a long start is not taken for a hang:
    the compile and the capture, on a random batch before the data (train.steps.warm_up)."""
    t = cfg.train
    done = [
        "compiled (torch.compile: minutes on a cold compile cache)" if t.compile else "",
        "its step captured as CUDA graphs" if t.cuda_graph else "",
    ]
    return f" {' and '.join(filter(None, done))} on a random batch" if any(done) else ""


def _cache_words(cache: object) -> str:
    """What the start line says of the compile cache (with train.compile)."""
    if cache == "warm":
        return "; its compile came from the compile cache"
    if cache == "cold":
        return "; compiled afresh, and saved to the compile cache for the next job"
    return ""


@dataclasses.dataclass
class _Shown:
    """What `--wait` has said: epochs 1..last, of the attempt that started at `attempt`."""

    last: int = 0
    attempt: float | None = None
    progress: float = 0.0  # the time of the last progress record said


def _show_epochs(run_dir: Path, shown: _Shown, say: Callable[[str], None]) -> None:
    """Say each epoch past the last one said. A new attempt (a requeue, a resume) is said with
    where it goes on from; one that goes on from an earlier epoch (its checkpoint was older)
    has those epochs said again."""
    records = runfolder.read_rank(run_dir, 0)
    start = next(iter(runfolder.of_kind(records, "start")), None)
    if start and start.get("task") == "program":
        _show_program(records, start, shown, say)
        return
    epochs = runfolder.of_kind(records, "epoch")
    if start and start["time"] != shown.attempt:
        first, batch = start.get("first_epoch", 1), start.get("resumed_at_batch", 0)
        if shown.attempt is not None:
            say(f"resumed at epoch {first}, batch {batch}")
        say(_started_words(start) + _cache_words(start.get("compile_cache")))
        if start.get("placement"):
            say(f"warning: {start['placement']}")
        shown.attempt, shown.last = start["time"], min(shown.last, first - 1)
    world, total = (start.get("world_size", 1), start.get("epochs", "?")) if start else (1, "?")
    for r in epochs[shown.last :]:
        say(epoch_words(r, world, total))
    shown.last = max(shown.last, len(epochs))
    _show_progress(records, epochs, shown, say, total)


def epoch_words(r: dict[str, Any], world: int, total: object) -> str:
    """One epoch record as `--wait` says it; a figure it lacks is n/m (see `figure`)."""
    return (
        f"epoch {r['epoch']}/{total}: {_timing_words(r, world)}, "
        f"train loss {figure(r.get('train_loss'), '.4f')}, "
        f"test loss {figure(r.get('test_loss'), '.4f')}, "
        f"accuracy {figure(r.get('test_accuracy'), '.2%')}"
    )


def _timing_words(r: dict[str, Any], world: int) -> str:
    seconds, samples = r.get("seconds"), r.get("samples")
    if not seconds:  # None: the epoch was split across attempts, so it has no one time
        return "time n/m (split across attempts)"
    speed = samples * world / seconds if isinstance(samples, int) else None
    return f"{figure(seconds, '.2f')} s, {figure(speed, '.0f')} samples/s"


def _show_progress(
    records: list[dict[str, Any]],
    epochs: list[dict[str, Any]],
    shown: _Shown,
    say: Callable[[str], None],
    total: object,
) -> None:
    """Where the running epoch is (output.progress_s), said once per record, indented: only the
    latest, and none once its epoch has ended."""
    done = epochs[-1]["time"] if epochs else 0.0
    latest = next(iter(runfolder.of_kind(records, "progress")[-1:]), None)
    if latest is None or latest["time"] <= max(done, shown.progress):
        return
    shown.progress = latest["time"]
    b, n, e = (latest.get(key, "?") for key in ("batch", "batches", "epoch"))
    share = b / n if isinstance(b, int) and isinstance(n, int) and n else None  # 0: a hand edit
    seconds = figure(latest.get("seconds"), ".0f")
    say(f"  batch {b}/{n} of epoch {e}/{total} ({figure(share, '.0%')}), {seconds} s in")
