"""What readers can compute with: each record kind's fields, their types and ranges, checked
as a record is read, so one hand-edited or hostile line is skipped with a warning instead of
failing every command that reads the run."""

from __future__ import annotations

import itertools
from typing import Any

MAX_RANKS = 100_000 * 64  # cluster.nodes × cluster.gpus_per_node at their largest


MOST = float(2**53)  # past this a number is no count, time or size of a run
_INT, _NUMBER, _TEXT = (int,), (int, float), (str,)
_MAYBE_INT, _MAYBE_NUMBER, _MAYBE_TEXT = (
    (int, type(None)),
    (int, float, type(None)),
    (str, type(None)),
)
_RANK, _COUNT, _SECONDS = (0, MAX_RANKS - 1), (0, MOST), (0.0, MOST)

# The fields that readers compute with, by kind, and the types each may have: a record holding one
# of another type (a hand edit, another tool's line) is skipped with a warning, like a line cut
# short, instead of failing every command that reads the run.
_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "*": {"kind": _TEXT, "time": _NUMBER, "rank": _INT},
    "start": {
        **dict.fromkeys(("pid", "world_size", "gpu_count", "first_epoch", "restarts"), _INT),
        **dict.fromkeys(("local_rank", "local_world_size", "node_rank", "master_port"), _INT),
        **dict.fromkeys(("master_addr", "source", "device", "cuda_visible_devices"), _MAYBE_TEXT),
        "python": _MAYBE_TEXT,
        **dict.fromkeys(("train_samples", "test_samples", "epochs", "global_batch"), _INT),
        **dict.fromkeys(("host", "mode", "task", "backend", "torch"), _TEXT),
        **dict.fromkeys(("node", "job_id", "device_name"), _MAYBE_TEXT),
        **dict.fromkeys(("startup_s", "data_touched"), _MAYBE_NUMBER),
        "compile_cache": _MAYBE_TEXT,
        "startup_parts": (dict, type(None)),
        "resumed_at_batch": _MAYBE_INT,
        "bytecode_cached": (bool, type(None)),
        **dict.fromkeys(("cpus", "placement"), _MAYBE_TEXT),
        **dict.fromkeys(("cpus_usable", "cpus_asked"), _MAYBE_INT),
        "gpu_ids": (list, type(None)),
        "program": (list,),
    },
    "epoch": {
        "epoch": _INT,
        "samples": _MAYBE_INT,
        "resumed_at_batch": _MAYBE_INT,
        **dict.fromkeys(
            ("seconds", "samples_per_s", "train_loss", "test_loss", "test_accuracy"), _MAYBE_NUMBER
        ),
        **dict.fromkeys(
            ("eval_seconds", "step_ms_p50", "step_ms_p90", "step_ms_p99", "energy_j"),
            _MAYBE_NUMBER,
        ),
    },
    "progress": {**dict.fromkeys(("epoch", "batch", "batches"), _INT), "seconds": _NUMBER},
    "summary": {
        **dict.fromkeys(("train_seconds", "total_seconds", "tolerance"), _MAYBE_NUMBER),
        **dict.fromkeys(("final_test_loss", "final_test_accuracy"), _MAYBE_NUMBER),
        **dict.fromkeys(
            (
                *("epochs", "largest_global_batch", "ceiling", "diverged_epoch", "attempts"),
                *("untimed", "largest_width", "largest_model_parameters", "global_batch"),
            ),
            _MAYBE_INT,
        ),
        **dict.fromkeys(("checkpoint", "parameters_sha256"), _MAYBE_TEXT),
        **dict.fromkeys(("gpus", "trials"), (list,)),
    },
    "stop": {
        "reason": _TEXT,
        **dict.fromkeys(("epoch", "batches", "requeues_used"), _INT),
        "requeue": (str, int, type(None)),
        **dict.fromkeys(("slurm_state", "not_requeued"), _MAYBE_TEXT),
        "saved": (bool,),
    },
    "error": {
        **dict.fromkeys(("error", "host", "traceback_tail"), _TEXT),
        "node": _MAYBE_TEXT,
        "kit_error": (bool,),
        "stood_still_s": _MAYBE_NUMBER,
        "exit_code": _MAYBE_INT,
    },
    "notice": {"text": _TEXT},
    "log": {"fields": (dict,)},
}


# The lists and mappings of a record whose entries readers compute with (a mapping's values are
# its entries): the types an entry may have, or for an entry that is a mapping (a summary's
# `gpus` entry per card), the types of its fields.
_ITEMS: dict[str, dict[str, tuple[type, ...] | dict[str, tuple[type, ...]]]] = {
    # gpu_ids: the GPUs a rank drove, by UUID (`core.placement.Place`); a number in older runs.
    "start": {"startup_parts": _MAYBE_NUMBER, "gpu_ids": (str, int, type(None))},
    "summary": {
        "gpus": {
            "cuda_index": _MAYBE_INT,
            "name": _MAYBE_TEXT,
            "util_samples": _MAYBE_INT,
            **dict.fromkeys(
                ("util_pct", "nvml_used_mb_peak", "max_allocated_mb", "max_reserved_mb"),
                _MAYBE_NUMBER,
            ),
            "energy_j": _MAYBE_NUMBER,
        },
        "trials": {
            **dict.fromkeys(("global_batch", "width", "parameters"), _MAYBE_INT),
            "fits": (bool,),
        },
    },
}


