"""What a program launched by the kit (`launch submit … -- python my_train.py`) may ask of it.

Three things only the program knows, in a module it can import anywhere: without the kit, off
Slurm, with no side effect at import:

    import slurm_ddp_kit as kit

    start = kit.resume_from()  # the checkpoint folder: empty on a first run
    for epoch in ...:
        ...
        kit.log(epoch=epoch, loss=loss, accuracy=accuracy)  # a record in the run folder
        if kit.stop_requested():  # the time limit is near, or the job is preempted
            # (with several ranks: agree on it first, an all-reduce of the flag with MAX)
            save(kit.checkpoint_dir() / "last.pt")
            raise SystemExit(0)  # the kit requeues the job, which starts the program again

Under the kit, `stop_requested` turns true once the task's start (`train.program`) has seen
Slurm's time-limit warning (SIGUSR2, when the lead before the limit is left) or SIGTERM: it
writes a file this module looks for. Its first call also takes SIGTERM in this process as a stop
request (where the program has no handler of its own), so that a preemption's SIGTERM does not
end it before it saves. (SIGUSR2 reaches the program ignored: Slurm may send it early.)
Without the kit it is false and nothing is installed; `checkpoint_dir` is ./checkpoints and
`log` writes nothing. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

# What the task's start hands the program (train/program.py sets them).
RUN_DIR = "KIT_RUN_DIR"
CHECKPOINT_DIR = "KIT_CHECKPOINT_DIR"
RECORDS = "KIT_RECORDS"
STOP_FILE = "KIT_STOP_FILE"

_STOP_SIGNALS = (signal.SIGTERM,)
_seen: list[int] = []  # the stop signals this process has taken, if it took any
_listening = False


def under_kit() -> bool:
    """Whether this process was started by the kit's launch."""
    return bool(os.environ.get(RUN_DIR))


def stop_requested() -> bool:
    """True once the job must stop: save, then exit with status 0 (the kit requeues it)."""
    if not under_kit():
        return False
    _listen()
    return bool(_seen) or os.path.exists(os.environ.get(STOP_FILE, "") or "/nonexistent")


def checkpoint_dir() -> Path:
    """Where to save and find the program's checkpoints: in the run folder under the kit (kept
    across requeues and `launch resume`), else ./checkpoints. Made on first use."""
    folder = Path(os.environ.get(CHECKPOINT_DIR) or "checkpoints")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def resume_from() -> Path | None:
    """The checkpoint folder where it holds something saved before (a requeued or resumed run),
    else None."""
    folder = checkpoint_dir()
    return folder if any(folder.iterdir()) else None


def log(**fields: Any) -> None:
    """Append one record to this rank's records in the run folder: plain JSON values (numbers,
    text, lists, mappings); `--wait` shows each. `analysis summarize` reads `epoch` (a whole
    number: seconds per epoch), `test_accuracy` else `accuracy`, and `test_loss` else `loss`.
    Nothing without the kit."""
    path = os.environ.get(RECORDS)
    if not path:
        return
    record = {
        "schema": 1,
        "kind": "log",
        "time": time.time(),
        "rank": int(os.environ.get("RANK", "0") or 0),
        "fields": fields,
    }
    line = json.dumps(record, default=str) + "\n"  # a NaN loss is recorded, not raised
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    try:
        os.write(fd, line.encode())  # one write: lines of the task's start are never mixed in
    finally:
        os.close(fd)


def _listen() -> None:
    """Take SIGTERM as a stop request, once, where the program left it to its default."""
    global _listening
    if _listening:
        return
    _listening = True
    for signum in _STOP_SIGNALS:
        try:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.SIG_IGN, None):
                signal.signal(signum, _take)
        except ValueError:  # not the main thread: the stop file still says it
            return


def _take(signum: int, frame: object) -> None:
    _seen.append(signum)
