"""The user's own model and dataset: `package.module:function` found on the job's Python path.

Torch-free, so the launcher can check a factory before it submits anything.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from slurm_ddp_kit.core.errors import KitError

CONTRACT = {
    "model.name": "function(sample_shape: tuple[int, ...], classes: int) -> torch.nn.Module",
    "data.dataset": (
        "function(train: bool) -> (inputs, labels): inputs a tensor (N, *sample_shape) of uint8 "
        "pixels (the kit scales them to [0, 1]) or floats (used as float32), labels integers (N,) "
        "in 0..classes-1"
    ),
}


class FactoryError(KitError):
    """A factory cannot be found or breaks its contract; the message says which and how."""


IMPORT_S = 60.0  # a factory's module imports in seconds; one that takes this long hangs


class _TookTooLong(BaseException):
    """The import's deadline passed (a BaseException: a module's `except Exception` keeps it)."""


def find(key: str, spec: str, deadline_s: float | None = None) -> Callable[..., Any]:
    """The function `package.module:function` names, imported now (within `deadline_s`, where
    given: the launcher's check, in its main thread)."""
    module_name, _, function = spec.partition(":")
    ctrl_c: list[int] = []
    try:
        with _watched(deadline_s, ctrl_c):
            module = importlib.import_module(module_name)
    except _TookTooLong:
        raise FactoryError(
            f"{key}={spec}: importing {module_name} took over {deadline_s:.0f} s and was stopped: "
            "a module the job imports must import quickly (does it wait for input, a lock or the "
            'network?); keep script code under `if __name__ == "__main__":`'
        ) from None
    except KeyboardInterrupt:
        if ctrl_c or deadline_s is None:
            raise  # a real Ctrl-C: the command was interrupted
        raise FactoryError(
            f"{key}={spec}: importing {module_name} raised KeyboardInterrupt itself (no Ctrl-C "
            "came): a module the job imports must not; keep script code under "
            '`if __name__ == "__main__":`'
        ) from None
    except ImportError as err:
        raise FactoryError(
            f"{key}={spec}: cannot import {module_name} ({err}). The job imports it from its "
            f"Python path: install the package, or add its folder to PYTHONPATH where you launch "
            f"(the job inherits it). Python path here: {':'.join(sys.path[1:4])}…"
        ) from None
    except SystemExit as end:  # script code run on import: nothing would be made, nor said
        raise FactoryError(
            f"{key}={spec}: importing {module_name} ended the program (sys.exit({end.code!r})): "
            "a module the job imports must not exit; keep script code under "
            '`if __name__ == "__main__":`'
        ) from None
    except Exception as err:  # the user's module itself failed while importing
        raise FactoryError(
            f"{key}={spec}: importing {module_name} failed: {type(err).__name__}: {err}"
        ) from err
    found = getattr(module, function, None)
    if not callable(found):
        what = "no attribute" if found is None else f"a {type(found).__name__}, not a function,"
        raise FactoryError(
            f"{key}={spec}: {module_name} has {what} named {function}; it must define "
            f"{CONTRACT[key]}"
        )
    return found


@contextlib.contextmanager
def _watched(deadline_s: float | None, ctrl_c: list[int]) -> Iterator[None]:
    """Run the block under a deadline (SIGALRM), noting in `ctrl_c` a real Ctrl-C; a timer
    already set (pytest-timeout's, say) is set again after, less the time spent."""
    if deadline_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum: int, frame: object) -> None:
        raise _TookTooLong

    def interrupt(signum: int, frame: object) -> None:
        ctrl_c.append(signum)
        raise KeyboardInterrupt

    began = time.monotonic()
    before_alarm = signal.signal(signal.SIGALRM, alarm)
    before_int = signal.getsignal(signal.SIGINT)
    if before_int != signal.SIG_IGN:  # ignored (a background job): it stays so
        signal.signal(signal.SIGINT, interrupt)
    timer = signal.setitimer(signal.ITIMER_REAL, deadline_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before_alarm)
        if before_int is not None:
            signal.signal(signal.SIGINT, before_int)
        if timer[0]:
            left = max(timer[0] - (time.monotonic() - began), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, timer[1])


def broken(key: str, spec: str, problem: str) -> FactoryError:
    """The error for a factory that ran but returned the wrong thing."""
    return FactoryError(f"{key}={spec} {problem}; the contract: {CONTRACT[key]}")


# How the kit calls each factory: example arguments for checking a signature before the job.
EXAMPLE_CALL: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "model.name": (((1, 28, 28), 10), {}),
    "data.dataset": ((), {"train": True}),
}


def check(key: str, spec: str) -> None:
    """The factory can be found and takes the arguments the kit will give it (the launcher's
    check: nothing is called)."""
    args, kwargs = EXAMPLE_CALL[key]
    _check_signature(key, spec, find(key, spec, deadline_s=IMPORT_S), args, kwargs)


def call(key: str, spec: str, *args: Any, **kwargs: Any) -> Any:
    """Find the factory and call it, after checking it takes the contract's arguments."""
    function = find(key, spec)
    _check_signature(key, spec, function, args, kwargs)
    try:
        return function(*args, **kwargs)
    except SystemExit as end:  # a rank ending "successfully" with nothing trained
        raise broken(key, spec, f"ended the program (sys.exit({end.code!r})) when called") from None


def _check_signature(
    key: str, spec: str, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError as err:
        raise broken(key, spec, f"cannot be called so ({err})") from None
    except ValueError:  # no signature to read (a built-in): the call will tell
        pass
