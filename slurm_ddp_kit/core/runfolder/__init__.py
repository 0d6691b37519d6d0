"""The run folder: the one package that knows its layout, its records and their schema.

Here: making a run folder, its run.json and settings read back, finding runs, a job's claim on
a folder; `layout` its names and the readers and writers of its bytes, `records` the ranks'
JSON-lines records, `paths` where its files lie (each inside the folder), `checks` the types
and ranges readers compute with, `failures` why a run failed. Every name is asked of the package.

`launch` creates it, `train` fills it from inside the job, `analysis` and `launch status` read it;
all of them ask this module for every path and record (contract: docs/run-folder.md). It imports
neither torch nor OmegaConf, so readers of thousands of runs stay fast.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import json
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_ddp_kit.core import processes, slurmtext
from slurm_ddp_kit.core.runfolder.checks import MAX_RANKS, misfit_fields
from slurm_ddp_kit.core.runfolder.layout import (
    CHECKPOINT,
    CLAIM,
    CODE,
    CODE_MANIFEST,
    CONFIG,
    ENDS,
    KINDS,
    LOGS,
    META,
    METRICS,
    PLAIN_PATH,
    PROGRAM_CHECKPOINTS,
    SCHEMA,
    SHARDS,
    SRUN_LOG,
    STATE,
    STORE_PORT,
    SWEEPS,
    RunFolderError,
    TooLarge,
    atomic_file,
    drop_partials,
    log,
    read_bytes,
    umask,
    warn_once,
    write_json,
)
from slurm_ddp_kit.core.runfolder.paths import (
    check_writable,
    checkpoint_path,
    code_dir,
    code_manifest,
    drop_other_shards,
    forget_store_port,
    logs_dir,
    logs_to_write,
    no_links,
    open_inside,
    program_checkpoints,
    publish_store_port,
    published_store_port,
    saved_state,
    sbatch_log_pattern,
    shards_path,
    shell_assignments,
    state_path,
    sweep_logs_dir,
)
from slurm_ddp_kit.core.runfolder.records import (
    MAX_LINE,
    RecordWriter,
    attempts,
    metrics_path,
    of_kind,
    rank_files,
    rank_of,
    read_rank,
    read_records,
    run_view,
)
from slurm_ddp_kit.core.settings.loading import from_dict, load_config, to_dict, to_yaml
from slurm_ddp_kit.core.settings.schema import Config

# The package's face: every name its readers and writers use, wherever it is defined.
__all__ = [
    "CHECKPOINT",
    "CLAIM",
    "CODE",
    "CODE_MANIFEST",
    "CONFIG",
    "ENDS",
    "KINDS",
    "LOGS",
    "MAX_LINE",
    "MAX_META",
    "MAX_META_DEPTH",
    "MAX_RANKS",
    "META",
    "METRICS",
    "PLAIN_PATH",
    "PROGRAM_CHECKPOINTS",
    "SCHEMA",
    "SHARDS",
    "SRUN_LOG",
    "STAGING",
    "STATE",
    "STORE_PORT",
    "SWEEPS",
    "RecordWriter",
    "RunFolderError",
    "TooLarge",
    "atomic_file",
    "attempts",
    "check_root",
    "check_writable",
    "checkpoint_path",
    "claimed",
    "code_dir",
    "code_manifest",
    "config_of",
    "create",
    "discard",
    "drop_other_shards",
    "drop_partials",
    "expand",
    "find_for_job",
    "find_runs",
    "fingerprint",
    "folders_to_make",
    "forget_store_port",
    "load_job_config",
    "log",
    "log_files",
    "log_inside",
    "logs_dir",
    "logs_to_write",
    "metrics_path",
    "new_name",
    "no_links",
    "of_kind",
    "open_inside",
    "program_checkpoints",
    "publish_store_port",
    "published_store_port",
    "rank_files",
    "rank_of",
    "read_bytes",
    "read_config",
    "read_meta",
    "read_rank",
    "read_records",
    "run_view",
    "saved_state",
    "sbatch_log_pattern",
    "shards_path",
    "shell_assignments",
    "state_path",
    "sweep_logs_dir",
    "umask",
    "update_meta",
    "warn_once",
    "write_json",
]


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
    if not PLAIN_PATH.fullmatch(str(path)):
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
        staging.chmod(0o777 & ~umask())  # as mkdir makes it: the group may read runs
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


def _publish(staging: Path, cfg: Config, launcher: str, backend: str, command: list[str]) -> Path:
    while True:
        run_dir = staging.parent / new_name(cfg)
        write_json(staging / META, _meta(run_dir.name, cfg, launcher, backend, command))
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
        meta = json.loads(read_bytes(path, MAX_META))
    except TooLarge as err:
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
        if job is not None and not (isinstance(job, str | int) and slurmtext.is_job_id(str(job))):
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
    write_json(run_dir / META, meta)
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
            files = [_identity(entry) for entry in entries if rank_of(entry.name) is not None]
    except FileNotFoundError:  # no records yet
        files = []
    except OSError:
        return None
    return (meta.st_ino, meta.st_size, meta.st_mtime_ns, *sorted(files))


def _identity(entry: os.DirEntry[str]) -> tuple[str, int, int, int]:
    got = entry.stat()
    return entry.name, got.st_ino, got.st_size, got.st_mtime_ns


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
