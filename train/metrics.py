"""Per-rank JSON-lines records (schema in docs/run-folder.md); nothing is parsed out of free text."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

SCHEMA = 1


def metrics_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "metrics" / f"rank-{rank:05d}.jsonl"


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a killed job keeps every whole record."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.path = metrics_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"schema": SCHEMA, "kind": kind, "time": time.time(), "rank": self.rank, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every whole record of one file, and a warning per line that could not be read."""
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            problems.append(
                f"{path}:{number}: unreadable line skipped (cut short by a killed job?)"
            )
            continue
        if record.get("schema") != SCHEMA:
            problems.append(
                f"{path}:{number}: schema {record.get('schema')} skipped (this kit reads {SCHEMA})"
            )
            continue
        records.append(record)
    return records, problems
