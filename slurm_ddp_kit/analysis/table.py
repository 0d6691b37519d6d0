"""The comparison table: runs grouped by comparable settings, rows = figures, columns = strategies.

DP and DDP are always shown (the article's comparison, "DDP vs DP"); every other strategy a group
ran (ZeRO, DDP with a communication hook) gets its own column and a comparison against DDP.

Runs of different settings or hardware are never pooled: each group gets its own table. Repeats
within a group are pooled by the median, figure by figure, over the runs that measured it.

A user's program's runs (`analysis.programs`) get groups of their own, after the kit's: a program's
command is its setting, and its figures are those the kit can read from outside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.analysis.figures import FIGURES, Figure
from slurm_ddp_kit.analysis.load import HARDWARE, LARGEST_BATCH_KEYS, SEARCHES, SETTINGS
from slurm_ddp_kit.analysis.programs import PROGRAM_FIGURES, PROGRAM_SETTINGS, TASK
from slurm_ddp_kit.core import strategies

if TYPE_CHECKING:  # imported where used: the command line is parsed, and runs are being read
    import pandas as pd  # by other processes, while this one loads pandas


# Every column the table can show (`analysis.labels.strategy_key`), in its order: from the strategies.
COLUMNS = {column.key: column for column in strategies.columns()}


LABELS = {key: column.label for key, column in COLUMNS.items()}


# The article's comparison, always shown: DDP against DP; every other column is held to DDP.
REFERENCE, BASELINE = (key for key, column in COLUMNS.items() if column.always_shown)


SHOWN = (REFERENCE, BASELINE)


COMPARISON = f"{BASELINE}_vs_{REFERENCE}"  # the improvement column's key in csv/json


NM = "n/m"  # not measured


@dataclass(frozen=True)
class Group:
    """Runs that share every setting and the hardware, and their figures per mode."""

    number: int
    key: dict[str, Any]  # SETTINGS and HARDWARE values
    runs: pd.DataFrame
    # Strategy shown → figure column → median (NaN: not measured); in the order shown.
    medians: dict[str, dict[str, float]]
    task: str = "train"  # the task of the runs in its columns: "train", or a user's "program"

    @property
    def program(self) -> bool:
        """Whether the group's runs are of a user's program, not of the kit's loop."""
        return self.task == TASK

    @property
    def columns(self) -> list[str]:
        """The strategies shown: DP and DDP, then any other the group ran."""
        return list(self.medians)

    def run_ids(self, mode: str, task: str | None = None) -> list[str]:
        """The ids of the group's runs of `mode` and `task` (default: the group's own task)."""
        chosen = (self.runs["mode"] == mode) & (self.runs["task"] == (task or self.task))
        return self.runs.loc[chosen, "run_id"].tolist()


def group_runs(runs: pd.DataFrame) -> tuple[list[Group], list[str]]:
    """Groups of training runs in the order of their first run (run ids start with the UTC time),
    then groups of a user's program's runs in the same order, and a note per largest-batch run
    that joins none. The kit's groups come first: their numbers do not change as program runs
    are added.

    Largest-batch runs carry no epochs: each joins the groups whose training runs share its mode,
    model, precision, shape and hardware.
    """
    if runs.empty:
        return [], []
    groups, alone = _train_groups(runs)
    return groups + _program_groups(runs[runs["task"] == TASK], len(groups) + 1), alone


def _train_groups(runs: pd.DataFrame) -> tuple[list[Group], list[str]]:
    import pandas as pd

    keys = [*SETTINGS, *HARDWARE]
    train = runs[runs["task"] == "train"].sort_values("run_id")
    searches = runs[runs["task"].isin(SEARCHES)]
    groups = []
    joined: set[str] = set()
    # No training run: no setting columns to group by (a search's row has none of them).
    grouped: Iterable[tuple[Any, pd.DataFrame]] = (
        train.groupby(keys, sort=False, dropna=False) if not train.empty else []
    )
    for number, (key, frame) in enumerate(grouped, start=1):
        matched = _matching_searches(frame, searches)
        joined.update(matched["run_id"])
        groups.append(
            Group(
                number,
                {k: plain(v) for k, v in zip(keys, key, strict=True)},
                pd.concat([frame, matched]),
                _medians(frame, matched, FIGURES),
            )
        )
    alone = searches[~searches["run_id"].isin(joined)]
    return groups, [_alone_note(run) for _, run in alone.iterrows()]


def _program_groups(programs: pd.DataFrame, first: int) -> list[Group]:
    """A group per program command and job shape, numbered on from `first`."""
    if programs.empty:
        return []
    keys = list(PROGRAM_SETTINGS)
    grouped = programs.sort_values("run_id").groupby(keys, sort=False, dropna=False)
    return [
        Group(
            number,
            {k: plain(v) for k, v in zip(keys, key, strict=True)},
            frame,
            _medians(frame, programs.iloc[:0], PROGRAM_FIGURES),
            TASK,
        )
        for number, (key, frame) in enumerate(grouped, start=first)
    ]


