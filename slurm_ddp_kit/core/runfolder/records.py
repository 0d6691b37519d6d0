"""A run's records: one JSON-lines file per rank, written by `RecordWriter` and read back as data
(size-limited lines, checked kinds), and the views readers take of them (the last attempt, a kind)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core.runfolder.checks import MAX_RANKS, misfit
from slurm_ddp_kit.core.runfolder.layout import KINDS, METRICS, SCHEMA, read_bytes, warn_once
from slurm_ddp_kit.core.runfolder.paths import no_links, open_inside


def metrics_path(run_dir: Path, rank: int) -> Path:
    return run_dir / METRICS / f"rank-{rank:05d}.jsonl"


def rank_files(run_dir: Path, ranks: int = MAX_RANKS) -> dict[int, Path]:
    """Each rank's records file, by rank, of the run's `ranks` (its world size); a file named
    as a rank's that is none of them, and a metrics folder that cannot be read, are passed
    over with a warning."""
    folder = Path(run_dir, METRICS)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):  # no records yet
        return {}
    except OSError as err:
        warn_once(folder, f"{folder} cannot be read ({err.strerror}): its records are skipped")
        return {}
    files, strays = {}, []
    for entry in entries:
        rank = rank_of(entry.name)
        if rank is not None and rank < min(ranks, MAX_RANKS):
            files[rank] = Path(entry.path)
        elif entry.name.startswith("rank-") and entry.name.endswith(".jsonl"):
            strays.append(entry.name)
    if strays:
        more = f" (and {len(strays) - 1} more)" if len(strays) > 1 else ""
        warn_once(
            folder,
            f"{folder}: {min(strays)}{more} skipped: no rank of this run, whose ranks are "
            f"0–{min(ranks, MAX_RANKS) - 1}",
        )
    return dict(sorted(files.items()))


def rank_of(name: str) -> int | None:
    """The rank whose records file this is (rank-00003.jsonl: 3); None for any other file."""
    digits = name[5:-6]
    if name.startswith("rank-") and name.endswith(".jsonl") and _RANK_DIGITS.fullmatch(digits):
        return int(digits)
    return None


_RANK_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII digits only (str.isdigit takes '٣' too)


class RecordWriter:
    """Appends one JSON object per line and flushes it, so a killed job keeps every whole record."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.run_dir = run_dir
        self.path = no_links(run_dir, metrics_path(run_dir, rank))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._end_cut_line()

    def _end_cut_line(self) -> None:
        """A job killed mid-write leaves a line without its newline: end it, so this attempt's
        first record is not glued to it (the reader then skips the cut line alone)."""
        try:
            f = os.fdopen(open_inside(self.run_dir, self.path, os.O_RDWR), "rb+")
        except OSError:  # no file: nothing cut (an unreadable one: the first write says why)
            return
        with contextlib.suppress(OSError), f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert kind in KINDS, kind
        record = {"schema": SCHEMA, "kind": kind, "time": time.time(), "rank": self.rank, **fields}
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        with os.fdopen(open_inside(self.run_dir, self.path, flags), "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every whole record of one file, and a warning per line that could not be used (a file
    that cannot be read at all is one warning)."""
    try:
        text = read_bytes(path).decode(errors="replace")  # a bad byte spoils its line only
    except OSError as err:  # unreadable by this user, say: the other ranks' files still count
        return [], [f"{path}: cannot be read ({err.strerror}), skipped"]
    lines = text.splitlines()
    try:  # one parse for the whole file: the common case, and the fast one
        if max(map(len, lines), default=0) <= MAX_LINE:
            parsed = json.loads("[" + ",".join(lines) + "]")
            if all(
                isinstance(r, dict) and r.get("schema") == SCHEMA and not misfit(r) for r in parsed
            ):
                return parsed, []
    except (ValueError, RecursionError):  # RecursionError: a line nested too deep
        pass
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        record, problem = _parse_line(line)
        if problem:
            problems.append(f"{path}:{number}: {problem}")
        else:
            records.append(record)
    return records, problems


MAX_LINE = 1 << 20  # characters of one record: the largest the kit writes (a summary) is a few kB


def _parse_line(line: str) -> tuple[dict[str, Any], str]:
    if len(line) > MAX_LINE:
        return {}, f"line of {len(line)} characters skipped: no record of this kit is so long"
    try:
        record = json.loads(line)
    except RecursionError:
        return {}, "line skipped: nested deeper than any record of this kit"
    except ValueError:
        record = None
    if not isinstance(record, dict) or "kind" not in record:
        return {}, "unreadable line skipped (cut short by a killed job?)"
    schema = record.get("schema")
    if isinstance(schema, int) and schema > SCHEMA:
        return (
            {},
            f"schema {schema} skipped: written by a newer kit (this one reads {SCHEMA}); upgrade to read it",
        )
    if schema != SCHEMA:
        return {}, f"schema {schema!r} skipped: not a record of this kit (it reads {SCHEMA})"
    if problem := misfit(record):
        return {}, f"record skipped: {problem}"
    return record, ""


def run_view(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run as its attempts leave it: the last `start`, each epoch once, then the last
    attempt's other records (its stop, its summary).

    Every attempt appends a `start` saying the epoch it begins with (`first_epoch`: 1 unless it
    resumed from a checkpoint); its epochs replace those of earlier attempts from that one on.
    """
    epochs: dict[int, dict[str, Any]] = {}
    last: list[dict[str, Any]] = []
    for record in records:
        kind = record.get("kind")
        if kind == "start":
            first = int(record.get("first_epoch") or 1)
            epochs = {n: r for n, r in epochs.items() if n < first}
            last = [record]
        elif kind == "epoch" and isinstance(record.get("epoch"), int):
            epochs[record["epoch"]] = record
        else:
            last.append(record)
    return last[:1] + [epochs[n] for n in sorted(epochs)] + last[1:]


def attempts(records: list[dict[str, Any]]) -> int:
    return sum(1 for r in records if r.get("kind") == "start")


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == kind]


def read_rank(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """One rank's run view ([] before it wrote anything); unreadable lines skipped, and said
    once per file in one warning line with their count."""
    path = metrics_path(run_dir, rank)
    if _absent(path):
        return []
    records, problems = read_records(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        warn_once(path, f"{problems[0]}{more}")
    return run_view(records)


def _absent(path: Path) -> bool:
    """No records file there (nor a regular file: a pipe is never read); one that is there but
    cannot be looked at (a folder without permission) is left to the reader to report."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
