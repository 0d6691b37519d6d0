"""The code a run's jobs run: a copy made at submission, in the run folder's code/.

Without it a job runs the live checkout, and an edit after `launch submit` changes what a queued,
a requeued or a resumed job runs. `plan` counts what would be copied before a byte is written (the
kit's package; the launching folder's git repository, its files as git lists them; the folders of
code.folders) and decides by code.snapshot and code.max_mb; `take` copies it into the run folder,
the manifest last; `share` gives a sweep's other runs the same copy through hard links; at a job's
start `job_paths` says where to start and what to import from; `describe` says in one line which
code a run runs (`describe_plan`: which it would run, for the dry run).

code/ holds kit/slurm_ddp_kit/ (first on the task's PYTHONPATH), project/ (the repository, paths
as from its top) and folders/<n>-<name>/; the manifest says what each came from. A run folder
lies on a shared file system, so the manifest is data: it is read with a size limit and its
types checked, and every path it yields lies inside code/ (paths are stored relative to it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.settings.schema import Config, Snapshot
from slurm_ddp_kit.core.snapshot.manifest import (
    SCHEMA,
    JobCode,
    copied,
    describe,
    describe_plan,
    job_code,
    job_paths,
    manifest_of,
    planned_job_code,
    planned_setup_lines,
    program_in_copy,
    read_manifest,
    setup_lines,
    size_words,
)
from slurm_ddp_kit.core.snapshot.sources import (
    KIT_DATA,
    MB,
    Entry,
    Part,
    Plan,
    SnapshotError,
    folder_parts,
    kit_part,
    log,
    project_part,
    real_path,
)


def plan(cfg: Config, workdir: Path | None = None, pythonpath: str | None = None) -> Plan:
    """What a snapshot of the code would copy, counted, nothing written. `workdir` and
    `pythonpath`: the launching folder and PYTHONPATH (this process's where not given). Over
    code.max_mb: with code.snapshot=auto a plan that copies nothing (`why` 'over'), with
    code.snapshot=on a SnapshotError naming the fix. output.root and data.root are never
    copied: runs/ and data/ inside a repository, and not ignored there, are no code."""
    code = cfg.code
    where = Path(os.path.realpath(workdir or os.getcwd()))
    path = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    entries = path.split(os.pathsep) if path else []
    if code.snapshot == Snapshot.off:
        return Plan(code, where, entries, [], why="off")
    not_code = [real_path(where, root) for root in (cfg.output.root, cfg.data.root)]
    parts = [
        kit_part(),
        *project_part(where, not_code),
        *folder_parts(code.folders, where, not_code),
    ]
    planned = Plan(code, where, entries, parts)
    if planned.bytes > code.max_mb * MB:
        if code.snapshot == Snapshot.on:
            raise SnapshotError(
                f"code.snapshot=on: {_over(planned)}: raise code.max_mb (e.g. "
                f"code.max_mb={_enough_mb(planned.bytes)}), keep large files out of the copy (in "
                ".gitignore, or out of code.folders), or set code.snapshot=auto to run the live "
                "code when the copy would be too large"
            )
        planned.why = "over"
    return planned


# The package's face: what the launcher, the job start and the tests use.
__all__ = [
    "KIT_DATA",
    "Entry",
    "JobCode",
    "Part",
    "Plan",
    "SnapshotError",
    "copied",
    "describe",
    "describe_plan",
    "folder_parts",
    "job_code",
    "job_paths",
    "kit_part",
    "plan",
    "planned_job_code",
    "planned_setup_lines",
    "program_in_copy",
    "project_part",
    "read_manifest",
    "setup_lines",
    "share",
    "take",
]


def _over(planned: Plan) -> str:
    """'the code to copy is … MB, over code.max_mb=…', naming its largest part and file."""
    part = max(planned.parts, key=lambda p: p.bytes)
    largest = max(part.entries, key=lambda e: e.size)
    return (
        f"the code to copy is {size_words(planned.bytes)}, over code.max_mb={planned.code.max_mb} (of "
        f"it {part.source}: {size_words(part.bytes)} in {len(part.entries):,} files, the largest "
        f"{largest.path} of {size_words(largest.size)})"
    )


def _enough_mb(size: int) -> int:
    return max(64, -(-size // MB) * 2)


def take(run_dir: Path, planned: Plan) -> None:
    """Copy the planned code into the run folder's code/, then write its manifest (atomically,
    last: a code/ without one was cut short, and is never used). Where the plan copies nothing,
    the manifest says why (and a copy that was too large is said in one warning line)."""
    code = _new_code_dir(run_dir)
    try:
        if planned.copies:
            counted = [_copy_part(code, part) for part in planned.parts]
            manifest = manifest_of(planned, counted)
        else:
            manifest = {"schema": SCHEMA, "copied": False, "why": planned.why}
            manifest |= {"bytes": planned.bytes, "max_mb": planned.code.max_mb}
        with runfolder.atomic_file(runfolder.code_manifest(run_dir)) as partial:
            partial.write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException as err:
        shutil.rmtree(code, ignore_errors=True)  # no half copy left behind
        if isinstance(err, OSError):  # a full disk, a quota
            raise SnapshotError(
                f"could not copy the code into {code}: {err.strerror or err}; free space there, "
                "or set code.snapshot=off to run the live code"
            ) from None
        raise
    if planned.why == "over":
        log.warning(
            "warning: %s, so it was not copied: the jobs run the live code, and an edit before "
            "they start changes what they run; raise code.max_mb to copy it, or set "
            "code.snapshot=off to run the live code without this warning",
            _over(planned),
        )
    left_out = [f"{part.copy}/{name}" for part in planned.parts for name in part.left_out]
    if planned.copies and left_out:
        more = f" and {len(left_out) - 1} more" if len(left_out) > 1 else ""
        log.warning(
            "warning: the code's copy leaves out %s%s: a link leading out of what is copied, or "
            "no regular file; a job that reads it finds nothing there (name the folder it leads "
            "to in code.folders, or make the link lead inside the repository)",
            left_out[0],
            more,
        )


def _copy_part(code: Path, part: Part) -> tuple[int, int]:
    """Copy one part under code/; (files, bytes) as copied (a file may change meanwhile)."""
    files = size = 0
    top = code / part.copy
    for entry in part.entries:
        target = top / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.link is not None:
            os.symlink(entry.link, target)
        else:
            copied = _copy_file(entry.source, target)
            if copied is None:
                continue  # deleted or replaced since it was counted
            size += copied
        files += 1
    top.mkdir(parents=True, exist_ok=True)  # an empty part is a folder still
    return files, size


def _copy_file(source: str, target: Path) -> int | None:
    """Copy a regular file with its mode bits (an executable script stays one): its bytes, or
    None where it is gone or no longer a regular file (read through no link)."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None
        raise
    with os.fdopen(fd, "rb") as reader:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(target, flags, 0o600), "wb") as writer:
            shutil.copyfileobj(reader, writer, MB)
            os.fchmod(writer.fileno(), stat.S_IMODE(info.st_mode) & 0o777)
            return writer.tell()


