"""One PNG: a row of panels per group of comparable runs, DP and DDP side by side in each panel.

Panels are a list of small functions, so a per-card memory or utilisation panel is one more entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.table import COLUMNS, LABELS, NM, Group


def _epoch_times(ax: Axes, group: Group) -> None:
    """Each run's epoch times; an epoch lasts until its slowest rank is done."""
    labelled: set[str] = set()
    train = group.runs[group.runs["task"] == "train"]
    for mode, seconds in zip(train["mode"], train["epoch_seconds"], strict=True):
        label = None if mode in labelled else LABELS[mode]
        labelled.add(mode)
        colour = COLUMNS[mode].colour
        ax.plot(range(1, len(seconds) + 1), seconds, marker="o", color=colour, label=label)
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
    ax.set_xticks(range(len(group.columns)), [LABELS[m] for m in group.columns])
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


# One column per panel, left to right.
PANELS: list[Callable[[Axes, Group], None]] = [
    _epoch_times,
    _throughput,
    _per_card("util_pct", "GPU utilisation (NVML)", "% of time a kernel ran"),
    _per_card("max_allocated_mb", "peak memory (allocator)", "MB allocated"),
    _per_card("nvml_used_mb_peak", "peak memory (NVML)", "MB used, driver's view"),
]


def save_plot(groups: list[Group], path: Path) -> None:
    """Write the figure to path (its suffix picks the format: .png, .svg, .pdf)."""
    # A bare Figure, not pyplot: no GUI backend is looked for and no global state is left behind.
    fig = Figure(figsize=(5 * len(PANELS), 3.8 * len(groups)), layout="constrained")
    rows = fig.subfigures(len(groups), 1, squeeze=False)[:, 0]
    for row, group in zip(rows, groups, strict=True):
        row.suptitle(_row_title(group), fontweight="bold")
        for ax, panel in zip(row.subplots(1, len(PANELS), squeeze=False)[0], PANELS, strict=True):
            panel(ax, group)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _row_title(group: Group) -> str:
    k = group.key
    return f"group {group.number}: batch {k['global_batch']}, {k['device_name']}"
