"""The stop signals, held from the first instruction of every process the kit starts in a job.

Slurm sends its time-limit warning (SIGUSR2) and preemption or cancel (SIGTERM) to every process
of a job step, at any instant: during the interpreter's start, the imports, data preparation, a
compile, or in a DataLoader, search or compile worker. Left to their default action, both end
the process ("User defined signal 2"). So a job process blocks both before anything else: a
blocked signal waits, pending, until the job reads it at its next step boundary (`take`), and
every process started from then on (data, search and compile workers, `scontrol`) inherits the
block, so none of them dies of a signal meant for the job. A flag-only handler covers a thread
that unblocks them.

A forked child (a DataLoader or pool worker, a search worker forked by its server) must still
end when the job's own processes end it with SIGTERM (`Process.terminate`, which a Pool's exit
relies on): a thread in it takes the stop signals and ends it on a SIGTERM sent by the process
that held them or one of its descendants; Slurm's, sent from outside, pass it by. (Standard
signals do not queue: the job's SIGTERM sent while one from outside is still pending merges into
it and is lost.) A program a job execs keeps the block: end it with SIGKILL, or unblock the two
in its preexec_fn.

Standard library only: it runs before the kit's heavy imports.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from slurm_ddp_kit.core import processes, submitted

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

HOLDER = "KIT_STOP_SIGNALS_HELD_BY"  # the PID of the process that held them, for its children

_noted: dict[int, float] = {}  # signal -> when the handler saw it first


def hold() -> dict[int, Any]:
    """Block the stop signals and note them from now on; returns the handlers this replaced (a
    launcher's, such as submitit's checkpoint-and-requeue), not counting this module's own."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    os.environ[HOLDER] = str(os.getpid())
    before = {signum: signal.signal(signum, _note) for signum in STOP_SIGNALS}
    return {signum: h for signum, h in before.items() if h is not _note}


PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_controller() -> None:
    """A local job's task stops (SIGTERM: an agreed stop that saves) when the controller that
    started it dies, as a Slurm step's tasks end with their step: killed, the controller could
    not end its tasks, which would train on where neither `status` nor `cancel` looks."""
    if not submitted.by_local_executor() or not os.path.isdir("/proc"):
        return
    import ctypes  # here: only a local task pays for it

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if not _under_controller():  # it died before the request took hold: this was reparented
        os.kill(os.getpid(), signal.SIGTERM)


def _under_controller() -> bool:
    """Whether the job's controller is still among this process's nearest ancestors: its parent,
    or above it (a shell that runs the job's setup lines, a container's runtime). A task whose
    controller died was given to PID 1 or to a subreaper (`systemd --user`)."""
    job = int(os.environ.get("SUBMITIT_LOCAL_JOB_ID") or 0)
    pid = os.getpid()
    for _ in range(4):
        fields = processes.stat(pid)
        if fields is None:
            return True  # /proc cannot tell: leave the task alone
        pid = int(fields[1])
        if pid == job:
            return True
    return False