def share(source_run: Path, run_dir: Path) -> None:
    """Give `run_dir` the code snapshot of `source_run` (a sweep's first run): hard links to the
    same files, so a sweep of 100 runs copies the bytes once (a copy where the two lie on
    different file systems). The manifest comes last, as in `take`. A job that writes into a
    file of its copy writes into every run's: the copies are for reading."""
    source = runfolder.code_dir(source_run)
    manifest = runfolder.code_manifest(source_run)
    if read_manifest(source_run) is None:
        raise SnapshotError(
            f"{source_run} holds no whole code snapshot to share (no {manifest.name}): take one "
            "for this run instead"
        )
    code = _new_code_dir(run_dir)
    try:
        for rel, kind in _walk_copy(source):
            target = code / rel
            if kind == "folder":
                target.mkdir()
            elif kind == "link":
                os.symlink(os.readlink(source / rel), target)
            else:
                _link_or_copy(source / rel, target)
        # The manifest last, whole or not at all (a few kB: written, not linked).
        with runfolder.atomic_file(runfolder.code_manifest(run_dir)) as partial:
            partial.write_bytes(manifest.read_bytes())
    except BaseException as err:
        shutil.rmtree(code, ignore_errors=True)  # no half copy left behind
        if isinstance(err, OSError):
            raise SnapshotError(
                f"could not share {source} with {run_dir}: {err.strerror or err}; free space "
                "there, or set code.snapshot=off to run the live code"
            ) from None
        raise


def _walk_copy(code: Path) -> Iterator[tuple[str, str]]:
    """(path under code/, 'folder' | 'link' | 'file') of a copy, folders before what they hold;
    not its manifest (nor a partial one), nor what a job compiled into it."""
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(code / rel) as found:
            for item in sorted(found, key=lambda e: e.name):
                path = f"{rel}/{item.name}".lstrip("/")
                if item.name == "__pycache__" or (not rel and item.name.startswith(".")):
                    continue
                if not rel and path == os.path.basename(runfolder.CODE_MANIFEST):
                    continue
                if item.is_symlink():
                    yield path, "link"
                elif item.is_dir():
                    yield path, "folder"
                    pending.append(path)
                elif item.is_file():
                    yield path, "file"


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as err:  # another file system, or one without hard links
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        if _copy_file(str(source), target) is None:
            raise SnapshotError(
                f"{source} was removed or replaced while it was shared: a run folder's code is "
                "not to be edited; start the sweep anew"
            ) from None


def _new_code_dir(run_dir: Path) -> Path:
    """The run folder's code/, made now: never into an existing copy (a run's code is made once)."""
    code = runfolder.code_dir(run_dir)
    try:
        code.mkdir()
    except OSError as err:
        raise SnapshotError(
            f"could not make {code}: {err.strerror or err}; the code is copied once, into a new "
            "run folder: start a new run"
        ) from None
    return code
