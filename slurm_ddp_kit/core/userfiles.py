"""Files the kit keeps for the user and reads back (the summary cache, a passed workload trial,
compiled artifacts): read only where no one else could have written them.

Such a file may sit where others can write (a shared XDG_CACHE_HOME, an output.root on a group's
file system), and what it holds decides what the kit runs or trusts. So it is read only where it
is a regular file (no symbolic link), owned by this user and writable by no one else, in a folder
of the same kind; any other is passed over (and written anew by its owner's next use).
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def open_own(path: Path) -> BinaryIO | None:
    """The file, opened for reading, where only this user could have written it; else None
    (missing too)."""
    try:
        folder = os.lstat(path.parent)  # a link to a folder is not the user's folder
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # nor a FIFO's wait
    except OSError:
        return None
    handle = os.fdopen(fd, "rb")
    if not (_own(folder, stat.S_ISDIR) and _own(os.fstat(fd), stat.S_ISREG)):
        handle.close()
        return None
    return handle


class PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings and numbers: a pickle builds anything else through a
    named class or function, and none is found here, so what it holds runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: only plain data is read here")


def plain_data(path: Path) -> Any:
    """The plain data a pickle of this user's alone holds (`PlainData`); ValueError where the
    file is another's or holds more than plain data, OSError where it cannot be read."""
    handle = open_own(path)
    if handle is None:
        raise ValueError(why_not_own(path) if path.exists() else f"{path} does not exist")
    with handle:
        try:
            return PlainData(handle).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, IndexError) as err:
            raise ValueError(f"{path}: {err}") from None


def why_not_own(path: Path) -> str:
    """Why `open_own` passes the file over, in words ('' where it would read it)."""
    handle = open_own(path)
    if handle:
        handle.close()
        return ""
    return (
        f"{path} is not a file of this user's alone (a link, another user's, or writable by "
        "others, or in such a folder)"
    )


def keep_private(folder: Path) -> None:
    """Make a folder of the user's writable by the user alone (made with the umask, 002 say),
    so that the files written in it are read back; another's folder is left as it is."""
    info = os.lstat(folder)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & OTHERS_WRITE:
        os.chmod(folder, stat.S_IMODE(info.st_mode) & ~OTHERS_WRITE)


def _own(info: os.stat_result, kind: Callable[[int], bool]) -> bool:
    return kind(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & OTHERS_WRITE