# The ranges of the numbers readers loop over, size by or print as times: a record holding one
# outside its range (a hand edit, another tool's line) is skipped as one of a wrong type is.
_RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "*": {"rank": _RANK, "time": _SECONDS},
    "start": {
        **dict.fromkeys(("world_size", "local_world_size"), (1, MAX_RANKS)),
        **dict.fromkeys(("local_rank", "node_rank"), _RANK),
        **dict.fromkeys(("first_epoch", "epochs"), (1, 1_000_001)),  # train.epochs' range
        **dict.fromkeys(("gpu_count", "restarts", "resumed_at_batch", "pid"), _COUNT),
        **dict.fromkeys(("startup_s", "data_touched"), _SECONDS),
        "master_port": (0, 65535),
    },
    "epoch": {"epoch": (1, 1_000_000)},
    "progress": {
        "epoch": (1, 1_000_000),
        **dict.fromkeys(("batch", "batches"), _COUNT),
        "seconds": _SECONDS,
    },
    "summary": {
        **dict.fromkeys(("train_seconds", "total_seconds"), _SECONDS),
        **dict.fromkeys(("epochs", "attempts", "untimed", "diverged_epoch"), _COUNT),
    },
    "stop": dict.fromkeys(("epoch", "batches", "requeues_used"), _COUNT),
    "error": {"stood_still_s": _SECONDS},
}


# Per kind, with the fields every record has.
_BOUNDS = {kind: tuple({**_RANGES["*"], **_RANGES.get(kind, {})}.items()) for kind in _FIELDS}


class _Absent:
    """What a record's field is when it has none: every field may be absent."""


def _checks(
    fields: dict[str, tuple[type, ...]],
) -> tuple[tuple[str, ...], tuple[frozenset[type], ...]]:
    """The fields' names, and each one's exact types as json gives them (a bool only where bool
    is named), absence allowed."""
    return tuple(fields), tuple(frozenset({*types, _Absent}) for types in fields.values())


# Per kind, with the fields every record has: merged once, read for every record of every run.
_CHECKS = {kind: _checks({**_FIELDS["*"], **fields}) for kind, fields in _FIELDS.items()}


_ABSENT = itertools.repeat(_Absent())


# The field readers order and index records by, which every record the kit writes has: one
# without it is skipped (another tool's, or cut by hand), not a KeyError in whatever reads next.
_REQUIRED = {kind: ("time",) for kind in _FIELDS}


def misfit(record: dict[str, Any]) -> str:
    """'' for a record whose known fields have their types and ranges; else the first that has
    not.

    summarize checks every record of every run, so the common case runs in C: each known field's
    exact type (json gives int, float, str, bool, None, list and dict only) looked up in a set.
    """
    kind = record.get("kind")
    kind = kind if isinstance(kind, str) and kind in _CHECKS else "*"
    missing = [name for name in _REQUIRED[kind] if name not in record]
    if missing:
        return f"it has no {missing[0]}"
    names, allowed = _CHECKS[kind]
    types = map(type, map(record.get, names, _ABSENT))
    if not all(map(frozenset.__contains__, allowed, types)):
        return misfit_fields(record, _FIELDS["*"] | _FIELDS.get(kind, {}))
    for name, (low, high) in _BOUNDS[kind]:
        value = record.get(name)
        if value is not None and not low <= value <= high:  # NaN is in no range
            return f"its {name} is {value!r}, not in {low}..{high}"
    return _misfit_items(record, _ITEMS.get(kind, {}))


def _misfit_items(record: dict[str, Any], fields: dict[str, Any]) -> str:
    """'' where each entry of the record's lists and mappings (a summary's `gpus`, …) has its
    type (_ITEMS); else what is wrong with the first that has not."""
    for name, entry_type in fields.items():
        items = record.get(name)
        entries = items.values() if isinstance(items, dict) else items or ()
        for entry in entries:
            if isinstance(entry_type, dict):  # a mapping of fields, each of its types
                misfit = misfit_fields(entry, entry_type) if isinstance(entry, dict) else "x"
            else:
                misfit = misfit_fields({name: entry}, {name: entry_type})
            if misfit:
                return f"its {name} holds {_short(entry)}, not {_ENTRIES.get(name, 'a figure')}"
    return ""


_ENTRIES = {"gpus": "a mapping of one card's figures", "trials": "a mapping of one trial"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def misfit_fields(values: dict[str, Any], fields: dict[str, tuple[type, ...]]) -> str:
    for name, types in fields.items():
        if name not in values:
            continue
        value = values[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"its {name} is {_short(value)}, not {' or '.join(t.__name__ for t in types)}"
    return ""
