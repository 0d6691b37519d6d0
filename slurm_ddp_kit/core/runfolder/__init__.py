"""The run folder: the one module that knows its layout, its records and their schema.

`launch` creates it, `train` fills it from inside the job, `analysis` and `launch status` read it;
all of them ask this module for every path and record (contract: docs/run-folder.md). It imports
neither torch nor OmegaConf, so readers of thousands of runs stay fast.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import glob
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import processes, slurm
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.runfolder.checks import MAX_RANKS, misfit, misfit_fields
from slurm_ddp_kit.core.settings.loading import from_dict, load_config, to_dict, to_yaml
from slurm_ddp_kit.core.settings.schema import Config

SCHEMA = 1  # of run.json and of every record; a reader refuses a newer one, naming the fix


CONFIG = "config.yaml"  # the resolved settings, for people and for the job


SWEEPS = "sweeps"  # beside a sweep's run folders: its array's logs, one folder per sweep


META = "run.json"  # who made the run, its job, and the settings again as JSON for fast readers


METRICS = "metrics"  # one JSON-lines file per rank


LOGS = "logs"


SRUN_LOG = "srun.err"  # under logs/: srun's own messages, copied there by the sbatch scripts


CHECKPOINT = "checkpoints/model.pt"  # the bare model's weights


STATE = "checkpoints/state.pt"  # the whole training state a job resumes from


# A sharded strategy's (FSDP's) model and optimizer state: one torch.distributed.checkpoint
# folder per save, each rank writing its own shards; state.pt names the one it belongs to.
SHARDS = "checkpoints/shards"


PROGRAM_CHECKPOINTS = "checkpoints/program"  # a user's program saves here (slurm_ddp_kit)


# Under logs/: the port a local job's rendezvous store took, for its other processes to read.
STORE_PORT = "store-{job}.port"


# The code the run's jobs run, copied at submission (core.snapshot): kit/, project/, folders/.
CODE = "code"


CODE_MANIFEST = "code/manifest.json"  # written last: a code/ without it is cut short, never used


CLAIM = ".submitting"  # locked while a launcher checks the folder is free and submits into it


# `log`: a user's program's own record (`slurm_ddp_kit.log`), its values under `fields`.
KINDS = ("start", "epoch", "progress", "notice", "stop", "error", "summary", "log")


ENDS = ("error", "summary", "stop")  # the kinds a rank's attempt ends with


_PLAIN_PATH = re.compile(r"[A-Za-z0-9@+=:,./_-]+")  # needs no shell quoting; no Slurm % pattern


log = logging.getLogger("kit")


class RunFolderError(KitError):
    """A path is not a readable run folder of this kit's schema; the message names the fix."""


def check_root(root: str | Path) -> Path:
    """The output root, absolute, after checking a run folder can be made there (nothing made)."""
    path = expand("output.root", root)
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise RunFolderError(
            f"output.root={root} cannot hold run folders: {existing} is a file. Point output.root "
            "at a folder, e.g. output.root=runs"
        )
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_make_folder_in(existing):
        raise RunFolderError(
            f"output.root={root}: {existing} is not writable by this user; pick a folder you "
            "can write, e.g. output.root=$HOME/runs"
        )
    if not _PLAIN_PATH.fullmatch(str(path)):
        raise RunFolderError(
            f"output.root={path} holds a character that Slurm's log patterns or the shell would "
            "rewrite (a space, %, quotes, $ …): use letters, digits and @+=:,./_- only"
        )
    return path


def expand(key: str, value: str | Path) -> Path:
    """The setting's path, absolute, with ~ and ~user expanded."""
    try:
        return Path(value).expanduser().resolve()
    except RuntimeError:  # ~user of a user this machine does not know
        raise RunFolderError(
            f"{key}={value}: {str(value).split('/')[0]} names no user on this machine; write the "
            "path in full"
        ) from None


