"""What a snapshot copies: the kit's package, the files git lists of the project, and the folders of
code.folders; counted, never copied here (`take` copies)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path, PurePosixPath

from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.schema import CodeConfig

PACKAGE = Path(__file__).resolve().parents[2]  # this kit's slurm_ddp_kit/


# code/'s parts: the kit's package copies to kit/slurm_ddp_kit, so that kit/ on PYTHONPATH
# imports it (and nothing of the checkout's top: a `train` of its there would shadow the user's).
KIT, PROJECT, FOLDERS = "kit", "project", "folders"
# Why a run made by an earlier kit has no copy, besides code.snapshot=off and code.max_mb: it
# ran in a container (whose tasks run the copy now); read back, never written.
CONTAINER = "container"


# The package data a wheel ships inside the package, and where a checkout keeps it (pyproject.toml's
# package-dir and package-data): the job's copy of the kit holds it either way.
KIT_DATA = {"sbatch": ("slurm", (".sbatch",)), "examples": ("docs/examples", (".yaml", ".py"))}


# Not code: a folder of code.folders is copied without its version control's store and caches.
NOT_CODE = {".git", "__pycache__"}


MB = 1 << 20


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
        skip = {rel for folder in not_code if (rel := under(folder, real))}
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


def real_path(workdir: Path, setting: str) -> str:
    """A path setting's real path (relative ones from the launching folder)."""
    return os.path.realpath(Path(workdir, os.path.expanduser(setting)))


def _outside(names: list[str], root: Path, not_code: list[str]) -> list[str]:
    """The paths under root that lie in no folder of `not_code` (one that is root itself, or
    holds it, takes nothing away: output.root=. puts the runs beside the code, not the code in
    the runs)."""
    folders = tuple(f"{rel}/" for folder in not_code if (rel := under(folder, root)))
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
        inside = under(target, root)
        if inside is not None and inside in copied:  # relative: it leads to the copy's own
            text = os.path.relpath(inside or ".", os.path.dirname(name) or ".")
            part.entries.append(Entry(str(root / name), name, 0, text))
        else:
            part.left_out.append(name)
    return part


def under(path: str, root: Path) -> str | None:
    """`path` (real) relative to `root` (real), '' for root itself; None where it lies outside."""
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../"):
        return None
    return "" if rel == "." else rel
