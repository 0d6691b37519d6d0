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

import dataclasses
import datetime
import errno
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.schema import CodeConfig, Config, Snapshot

SCHEMA = 1  # of manifest.json; a reader refuses a newer one

# code/'s parts: the kit's package copies to kit/slurm_ddp_kit, so that kit/ on PYTHONPATH
# imports it (and nothing of the checkout's top: a `train` of its there would shadow the user's).
KIT, PROJECT, FOLDERS = "kit", "project", "folders"
PACKAGE = Path(__file__).resolve().parents[1]  # this kit's slurm_ddp_kit/

# The package data a wheel ships inside the package, and where a checkout keeps it (pyproject.toml's
# package-dir and package-data): the job's copy of the kit holds it either way.
KIT_DATA = {"sbatch": ("slurm", (".sbatch",)), "examples": ("docs/examples", (".yaml", ".py"))}

# Not code: a folder of code.folders is copied without its version control's store and caches.
NOT_CODE = {".git", "__pycache__"}

MB = 1 << 20
MAX_MANIFEST = 1 << 20  # bytes: the kit's own is a few kB (a part and a path entry a line each)
GIT_TIMEOUT_S = 120
SUBMODULE_DEPTH = 8  # repositories in repositories, followed this deep

log = logging.getLogger("kit")


class SnapshotError(KitError):
    """The code cannot be copied, or a run's copy cannot be used; the message names the fix."""


@dataclasses.dataclass
class Entry:
    """One thing to copy: a regular file (`size` bytes), or a link to something copied."""

    source: str  # absolute
    path: str  # in the part's copy, '/'-separated
    size: int = 0
    link: str | None = None  # a link's target, relative to its folder in the copy


@dataclasses.dataclass
class Part:
    """One source of code and its place under code/."""

    source: Path  # its real path
    copy: str  # under code/: kit/slurm_ddp_kit, project, folders/1-mylib
    entries: list[Entry]
    folders: set[str]  # the folders the copy holds ('' its top), which paths may be mapped to
    left_out: list[str]  # links leading out of the copy, and what is no file nor folder
    commit: str | None = None  # the repository's HEAD (project only)
    changed: bool | None = None  # whether its tree differs from HEAD (untracked files count)

    @property
    def bytes(self) -> int:
        return sum(entry.size for entry in self.entries)


@dataclasses.dataclass
class Plan:
    """What a submission's snapshot copies, counted; `why`: why nothing is copied ('' where it
    is: 'off', or 'over' code.max_mb)."""

    code: CodeConfig
    workdir: Path  # the launching folder, real
    pythonpath: list[str]  # the launching PYTHONPATH's entries, as written
    parts: list[Part]
    why: str = ""

    @property
    def copies(self) -> bool:
        return not self.why

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    @property
    def files(self) -> int:
        return sum(len(part.entries) for part in self.parts)


# ---------------------------------------------------------------- what is copied, counted


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
    not_code = [_real(where, root) for root in (cfg.output.root, cfg.data.root)]
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


def kit_part() -> Part:
    """The kit's package: its modules and the package data it ships (from the checkout's own
    folders where it runs from a checkout, which holds them outside the package)."""
    names = [
        rel
        for rel, kind in _walk(PACKAGE)
        if kind == "file" and rel.endswith(".py")  # no stray file of a checkout's package folder
    ]
    part = _gather(PACKAGE, names, f"{KIT}/{PACKAGE.name}")
    for sub, (checkout_folder, suffixes) in KIT_DATA.items():
        folder = PACKAGE / sub if (PACKAGE / sub).is_dir() else PACKAGE.parent / checkout_folder
        if not folder.is_dir():
            continue  # an install without it: the jobs never need it
        with os.scandir(folder) as found:
            for item in sorted(found, key=lambda e: e.name):
                if item.name.endswith(suffixes) and item.is_file(follow_symlinks=False):
                    path = f"{sub}/{item.name}"
                    if path not in part.folders and all(e.path != path for e in part.entries):
                        size = item.stat(follow_symlinks=False).st_size
                        part.entries.append(Entry(item.path, path, size))
        part.folders.add(sub)
    return part


