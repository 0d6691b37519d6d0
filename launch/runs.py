"""Run folders: created once per submission, never overwritten (layout in docs/run-folder.md)."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from launch.config import Config, save

RUN_SCHEMA = 1


def create(cfg: Config, launcher: str, backend: str, command: list[str]) -> Path:
    """Make a new run folder holding the resolved config (paths made absolute) and run.json."""
    cfg.output.root = str(Path(cfg.output.root).resolve())
    cfg.data.root = str(Path(cfg.data.root).resolve())  # the job may start in another folder
    run_dir = _new_folder(cfg)
    save(cfg, run_dir / "config.yaml")
    meta = {
        "schema": RUN_SCHEMA,
        "run_id": run_dir.name,
        "mode": cfg.mode,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "launcher": launcher,
        "backend": backend,
        "job_id": None,
        "host": socket.gethostname(),
        "command": command,
    }
    _write_json(run_dir / "run.json", meta)
    return run_dir


def read_meta(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "run.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run folder (no run.json): pass a folder under runs/"
        )
    meta: dict[str, Any] = json.loads(path.read_text())
    return meta


def update_meta(run_dir: Path, **fields: Any) -> dict[str, Any]:
    meta = {**read_meta(run_dir), **fields}
    _write_json(run_dir / "run.json", meta)
    return meta


def find_runs(root: Path) -> list[Path]:
    """Every run folder under root (a folder holding run.json), oldest first by name."""
    if (root / "run.json").is_file():
        return [root]
    return sorted(p.parent for p in root.glob("**/run.json"))


def _new_folder(cfg: Config) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    shape = f"{cfg.cluster.nodes}n{cfg.cluster.gpus_per_node}g"
    name = "-".join(filter(None, [stamp, cfg.mode, shape, cfg.output.name]))
    root = Path(cfg.output.root)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        folder = root / f"{name}-{secrets.token_hex(2)}"
        try:
            folder.mkdir()  # fails rather than reuse: an earlier run is never overwritten
            return folder
        except FileExistsError:
            continue


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)
