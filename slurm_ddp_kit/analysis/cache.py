"""Runs already read, kept for the next `summarize` of the same folders.

Reading a run costs about half a millisecond, mostly parsing JSON: 100,000 runs take most of a
minute on two cores. A sweep is summarized again and again as its runs finish, and most of them
have not changed since the last call. So each run's result is kept with its fingerprint
(`core.runfolder.fingerprint`: identity, size and modification time of its files, a few system
calls) and used again only while the fingerprint is unchanged and the code that read it is the
same. Anything else is read afresh, as without the cache.

The cache is the user's: one file per set of folders summarized, under $XDG_CACHE_HOME/kit
(else ~/.cache/kit), readable by its owner alone. It is read back only where no one else could
have written it (`core.userfiles`), and unpickled into plain data alone (dicts, lists, tuples,
strings, numbers): no class is built and nothing called, so even a planted file runs no code.
A cache that cannot be read or written is passed over: never an error, never a wrong row.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import runfolder, userfiles
from slurm_ddp_kit.core.settings import schema

VERSION = 1
_PACKAGES = ("analysis", "core")  # the code a result depends on


class Kept:
    """The results of an earlier call, by run folder, and this call's to keep (path None: none
    kept, none read)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, tuple[Any, Any]] = _load(path) if path else {}
        self.changed = False

    def get(self, run_dir: Path) -> Any:
        """The result kept for this run folder, or None where it may have changed since."""
        kept = self.entries.get(os.fspath(run_dir))
        if kept is None or kept[0] != runfolder.fingerprint(run_dir):
            return None
        return kept[1]

    def put(self, run_dir: Path, fingerprint: Any, result: Any) -> None:
        """Keep a result read from the run as `fingerprint` says it was (None: unreadable)."""
        if self.path is not None and fingerprint is not None:
            self.entries[os.fspath(run_dir)] = (fingerprint, result)
            self.changed = True

    def keep_only(self, run_dirs: Sequence[Path]) -> None:
        """Forget runs not summarized this time (deleted, or moved away)."""
        if len(self.entries) > len(run_dirs):
            wanted = {os.fspath(run_dir) for run_dir in run_dirs}
            self.entries = {k: v for k, v in self.entries.items() if k in wanted}
            self.changed = True

    def save(self) -> None:
        """Write the results kept, where they changed; either way the file counts as used."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            userfiles.keep_private(self.path.parent)  # made under a umask of 002: read back
            if self.changed:
                with runfolder.atomic_file(self.path) as partial:
                    partial.chmod(0o600)
                    with partial.open("wb") as f:
                        pickle.dump(_header() | {"entries": self.entries}, f, protocol=5)
            else:
                os.utime(self.path)
            _forget_unused(self.path.parent)


def path_for(paths: Sequence[Path]) -> Path | None:
    """The cache file of a summary of these folders; None where no cache folder can be named."""
    try:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    except RuntimeError:  # no home folder to be found
        return None
    named = "\n".join(sorted(os.fspath(path.resolve()) for path in paths))
    key = hashlib.sha256(named.encode()).hexdigest()[:24]
    return Path(home) / "kit" / "summarize" / f"{key}.pickle"


UNUSED_DAYS = 30  # a summary's cache not written for this long is deleted


def _forget_unused(folder: Path) -> None:
    """Delete the caches of folders not summarized for UNUSED_DAYS (each is written on use)."""
    oldest = time.time() - UNUSED_DAYS * 86400
    for cached in folder.glob("*.pickle"):
        with contextlib.suppress(OSError):
            if cached.stat().st_mtime < oldest:
                cached.unlink()


class _Results(userfiles.PlainData):
    """Plain data, and the settings' choices a row holds (`Precision.bf16`, …): an enum of the
    kit's schema is looked up by its value, which builds nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = getattr(schema, name, None) if module == schema.__name__ else None
        if isinstance(found, type) and issubclass(found, schema.Choice):
            return found
        return super().find_class(module, name)


def _load(path: Path) -> dict[str, tuple[Any, Any]]:
    try:
        handle = userfiles.open_own(path)
        if handle is None:
            return {}  # missing, or not this user's alone: passed over, and written anew
        with handle:
            kept = _Results(handle).load()
        if not isinstance(kept, dict) or any(kept.get(k) != v for k, v in _header().items()):
            return {}
    except Exception:  # missing, damaged, stale, or from another Python: read the runs afresh
        return {}
    entries = kept.get("entries")
    return entries if isinstance(entries, dict) else {}


def _header() -> dict[str, Any]:
    return {"version": VERSION, "code": _code_digest()}


@functools.cache
def _code_digest() -> str:
    """A digest of the reading code's sources: a kit changed in any way reads its runs afresh.
    Once a process: the load and the save of one call compare the same code."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        folder = Path(__file__).resolve().parent.parent / package
        for source in sorted(folder.rglob("*.py")):
            digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()
