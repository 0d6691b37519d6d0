"""`launch init`: the sbatch scripts and the examples, copied out of the kit into a project, so
that a kit installed with pip (which has no checkout to `sbatch slurm/ddp.sbatch` from) gives the
same files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_ddp_kit.core.errors import KitError

if TYPE_CHECKING:  # importlib.abc's Traversable is deprecated from Python 3.12 on
    from importlib.resources.abc import Traversable

# Where each group of files lies in the checkout, and the package the wheel carries it as
# (pyproject.toml maps the one onto the other).
GROUPS = {
    "slurm": ("slurm", "slurm_ddp_kit.sbatch"),
    "examples": ("docs/examples", "slurm_ddp_kit.examples"),
}
SUFFIXES = (".sbatch", ".yaml", ".py")
CHECKOUT = Path(__file__).resolve().parents[2]


class InitError(KitError):
    """A file could not be written; the message says which and why."""


def kit_files() -> dict[str, Traversable]:
    """Each file to hand out, by its path in the project ('slurm/ddp.sbatch', …)."""
    found: dict[str, Traversable] = {}
    for group, (folder, package) in GROUPS.items():
        for item in _folder(folder, package).iterdir():
            if item.name.endswith(SUFFIXES):
                found[f"{group}/{item.name}"] = item
    return dict(sorted(found.items()))


def _folder(folder: str, package: str) -> Traversable:
    """The wheel's copy where the kit was installed from one; else the checkout's own folder
    (an editable install, or the kit run from its clone)."""
    try:
        return resources.files(package)
    except ModuleNotFoundError:
        return CHECKOUT / folder


def copy_into(target: Path) -> Iterator[tuple[str, bool]]:
    """Write each file under `target`, keeping any that is there already: (path, written), each
    as it is done (so that what was written before a refusal is said)."""
    for name, source in kit_files().items():
        path = target / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = 0o755 if name.endswith(".sbatch") else 0o644
            # O_EXCL: a file, a folder or a link (even a dangling one) already there stays as it is.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            if not path.parent.is_dir():  # mkdir met a file where the folder goes
                raise InitError(
                    f"cannot write {path}: {path.parent} is a file, not a folder: move it, or "
                    "choose another folder"
                ) from None
            yield name, False
            continue
        except OSError as e:
            raise InitError(
                f"cannot write {path}: {e.strerror}: choose a folder you can write to"
            ) from e
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
        yield name, True
