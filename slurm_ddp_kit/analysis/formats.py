"""The comparison as it is written out: Markdown (a table per group, its heading, runs line and
notes), a tidy DataFrame, and CSV and JSON from it (null where a figure was not measured)."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.analysis.figures import Figure
from slurm_ddp_kit.analysis.load import SEARCHES
from slurm_ddp_kit.analysis.table import (
    BASELINE,
    COMPARISON,
    REFERENCE,
    SHOWN,
    TIME_TO_ACCURACY,
    Group,
    comparison,
    figures,
    heading,
    headings,
    label,
    measured,
    notes,
    number_text,
    plain,
    runs_line,
    versus,
)

if TYPE_CHECKING:  # imported where used, as in `analysis.table`
    import pandas as pd


def to_markdown(groups: list[Group]) -> str:
    """A heading and a GitHub Markdown table per group."""
    return "\n\n".join(_markdown_group(group) for group in groups) + "\n"


def _markdown_group(group: Group) -> str:
    lines = [f"## {heading(group)}", "", runs_line(group), ""]
    shown = headings(group)
    lines += [
        "| " + " | ".join(["metric", *shown.values()]) + " |",
        "|---|" + "---:|" * len(group.columns) + "---|" * (len(shown) - len(group.columns)),
    ]
    some, none = measured(group)
    for figure in some:
        texts = [text for _, _, text in _cells(group, figure).values()]
        lines.append("| " + " | ".join([figure.label, *texts]) + " |")
    reached = any(math.isfinite(v) for v in group.runs.get("tta_epoch", []))
    unreached = [] if reached else [f for f in none if f.column in TIME_TO_ACCURACY]
    if unreached:  # measured, but no run got there
        target = f"{100 * group.key['target_accuracy']:g} %"
        lines += ["", f"No run here reached the target accuracy ({target}): time to it left out."]
    if others := [f for f in none if f not in unreached]:
        names = ", ".join(dict.fromkeys(f.name for f in others))
        lines += ["", f"Not measured by any run here, so left out (null in csv/json): {names}."]
    if said := notes(group):
        lines += ["", *said]
    return "\n".join(lines)


def _cells(group: Group, figure: Figure) -> dict[str, tuple[float, str, str]]:
    """One figure's cells as (number, unit, text): each strategy's, DDP against DP, then each
    other strategy against DDP."""
    values = {mode: group.medians[mode][figure.column] for mode in group.columns}
    cells = {
        mode: (value, figure.unit, number_text(figure, value)) for mode, value in values.items()
    }
    names = (label(group, REFERENCE), label(group, BASELINE))
    cells[COMPARISON] = comparison(figure, values[REFERENCE], values[BASELINE], names)
    for mode in group.columns[len(SHOWN) :]:
        names = (label(group, BASELINE), label(group, mode))
        cells[versus(mode)] = comparison(figure, values[BASELINE], values[mode], names)
    return cells


def tidy(groups: list[Group]) -> pd.DataFrame:
    """One record per (group, figure, mode or comparison): numbers as numbers, units apart."""
    import pandas as pd

    return pd.DataFrame([record for group in groups for record in _group_records(group)])


def _group_records(group: Group) -> list[dict[str, Any]]:
    runs = {mode: len(group.run_ids(mode)) for mode in group.columns}
    runs[COMPARISON] = runs[REFERENCE] + runs[BASELINE]
    runs |= {versus(mode): runs[BASELINE] + runs[mode] for mode in group.columns[len(SHOWN) :]}
    shown = headings(group)
    return [
        {"group": group.number, "metric": figure.column, "label": figure.label, "mode": mode}
        | {"column": shown[mode], "value": value, "unit": unit, "text": text}
        | {"runs": runs[mode], **group.key}
        for figure in figures(group)
        for mode, (value, unit, text) in _cells(group, figure).items()
    ]


def to_csv(groups: list[Group]) -> str:
    buffer = io.StringIO()
    tidy(groups).to_csv(buffer, index=False)
    return buffer.getvalue()


def to_json(groups: list[Group]) -> str:
    """{"groups": each group's settings and run ids, once; "records": the tidy records}.

    Not-measured figures are null, never NaN or 0.
    """
    records = [{k: plain(v) for k, v in r.items()} for r in tidy(groups).to_dict("records")]
    described = [
        {"group": g.number, **{k: plain(v) for k, v in g.key.items()}}
        | {"run_ids": {mode: g.run_ids(mode) for mode in g.columns}}
        | {
            f"{task}_run_ids": {mode: g.run_ids(mode, task) for mode in g.columns}
            for task in SEARCHES
        }
        | {"notes": notes(g)}
        for g in groups
    ]
    return (
        json.dumps({"groups": described, "records": records}, indent=1, ensure_ascii=False) + "\n"
    )


FORMATS: dict[str, Callable[[list[Group]], str]] = {
    "markdown": to_markdown,
    "csv": to_csv,
    "json": to_json,
}