def project_part(workdir: Path, not_code: list[str]) -> list[Part]:
    """The git repository `workdir` lies in, as git lists its files: tracked ones with what the
    working tree holds, and untracked ones that are not ignored ([] outside a repository)."""
    if shutil.which("git") is None:
        if any((folder / ".git").exists() for folder in [workdir, *workdir.parents]):
            log.warning(
                "warning: %s lies in a git repository, but git is not installed here: its code "
                "is not copied, and the jobs run it live; install git, or name the folders to "
                "copy in code.folders",
                workdir,
            )
        return []
    top = _git(workdir, "rev-parse", "--show-toplevel")
    if top is None:
        return []
    root = Path(os.path.realpath(os.fsdecode(top.removesuffix(b"\n"))))
    part = _gather(root, _outside(_git_files(root), root, not_code), PROJECT)
    head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD")  # none before a first commit
    part.commit = head.decode().strip() if head else None
    part.changed = _changed(root, not_code)
    return [part]


def _changed(root: Path, not_code: list[str]) -> bool | None:
    """Whether the working tree differs from HEAD (an untracked file that is not ignored counts:
    it is copied, and no commit holds it), runs and data apart; None where git cannot say."""
    status = _git(root, "status", "--porcelain", "-z", "--untracked-files=normal")
    if status is None:
        return None
    paths, words = [], iter(status.split(b"\0"))
    for word in words:  # `XY path`, and a rename's or copy's origin as a word of its own
        if len(word) > 3:
            paths.append(os.fsdecode(word[3:]).rstrip("/"))
            if b"R" in word[:2] or b"C" in word[:2]:
                next(words, None)
    return bool(_outside(paths, root, not_code))


def folder_parts(folders: list[str], workdir: Path, not_code: list[str]) -> list[Part]:
    """Each folder of code.folders (relative ones from the launching folder), whole but for its
    .git and __pycache__ folders and the folders of `not_code`."""
    parts = []
    for number, folder in enumerate(folders, 1):
        path = Path(workdir, os.path.expanduser(folder))
        if not path.is_dir():
            raise SnapshotError(
                f"code.folders names {folder}, and {path} is no folder: give each folder of code "
                "to copy, absolute or relative to where you launch, or drop it from code.folders"
            )
        real = Path(os.path.realpath(path))
        name = re.sub(r"[^A-Za-z0-9._-]", "_", real.name) or "root"
        skip = {rel for folder in not_code if (rel := _under(folder, real))}
        names = [rel for rel, _ in _walk(real, skip)]
        parts.append(_gather(real, names, f"{FOLDERS}/{number}-{name}"))
    return parts


def _walk(root: Path, skip: Collection[str] = ()) -> Iterator[tuple[str, str]]:
    """(path under root, 'file' | 'other') of everything below `root` but folders (and those of
    `skip`, paths under root), through no link to a folder (a link is listed, as 'other', for
    `_gather` to judge)."""
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            found = list(os.scandir(root / rel))
        except OSError as err:
            raise SnapshotError(
                f"cannot read {root / rel} ({err.strerror}) to copy it: make it readable, or "
                "leave it out of code.folders"
            ) from None
        for item in found:
            path = f"{rel}/{item.name}".lstrip("/")
            if item.is_dir(follow_symlinks=False):
                if item.name not in NOT_CODE and path not in skip:
                    pending.append(path)
            elif not item.name.endswith(".pyc"):  # compiled: Python compiles the copy anew
                yield path, "file" if item.is_file(follow_symlinks=False) else "other"


def _real(workdir: Path, setting: str) -> str:
    """A path setting's real path (relative ones from the launching folder)."""
    return os.path.realpath(Path(workdir, os.path.expanduser(setting)))


def _outside(names: list[str], root: Path, not_code: list[str]) -> list[str]:
    """The paths under root that lie in no folder of `not_code` (one that is root itself, or
    holds it, takes nothing away: output.root=. puts the runs beside the code, not the code in
    the runs)."""
    folders = tuple(f"{rel}/" for folder in not_code if (rel := _under(folder, root)))
    return [name for name in names if not f"{name}/".startswith(folders)]


