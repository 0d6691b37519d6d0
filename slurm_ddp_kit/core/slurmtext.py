"""What Slurm writes, read as text: host lists (SLURM_NODELIST's `node[01-04,07]`), srun's lines
naming the task that ended a step, sacct's rows and its durations. No command is run here
(`core.slurm` runs them); every function is a pure reading of a string."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

# A Slurm job id as the kit records and passes it: a job (`123`), an array's element (`123_4`), or
# an array's pending elements as accounting names them (`123_[4-9%2]`). A local job's id (its
# controller's PID) is digits too. Nothing else reaches a Slurm command: ids are read from run
# folders, which other users may write, and `--user=root` read from one would be an option.
_JOB_ID = re.compile(r"\d+(_(\d+|\[[\d,-]+(%\d+)?\]))?")


def is_job_id(job_id: str) -> bool:
    return bool(_JOB_ID.fullmatch(job_id))


@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's word: PENDING, RUNNING, COMPLETED, …
    elapsed: str
    nodes: str  # '-' where none are assigned


def either(queued: JobState | None, accounted: JobState | None) -> JobState | None:
    if queued and queued.state != "COMPLETING":
        return queued
    if accounted and (not queued or accounted.state in ENDED):
        return accounted
    return queued


def as_sacct(elapsed: str) -> str:
    """squeue's time (`1:05`, `2-03:04:05`) as sacct writes it (`00:01:05`), so that a run's
    ELAPSED reads alike whichever of the two told it."""
    total = seconds(elapsed)
    if total is None:
        return elapsed
    days, rest = divmod(total, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def accounted(row: dict[str, str]) -> JobState:
    nodes = row["NodeList"] if row["NodeList"] not in ("", "None assigned") else "-"
    return JobState(row["State"].split()[0], row["Elapsed"], nodes)  # "CANCELLED by 0"


_ARRAY_RECORD = re.compile(r"(?P<job>\d+)_\[(?P<spec>[\d,-]+)(%\d+)?\]")


def array_records(accounted: dict[str, JobState]) -> dict[str, list[tuple[str, JobState]]]:
    """Accounting's records of arrays' pending elements (`J_[3-999%256]`): array id → (index
    list, state), read once for all the elements asked about."""
    records: dict[str, list[tuple[str, JobState]]] = {}
    for key, found in accounted.items():
        if record := _ARRAY_RECORD.fullmatch(key):
            records.setdefault(record["job"], []).append((record["spec"], found))
    return records


def unstarted(job_id: str, arrays: dict[str, list[tuple[str, JobState]]]) -> JobState | None:
    """The state of the array record that holds a never-started element `J_K`, if any."""
    job, _, index = job_id.partition("_")
    if not index.isdigit():
        return None
    held = (found for spec, found in arrays.get(job, []) if _holds(spec, int(index)))
    return next(held, None)


def _holds(spec: str, index: int) -> bool:
    """Whether Slurm's index list (`0-999`, `3,5-7`) holds index."""
    return any(low <= index <= high for low, high in spans(spec))


# The states a job ends in (a requeued job is not ended: it runs again).
ENDED = frozenset(
    [
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    ]
)


# The states of a job that still holds, or waits for, its allocation: every other state of
# squeue's list is one of ENDED. STOPPED is Slurm's word for a job SIGSTOPped in place
# (`scancel --signal=STOP`), its nodes kept; SPECIAL_EXIT and REQUEUE_HOLD are requeued, held.
LIVE = frozenset(
    [
        "COMPLETING",
        "CONFIGURING",
        "PENDING",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "RESV_DEL_HOLD",
        "RUNNING",
        "SIGNALING",
        "SPECIAL_EXIT",
        "STAGE_OUT",
        "STOPPED",
        "SUSPENDED",
    ]
)


@dataclass(frozen=True)
class TaskEnd:
    """A task's bad end as srun reports it: `srun: error: NODE: task 2: Aborted (core dumped)`."""

    node: str
    tasks: tuple[int, ...]  # task ids: the kit's global ranks
    what: str  # "Exited with exit code 1", "Killed", "Aborted (core dumped)", …

    @property
    def by_signal(self) -> bool:
        return not self.what.startswith("Exited with exit code")


