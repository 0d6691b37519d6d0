"""What both kinds of run are read into: the table's figures, a run's result or the reason it
is skipped, and the readers of its records that the kit's loop and a user's program share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from slurm_ddp_kit.core import runfolder, strategies
from slurm_ddp_kit.core.settings.schema import Config

NOT_MEASURED = float("nan")


# How the "DDP vs DP" column reads a figure: time (lower is better, "2.10× faster"), rate (relative
# change, "+110%"), points (difference of two percentages, "+0.4 pp"), diff (plain difference).
Compare = Literal["none", "time", "rate", "points", "diff"]


@dataclass(frozen=True)
class Figure:
    """One row of the comparison table and where its number comes from."""

    column: str  # the DataFrame column (and the csv/json `metric`)
    name: str
    unit: str
    compare: Compare
    note: str = ""  # how it was measured, shown next to the unit
    source: str = ""  # "kind.field" of the record carrying it; "": derived from the epoch records
    card: Literal["main", "other"] | None = None  # the field is a list per driven GPU
    others: Literal["mean", "max"] = "max"  # the other cards' figure: their mean, or their peak
    scale: float = 1.0
    digits: int = 2

    @property
    def label(self) -> str:
        """The row name: what, and its unit and how it was measured in brackets."""
        note = [self.unit, self.note, f"{self.others} over cards" if self.card == "other" else ""]
        details = ", ".join(filter(None, note))
        return f"{self.name} ({details})" if details else self.name

    @property
    def kind(self) -> str:
        return self.source.partition(".")[0]

    @property
    def field(self) -> str:
        return self.source.partition(".")[2]


def _field(source: str, name: str, unit: str, compare: Compare, **more: Any) -> Figure:
    """A figure read from rank 0's record; its column is the field's name."""
    return Figure(source.partition(".")[2], name, unit, compare, source=source, **more)


def _cards(source: str, name: str, unit: str, compare: Compare, **more: Any) -> tuple[Figure, ...]:
    """A per-GPU list in every rank's record, as two rows: the main card and the other cards."""
    column = source.rpartition(".")[2]
    main = Figure(
        f"{column}_main", f"{name} main card", unit, compare, source=source, card="main", **more
    )
    return main, replace(main, column=f"{column}_other", name=f"{name} other cards", card="other")


# The table's rows, in order. A field the writer adds later is one line here.
# fmt: off
FIGURES: tuple[Figure, ...] = (
    Figure("runs", "runs", "", "none", digits=0),
    Figure("epoch_s", "seconds per epoch", "s", "time", "steady state: median of epochs 2..N"),
    Figure("first_epoch_s", "first epoch", "s", "time"),
    Figure("tta_s", "time to target accuracy from submission", "s", "time", "to the end of the first epoch reaching it"),
    Figure("tta_data_s", "time to target accuracy from first data", "s", "time", "rank 0's first touch of the training data"),
    Figure("throughput", "throughput", "samples/s", "rate", "all ranks, steady state", digits=0),
    Figure("tokens_per_s", "throughput", "tokens/s", "rate", "all ranks, steady state; token workloads", digits=0),
    Figure("startup_s", "start-up", "s", "time", "slowest rank"),
    Figure("energy_epoch_j", "energy per epoch", "J", "rate", "NVML, every card, training, median of epochs 2..N", digits=1),
    Figure("energy_kilosample_j", "energy per 1,000 samples", "J", "rate", "NVML, every card, training, median of epochs 2..N", digits=3),
    Figure("energy_run_j", "energy per run", "J", "rate", "NVML, every card, model built to the end", digits=0),
    Figure("gpu_seconds", "GPU time per run", "GPU-s", "rate", "GPUs driven × each rank's time, last attempt", digits=1),
    Figure("step_ms_p50", "step time p50", "ms", "time", "data + compute, median over steady epochs"),
    Figure("step_ms_p90", "step time p90", "ms", "time", "data + compute, median over steady epochs"),
    *_cards("summary.gpus.util_pct", "GPU util", "%", "points", note="NVML: share of time a kernel ran", others="mean"),
    *_cards("summary.gpus.max_allocated_mb", "peak memory", "MB", "rate", note="PyTorch allocator, allocated"),
    *_cards("summary.gpus.max_reserved_mb", "peak memory", "MB", "rate", note="PyTorch allocator, reserved"),
    *_cards("summary.gpus.nvml_used_mb_peak", "peak memory", "MB", "rate", note="NVML used, driver's view"),
    Figure("largest_batch", "largest batch", "samples", "rate", "global, fits within 5 %; task=largest_batch runs", digits=0),
    Figure("largest_width", "largest model", "model.width", "rate", "widest gpt of the depth that trains at the search's global batch, within 5 %; task=largest_model runs", digits=0),
    Figure("largest_model_parameters", "largest model", "M parameters", "rate", "of that width", digits=1),
    _field("summary.final_test_accuracy", "final test accuracy", "%", "points", scale=100),
    _field("summary.final_test_loss", "final test loss", "cross-entropy", "diff", digits=4),
)


# statistics.fmean's sum and division, without its per-call overhead
_CARD_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda values: math.fsum(values) / len(values),
    "max": max,
}