def _can_make_folder_in(folder: Path) -> bool:
    """Try it (root passes os.access even where mkdir fails, e.g. under /proc or /sys); the trial
    folder is removed at once."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kit-check-", dir=folder))
    except OSError:
        return False
    return True


def new_name(cfg: Config) -> str:
    """<UTC time>-<mode>-<nodes>n<gpus>g[-<output.name>]-<4 hex>: unique, sortable by time."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    shape = f"{cfg.cluster.nodes}n{cfg.cluster.gpus_per_node}g"
    parts = [stamp, cfg.mode, shape, cfg.output.name, secrets.token_hex(2)]
    return "-".join(filter(None, parts))


def create(cfg: Config, launcher: str, backend: str, command: list[str]) -> Path:
    """Make a new run folder with the resolved config (paths made absolute) and run.json.

    Written under a hidden staging name and renamed into place, so a reader never sees a run
    folder without its config.
    """
    root = check_root(cfg.output.root)
    cfg.output.root = str(root)
    cfg.data.root = str(expand("data.root", cfg.data.root))  # the job may start elsewhere
    made = folders_to_make(root)
    staging = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clear_stale_staging(root)
        staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(), dir=root))
        staging.chmod(0o777 & ~_umask())  # as mkdir makes it: the group may read runs
        (staging / CONFIG).write_text(to_yaml(cfg))
        (staging / LOGS).mkdir()
        return _publish(staging, cfg, launcher, backend, command)
    except BaseException as err:
        if staging is not None:
            _remove_tree(staging)
        discard([], made)
        if isinstance(err, OSError):  # a full disk, a quota, a read-only mount
            raise RunFolderError(
                f"could not write a run folder in output.root={root}: {err.strerror or err}; "
                "free space there or point output.root at another folder"
            ) from None
        raise


def folders_to_make(root: str | Path) -> list[Path]:
    """The folders of output.root that do not exist yet, deepest first (for `discard`)."""
    path = expand("output.root", root)
    return [p for p in [path, *path.parents] if not p.exists()]


def discard(trees: list[Path], made: list[Path]) -> None:
    """Folders a refused submission made, removed: its run folders (no job ran in them), then
    those of `made` (deepest first) that are left empty."""
    for tree in trees:
        shutil.rmtree(tree, ignore_errors=True)
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


STAGING = ".staging-"  # then the host and PID that assemble the folder


def _staging_prefix() -> str:
    return f"{STAGING}{socket.gethostname()}-{os.getpid()}-"


