"""A user's program's runs (`launch submit … -- python my_train.py ARGS`) as rows of the table.

The kit does not look inside a program. What a run of one can say comes from two places only:
what the kit measured from outside (each rank's start, and how its program ended: a summary with
its wall time, or an error with its exit status) and what the program chose to log
(`slurm_ddp_kit.log`: `log` records whose `fields` may hold anything, so every value is checked
before it is used). Every other figure is NaN ("n/m"): never a guess.
"""

from __future__ import annotations

import math
import reprlib
import shlex
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_ddp_kit.analysis.figures import (
    FIGURES,
    NO_METRICS,
    NOT_MEASURED,
    Figure,
    Records,
    Result,
    as_float,
    by_kind,
    cpus_per_gpu,
    median,
    named_ranks,
    rank_records,
    record_figures,
    run_energy,
    skipped,
)
from slurm_ddp_kit.core.runfolder import ENDS
from slurm_ddp_kit.core.settings.loading import program_arguments
from slurm_ddp_kit.core.settings.rules import world_size
from slurm_ddp_kit.core.settings.schema import Config

TASK = "program"  # the `task` of a program's rows (the kit's own are train or a search)

# The fields of a program's `log` records that the table reads, in the order looked for: the
# first name the program logged at all gives the figure (a test figure before a training one).
ACCURACY_NAMES = ("test_accuracy", "accuracy")
LOSS_NAMES = ("test_loss", "loss")
EPOCH_NAME = "epoch"

# GPU figures the kit samples from outside a program (NVML, `train.outside`); n/m where it could
# not. The allocator's figures are left out: only the program's own process can read them.
_OUTSIDE = ("util_pct_main", "util_pct_other", "nvml_used_mb_peak_main", "nvml_used_mb_peak_other")
_GPU_FIGURES = (
    *(f for f in FIGURES if f.column in _OUTSIDE),
    Figure("energy_run_j", "energy per run", "J", "rate", "NVML, every card", digits=0),
)


def _names(names: Sequence[str]) -> str:
    return ", else ".join(f"`{name}`" for name in names)


# A program group's rows, in order (the column names are the kit's where the figure is the same).
# fmt: off
PROGRAM_FIGURES: tuple[Figure, ...] = (
    Figure("runs", "runs", "", "none", digits=0),
    Figure("wall_s", "wall time per run", "s", "time", "slowest rank, its task's start to the program's exit, last attempt"),
    Figure("epoch_s", "seconds per epoch", "s", "time", f"median of epochs 2..N, between the program's records carrying `{EPOCH_NAME}`"),
    Figure("program_accuracy", "final accuracy", "as logged", "diff", f"rank 0's last {_names(ACCURACY_NAMES)}", digits=4),
    Figure("program_loss", "final loss", "as logged", "diff", f"rank 0's last {_names(LOSS_NAMES)}", digits=4),
    *_GPU_FIGURES,
)
# fmt: on

# What makes two program runs comparable: the same command (its `{group.key}` words filled in),
# the same shape of job, and (no device being recorded) the same GPUs asked for and given.
PROGRAM_SETTINGS = ("program", "nodes", "gpus_per_node", "cpus_per_gpu", "asked", "gpus")


def read_run(run_dir: Path, run_id: str, cfg: Config, meta: dict[str, Any]) -> Result:
    """The program run's row, or None and a note saying why not (unfinished, stopped, failed)."""
    notes: list[str] = []
    ranks = {rank: records for rank, _, records in rank_records(run_dir, world_size(cfg), notes)}
    attempts = {rank: _last_attempt(records) for rank, records in ranks.items()}
    unfinished = _unfinished(cfg, attempts, run_dir)
    if unfinished:
        return skipped(run_dir, run_id, unfinished, meta, notes)
    rank0 = ranks[0]
    accuracy, accuracy_note = _final(rank0, ACCURACY_NAMES)
    loss, loss_note = _final(rank0, LOSS_NAMES)
    notes += [f"note {run_id}: {said}" for said in (accuracy_note, loss_note) if said]
    epochs = _epoch_seconds(list(ranks.values()))
    return {
        "run_id": run_id,
        "task": TASK,
        "mode": cfg.mode,  # the shape of its tasks: a program brings its own strategy
        "run_dir": str(run_dir),
        **_settings(cfg, [attempt[0] for _, attempt in sorted(attempts.items())]),
        "runs": 1,
        "wall_s": _wall_seconds(attempts),
        "epoch_s": median(epochs),  # NaN (skipped) for the first: no record before it
        "program_accuracy": accuracy,
        "program_loss": loss,
        **_gpu_figures(attempts),
        "epoch_seconds": epochs,  # for the plot: one value per epoch logged
    }, notes