def _alone_note(run: pd.Series) -> str:
    """Why a search's run is in no table, and its figure, which is shown nowhere else."""
    column, what = (
        ("largest_width", "widest model.width")
        if run["task"] == "largest_model"
        else ("largest_batch", "largest global batch")
    )
    best = run[column]
    found = "not measured (no GPU)" if math.isnan(best) else f"{best:.0f}"
    return (
        f"note {run['run_id']}: a {run['task'].replace('_', '-')} run is shown beside training "
        f"runs of the same strategy, model, precision and GPUs; none here ({what}: "
        f"{found}{', none fits' if best == 0 else ''})"
    )


def _matching_searches(train: pd.DataFrame, searches: pd.DataFrame) -> pd.DataFrame:
    """The search runs that belong to these training runs: a largest-batch run of their very
    model, a largest-model run of their model family (any width)."""
    import pandas as pd

    if searches.empty:
        return searches
    keys = list(LARGEST_BATCH_KEYS)
    shapes = train[keys].drop_duplicates()
    families = train[keys].assign(model=train["model_family"]).drop_duplicates()
    return pd.concat(
        [
            searches[searches["task"] == "largest_batch"].merge(shapes, on=keys),
            searches[searches["task"] == "largest_model"].merge(families, on=keys),
        ]
    )


def _medians(
    train: pd.DataFrame, searches: pd.DataFrame, shown: Iterable[Figure]
) -> dict[str, dict[str, float]]:
    medians: dict[str, dict[str, float]] = {}
    ran = set(train["mode"])  # search runs join only the strategies trained here
    for mode in (key for key in COLUMNS if key in SHOWN or key in ran):
        runs = train[train["mode"] == mode]
        figures = {f.column: _median(runs, f.column) for f in shown}  # NaN if none
        for task, columns in SEARCHES.items():
            found = searches[(searches["mode"] == mode) & (searches["task"] == task)]
            figures |= {column: _median(found, column) for column in columns}
        medians[mode] = figures | {"runs": float(len(runs))}
    return medians


def _median(frame: pd.DataFrame, column: str) -> float:
    return float(frame[column].median()) if column in frame and len(frame) else math.nan


def comparison(
    figure: Figure, dp: float, ddp: float, names: tuple[str, str] = ("DP", "DDP")
) -> tuple[float, str, str]:
    """DDP against DP (or `names[1]` against `names[0]`) as (number, unit, text); NaN and "n/m"
    when either side is not measured."""
    if figure.compare == "none":
        return math.nan, "", ""
    if math.isnan(dp) or math.isnan(ddp):
        return math.nan, "", NM
    if figure.compare == "time":
        if dp <= 0 or ddp <= 0:
            return math.nan, "", "–"
        speedup = dp / ddp
        text = f"{speedup:.2f}× faster" if speedup >= 1 else f"{1 / speedup:.2f}× slower"
        return speedup, f"× ({names[0]} time / {names[1]} time)", text
    if figure.compare == "rate":
        if dp == 0:
            return math.nan, "", "–"
        change = (ddp / dp - 1) * 100
        return change, f"% (relative to {names[0]})", f"{change:+.0f}%"
    if figure.compare == "points":
        return ddp - dp, "pp", f"{ddp - dp:+.1f} pp"
    return ddp - dp, figure.unit, f"{ddp - dp:+.{figure.digits}f}"


def number_text(figure: Figure, value: float) -> str:
    return NM if math.isnan(value) else f"{value:.{figure.digits}f}"


def _optimizer(key: dict[str, Any]) -> str:
    """The optimizer in the heading where it is not the article's plain SGD."""
    return "" if key["optimizer"] == "sgd" else f"{key['optimizer']}, "


def _other(key: dict[str, Any]) -> str:
    """The other settings the group's runs changed, where they changed any."""
    return f", {key['other_settings']}" if key.get("other_settings") else ""


def heading(group: Group) -> str:
    """One line: the settings and hardware the group's figures hold for."""
    if group.program:
        return _program_heading(group)
    k = group.key
    gpus = f"{k['gpus']} GPU(s) driven" if k["gpus"] else "no GPU (DDP ranks are CPU processes)"
    return (
        f"Group {group.number}: {k['dataset']} {k['train_samples']} train / {k['test_samples']} test, "
        f"{k['model']}, global batch {k['global_batch']}, {k['epochs']} epochs, "
        f"target accuracy {100 * k['target_accuracy']:g} %, "
        f"grad accum {k['grad_accum_steps']}, {k['precision']}, {_optimizer(k)}"
        f"{k['nodes']} node(s) × {k['gpus_per_node']} GPUs/node, {k['cpus_per_gpu']:g} CPUs/GPU, "
        f"speed options: {k['speed_options']}{_other(k)} | "
        f"hardware: {k['device_name']}, {gpus}, torch {k['torch']}"
    )


def _program_heading(group: Group) -> str:
    """A program's group: its command and job shape; of the hardware, the GPUs it was given
    (the kit records no device of a program: it does not import torch for it)."""
    k = group.key
    asked = f", asked: {k['asked']}" if k["asked"] else ""
    return (
        f"Group {group.number}: program `{k['program']}`, {k['nodes']} node(s) × "
        f"{k['gpus_per_node']} GPUs/node, {k['cpus_per_gpu']:g} CPUs/GPU{asked} | "
        f"hardware: not recorded for a program, {_given(k['gpus'])}"
    )