def _clear_stale_staging(root: Path) -> None:
    """Remove the staging folders of launchers of this host that were killed while they made a
    run folder (SIGKILL, or SIGTERM's default: no clean-up ran). Another host's are left: its
    PIDs cannot be checked from here."""
    host = socket.gethostname()
    for staging in root.glob(f"{STAGING}{glob.escape(host)}-*"):
        pid = staging.name[len(STAGING) + len(host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not processes.alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


@functools.cache
def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def _publish(staging: Path, cfg: Config, launcher: str, backend: str, command: list[str]) -> Path:
    while True:
        run_dir = staging.parent / new_name(cfg)
        _write_json(staging / META, _meta(run_dir.name, cfg, launcher, backend, command))
        try:
            staging.rename(run_dir)  # fails rather than replace: an earlier run is never lost
            return run_dir
        except OSError:
            if not run_dir.exists():
                raise
            time.sleep(0.01)


def _meta(
    run_id: str, cfg: Config, launcher: str, backend: str, command: list[str]
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "run_id": run_id,
        "mode": cfg.mode,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "created_at": time.time(),  # the same instant, on the clock of the records' `time`
        "launcher": launcher,
        "backend": backend,
        "job_id": None,
        "host": socket.gethostname(),
        "command": command,
        "config": to_dict(cfg),
    }


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def _not_a_run_folder(path: Path) -> str:
    """Why `path` is no run folder, and which to pass: one of the runs it holds (a sweep's root,
    an output root), else one under the output root."""
    held = find_runs(path) if os.path.isdir(path) else []
    if not held:
        return (
            f"{path} is not a run folder (no {META}): pass a run folder (made under "
            "output.root, runs/ by default)"
        )
    return f"{path} is not a run folder but holds {len(held)}: pass one of them, e.g. {held[0]}"


# run.json's bounds: a run folder is data, and a reader of it must not recurse, allocate or parse
# without end for what a file holds. The kit's own nests 4 deep (config → cluster → sbatch_extra)
# and holds a few kB, or about 30 MB for a job of 100,000 ranks (two log paths each).
MAX_META = 64 << 20  # bytes
MAX_META_DEPTH = 16  # levels of lists and objects


def read_meta(run_dir: Path) -> dict[str, Any]:
    path = run_dir / META
    try:  # read first, ask why only when that fails: one system call less per run
        meta = json.loads(_read_bytes(path, MAX_META))
    except _TooLarge as err:
        raise RunFolderError(
            _damaged(path, f"is {err.size:,} bytes ({MAX_META:,} at most)")
        ) from None
    except RecursionError:  # json's decoder recurses once per level
        raise RunFolderError(_damaged(path, _TOO_DEEP)) from None
    except (OSError, ValueError) as err:
        if isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG:
            raise  # the path itself is refused: the command line says so (core.cli)
        if isinstance(err, OSError) and err.errno == errno.EACCES and not os.path.lexists(path):
            raise RunFolderError(
                f"{run_dir}: permission denied: pick a path this user can reach, or ask its "
                "owner for access"
            ) from None
        if not os.path.lexists(path):
            raise RunFolderError(_not_a_run_folder(run_dir)) from None
        raise RunFolderError(f"{path} cannot be read ({err}): the run folder is damaged") from None
    if _deeper_than(meta, MAX_META_DEPTH):  # every later reader of a field may recurse
        raise RunFolderError(_damaged(path, _TOO_DEEP))
    if not isinstance(meta, dict) or not isinstance(meta.get("schema"), int):
        raise RunFolderError(f"{path} is not a run record of this kit (no schema number)")
    if meta["schema"] > SCHEMA:
        raise RunFolderError(
            f"{path} has schema {meta['schema']}, newer than this kit's {SCHEMA}: "
            "read it with the newer kit that wrote it (pip install -U the kit)"
        )
    if misfit := misfit_fields(meta, _META_FIELDS) or _misfit_job_ids(meta):
        raise RunFolderError(f"{path} is damaged: {misfit}")
    return meta


_TOO_DEEP = f"nests lists or objects over {MAX_META_DEPTH} levels deep"


def _damaged(path: Path, what: str) -> str:
    """The line for a run.json over its bounds: more than the kit ever writes, so not its own."""
    return (
        f"{path} {what}, more than any run record of this kit: the run folder is damaged, or "
        f"was made so; put back a good copy of {META}, or start a new run"
    )


def _deeper_than(value: object, depth: int) -> bool:
    """Whether lists and objects nest more than `depth` levels in `value`: level by level, in a
    loop (recursion is what a crafted file would exhaust), keeping containers alone."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(depth):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


def _misfit_job_ids(meta: dict[str, Any]) -> str:
    """'' where every job id run.json names is a Slurm job id (a local job's PID is digits too):
    they become Slurm commands' arguments and log files' names, and a run folder is data."""
    for job in [meta.get("job_id"), *meta.get("jobs", [])]:
        if job is not None and not (isinstance(job, str | int) and slurm.is_job_id(str(job))):
            return (
                f"its job id {job!r} is not a Slurm job id (digits, or J_K for an array's "
                "element): nothing was passed to Slurm; put the job's own id back, or start a "
                "new run"
            )
    return ""


# run.json's fields that readers use, and the types each may have (see _FIELDS).
_META_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("run_id", "mode", "backend", "launcher", "created", "host"), (str,)),
    **dict.fromkeys(("job_id", "submit_error", "job_process"), (str, type(None))),
    **dict.fromkeys(("jobs", "logs", "command"), (list,)),
    "config": (dict,),
    "cancel_requested": (bool, type(None)),
    "created_at": (int, float),
}


def update_meta(run_dir: Path, **fields: Any) -> dict[str, Any]:
    meta = {**read_meta(run_dir), **fields}
    _write_json(run_dir / META, meta)
    return meta


@contextlib.contextmanager
def claimed(run_dir: Path, wait_s: float = 120) -> Iterator[None]:
    """One launcher at a time submits into a run folder: hold this while checking that no job of
    the folder is live and recording the job submitted, so that a second `launch resume` started
    at the same moment waits, then finds the first one's job and refuses. The lock (flock) goes
    with the process that holds it, a killed launcher's included."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    try:
        handle = os.fdopen(open_inside(run_dir, run_dir / CLAIM, flags), "a")
    except OSError as err:
        raise RunFolderError(f"cannot lock {run_dir} for the submission: {err.strerror}") from None
    with handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunFolderError(
                        f"another launcher has been submitting into {run_dir.name} for "
                        f"{wait_s:.0f} s: see `python -m launch status {run_dir}`"
                    ) from None
                time.sleep(0.1)
        yield


def read_config(run_dir: Path) -> Config:
    """The run's settings: from run.json (fast), else config.yaml (folders of older kits)."""
    return config_of(run_dir, read_meta(run_dir))


def config_of(run_dir: Path, meta: dict[str, Any]) -> Config:
    """`read_config` for a reader that has read run.json already (it is read once per run)."""
    stored = meta.get("config")
    if isinstance(stored, dict):
        return from_dict(stored)
    return load_job_config(run_dir)


def load_job_config(run_dir: Path) -> Config:
    """config.yaml, validated in full: what a job runs with."""
    path = run_dir / CONFIG
    if not path.is_file():
        raise RunFolderError(
            f"{path} does not exist: is {run_dir} a run folder made by `python -m launch submit` "
            "or `python -m launch prepare`?"
        )
    return load_config([path])


def find_runs(root: Path) -> list[Path]:
    """Every run folder in or under root (a folder holding run.json), by name; never inside one."""
    if _holds_meta(os.fspath(root)):
        return [Path(root)]
    found: list[tuple[str, str]] = []  # (name, path): sorted as strings, made Paths once
    folders = [os.fspath(root)]
    while folders:  # one stat per run folder, rather than listing what it holds (os.walk)
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:  # unreadable, or gone meanwhile: as os.walk, pass over it
            continue
        for entry in entries:
            # Hidden: staging folders. Links to folders are not followed (os.walk's default).
            if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
                continue
            if _holds_meta(entry.path):
                found.append((entry.name, entry.path))  # a run folder holds no other run folder
            else:
                folders.append(entry.path)
    return [Path(path) for _, path in sorted(found)]


def _holds_meta(folder: str) -> bool:
    """Whether the folder holds a run.json that is no folder (what os.walk would list as a file)."""
    path = os.path.join(folder, META)
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return os.path.islink(path)  # a dangling link: a damaged run, reported as such later


def find_for_job(root: Path, job_id: str) -> Path | None:
    """The run folder under root whose run.json names this Slurm job, if any."""
    for run_dir in find_runs(root):
        with contextlib.suppress(RunFolderError):
            if str(read_meta(run_dir).get("job_id")) == job_id:
                return run_dir
    return None


def fingerprint(run_dir: Path) -> tuple[object, ...] | None:
    """What a reader's view of the run depends on, from a few system calls and no reading: the
    identity, size and modification time of run.json and of every rank's records file. Any
    write the kit makes changes it (records are appended, run.json is replaced whole). None
    where the folder cannot be read."""
    folder = os.fspath(run_dir)
    try:
        meta = os.stat(os.path.join(folder, META))
    except OSError:
        return None
    try:
        with os.scandir(os.path.join(folder, METRICS)) as entries:
            files = [_identity(entry) for entry in entries if _rank_of(entry.name) is not None]
    except FileNotFoundError:  # no records yet
        files = []
    except OSError:
        return None
    return (meta.st_ino, meta.st_size, meta.st_mtime_ns, *sorted(files))


def _identity(entry: os.DirEntry[str]) -> tuple[str, int, int, int]:
    got = entry.stat()
    return entry.name, got.st_ino, got.st_size, got.st_mtime_ns


def publish_store_port(run_dir: Path, job_id: str, port: int) -> None:
    """Tell the job's other processes where its store listens (written whole or not at all)."""
    path = _store_port_path(run_dir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_inside(run_dir, staging, flags), "w") as f:
        f.write(str(port))
    os.replace(staging, path)


def published_store_port(run_dir: Path, job_id: str) -> int | None:
    """The port the job's store published, or None while it has not."""
    with contextlib.suppress(OSError, ValueError):
        return int(_store_port_path(run_dir, job_id).read_text())
    return None


def forget_store_port(run_dir: Path, job_id: str) -> None:
    """Once every process has joined: a requeued attempt of the same job publishes anew."""
    _store_port_path(run_dir, job_id).unlink(missing_ok=True)


def _store_port_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / LOGS / STORE_PORT.format(job=job_id)


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
        _warn_once(folder, f"{folder} cannot be read ({err.strerror}): its records are skipped")
        return {}
    files, strays = {}, []
    for entry in entries:
        rank = _rank_of(entry.name)
        if rank is not None and rank < min(ranks, MAX_RANKS):
            files[rank] = Path(entry.path)
        elif entry.name.startswith("rank-") and entry.name.endswith(".jsonl"):
            strays.append(entry.name)
    if strays:
        more = f" (and {len(strays) - 1} more)" if len(strays) > 1 else ""
        _warn_once(
            folder,
            f"{folder}: {min(strays)}{more} skipped: no rank of this run, whose ranks are "
            f"0–{min(ranks, MAX_RANKS) - 1}",
        )
    return dict(sorted(files.items()))


def _rank_of(name: str) -> int | None:
    """The rank whose records file this is (rank-00003.jsonl: 3); None for any other file."""
    digits = name[5:-6]
    if name.startswith("rank-") and name.endswith(".jsonl") and _RANK_DIGITS.fullmatch(digits):
        return int(digits)
    return None


_RANK_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII digits only (str.isdigit takes '٣' too)


def _warn_once(key: Path, text: str) -> None:
    """One warning per file or folder and process: a reader may look at a run many times."""
    if key not in _warned:
        _warned.add(key)
        log.warning("warning: %s", text)


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
        text = _read_bytes(path).decode(errors="replace")  # a bad byte spoils its line only
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
        _warn_once(path, f"{problems[0]}{more}")
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


_warned: set[Path] = set()  # files whose skipped lines this process has already reported


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE


def saved_state(run_dir: Path) -> Path | None:
    """The run's saved training state, or None where none was saved; a state.pt that is no
    regular file (a folder, a named pipe) is refused, never taken as 'nothing saved', which
    would start the run over from epoch 1."""
    path = state_path(run_dir)
    try:
        mode = os.lstat(path).st_mode  # a link is no regular file: it may lead out of the folder
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise RunFolderError(
            f"{path} cannot be read ({err.strerror}): the run cannot resume"
        ) from None
    if not stat.S_ISREG(mode):
        raise RunFolderError(
            f"{path} is not a regular file (a folder, a pipe, a link …), so the run cannot resume from "
            "it: remove it to start the run over, or start a new run"
        )
    return path


def program_checkpoints(run_dir: Path) -> Path:
    """A user's program's checkpoint folder, made, reached through no link (`no_links`)."""
    folder = no_links(run_dir, run_dir / PROGRAM_CHECKPOINTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shards_path(run_dir: Path, name: str) -> Path:
    return run_dir / SHARDS / name


def drop_other_shards(run_dir: Path, keep: str) -> None:
    """After state.pt names `keep`: the folders of earlier saves, and of any save that died before
    its state.pt, go (the one named stays whole until a later state.pt names another)."""
    for folder in no_links(run_dir, run_dir / SHARDS).glob("*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once written, it is synced and renamed into place.

    A crash at any point leaves the previous file whole, and no partial file behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # as open() makes it: the group may read the run
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        with partial.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
        _sync_folder(path.parent)
    finally:
        partial.unlink(missing_ok=True)


def drop_partials(path: Path) -> None:
    """Remove what a writer of `path` killed outright (SIGKILL: no clean-up runs) left of it; only
    for a file that one process at a time writes (a checkpoint), never run.json."""
    for left in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        left.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def code_dir(run_dir: Path) -> Path:
    return run_dir / CODE


def code_manifest(run_dir: Path) -> Path:
    return run_dir / CODE_MANIFEST


def logs_dir(run_dir: Path) -> Path:
    return run_dir / LOGS


def logs_to_write(run_dir: Path) -> Path:
    """The logs folder a job writes into, checked by `check_writable`."""
    return _no_links_in(run_dir, logs_dir(run_dir))


def check_writable(run_dir: Path) -> None:
    """Before a job is submitted into an existing run folder (`launch resume`): no symbolic link
    where the job writes (see `no_links`), so that it is refused now, before anything is written,
    rather than in the job."""
    for name in (CLAIM, META, LOGS, METRICS, os.path.dirname(STATE), SHARDS):
        _no_links_in(run_dir, run_dir / name)


def _no_links_in(run_dir: Path, folder: Path) -> Path:
    """`folder`, checked as `no_links` checks a path, and every entry in it: a link planted under
    a coming file's name (a new job's log) would carry that write elsewhere. A link that leads
    to a file of the same run folder is passed (submitit links `.submission_file_*.sh` to the
    job's script in its logs folder)."""
    no_links(run_dir, folder)
    inside = run_dir.resolve()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(inside):
                no_links(run_dir, Path(entry.path))
    return folder


def no_links(run_dir: Path, path: Path) -> Path:
    """`path` (in the run folder), after checking that neither it nor a folder between the run
    folder and it is a symbolic link. Run folders sit on shared file systems: a link planted in
    one would carry the kit's writes (records, checkpoints, logs) to a file outside it."""
    current = run_dir
    for part in path.relative_to(run_dir).parts:
        current = current / part
        if current.is_symlink():
            raise RunFolderError(
                f"{current} is a symbolic link: the kit writes only inside the run folder, never "
                "through a link; remove it (the kit makes what it needs), then run the command again"
            )
    return path


def open_inside(run_dir: Path, path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open of a file in the run folder, through no symbolic link (see `no_links`; O_NOFOLLOW
    also refuses a link that appears at the last moment)."""
    try:
        return os.open(no_links(run_dir, path), flags | os.O_NOFOLLOW, mode)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        no_links(run_dir, path)  # says it in words
        raise


def sweep_logs_dir(first_run: Path) -> Path:
    """A sweep's array writes every element's logs into one folder beside its run folders."""
    return first_run.parent / SWEEPS / first_run.name


def sbatch_log_pattern(run_dir: Path) -> str:
    """srun's --output for the sbatch scripts: one file per task (%t: the task's rank)."""
    return str(logs_dir(run_dir) / "rank-%t.out")


def log_files(run_dir: Path, rank: int, earlier_jobs: bool = True) -> list[Path]:
    """The files holding one rank's stdout and stderr, oldest first: an sbatch script's, then
    those `launch submit` or `launch resume` recorded (a run made by sbatch may be resumed so);
    without `earlier_jobs`, not those of the jobs before the last one."""
    meta = read_meta(run_dir)
    recorded = meta.get("logs") or []
    paths = []
    if meta.get("launcher") == "sbatch":
        paths.append(Path(sbatch_log_pattern(run_dir).replace("%t", str(rank))))
    # The jobs before the last one (a failed attempt, then `launch resume`), named as submitit
    # names a job's files; run.json records the last job's alone.
    jobs = (meta.get("jobs") or []) if earlier_jobs else []
    earlier = [str(job) for job in jobs if str(job) != str(meta.get("job_id"))]
    paths += [logs_dir(run_dir) / f"{job}_{rank}_log.{end}" for job in earlier for end in _ENDS]
    if 0 <= rank < len(recorded) and isinstance(recorded[rank], list):
        paths += [_here(run_dir, Path(p)) for p in recorded[rank] if isinstance(p, str)]
    return [p for p in dict.fromkeys(paths) if log_inside(run_dir, p).is_file()]


_ENDS = ("out", "err")


def _here(run_dir: Path, recorded: Path) -> Path:
    """A recorded log's path in this copy of the run folder (a moved or copied folder keeps the
    paths of where it was made): its own logs folder, or its sweep's beside it. Nothing else:
    run.json is data, and a path it names elsewhere (/etc/passwd) is refused, never read."""
    folder = recorded.parent
    plain = {recorded.name, folder.name}.isdisjoint({"", ".", ".."})
    if plain and folder.name == LOGS:
        return logs_dir(run_dir) / recorded.name
    if plain and folder.parent.name == SWEEPS:
        return run_dir.parent / SWEEPS / folder.name / recorded.name
    raise RunFolderError(
        f"{run_dir / META} names the log {recorded}, outside the run's logs folder: the kit reads "
        f"logs only there (or in its sweep's, {SWEEPS}/); put the recorded path back, or start a "
        "new run"
    )


def log_inside(run_dir: Path, path: Path) -> Path:
    """The log's path, refused where it leads out of the run's logs folder and its sweep's (a
    symbolic link planted there, say): the kit prints what it finds, so never another file."""
    homes = (logs_dir(run_dir).resolve(), (run_dir.parent / SWEEPS).resolve())
    found = path.resolve()
    if not any(found.is_relative_to(home) for home in homes):
        raise RunFolderError(
            f"{path} leads out of the run folder (to {found}): the kit reads only its own logs; "
            "remove the link, or start a new run"
        )
    return path


def shell_assignments(run_dir: Path) -> str:
    """What `launch prepare --shell` prints: the paths an sbatch script needs, as shell lines."""
    import shlex

    values = {
        "run_dir": str(run_dir),
        "rank_log": sbatch_log_pattern(run_dir),
        "srun_log": str(logs_dir(run_dir) / SRUN_LOG),
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


class _TooLarge(OSError):
    """A file over the size its reader takes (`_read_bytes`'s limit)."""

    def __init__(self, path: Path, size: int) -> None:
        super().__init__(errno.EFBIG, "too large to read", str(path))
        self.size = size  # bytes found: the file's, or as many as were read before giving up


def _read_bytes(path: Path, limit: int = 1 << 62) -> bytes:
    """The file's bytes, through the bare system calls: half the cost of open().read() (which
    readers of thousands of runs pay for every file). Over `limit` bytes: `_TooLarge`, having
    read no more than that (the file may grow while it is read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a named pipe would block until written
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if found.st_size > limit:
            raise _TooLarge(path, found.st_size)
        chunks = [os.read(fd, 1 << 16)]  # a run's files are a few kB: one read, as a rule
        size = len(chunks[0])
        while len(chunks[-1]) == 1 << 16 and size <= limit:
            chunks.append(os.read(fd, 1 << 16))
            size += len(chunks[-1])
        if size > limit:
            raise _TooLarge(path, size)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_file(path) as partial:
        partial.write_text(json.dumps(data, indent=2) + "\n")