def _last_attempt(records: Records) -> Records:
    """The records from the rank's last `start` on (a requeued or resumed job appends one)."""
    starts = [at for at, record in enumerate(records) if record.get("kind") == "start"]
    return records[starts[-1] :] if starts else []


def _unfinished(cfg: Config, attempts: dict[int, Records], run_dir: Path) -> str:
    """What keeps the run out of the table ('' for none): a rank that never started, the
    program's failure on a rank (each rank's exit status said), a stop, a rank not ended."""
    if not attempts:
        return NO_METRICS
    expected = range(world_size(cfg))
    absent = [rank for rank in expected if not attempts.get(rank)]
    if absent:
        return f"no start record from rank(s) {named_ranks(absent)} of {len(expected)}"
    ends = {rank: _end(attempts[rank]) for rank in expected}
    kinds = {end.get("kind") for end in ends.values() if end}
    if "error" in kinds:
        return f"the program failed (exit status per rank: {_statuses(ends)})"
    running = [rank for rank, end in ends.items() if end is None]
    if running:
        return (
            f"rank(s) {named_ranks(running)} of {len(expected)} recorded no end (job running, or "
            "ended without a word: `launch status` says which)"
        )
    if "stop" in kinds:
        reason = next(e.get("reason") for e in ends.values() if e and e.get("kind") == "stop")
        return (
            f"stopped ({reason}) before the program's end: a requeued job goes on by itself, "
            f"else `python -m launch resume {run_dir}`"
        )
    return ""


def _end(attempt: Records) -> dict[str, Any] | None:
    """How the rank's attempt ended: its last summary, error or stop; None while none."""
    return next((r for r in reversed(attempt) if r.get("kind") in ENDS), None)


def _statuses(ends: dict[int, dict[str, Any] | None]) -> str:
    """'status 1 on rank 2; status 0 on ranks 0, 1': the ranks by how they ended, the failures
    first."""
    by_status: dict[str, list[int]] = {}
    for rank, end in sorted(ends.items()):
        by_status.setdefault(_status(end), []).append(rank)
    order = sorted(by_status, key=lambda status: (status == "status 0", by_status[status][0]))
    return "; ".join(
        f"{status} on rank{'s' if len(by_status[status]) > 1 else ''} {named_ranks(by_status[status])}"
        for status in order
    )


def _status(end: dict[str, Any] | None) -> str:
    """One rank's end in words: its exit status, the signal that ended it, or what is known."""
    if end is None:
        return "no end recorded"
    if end.get("kind") == "stop":
        return "stopped"
    code = end.get("exit_code", 0 if end.get("kind") == "summary" else None)
    if type(code) is not int:  # a summary or error of another tool: no status to say
        return "an error" if end.get("kind") == "error" else "ended"
    if code >= 0:
        return f"status {code}"
    try:
        return f"ended by {signal.Signals(-code).name}"
    except ValueError:  # no signal of this system
        return f"status {code}"


def _settings(cfg: Config, starts: Records) -> dict[str, Any]:
    """The run's setting as its group's heading names it."""
    c = cfg.cluster
    asked = {"partition": c.partition, "gpu_type": c.gpu_type, "constraint": c.constraint}
    return {
        "program": shlex.join(program_arguments(cfg)),
        "nodes": c.nodes,
        "gpus_per_node": c.gpus_per_node,
        "cpus_per_gpu": cpus_per_gpu(cfg, starts[0]),
        "asked": ", ".join(f"{key}={value}" for key, value in asked.items() if value),
        "gpus": _gpus_given(starts),
    }


def _gpus_given(starts: Records) -> float:
    """The GPUs the job's tasks were given (CUDA_VISIBLE_DEVICES), each once per host: whether
    the program drove them is its own affair. NaN where a task's variable was not set (every
    GPU of its machine visible, however many)."""
    given: set[tuple[Any, str]] = set()
    for start in starts:
        visible = start.get("cuda_visible_devices")
        if visible is None:
            return NOT_MEASURED
        ids = (entry.strip() for entry in visible.split(","))
        given.update((start.get("host"), entry) for entry in ids if entry)
    return float(len(given))