def cpus_per_gpu(cfg: Config, start: dict[str, Any]) -> float:
    """The CPUs each GPU's share of the work had: a process's CPUs (its Slurm job's word, else
    the config's) over the GPUs it drives. DP's one process with 8 CPUs for 4 GPUs compares with
    DDP's ranks of 2 each; a DP process with 2 for 4 does not."""
    asked = start.get("cpus_asked")
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        return float(cfg.cluster.cpus_per_task)  # already per GPU
    return asked / strategies.of(cfg).gpus_per_task(cfg.cluster.gpus_per_node)


Result = tuple[dict[str, Any] | None, list[str]]  # what read_run returns


Records = list[dict[str, Any]]


Rank = dict[str, Records]  # one rank's current attempt: its records by kind, each in file order


def skipped(
    run_dir: Path, run_id: str, missing: str, meta: dict[str, Any], notes: list[str]
) -> Result:
    """No row for an unfinished run: the notes, and one saying what it lacks and where to look
    (or, where it was cancelled, how to finish it)."""
    if meta.get("cancel_requested"):
        return None, [*notes, f"skipped {run_id}: {missing}: cancelled (`launch cancel`); "
                      f"`python -m launch resume {run_dir}` finishes it"]  # fmt: skip
    return None, [*notes, f"skipped {run_id}: {missing}; see {runfolder.logs_dir(run_dir)}"]


def rank_records(
    run_dir: Path, world: int, notes: list[str]
) -> Iterator[tuple[int, Path, Records]]:
    """Each rank's file and its records in file order (every attempt's); the lines skipped in a
    file are one warning in `notes`, with the count of the others."""
    for rank, path in runfolder.rank_files(run_dir, world).items():
        records, problems = runfolder.read_records(path)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            notes.append(f"warning: {problems[0]}{more}")
        yield rank, path, records


def by_kind(records: Records) -> Rank:
    """The records by kind, in one pass: every figure then finds its record without a scan."""
    kinds: Rank = {}
    for record in records:
        kind = record.get("kind")
        if isinstance(kind, str):
            kinds.setdefault(kind, []).append(record)
    return kinds


ABSENT_NAMED = 8  # ranks named in a skipped run's note; more are counted


NO_METRICS = "no metrics yet (job queued, still starting, cancelled, or failed at start)"


def named_ranks(ranks: Sequence[int]) -> str:
    """'0, 3, 5': the first ABSENT_NAMED ranks, and the count of the others."""
    named = ", ".join(map(str, ranks[:ABSENT_NAMED]))
    return named + (f" and {len(ranks) - ABSENT_NAMED} more" if len(ranks) > ABSENT_NAMED else "")


def run_energy(summaries: Records) -> float:
    """Joules of every card the ranks' summaries list (NVML's counter); NaN if one card has
    none, or no rank lists a card."""
    cards = [card.get("energy_j") for s in summaries for card in s.get("gpus") or [{}]]
    return math.fsum(map(as_float, cards))


def as_float(value: Any) -> float:
    """A record's field as a float; NaN (what pandas skips) where it is absent or no number."""
    return float(value) if isinstance(value, int | float) else NOT_MEASURED


def median(values: list[float]) -> float:
    """The median of the values measured (NaN skipped, as pandas does); NaN if there is none."""
    known = sorted([v for v in values if v == v])  # NaN is the one value unequal to itself
    if not known:
        return NOT_MEASURED
    middle = len(known) // 2
    return known[middle] if len(known) % 2 else (known[middle - 1] + known[middle]) / 2


def record_figures(ranks: dict[int, Rank]) -> dict[str, float]:
    ordered = [ranks[rank] for rank in sorted(ranks)]  # rank 0 first (_missing made sure of it)
    cards: dict[str, list[float | None]] = {}  # per source: its main card's and other cards' rows
    figures = {}
    for figure in _RECORD_FIGURES:
        if figure.card is None:
            values = _field_values(ordered[0], figure)
        elif figure.source in cards:
            values = cards[figure.source]
        else:
            values = cards[figure.source] = [v for k in ordered for v in _field_values(k, figure)]
        figures[figure.column] = _record_figure(figure, values)
    return figures


def _record_figure(figure: Figure, values: list[float | None]) -> float:
    """A figure read from the records: rank 0's value, or the main card's, or the other cards'.

    values: rank 0's field, or the field of every card that the job drove, rank by rank.
    """
    if figure.card != "other":
        return values[0] * figure.scale if values and values[0] is not None else NOT_MEASURED
    others = values[1:]
    if not others or None in others:  # a figure from some of the cards only is no figure
        return NOT_MEASURED
    return _CARD_REDUCE[figure.others]([v for v in others if v is not None]) * figure.scale


def _field_values(kinds: Rank, figure: Figure) -> list[float | None]:
    """The field in a rank's last record of its kind, per driven GPU; [None] where it is absent."""
    kind, name, per_card = _SOURCES[figure.column]
    found = kinds.get(kind)
    value = found[-1].get(name) if found else None
    if per_card:
        value = [card.get(per_card) for card in value] if isinstance(value, list) else None
    values = value if isinstance(value, list) else [value]
    return [float(v) if isinstance(v, int | float) else None for v in values]


def _source(figure: Figure) -> tuple[str, str, str]:
    """The record kind, its field, and the field of each card's entry ("gpus.util_pct") or ""."""
    name, _, per_card = figure.field.partition(".")
    return figure.kind, name, per_card


_RECORD_FIGURES = tuple(f for f in FIGURES if f.source)


_SOURCES = {f.column: _source(f) for f in _RECORD_FIGURES}  # split once, read 10,000s of times