def _given(gpus: int | None) -> str:
    if gpus is None:  # NaN in the frame
        return "GPUs given: not recorded (CUDA_VISIBLE_DEVICES unset)"
    return f"{gpus} GPU(s) given" if gpus else "no GPU given (the program ran on CPUs)"


LISTED_IDS = 6  # a group with more runs per mode names the first and last only


def _ids(ids: list[str]) -> str:
    """Run ids in a line whose length does not grow with the number of runs."""
    if len(ids) <= LISTED_IDS:
        return ", ".join(ids) or "none"
    return f"{len(ids)} runs, {ids[0]} … {ids[-1]} (all ids: --format json)"


def label(group: Group, mode: str) -> str:
    """A column's heading: its strategy's label, or what the strategy ran as without a GPU; for
    a program, the shape of its tasks (the program chose its strategy itself)."""
    if group.program:
        return f"--mode {mode} ({strategies.get(mode).program_shape or 'no program shape'})"
    column = COLUMNS[mode]
    return column.cpu_label if column.cpu_label and not group.key["gpus"] else column.label


def headings(group: Group) -> dict[str, str]:
    """Each cell key's heading: the strategies, DDP against DP, each other against DDP."""
    shown = {mode: label(group, mode) for mode in group.columns}
    base, reference = shown[BASELINE], shown[REFERENCE]
    versus_ = {versus(mode): f"{shown[mode]} vs {base}" for mode in group.columns[len(SHOWN) :]}
    return shown | {COMPARISON: f"{base} vs {reference}"} | versus_


PROGRAM_NOTE = (
    "Note: a program's figures are read from outside it: its wall time, and from what it logged "
    "(`slurm_ddp_kit.log`) its epochs, loss and accuracy; see docs/programs.md."
)


def notes(group: Group) -> list[str]:
    """What a column means in this group where its label alone would mislead (no GPU, a
    program), and the runs whose ranks had fewer CPUs than asked or shared a GPU."""
    if group.program:
        return [PROGRAM_NOTE]
    said = [] if group.key["gpus"] else [
        f"Note: {COLUMNS[m].cpu_note}." for m in group.columns if COLUMNS[m].cpu_note
    ]  # fmt: skip
    return said + _placement_notes(group)


def _placement_notes(group: Group) -> list[str]:
    runs = group.runs
    if "placement" not in runs:
        return []
    placed = runs[runs["placement"].fillna("").astype(str) != ""]
    return [
        f"Warning: {run['run_id']} ({run['mode']}): {run['placement']}."
        for _, run in placed.iterrows()
    ]


TIME_TO_ACCURACY = ("tta_s", "tta_data_s")  # NaN when no epoch reached the target


def figures(group: Group) -> list[Figure]:
    """The figures that apply to the group: the largest model only where a width can be searched,
    tokens/s only for token sequences; a program's own list."""
    if group.program:
        return list(PROGRAM_FIGURES)
    searchable = group.key["model"].startswith("gpt ")
    tokens = group.key["dataset"].startswith("tokens ")
    return [
        f
        for f in FIGURES
        if (searchable or f.column not in SEARCHES["largest_model"])
        and (tokens or f.column != "tokens_per_s")
    ]


def measured(group: Group) -> tuple[list[Figure], list[Figure]]:
    """The figures some run of the group measured, and those none did (GPU figures without a
    GPU): the markdown table leaves the latter out and says so."""
    some: list[Figure] = []
    none: list[Figure] = []
    for figure in figures(group):
        values = [group.medians[mode][figure.column] for mode in group.columns]
        (some if figure.compare == "none" or any(map(math.isfinite, values)) else none).append(
            figure
        )
    return some, none


def runs_line(group: Group) -> str:
    shown = headings(group)
    parts = [f"{shown[mode]}: {_ids(group.run_ids(mode))}" for mode in group.columns]
    line = "Runs used: " + "; ".join(parts)
    for task in SEARCHES:
        found = [
            f"{shown[mode]}: {_ids(ids)}"
            for mode in group.columns
            if (ids := group.run_ids(mode, task))
        ]
        if found:
            line += f". {task.replace('_', '-').capitalize()} runs{_search_batch(group, task)}: "
            line += "; ".join(found)
    return line


def _search_batch(group: Group, task: str) -> str:
    """The global batch a largest-model search trained at, where it is not the group's."""
    if task != "largest_model":
        return ""
    batches = set(group.runs.loc[group.runs["task"] == task, "search_batch"])
    return f" (at a global batch of {', '.join(f'{b:.0f}' for b in sorted(batches))})"


def versus(mode: str) -> str:
    """The key of a column's comparison with the baseline (DDP) in csv/json."""
    return f"{mode}_vs_{BASELINE}"


def plain(value: Any) -> Any:
    """Plain values: numpy scalars become Python numbers, whole floats ints, NaN becomes null."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None if isinstance(value, float) and math.isnan(value) else value