def _wall_seconds(attempts: dict[int, Records]) -> float:
    """The slowest rank's time from its task's start to its program's exit (the summary's
    total_seconds, last attempt); NaN where a rank's summary has none."""
    seconds = [
        as_float((_end(attempt) or {}).get("total_seconds")) for attempt in attempts.values()
    ]
    return max(seconds) if all(s == s for s in seconds) else NOT_MEASURED  # NaN ≠ NaN


def _gpu_figures(attempts: dict[int, Records]) -> dict[str, float]:
    """The GPU figures, where the ranks' summaries carry them (the kit sampled the cards);
    NaN otherwise."""
    last = {rank: by_kind(attempt) for rank, attempt in sorted(attempts.items())}
    read = record_figures(last)
    summaries = [(kinds.get("summary") or [{}])[-1] for kinds in last.values()]
    figures = {f.column: read.get(f.column, NOT_MEASURED) for f in _GPU_FIGURES}
    return figures | {"energy_run_j": run_energy(summaries)}


def _epoch_seconds(ranks: list[Records]) -> list[float]:
    """Per epoch the program logged, in order: its seconds, the slowest rank's; NaN for the
    first and for any whose epoch before was not logged in the same attempt."""
    per_epoch: dict[int, float] = {}
    for records in ranks:
        for epoch, seconds in _rank_epoch_seconds(records).items():
            per_epoch[epoch] = max(per_epoch.get(epoch, NOT_MEASURED), seconds, key=_known)
    return [per_epoch[epoch] for epoch in sorted(per_epoch)]


def _known(value: float) -> float:
    """max's key: NaN below every number, so a measured time wins over none."""
    return value if value == value else -math.inf


def _rank_epoch_seconds(records: Records) -> dict[int, float]:
    """One rank's epochs: each ends at its last record carrying the epoch's number, and lasts
    from the end of the epoch before, where that is in the same attempt (a requeue's wait is no
    epoch's time); NaN where it is not. A later attempt's epoch replaces an earlier one's."""
    ends: dict[int, float] = {}  # this attempt's
    seconds: dict[int, float] = {}
    for record in records:
        if record.get("kind") == "start":
            ends = {}
        elif mark := _epoch_mark(record):
            epoch, at = mark
            ends[epoch] = at
            took = at - ends.get(epoch - 1, math.nan)
            seconds[epoch] = took if took > 0 else NOT_MEASURED  # ≤ 0: a clock stepped back
    return seconds


def _epoch_mark(record: dict[str, Any]) -> tuple[int, float] | None:
    """(epoch, time) of a `log` record whose `epoch` is a whole number; None for any other."""
    fields, at = record.get("fields"), record.get("time")
    if record.get("kind") != "log" or not isinstance(fields, dict):
        return None
    epoch = _whole(fields.get(EPOCH_NAME))
    if epoch is None or not isinstance(at, int | float):  # `time` is checked: never a bool
        return None
    return epoch, float(at)


def _whole(value: Any) -> int | None:
    """An epoch's number where the value is a whole number (1, or 1.0); else None (a string, a
    fraction of an epoch, a bool, NaN)."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def _final(records: Records, names: Sequence[str]) -> tuple[float, str]:
    """The last value logged under the first of `names` the program logged at all, and a note
    where that value is no finite number (then NaN: an earlier value is no final one)."""
    for name in names:
        for record in reversed(records):
            fields = record.get("fields")
            if record.get("kind") != "log" or not isinstance(fields, dict) or name not in fields:
                continue
            value = _finite(fields[name])
            if value == value:
                return value, ""
            shown = reprlib.repr(fields[name])  # shortened: a field may be a megabyte long
            return NOT_MEASURED, f"rank 0's last `{name}` is {shown}, not a finite number: n/m"
    return NOT_MEASURED, ""


def _finite(value: Any) -> float:
    """The value as a float where it is a finite number (not a bool, not too large); else NaN."""
    if type(value) not in (int, float):
        return NOT_MEASURED
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        return NOT_MEASURED
    return number if math.isfinite(number) else NOT_MEASURED
