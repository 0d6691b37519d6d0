"""A snapshot's manifest read back: data from someone else (run folders live on shared file
systems), so read with a size limit, its fields checked, and every path it yields inside RUN/code."""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
import re
import shlex
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.container import python_script
from slurm_ddp_kit.core.snapshot.sources import (
    CONTAINER,
    FOLDERS,
    KIT,
    MB,
    PROJECT,
    Plan,
    SnapshotError,
    under,
)

SCHEMA = 1  # of manifest.json; a reader refuses a newer one


MAX_MANIFEST = 1 << 20  # bytes: the kit's own is a few kB (a part and a path entry a line each)


def manifest_of(planned: Plan, counted: list[tuple[int, int]]) -> dict[str, Any]:
    parts = []
    for part, (files, size) in zip(planned.parts, counted, strict=True):
        record = {"copy": part.copy, "source": str(part.source), "files": files, "bytes": size}
        record["left_out"] = len(part.left_out)
        if part.copy == PROJECT:
            record |= {"commit": part.commit, "changed": part.changed}
        parts.append(record)
    now = time.time()
    return {
        "schema": SCHEMA,
        "copied": True,
        "made": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(
            "T", "seconds"
        ),
        "made_at": now,
        "files": sum(files for files, _ in counted),
        "bytes": sum(size for _, size in counted),
        "parts": parts,
        # Where the job starts and what it imports: in the copy, where the copy holds it.
        "workdir": {"source": str(planned.workdir), "copy": _mapped(planned, "")},
        "pythonpath": [{"source": e, "copy": _mapped(planned, e)} for e in planned.pythonpath],
    }


def _mapped(planned: Plan, entry: str) -> str | None:
    """Where a launching path (relative ones from the launching folder; '' is that folder) lies
    in the copy, relative to code/; None where the copy does not hold it."""
    real = os.path.realpath(os.path.join(planned.workdir, entry))
    for part in sorted(planned.parts, key=lambda p: len(str(p.source)), reverse=True):
        inside = under(real, part.source)  # the innermost part first: a folder in the project
        if inside is not None and (
            inside in part.folders or any(e.path == inside for e in part.entries)
        ):
            return f"{part.copy}/{inside}".rstrip("/")
    return None


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run's code manifest, its fields checked; None where the run has none (made before
    snapshots, or cut short), SnapshotError where it is damaged."""
    code, path = runfolder.code_dir(run_dir), runfolder.code_manifest(run_dir)
    if code.is_symlink():
        raise SnapshotError(_damaged(path, f"{code} is a symbolic link"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        link = err.errno == errno.ELOOP  # O_NOFOLLOW: a link may lead anywhere
        why = "it is a symbolic link" if link else f"it cannot be read ({err.strerror})"
        raise SnapshotError(_damaged(path, why)) from None
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotError(_damaged(path, "it is no regular file"))
        text = reader.read(MAX_MANIFEST + 1)
    if len(text) > MAX_MANIFEST:
        raise SnapshotError(_damaged(path, f"it is over {MAX_MANIFEST:,} bytes"))
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError):
        raise SnapshotError(_damaged(path, "it is no JSON")) from None
    if problem := _misfit(manifest):
        raise SnapshotError(_damaged(path, problem))
    return manifest


def _damaged(path: Path, why: str) -> str:
    return (
        f"{path} is damaged: {why}; the run's code copy cannot be trusted: start a new run "
        "(or, to run the live code, move the run's code/ folder away)"
    )


_TEXT, _COUNT = (str,), (int,)


_MAYBE_TEXT = (str, type(None))


_NOT_COPIED: dict[str, tuple[type, ...]] = {"why": _TEXT, "bytes": _COUNT, "max_mb": _COUNT}


_COPIED: dict[str, tuple[type, ...]] = {
    "made": _TEXT,
    "made_at": (int, float),
    "files": _COUNT,
    "bytes": _COUNT,
    "parts": (list,),
    "workdir": (dict,),
    "pythonpath": (list,),
}


_PART: dict[str, tuple[type, ...]] = {
    "copy": _TEXT,
    "source": _TEXT,
    "files": _COUNT,
    "bytes": _COUNT,
    "left_out": _COUNT,
}


_PROJECT: dict[str, tuple[type, ...]] = {"commit": _MAYBE_TEXT, "changed": (bool, type(None))}


_PATH: dict[str, tuple[type, ...]] = {"source": _TEXT, "copy": _MAYBE_TEXT}


_COMMIT = re.compile(r"[0-9a-f]{7,64}")


def _misfit(manifest: Any) -> str:
    """'' where the manifest holds every field this kit reads, of its type; else what is wrong."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("schema"), int):
        return "it is no code manifest of this kit (no schema number)"
    if manifest["schema"] > SCHEMA:
        return (
            f"its schema {manifest['schema']} is newer than this kit's {SCHEMA} (upgrade the kit)"
        )
    if not isinstance(manifest.get("copied"), bool):
        return "its copied is not true or false"
    if not manifest["copied"]:
        return _fields(manifest, _NOT_COPIED, "")
    if problem := _fields(manifest, _COPIED, ""):
        return problem
    for number, part in enumerate(manifest["parts"]):
        project = isinstance(part, dict) and part.get("copy") == PROJECT
        if problem := _fields(
            part, {**_PART, **_PROJECT} if project else _PART, f"parts[{number}]."
        ):
            return problem
        if project and part["commit"] is not None and not _COMMIT.fullmatch(part["commit"]):
            return f"its parts[{number}].commit {part['commit'][:80]!r} is no git commit"
    if problem := _fields(manifest["workdir"], _PATH, "workdir."):
        return problem
    for number, entry in enumerate(manifest["pythonpath"]):
        if problem := _fields(entry, _PATH, f"pythonpath[{number}]."):
            return problem
    return ""