def _git_files(root: Path, depth: int = 0) -> list[str]:
    """The repository's files as git lists them, a submodule's (or a repository's inside it)
    listed by its own git, as paths under root."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is None:
        raise SnapshotError(
            f"git cannot list the files of {root}: fix the repository (run `git status` there "
            "to see why), or set code.snapshot=off"
        )
    paths = []
    for name in dict.fromkeys(os.fsdecode(p).rstrip("/") for p in listed.split(b"\0") if p):
        inner = root / name
        if depth < SUBMODULE_DEPTH and not inner.is_symlink() and (inner / ".git").exists():
            paths += [f"{name}/{path}" for path in _git_files(inner, depth + 1)]
        else:
            paths.append(name)  # unmerged paths are listed once per stage: once is enough
    return paths


def _git(folder: Path, *args: str) -> bytes | None:
    """git's output in `folder`, or None where it fails (not a repository, say)."""
    # No optional locks: `git status` would otherwise refresh the index, racing the user's git.
    environment = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args],
            capture_output=True,
            env=environment,
            timeout=GIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise SnapshotError(
            f"git {args[0]} took over {GIT_TIMEOUT_S} s in {folder}: the repository is too large "
            "to copy at every submission; set code.snapshot=off, or name smaller folders in "
            "code.folders and launch from outside the repository"
        ) from None
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def _gather(root: Path, names: Iterable[str], copy: str) -> Part:
    """A part of these paths under `root`: regular files, and links to what the part copies.
    Deleted files (git still lists them) are passed over; a path through a link to a folder, a
    link leading out, and anything that is no file (a pipe, a socket, a device) are left out."""
    part = Part(root, copy, [], {""}, [])
    links: dict[str, str] = {}
    real_folders: dict[str, bool] = {}
    for name in names:
        folder = os.path.dirname(name)
        if folder not in real_folders:  # never read through a link to a folder: it may lead out
            real_folders[folder] = os.path.realpath(root / folder) == str(root / folder)
        try:
            info = os.lstat(root / name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            raise SnapshotError(
                f"cannot read {root / name} ({err.strerror}) to copy it: make it readable, or "
                "set code.snapshot=off"
            ) from None
        if not real_folders[folder]:
            part.left_out.append(name)
        elif stat.S_ISREG(info.st_mode):
            part.entries.append(Entry(str(root / name), name, info.st_size))
        elif stat.S_ISLNK(info.st_mode):
            links[name] = os.path.realpath(root / name)
        elif not stat.S_ISDIR(info.st_mode):  # a folder: a submodule not checked out, empty
            part.left_out.append(name)
    part.folders |= {str(p) for e in part.entries for p in PurePosixPath(e.path).parents} - {"."}
    copied = {entry.path for entry in part.entries} | part.folders
    for name, target in links.items():
        inside = _under(target, root)
        if inside is not None and inside in copied:  # relative: it leads to the copy's own
            text = os.path.relpath(inside or ".", os.path.dirname(name) or ".")
            part.entries.append(Entry(str(root / name), name, 0, text))
        else:
            part.left_out.append(name)
    return part


def _under(path: str, root: Path) -> str | None:
    """`path` (real) relative to `root` (real), '' for root itself; None where it lies outside."""
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../"):
        return None
    return "" if rel == "." else rel


def _over(planned: Plan) -> str:
    """'the code to copy is … MB, over code.max_mb=…', naming its largest part and file."""
    part = max(planned.parts, key=lambda p: p.bytes)
    largest = max(part.entries, key=lambda e: e.size)
    return (
        f"the code to copy is {_size(planned.bytes)}, over code.max_mb={planned.code.max_mb} (of "
        f"it {part.source}: {_size(part.bytes)} in {len(part.entries):,} files, the largest "
        f"{largest.path} of {_size(largest.size)})"
    )


def _enough_mb(size: int) -> int:
    return max(64, -(-size // MB) * 2)


# ---------------------------------------------------------------- the copy


def take(run_dir: Path, planned: Plan) -> None:
    """Copy the planned code into the run folder's code/, then write its manifest (atomically,
    last: a code/ without one was cut short, and is never used). Where the plan copies nothing,
    the manifest says why (and a copy that was too large is said in one warning line)."""
    code = runfolder.code_dir(run_dir)
    try:
        code.mkdir()  # never into an existing copy: a run's code is made once
    except OSError as err:
        raise SnapshotError(
            f"could not make {code}: {err.strerror or err}; the code is copied once, into a new "
            "run folder: start a new run"
        ) from None
    try:
        if planned.copies:
            counted = [_copy_part(code, part) for part in planned.parts]
            manifest = _manifest(planned, counted)
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


def _manifest(planned: Plan, counted: list[tuple[int, int]]) -> dict[str, Any]:
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
        inside = _under(real, part.source)  # the innermost part first: a folder in the project
        if inside is not None and (
            inside in part.folders or any(e.path == inside for e in part.entries)
        ):
            return f"{part.copy}/{inside}".rstrip("/")
    return None


# ---------------------------------------------------------------- a sweep's runs share one


def share(source_run: Path, run_dir: Path) -> None:
    """Give `run_dir` the code snapshot of `source_run` (a sweep's first run): hard links to the
    same files, so a sweep of 100 runs copies the bytes once (a copy where the two lie on
    different file systems). The manifest comes last, as in `take`. A job that writes into a
    file of its copy writes into every run's: the copies are for reading."""
    source, code = runfolder.code_dir(source_run), runfolder.code_dir(run_dir)
    manifest = runfolder.code_manifest(source_run)
    if read_manifest(source_run) is None:
        raise SnapshotError(
            f"{source_run} holds no whole code snapshot to share (no {manifest.name}): take one "
            "for this run instead"
        )
    try:
        code.mkdir()  # never into an existing copy, as `take`
    except OSError as err:
        raise SnapshotError(
            f"could not make {code}: {err.strerror or err}; the code is copied once, into a new "
            "run folder: start a new run"
        ) from None
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


# ---------------------------------------------------------------- reading a run's copy back


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


def job_paths(
    run_dir: Path, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[Path, list[str]]:
    """Where a task of the run starts and its PYTHONPATH's entries: with a snapshot, the copy of
    the launching folder (else the task's own, `cwd`) and the copy's kit/ first, then the task's
    own PYTHONPATH (`environ`'s) with each entry that was copied replaced by its copy. Without
    one (code.snapshot=off, or a run made before snapshots): the task's own, unchanged.

    Only paths inside code/ are taken from the manifest: an entry it does not map is the task's
    own (a crafted manifest cannot point the task at code the launcher never chose)."""
    environ = os.environ if environ is None else environ
    own_dir = cwd or Path.cwd()
    own_path = environ.get("PYTHONPATH", "")
    entries = own_path.split(os.pathsep) if own_path else []
    manifest = read_manifest(run_dir)
    if manifest is None or not manifest["copied"]:
        return own_dir, entries
    path = runfolder.code_manifest(run_dir)
    kit = str(_inside(run_dir, KIT, path))
    mapped = {
        record["source"]: str(_inside(run_dir, record["copy"], path))
        for record in manifest["pythonpath"]
        if record["copy"] is not None
    }
    copy = manifest["workdir"]["copy"]
    workdir = own_dir if copy is None else _inside(run_dir, copy, path)
    pythonpath = [kit, *(mapped.get(entry, entry) for entry in entries)]
    return workdir, list(dict.fromkeys(pythonpath))  # a task's child may ask again: kit/ once


def _inside(run_dir: Path, rel: str, manifest: Path) -> Path:
    """code/`rel`, where it names a folder or file inside code/ (no '..', not absolute, and
    through no link leading out of it)."""
    code = runfolder.code_dir(run_dir)
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or ".." in parts or "\0" in rel:
        raise SnapshotError(_damaged(manifest, f"it names {rel[:200]!r}, not a path inside code/"))
    path = code.joinpath(*parts)
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(code)):
        raise SnapshotError(_damaged(manifest, f"{path} leads out of code/"))
    if not path.exists():
        raise SnapshotError(_damaged(manifest, f"{path} is not in the copy"))
    return path


# ---------------------------------------------------------------- in words


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
    return f"code: a copy made at submission ({_contents(_manifest(planned, counted))})"


def _why_not(manifest: Mapping[str, Any], verb: str = "was") -> str:
    if manifest["why"] == "over":
        return (
            f"the code {verb} {_size(manifest['bytes'])}, over code.max_mb={manifest['max_mb']}: "
            "raise code.max_mb to copy it"
        )
    return "code.snapshot=off"


def _contents(manifest: Mapping[str, Any]) -> str:
    """'212 files, 1.3 MB; project /x at git 1a2b3c4 with uncommitted changes; 1 folder'."""
    words = [f"{manifest['files']:,} files, {_size(manifest['bytes'])}"]
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


def _size(size: int) -> str:
    return f"{size / 1024:.0f} kB" if size < MB else f"{size / MB:.1f} MB"


def _when(stamp: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return "at an unknown time"
    return moment.strftime("%Y-%m-%d %H:%M UTC")