def interrupt_once() -> None:
    """A SIGINT ends a task once, and later ones are ignored: a Ctrl-C reaches a local job's
    task twice, from the terminal (to its whole process group) and from its controller, which
    passes it on to every task (as it does `launch cancel`'s). The second one broke into the
    first one's unwinding: the rank's error record lost, a traceback chained to a traceback in
    its log. A task that hangs is still ended: the controller's SIGKILL follows within a
    second. Left alone where SIGINT is not Python's default (ignored, say)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def pause_gc() -> None:
    """A task's start imports torch: some 1,200 modules, whose objects Python's cyclic collector
    would walk again and again as they pile up, about an eighth of the imports' CPU time (a
    rank's start-up is most of a short job's). Paused until `resume_gc`."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """The collector back on, once start-up is done; what start-up made (modules, classes,
    functions: nothing that becomes garbage) is frozen, so training's collections skip it and a
    forked DataLoader worker does not copy its pages by touching them."""
    global _gc_paused
    if _gc_paused:
        gc.freeze()
        gc.enable()
        _gc_paused = False


_gc_paused = False


class Interrupted(KeyboardInterrupt):
    """A SIGINT (`interrupt_once`), told from a KeyboardInterrupt that code raised itself."""


def _interrupted(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Interrupted


def _in_forked_child() -> None:
    if os.environ.get(HOLDER) and signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        threading.Thread(target=_child_watch, daemon=True, name="kit-stop-signals").start()


def _child_watch() -> None:
    """A forked child's stop signals: a SIGTERM from the job's own processes ends it."""
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and _from_the_job(info.si_pid):
            os._exit(128 + signal.SIGTERM)


def _from_the_job(pid: int) -> bool:
    """Whether `pid` is the process that held the signals or one of its descendants (a parent,
    a pool's owner), not Slurm's step daemon or a user's `kill` from outside."""
    holder = int(os.environ.get(HOLDER) or 0)
    while pid > 1:
        if pid == holder:
            return True
        fields = processes.stat(pid)
        if fields is None or not fields[1].isdigit():
            return False
        pid = int(fields[1])  # its parent
    return False


os.register_at_fork(after_in_child=_in_forked_child)


def _note(signum: int, frame: object) -> None:
    note(signum)


def note(signum: int) -> None:
    """Count a stop signal as seen (by the handler, or by a thread that waited for it)."""
    _noted.setdefault(signum, time.time())


def take() -> dict[int, float]:
    """The stop signals that came since the last call, each with when it was first seen (for a
    pending one: now), and consumed: the next call reports only newer ones."""
    got = dict(_noted)
    _noted.clear()
    while (info := signal.sigtimedwait(STOP_SIGNALS, 0)) is not None:
        got.setdefault(info.si_signo, time.time())
    return got


def requeue_through_submitit(before: dict[int, Any]) -> str:
    """submitit's own checkpoint-and-requeue, through its handler that `hold` replaced
    (`before`): it calls the submitted Checkpointable's `checkpoint` (a resubmission of the
    same run folder), stores it for the restart and runs `scontrol requeue`, then raises
    SystemExit, which is ours to take. '' on success, else why the job was not requeued."""
    handler = before.get(signal.SIGUSR2)
    if not callable(handler):
        return "submitit's signal handler is not installed in this process"
    try:
        handler(signal.SIGUSR2, None)
    except SystemExit:
        return ""
    except Exception as err:  # `scontrol requeue` failed, or submitit declined to requeue
        return str(err) or type(err).__name__
    return "submitit did not requeue the job"


def forkserver(preload: tuple[str, ...] = ()) -> ForkServerContext:
    """multiprocessing's forkserver context, its server and workers holding the stop signals
    (the server imports this module first, so that its forked workers watch them, then the
    modules in `preload`).

    multiprocessing's resource tracker, started with the first forkserver, unblocks SIGTERM in
    the process that starts it; started first here, the block is put back before the server is
    started (it inherits the block, and its workers inherit it from the server)."""
    import multiprocessing
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    hold()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, *preload])
    return context


def ignore() -> None:
    """From here on the process only ends: a signal now must not fail a job that did its work
    (an ignored signal that is pending is dropped)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def end_leftovers(grace_s: float = 1.0) -> list[int]:
    """End what this process started and left running, as it ends: a helper a user's factory
    forked (which holds the stop signals, so Slurm's SIGTERM passes it by), a program it ran.
    SIGTERM first (a kit-forked child ends at once on it), SIGKILL after `grace_s`.
    multiprocessing's own servers are left alone: they end as this process's pipes close.
    Returns the PIDs it had to end."""
    left = _descendants(os.getpid())
    if not left:
        return []
    signal.signal(
        signal.SIGCHLD, signal.SIG_DFL
    )  # a DataLoader's would call a worker's end a crash
    processes.signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(map(processes.alive, left)) and time.monotonic() < deadline:
        time.sleep(0.05)
    processes.signal_all([pid for pid in left if processes.alive(pid)], signal.SIGKILL)
    return left


def _descendants(root: int) -> list[int]:
    """The running processes below `root` (from /proc), less multiprocessing's servers and theirs."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and (fields := processes.stat(int(entry))):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if processes.alive(pid) and not _multiprocessing_server(pid):
            found.append(pid)
            todo += children.get(pid, [])
    return found


def _multiprocessing_server(pid: int) -> bool:
    """multiprocessing's resource tracker or forkserver, known by the command they run."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read()
    except OSError:
        return False
    # Not a spawned worker (multiprocessing.spawn), nor what a process of it forked.
    return any(f"from multiprocessing.{server} import".encode() in command for server in _SERVERS)


_SERVERS = ("resource_tracker", "forkserver")