def _fields(values: Any, fields: Mapping[str, tuple[type, ...]], prefix: str) -> str:
    if not isinstance(values, dict):
        return f"its {prefix.rstrip('.')} is no object"
    for name, types in fields.items():
        value = values.get(name, ...)
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if value is ... or wrong:
            found = "missing" if value is ... else repr(value)[:80]
            return f"its {prefix}{name} is {found}, not {' or '.join(t.__name__ for t in types)}"
    return ""


@dataclasses.dataclass(frozen=True)
class JobCode:
    """Where a run's tasks start and what they import, in its code copy: the copy of the
    launching folder (or the task's own folder where the copy does not hold it), and PYTHONPATH's
    entries, the copy's kit/ first."""

    workdir: Path
    pythonpath: list[str]
    held: Callable[[str], Path | None]  # a launching machine's absolute path, in the copy

    def lines(self) -> list[str]:
        """The shell lines that start the tasks in the copy: they go before the tasks start
        (the batch script's set-up), so every task's Python imports the copy from its first
        line."""
        return [
            f"cd {shlex.quote(str(self.workdir))}",
            f"export PYTHONPATH={shlex.quote(os.pathsep.join(self.pythonpath))}",
        ]


def job_code(
    run_dir: Path, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> JobCode | None:
    """The run's `JobCode`, from its manifest; None without a copy (code.snapshot=off, or a run
    made before snapshots): the live code runs. PYTHONPATH: the copy's kit/, then the task's own
    (`environ`'s) with each entry that was copied replaced by its copy.

    Only paths inside code/ are taken from the manifest: an entry it does not map is the task's
    own (a crafted manifest cannot point the task at code the launcher never chose)."""
    environ = os.environ if environ is None else environ
    own_path = environ.get("PYTHONPATH", "")
    entries = own_path.split(os.pathsep) if own_path else []
    manifest = read_manifest(run_dir)
    if manifest is None or not manifest["copied"]:
        return None
    path = runfolder.code_manifest(run_dir)
    kit = str(_inside(run_dir, KIT, path))
    mapped = {
        record["source"]: str(_inside(run_dir, record["copy"], path))
        for record in manifest["pythonpath"]
        if record["copy"] is not None
    }
    copy = manifest["workdir"]["copy"]
    workdir = (cwd or Path.cwd()) if copy is None else _inside(run_dir, copy, path)
    pythonpath = [kit, *(mapped.get(entry, entry) for entry in entries)]
    parts = [(part["source"], part["copy"]) for part in manifest["parts"]]

    def held(source: str) -> Path | None:
        found = _in_parts(source, parts)
        if found is None:
            return None
        place = runfolder.code_dir(run_dir).joinpath(*_rel_parts(found, path))
        return _inside(run_dir, found, path) if os.path.lexists(place) else None

    # A task's child may ask again: kit/ once.
    return JobCode(workdir, list(dict.fromkeys(pythonpath)), held)


def job_paths(
    run_dir: Path, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[Path, list[str]]:
    """Where a task of the run starts and its PYTHONPATH's entries (`job_code`); without a copy,
    the task's own, unchanged."""
    code = job_code(run_dir, environ, cwd)
    if code is not None:
        return code.workdir, code.pythonpath
    own_path = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    return cwd or Path.cwd(), own_path.split(os.pathsep) if own_path else []


def planned_job_code(planned: Plan, run_dir: Path) -> JobCode | None:
    """The `job_code` of a run folder not made yet, given the snapshot it would get: what a dry
    run shows (the same paths, in the same order)."""
    if not planned.copies:
        return None
    code = runfolder.code_dir(run_dir)
    copy = _mapped(planned, "")
    mapped = {e: str(code / m) for e in planned.pythonpath if (m := _mapped(planned, e))}
    pythonpath = [str(code / KIT), *(mapped.get(e, e) for e in planned.pythonpath)]
    parts = [(str(part.source), part.copy) for part in planned.parts]

    def held(source: str) -> Path | None:
        found = _in_parts(source, parts)
        return None if found is None else code.joinpath(*PurePosixPath(found).parts)

    workdir = code / copy if copy else Path.cwd()
    return JobCode(workdir, list(dict.fromkeys(pythonpath)), held)


def _in_parts(source: str, parts: list[tuple[str, str]]) -> str | None:
    """Where the absolute `source` lies under code/ ('/'-separated), by the innermost part
    whose source holds it; None where none does."""
    if not os.path.isabs(source):
        return None
    real = os.path.realpath(source)
    for part_source, copy in sorted(parts, key=lambda p: len(p[0]), reverse=True):
        inside = under(real, Path(part_source))
        if inside is not None:
            return f"{copy}/{inside}".rstrip("/")
    return None


def setup_lines(run_dir: Path) -> list[str]:
    """The shell lines that start a job's tasks in the copy (`JobCode.lines`, from the
    launcher's own PYTHONPATH, which the job inherits); none without a snapshot."""
    code = job_code(run_dir)
    return code.lines() if code else []


def planned_setup_lines(planned: Plan, run_dir: Path) -> list[str]:
    """The `setup_lines` of a run folder not made yet, given the snapshot it would get."""
    code = planned_job_code(planned, run_dir)
    return code.lines() if code else []


def program_in_copy(code: JobCode | None, argv: list[str]) -> list[str]:
    """A program's words with its command and its Python script, where named by an absolute
    path the copy holds, replaced by their copies (relative ones are read in the copy of the
    launching folder already): an edit after submission changes neither."""
    if code is None or not argv:
        return argv
    script = python_script(argv)
    swapped = []
    for at, word in enumerate(argv):
        named = at == 0 or word == script
        copy = code.held(word) if named else None
        swapped.append(str(copy) if copy is not None and copy.is_file() else word)
        if word == script:
            script = None  # its first place only
    return swapped


def copied(run_dir: Path) -> bool:
    """Whether the run's jobs run a copy of the code (its manifest read and checked)."""
    manifest = read_manifest(run_dir)
    return bool(manifest and manifest["copied"])


def _inside(run_dir: Path, rel: str, manifest: Path) -> Path:
    """code/`rel`, where it names a folder or file inside code/ (no '..', not absolute, and
    through no link leading out of it)."""
    code = runfolder.code_dir(run_dir)
    path = code.joinpath(*_rel_parts(rel, manifest))
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(code)):
        raise SnapshotError(_damaged(manifest, f"{path} leads out of code/"))
    if not path.exists():
        raise SnapshotError(_damaged(manifest, f"{path} is not in the copy"))
    return path


def _rel_parts(rel: str, manifest: Path) -> tuple[str, ...]:
    """The parts of a path under code/ the manifest names: no '..', not absolute."""
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or ".." in parts or "\0" in rel:
        raise SnapshotError(_damaged(manifest, f"it names {rel[:200]!r}, not a path inside code/"))
    return parts


def describe(run_dir: Path) -> str:
    """Which code the run's jobs run, in one line (for `launch resume` and `launch status`)."""
    code = runfolder.code_dir(run_dir)
    manifest = read_manifest(run_dir)
    if manifest is None and code.exists():
        return f"code: the live checkout (the copy in {code} was cut short: it has no manifest)"
    if manifest is None:
        return "code: the live checkout (no snapshot: the run was made without one)"
    if not manifest["copied"]:
        return f"code: the live checkout (no snapshot: {_why_not(manifest)})"
    made = _when(manifest["made_at"])
    return f"code: the copy made at submission ({code}: {_contents(manifest)}, copied {made})"


def describe_plan(planned: Plan) -> str:
    """Which code a submission's jobs will run, in one line (for the dry run)."""
    if not planned.copies:
        why = {"why": planned.why, "bytes": planned.bytes, "max_mb": planned.code.max_mb}
        return f"code: the live checkout (no snapshot: {_why_not(why, 'is')})"
    counted = [(len(part.entries), part.bytes) for part in planned.parts]
    return f"code: a copy made at submission ({_contents(manifest_of(planned, counted))})"


def _why_not(manifest: Mapping[str, Any], verb: str = "was") -> str:
    if manifest["why"] == "over":
        return (
            f"the code {verb} {size_words(manifest['bytes'])}, over code.max_mb={manifest['max_mb']}: "
            "raise code.max_mb to copy it"
        )
    if manifest["why"] == CONTAINER:
        return "a container runs the code it mounts from the checkout"
    return "code.snapshot=off"


def _contents(manifest: Mapping[str, Any]) -> str:
    """'212 files, 1.3 MB; project /x at git 1a2b3c4 with uncommitted changes; 1 folder'."""
    words = [f"{manifest['files']:,} files, {size_words(manifest['bytes'])}"]
    for part in manifest["parts"]:
        if part["copy"] == PROJECT:
            at = f"at git {part['commit'][:7]}" if part["commit"] else "before its first commit"
            changes = {True: " with uncommitted changes", False: "", None: ""}[part["changed"]]
            words.append(f"project {_shown(part['source'])} {at}{changes}")
    folders = sum(1 for part in manifest["parts"] if part["copy"].startswith(f"{FOLDERS}/"))
    if folders:
        words.append(f"{folders} folder{'s' * (folders > 1)} of code.folders")
    if len(words) == 1:
        words.append("the kit alone")
    return "; ".join(words)


def _shown(text: str) -> str:
    """Text from a run folder, printable: no character that would move the terminal."""
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


def size_words(size: int) -> str:
    return f"{size / 1024:.0f} kB" if size < MB else f"{size / MB:.1f} MB"


def _when(stamp: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return "at an unknown time"
    return moment.strftime("%Y-%m-%d %H:%M UTC")
