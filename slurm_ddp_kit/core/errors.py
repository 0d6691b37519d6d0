"""The kit's one error class: `KitError`, for what a user can fix.

A `KitError` is printed as one line that names the fix, with exit code 2 (`core.cli`). Any other
exception is a bug in the kit (or in torch, or the machine) and keeps its traceback, exit code 1.
Each part of the kit raises its own subclass (ConfigError, RunFolderError, …).
"""


class KitError(Exception):
    """Something the user can fix: the message says what was wrong and how to fix it."""