_TASK_END = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): (?P<what>.+)$")


_TERMINATING = "Terminating StepId"  # srun ending the step after a bad exit (--kill-on-bad-exit)


def seconds(duration: str) -> int | None:
    """Slurm's `[D-][HH:]MM:SS` in seconds; None for UNLIMITED, NOT_SET and the like."""
    days, _, clock = duration.strip().rpartition("-")
    parts = clock.split(":")
    if not (days or "0").isdigit() or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    total = 0
    for part in parts:
        total = total * 60 + int(part)
    return int(days or 0) * 86400 + total


def first_bad_exit(srun_stderr: str) -> TaskEnd | None:
    """The task whose end made srun end the step under `--kill-on-bad-exit`, from srun's own
    messages: srun reports each task that ends badly as it learns of it, then names the step it
    terminates; the tasks it ends then are reported after that line. The last terminated step
    counts (a requeued job appends to its log); None where srun terminated none."""
    lines = [line.strip() for line in srun_stderr.splitlines()]
    last = max((i for i, line in enumerate(lines) if _TERMINATING in line), default=None)
    if last is None:
        return None
    before: list[TaskEnd] = []
    for line in reversed(lines[:last]):
        if match := _TASK_END.match(line):
            before.append(TaskEnd(match["node"], _task_ids(match["tasks"]), match["what"]))
        elif line.startswith("srun:"):  # an earlier step's or attempt's end
            break
    return before[-1] if before else None


def _task_ids(spec: str) -> tuple[int, ...]:
    """srun's task list, `0-1,3`, as ids."""
    return tuple(i for low, high in spans(spec) for i in range(low, high + 1))


def spans(spec: str) -> list[tuple[int, int]]:
    """Slurm's list of numbers and ranges (`0-1,3`) as (first, last) pairs."""
    parts = (part.partition("-") for part in spec.split(","))
    return [(int(low), int(high or low)) for low, _, high in parts]


def hostnames(nodelist: str) -> list[str]:
    """A Slurm hostlist expanded, as `scontrol show hostnames` does: entries apart by commas or
    spaces, each with any number of bracketed ranges, zero-padded as written
    ('rack[1-2]-n[01-02]' → rack1-n01, rack1-n02, rack2-n01, rack2-n02). ValueError if it is
    not one."""
    return [host for entry in _entries(nodelist) for host in _expand(entry)]


def first_host(nodelist: str) -> str:
    """The list's first host, without expanding the rest (a list may name 100,000 nodes)."""
    entries = _entries(nodelist)
    if not entries:
        raise ValueError(f"an empty node list: {nodelist!r}")
    return "".join(values[0] for values in _choices(entries[0], first_only=True))


def _entries(nodelist: str) -> list[str]:
    entries, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in the node list {nodelist!r}")
        if depth == 0 and (char == "," or char.isspace()):
            entries.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in the node list {nodelist!r}")
    return [entry for entry in [*entries, nodelist[start:]] if entry]


def _expand(entry: str) -> list[str]:
    return ["".join(parts) for parts in itertools.product(*_choices(entry))]


def _choices(entry: str, first_only: bool = False) -> list[list[str]]:
    """Each piece of an entry: its text, or a bracket's values in order."""
    pieces = [p for p in re.split(r"(\[[^\]]*\])", entry) if p]
    return [_range(p[1:-1], first_only) if p.startswith("[") else [p] for p in pieces]


def _range(spec: str, first_only: bool) -> list[str]:
    values: list[str] = []
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise ValueError(f"not a range of node numbers: [{spec}]")
        width = len(low)  # node[08-10]: node08, node09, node10
        last = int(low) if first_only else int(high or low)
        values += [str(n).zfill(width) for n in range(int(low), last + 1)]
        if first_only:
            break
    return values


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """`sacct --parsable2` output (a header line, then '|'-separated rows) → JobID → fields."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = lines[0].split("|")
    rows = [dict(zip(header, line.split("|"), strict=False)) for line in lines[1:]]
    return {row["JobID"]: row for row in rows if "JobID" in row}
