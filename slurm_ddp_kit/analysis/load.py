"""Read run folders (docs/run-folder.md) into one DataFrame: one row per finished run.

Every figure is derived here from the per-rank records, and only from them. A figure the records do
not hold is NaN in the frame and "n/m" in print: never 0, never a guess. A user's program's runs
are read by `analysis.programs`; both build on `analysis.figures`.
"""

from __future__ import annotations

import bisect
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from slurm_ddp_kit.analysis import programs
from slurm_ddp_kit.analysis.cache import Kept
from slurm_ddp_kit.analysis.figures import (
    NO_METRICS,
    NOT_MEASURED,
    Rank,
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
from slurm_ddp_kit.analysis.labels import (
    dataset_label,
    model_label,
    optimizer_label,
    other_settings,
    speed_options,
    strategy_key,
)
from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.rules import world_size
from slurm_ddp_kit.core.settings.schema import Config

if TYPE_CHECKING:  # imported in load_runs: the processes that read runs never need pandas
    from concurrent.futures import Executor

    import pandas as pd


class RunDirError(KitError):
    """A path given (or the default root) holds no run folder; the message names the fix."""


# Settings that make figures comparable: runs differing in any of these are never pooled.
# Each reads the run's config; the dataset sizes come from the start record (exact for mnist too).
SETTINGS: dict[str, Callable[[Config, dict[str, Any]], Any]] = {
    "global_batch": lambda cfg, start: cfg.train.global_batch_size,
    "epochs": lambda cfg, start: cfg.train.epochs,
    "target_accuracy": lambda cfg, start: cfg.train.target_accuracy,
    "grad_accum_steps": lambda cfg, start: cfg.train.grad_accum_steps,
    "precision": lambda cfg, start: cfg.train.precision,
    "optimizer": lambda cfg, start: optimizer_label(cfg),
    "model": lambda cfg, start: model_label(cfg),
    "dataset": lambda cfg, start: dataset_label(cfg),
    "train_samples": lambda cfg, start: start["train_samples"],
    "test_samples": lambda cfg, start: start["test_samples"],
    "nodes": lambda cfg, start: cfg.cluster.nodes,
    "gpus_per_node": lambda cfg, start: cfg.cluster.gpus_per_node,
    "cpus_per_gpu": lambda cfg, start: cpus_per_gpu(cfg, start),
    "speed_options": lambda cfg, start: speed_options(cfg),
    "other_settings": lambda cfg, start: other_settings(cfg),
}


HARDWARE = ("device_name", "gpus", "torch")  # from the start records; gpus: all GPUs the job drove


def resolve_run_dirs(paths: Sequence[Path], root: Path) -> list[Path]:
    """The run folders named (or found under them), else every run under root; each once."""
    if not paths:
        found = runfolder.find_runs(root) if root.is_dir() else []
        if not found:
            raise RunDirError(
                f"no runs found under {root}/: make one with `python -m launch submit --mode ddp "
                "--wait`, or name a run folder (or --root) where runs are"
            )
        return found
    if len(paths) == 1:  # find_runs yields each folder once
        return _runs_in(paths[0])
    runs: dict[Path, Path] = {}
    for path in paths:
        # One resolve per path given, not per run: find_runs follows no link below the path.
        real = path.resolve()
        for run in _runs_in(path):
            runs.setdefault(real / run.relative_to(path), run)
    return list(runs.values())


def _runs_in(path: Path) -> list[Path]:
    if not path.exists():
        raise RunDirError(
            f"{path} does not exist: pass a run folder or a folder holding run folders"
        )
    found = runfolder.find_runs(path) if path.is_dir() else []
    if not found:
        raise RunDirError(
            f"{path} is not a run folder and holds none (no {runfolder.META} in or under it): pass a folder "
            "that `python -m launch submit` made, e.g. runs/<run id>, or the folder holding them"
        )
    return found


def load_runs(
    run_dirs: Iterable[Path], parallel: bool = False, cache: Path | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """One row per finished run (sorted by run id), and a note per problem met on the way.

    parallel: with many runs, read them in other processes (one per CPU). Those may be spawned
    (see _start_method), so the caller's main module must not do its work on import
    (`if __name__ == "__main__":`).
    cache: a file of results from an earlier call (`analysis.cache`): runs unchanged since are
    not read again; the file is brought up to date.
    """
    run_dirs = list(run_dirs)
    kept = Kept(cache)
    known = [kept.get(run_dir) for run_dir in run_dirs]
    todo = [i for i, result in enumerate(known) if result is None]
    fresh = _read_runs([run_dirs[i] for i in todo], parallel)  # other processes may start now …
    import pandas as pd  # … while this one loads pandas

    for i, (fingerprint, result) in zip(todo, fresh, strict=True):
        known[i] = result
        kept.put(run_dirs[i], fingerprint, result)
    kept.keep_only(run_dirs)
    kept.save()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for row, run_notes in cast(list[Result], known):
        notes += run_notes
        if row is not None:
            rows.append(row)
    frame = pd.DataFrame(rows)  # one frame at the end: pandas costs more per call than a run
    return (frame.sort_values("run_id", ignore_index=True) if rows else frame), notes


PARALLEL_FROM = 2000  # runs; with fewer, starting other processes costs more than it saves


CHUNK = 250  # runs per task: few messages, and the processes end close together


MAX_PROCESSES = 8


Read = tuple[Any, Result]  # a run's fingerprint as it was read, and what was read


def _read(run_dir: Path) -> Read:
    return runfolder.fingerprint(run_dir), read_run(run_dir)  # a change meanwhile: read again


def _read_runs(run_dirs: list[Path], parallel: bool) -> Iterator[Read]:
    """_read of every folder, in order; spread over processes when asked and there are many.

    Most of the time goes into parsing JSON, which holds the GIL: processes, not threads.
    """
    many = parallel and len(run_dirs) >= PARALLEL_FROM
    processes = min(MAX_PROCESSES, _cpus()) if many else 1
    if processes < 2:
        return map(_read, run_dirs)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context(_start_method())
    pool = ProcessPoolExecutor(processes, mp_context=context)
    chunks = [run_dirs[i : i + CHUNK] for i in range(0, len(run_dirs), CHUNK)]
    return _in_order(pool, pool.map(_read_chunk, chunks))  # map submits every chunk at once


def _start_method() -> str:
    """fork, which starts a reader at once, while this process runs a single thread; else spawn.

    A fork copies no other thread, but their locks, held or not: once pandas (numpy) has started
    its threads, only a fresh interpreter is safe. The command line reads runs before that.
    """
    import multiprocessing

    try:
        threads = len(os.listdir("/proc/self/task"))  # native threads too, not Python's only
    except OSError:  # no /proc: not Linux, where spawn is the default anyway
        threads = 0
    return "fork" if threads == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _in_order(pool: Executor, chunks: Iterator[list[Read]]) -> Iterator[Read]:
    try:
        for chunk in chunks:
            yield from chunk
    finally:  # done, or given up on (an error, ^C): no process left behind, no chunk more read
        pool.shutdown(cancel_futures=True)


def _read_chunk(run_dirs: list[Path]) -> list[Read]:
    return [_read(run_dir) for run_dir in run_dirs]


def _cpus() -> int:
    """The CPUs this process may run on (a Slurm job or a container may get fewer than exist)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_run(run_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's row, or None with a note saying what is missing; never raises for a bad run."""
    try:
        return _read_run(run_dir)
    except (OSError, KitError) as err:
        return None, [f"skipped {run_dir}: cannot read it: {err}"]
    except (TypeError, ValueError, KeyError, OverflowError) as err:  # values no kit writes
        return None, [f"skipped {run_dir}: its files hold values this kit does not write ({err})"]


def _read_run(run_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    meta = runfolder.read_meta(run_dir)
    cfg = runfolder.config_of(run_dir, meta)  # run.json read once, not twice
    run_id = meta.get("run_id", run_dir.name)
    if cfg.program:  # a program of the user's own: its records are read apart
        return programs.read_run(run_dir, run_id, cfg, meta)
    ranks, notes = _read_ranks(run_dir, world_size(cfg))
    if cfg.task in SEARCHES:
        return _search_row(run_dir, run_id, cfg, ranks), notes
    missing = _missing(cfg, ranks)
    if missing:
        return skipped(run_dir, run_id, missing, meta, notes)
    notes += [
        f"note {run_id}: rank {rank} has no summary record; its per-card figures are n/m"
        for rank, kinds in sorted(ranks.items())
        if rank and not kinds.get("summary")
    ]
    return _row(run_dir, run_id, cfg, ranks, meta.get("created_at")), notes


# A search's result belongs to the training runs with the same shape and hardware (a
# largest-model search: of the same model family, whatever the width trained).
LARGEST_BATCH_KEYS = (
    "mode",
    "model",
    "dataset",
    "precision",
    "optimizer",
    "nodes",
    "gpus_per_node",
    "device_name",
    "gpus",
)


# Each search task and the figures its runs give (the columns of FIGURES they fill).
SEARCHES = {
    "largest_batch": ("largest_batch",),
    "largest_model": ("largest_width", "largest_model_parameters"),
}


def _search_row(
    run_dir: Path, run_id: str, cfg: Config, ranks: dict[int, Rank]
) -> dict[str, Any] | None:
    summary = ranks.get(0, {}).get("summary")
    starts = [ranks[rank]["start"][-1] for rank in sorted(ranks) if ranks[rank].get("start")]
    if not summary or not starts:
        return None
    found, searched = summary[-1], bool(summary[-1].get("trials"))  # on CPU: not searched
    if cfg.task == "largest_model":
        width, parameters = found.get("largest_width"), found.get("largest_model_parameters")
        figures = {  # 0: no width fits
            "largest_width": float(width or 0) if searched else NOT_MEASURED,
            "largest_model_parameters": float(parameters or 0) / 1e6 if searched else NOT_MEASURED,
            "search_batch": cfg.train.global_batch_size,
        }
    else:
        largest = found.get("largest_global_batch")
        # 0: no batch fits
        figures = {"largest_batch": float(largest or 0) if searched else NOT_MEASURED}
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "task": cfg.task,
        "mode": strategy_key(cfg),
        "model": model_label(cfg, width=cfg.task != "largest_model"),
        "dataset": dataset_label(cfg),
        "precision": cfg.train.precision,
        "optimizer": optimizer_label(cfg),
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "device_name": starts[0]["device_name"],
        "gpus": sum(int(s.get("gpu_count") or 0) for s in starts),
        **figures,
    }


def _read_ranks(
    run_dir: Path, world: int = runfolder.MAX_RANKS
) -> tuple[dict[int, Rank], list[str]]:
    ranks: dict[int, Rank] = {}
    notes: list[str] = []
    for rank, path, records in rank_records(run_dir, world, notes):
        kinds = by_kind(records)  # one pass for the common case: one start, the first record
        starts = kinds.get("start", [])
        if len(starts) > 1:  # a requeued job appends a new attempt
            notes.append(f"note: {path}: {len(starts)} attempts, each epoch read once")
        if starts and (records[0] is not starts[-1] or not _rising(kinds.get("epoch", []))):
            kinds = by_kind(runfolder.run_view(records))  # earlier attempts: each epoch once
        ranks[rank] = kinds
    return ranks, notes


def _rising(epochs: Records) -> bool:
    """Whether the epoch numbers are whole and only rise: then run_view would change nothing."""
    numbers = [n for record in epochs if type(n := record.get("epoch")) is int]
    return len(numbers) == len(epochs) and numbers == sorted(set(numbers))


def _missing(cfg: Config, ranks: dict[int, Rank]) -> str:
    """What a run lacks before its figures mean anything; '' when it is complete."""
    if not ranks:
        return NO_METRICS
    expected = range(world_size(cfg))
    absent = [rank for rank in expected if not ranks.get(rank, {}).get("start")]
    if absent:
        return f"no start record from rank(s) {named_ranks(absent)} of {len(expected)}"
    summary = (ranks[0].get("summary") or [{}])[-1]
    if summary.get("diverged_epoch") is not None:
        return (
            f"diverged (test loss {summary.get('final_test_loss')} in epoch "
            f"{summary['diverged_epoch']}), so its figures are not compared"
        )
    done = min(len(ranks[rank].get("epoch", [])) for rank in expected)
    if done < cfg.train.epochs:
        return (
            f"{done} of {cfg.train.epochs} epochs done on every rank (job running, stopped, "
            "cancelled or failed: `launch status` says which)"
        )
    if not ranks[0].get("summary"):
        return "no summary from rank 0 (job still running, or failed before the end)"
    return ""


def _row(
    run_dir: Path, run_id: str, cfg: Config, ranks: dict[int, Rank], created: float | None
) -> dict[str, Any]:
    start = ranks[0]["start"][-1]
    starts = [ranks[rank]["start"][-1] for rank in sorted(ranks)]
    epochs = _epoch_table(ranks)
    _check_measured(epochs)
    return {
        "run_id": run_id,
        "task": "train",
        "mode": strategy_key(cfg),
        "run_dir": str(run_dir),
        **{name: read(cfg, start) for name, read in SETTINGS.items()},
        "device_name": start["device_name"],
        "gpus": sum(int(s.get("gpu_count") or 0) for s in starts),
        "placement": start.get("placement") or "",  # what was wrong with its CPUs or GPUs
        "torch": start["torch"],
        "model_family": model_label(cfg, width=False),  # what a largest-model search joins
        "runs": 1,
        **(timing := _timing(epochs, starts)),
        # A sample of the tokens is a sequence: its tokens are what a language model's speed counts.
        "tokens_per_s": timing["throughput"] * cfg.data.seq_len
        if cfg.data.dataset == "tokens"
        else NOT_MEASURED,
        **_time_to_accuracy(ranks[0], cfg.train.target_accuracy, created),
        **_energy(ranks, epochs, starts),
        **record_figures(ranks),
        "epoch_seconds": epochs["seconds"],  # for the plot: one value per epoch
    }


_STEP_TIMES = ("step_ms_p50", "step_ms_p90")


_SLOWEST = ("seconds", *_STEP_TIMES)  # an epoch lasts as long as on its slowest rank


_POOLED = ("samples", *_SLOWEST)  # the fields of an epoch record that the figures use


Epochs = dict[str, list[float]]  # "epoch" (in order) and the _POOLED fields: one value per epoch


def _epoch_table(ranks: dict[int, Rank]) -> Epochs:
    """Per epoch, in order: it ends when its slowest rank ends; its samples are every rank's together.

    Plain Python rather than a pandas groupby per run, which cost more than reading the run; a
    field that is absent or no number is skipped, as pandas skips NaN.
    """
    return _aligned(ranks) or _by_epoch(ranks)


def _check_measured(epochs: Epochs) -> None:
    """A time or a count no run measures (negative or infinite: a hand edit, another tool's line)
    would make a figure of the table: the run is skipped, saying which (NaN stays: not measured)."""
    for name in _POOLED:
        bad = [v for v in epochs.get(name, []) if v == v and not 0 <= v < math.inf]
        if bad:
            raise ValueError(f"an epoch's {name} is {bad[0]}, which no run measures")


_EPOCH_FIELDS = operator.itemgetter("epoch", *_POOLED)  # KeyError where one is absent


def _aligned(ranks: dict[int, Rank]) -> Epochs | None:
    """The common case, fast: every rank has the same epochs, each once and in order, and every
    field is a number. None otherwise (then _by_epoch pools record by record)."""
    try:  # per rank, its columns: the epoch numbers, then the _POOLED fields
        columns = [
            list(zip(*map(_EPOCH_FIELDS, kinds.get("epoch", [])), strict=True))
            for kinds in ranks.values()
        ]
    except KeyError:
        return None
    if not columns or not all(c and all(map(_numbers_only, c)) for c in columns):
        return None
    epochs = columns[0][0]
    if list(epochs) != sorted(set(epochs)) or any(c[0] != epochs for c in columns):
        return None

    def pooled(index: int, pool: Callable[[Sequence[float]], float]) -> list[float]:
        per_epoch = zip(*(c[index] for c in columns), strict=True)  # the field on every rank
        return list(map(float, map(pool, per_epoch)))  # map: the loop runs in C

    table = {"epoch": list(map(float, epochs)), "samples": pooled(1, math.fsum)}
    return table | {field: pooled(index, max) for index, field in enumerate(_SLOWEST, start=2)}


def _numbers_only(values: Sequence[Any]) -> bool:
    """Whether every value is a number, none NaN: their sum is a number then, and only then."""
    try:
        total = sum(values)
    except TypeError:  # None, a string …
        return False
    return total == total  # NaN is the one value unequal to itself


def _by_epoch(ranks: dict[int, Rank]) -> Epochs:
    """_epoch_table for any records: grouped by epoch number, what is no number skipped."""
    by_epoch: dict[float, list[list[float]]] = {}  # epoch → per rank, its _POOLED fields
    for kinds in ranks.values():
        for record in kinds.get("epoch", []):
            epoch = as_float(record.get("epoch"))
            if epoch == epoch:  # pandas' groupby drops a missing key (NaN)
                by_epoch.setdefault(epoch, []).append([as_float(record.get(f)) for f in _POOLED])
    table: Epochs = {field: [] for field in ("epoch", *_POOLED)}
    for epoch in sorted(by_epoch):
        fields = zip(*by_epoch[epoch], strict=True)  # per field, its value on each rank
        samples, *times = ([v for v in field if v == v] for field in fields)  # NaN skipped
        table["epoch"].append(epoch)
        table["samples"].append(math.fsum(samples))
        for column, values in zip(_SLOWEST, times, strict=True):
            table[column].append(max(values, default=NOT_MEASURED))
    return table


def _timing(epochs: Epochs, starts: Records) -> dict[str, float]:
    steady = bisect.bisect_left(epochs["epoch"], 2)  # epoch 1 pays for warm-up (allocator,
    seconds, samples = epochs["seconds"], epochs["samples"]  # kernels, caches): 2..N are steady
    startups = [s["startup_s"] for s in starts if s.get("startup_s") is not None]
    return {
        "epoch_s": median(seconds[steady:]),
        "first_epoch_s": seconds[0] if seconds else NOT_MEASURED,
        "throughput": median(list(map(_ratio, samples[steady:], seconds[steady:]))),
        "startup_s": max(startups) if len(startups) == len(starts) else NOT_MEASURED,
        **{column: median(epochs[column][steady:]) for column in _STEP_TIMES},
    }


def _time_to_accuracy(rank0: Rank, target: float, created: float | None) -> dict[str, float]:
    """Seconds from the run folder's making (the submission; the job's start on the sbatch
    path) and from rank 0's first touch of the training data in its last attempt, to the end
    (scored) of the first epoch whose test accuracy reaches the target. NaN where no epoch
    reached it, or the clock it is counted from is not recorded (runs of older kits)."""
    first = next(
        (
            r
            for r in rank0.get("epoch", [])
            if isinstance(r.get("test_accuracy"), int | float) and r["test_accuracy"] >= target
        ),
        None,
    )
    if first is None:
        return {"tta_epoch": NOT_MEASURED, "tta_s": NOT_MEASURED, "tta_data_s": NOT_MEASURED}
    reached = first["time"]
    touched = _data_touched(rank0["start"][-1])
    return {
        "tta_epoch": float(first["epoch"]),
        "tta_s": reached - created if isinstance(created, int | float) else NOT_MEASURED,
        "tta_data_s": reached - touched
        if touched is not None and reached > touched
        else NOT_MEASURED,
    }


def _data_touched(start: dict[str, Any]) -> float | None:
    """When rank 0 began reading the training data: its start record says so; in runs of older
    kits, which read it right after the process group, the start-up parts tell."""
    if isinstance(touched := start.get("data_touched"), int | float):
        return float(touched)
    parts = start.get("startup_parts") or {}
    # The process began startup_s before its start record; it read data after these two parts.
    began, imports, group = (
        start.get("startup_s"),
        parts.get("python_and_imports"),
        parts.get("process_group"),
    )
    known = all(isinstance(v, int | float) for v in (began, imports, group))
    return start["time"] - began + imports + group if known else None


def _energy(ranks: dict[int, Rank], epochs: Epochs, starts: Records) -> dict[str, float]:
    """Joules (NVML's counter, every card of every rank) per steady epoch, per 1,000 samples,
    per run; and GPU-seconds per run. NaN where a rank has no reading (no GPU, a card without
    the counter, runs of older kits)."""
    per_epoch: dict[int, float] = {}
    for kinds in ranks.values():
        for record in kinds.get("epoch", []):
            joules, number = record.get("energy_j"), record.get("epoch")
            if isinstance(number, int):  # NaN, and stays so, where any rank has none
                per_epoch[number] = per_epoch.get(number, 0.0) + as_float(joules)
    steady = [(n, j) for n, j in sorted(per_epoch.items()) if n >= 2]
    samples = dict(zip(epochs["epoch"], epochs["samples"], strict=True))
    summaries = [(kinds.get("summary") or [{}])[-1] for kinds in ranks.values()]
    gpus = [int(s.get("gpu_count") or 0) for s in starts]
    seconds = [as_float(s.get("total_seconds")) for s in summaries]
    return {
        "energy_epoch_j": median([j for _, j in steady]),
        "energy_kilosample_j": median(
            [1000 * _ratio(j, samples.get(float(n), NOT_MEASURED)) for n, j in steady]
        ),
        "energy_run_j": run_energy(summaries),
        "gpu_seconds": math.fsum(map(operator.mul, gpus, seconds)) if all(gpus) else NOT_MEASURED,
    }


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator as numpy divides: ±inf, or NaN for 0/0, rather than an error."""
    if denominator:
        return numerator / denominator
    if numerator and not math.isnan(numerator):
        return math.copysign(math.inf, numerator) * math.copysign(1.0, denominator)
    return math.nan
