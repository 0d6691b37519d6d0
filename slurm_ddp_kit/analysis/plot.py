"""One PNG: a row of panels per group of comparable runs, DP and DDP side by side in each panel.

Panels are a list of small functions, so a per-card memory or utilisation panel is one more entry.
A group shows only the panels some of its runs measured (no GPU panels for CPU runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from slurm_ddp_kit.analysis.table import COLUMNS, NM, Group, label


def _epoch_times(ax: Axes, group: Group) -> None:
    """Each run's epoch times; an epoch lasts until its slowest rank is done."""
    labelled: set[str] = set()
    train = group.runs[group.runs["task"] == group.task]  # not a search's runs
    for mode, seconds in zip(train["mode"], train["epoch_seconds"], strict=True):
        name = None if mode in labelled else label(group, mode)
        labelled.add(mode)
        colour = COLUMNS[mode].colour
        ax.plot(range(1, len(seconds) + 1), seconds, marker="o", color=colour, label=name)
    ax.set(title="time per epoch", xlabel="epoch", ylabel="seconds (slowest rank)")
    # NaN (a split epoch has no one time) is drawn as a gap and left out of the limits.
    known = [v for seconds in train["epoch_seconds"] for v in seconds if math.isfinite(v)]
    if known:
        ax.set_ylim(0, 1.15 * max(known))  # room for a legend
    else:
        ax.text(0.5, 0.5, NM, ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
    ax.legend(loc="lower right")  # the lines sit high: epoch times start at 0


def _throughput(ax: Axes, group: Group) -> None:
    """Steady-state throughput per strategy (median over repeats); n/m where not measured."""
    for x, mode in enumerate(group.columns):
        value = group.medians[mode]["throughput"]
        if math.isnan(value):
            ax.text(x, 0, NM, ha="center", va="bottom")
        else:
            ax.bar(x, value, color=COLUMNS[mode].colour)
            ax.text(x, value, f"{value:.0f}", ha="center", va="bottom")
    _strategy_axis(ax, group)
    ax.margins(y=0.12)  # room for the value above the tallest bar
    ax.set(title="throughput (steady state)", ylabel="samples/s, all ranks")


def _strategy_axis(ax: Axes, group: Group) -> None:
    """One place per strategy shown, DP and DDP even where one has no run."""
    names = [label(group, m).replace(" (", "\n(") for m in group.columns]  # long: two lines
    ax.set_xticks(range(len(group.columns)), names, fontsize=8)
    ax.set_xlim(-0.6, len(group.columns) - 0.4)


def _per_card(column: str, title: str, ylabel: str) -> Callable[[Axes, Group], None]:
    """A panel of the main card's and the other cards' figure, side by side per strategy."""

    def panel(ax: Axes, group: Group) -> None:
        for x, mode in enumerate(group.columns):
            for offset, card, hatch in ((-0.2, "main", ""), (0.2, "other", "//")):
                value = group.medians[mode][f"{column}_{card}"]
                label = f"{card} card{'s' if card == 'other' else ''}" if x == 0 else None
                if math.isnan(value):
                    ax.text(x + offset, 0, NM, ha="center", va="bottom", fontsize=8)
                    continue
                colour = COLUMNS[mode].colour
                ax.bar(x + offset, value, width=0.38, color=colour, hatch=hatch, label=label)
                ax.text(x + offset, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
        _strategy_axis(ax, group)
        ax.margins(y=0.15)
        ax.set(title=title, ylabel=ylabel)
        if ax.get_legend_handles_labels()[0]:  # nothing measured (no GPU): no legend to draw
            ax.legend(loc="upper left", fontsize=8)

    return panel


Panel = tuple[Callable[[Axes, Group], None], tuple[str, ...]]  # draws; the figures it needs

# Left to right: each panel and the table's figure columns it draws (drawn where one is measured).
PANELS: list[Panel] = [
    (_epoch_times, ("epoch_s", "first_epoch_s")),
    (_throughput, ("throughput",)),
    *(
        (_per_card(column, title, ylabel), (f"{column}_main", f"{column}_other"))
        for column, title, ylabel in (
            ("util_pct", "GPU utilisation (NVML)", "% of time a kernel ran"),
            ("max_allocated_mb", "peak memory (allocator)", "MB allocated"),
            ("nvml_used_mb_peak", "peak memory (NVML)", "MB used, driver's view"),
        )
    ),
]


def panels(group: Group) -> list[Callable[[Axes, Group], None]]:
    """The panels of a group's row: those with a figure some run measured."""
    return [
        draw
        for draw, needs in PANELS
        if any(
            math.isfinite(group.medians[m].get(c, math.nan)) for m in group.columns for c in needs
        )
    ]


def save_plot(groups: list[Group], path: Path) -> None:
    """Write the figure to path (its suffix picks the format: .png, .svg, .pdf)."""
    rows_panels = [panels(group) for group in groups]
    width = max([1, *map(len, rows_panels)])
    # A bare Figure, not pyplot: no GUI backend is looked for and no global state is left behind.
    fig = Figure(figsize=(5 * width, 3.8 * len(groups)), layout="constrained")
    rows = fig.subfigures(len(groups), 1, squeeze=False)[:, 0]
    for row, group, drawn in zip(rows, groups, rows_panels, strict=True):
        row.suptitle(_row_title(group), fontweight="bold")
        axes = row.subplots(1, width, squeeze=False)[0]
        for ax, panel in zip(axes, drawn, strict=False):
            panel(ax, group)
        for ax in axes[len(drawn) :]:  # a row with fewer panels than the widest: blank, no axes
            ax.set_axis_off()
        if not drawn:
            axes[0].text(0, 0.5, "no figure measured by these runs", va="center")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _row_title(group: Group) -> str:
    k = group.key
    where = f"{k['gpus']} GPU(s)" if k["gpus"] else "no GPU"
    if group.program:  # no batch nor device recorded: the command's end (its script), to fit
        command = k["program"] if len(k["program"]) <= 40 else f"…{k['program'][-39:]}"
        given = "GPUs n/m" if k["gpus"] is None else where  # None: CUDA_VISIBLE_DEVICES unset
        return f"group {group.number}: {command}, {given}"
    return f"group {group.number}: batch {k['global_batch']}, {k['device_name']}, {where}"
