"""`python -m train.start [-u] -m MODULE ARG…`: what each task of a submitit job runs.

submitit starts `PYTHON -u -m submitit.core._submit FOLDER` in every task; the kit hands it this
module as PYTHON's tail, so the stop signals are held (`train.early`) before submitit imports
anything, then submitit's own runner goes on as it would have.
"""

from train import early

early.hold()
early.end_with_controller()

import runpy  # noqa: E402  (after the signals are held)
import sys  # noqa: E402


def main(argv: list[str]) -> None:
    args = argv[1:] if argv[:1] == ["-u"] else argv  # `-u` is this interpreter's already
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit("usage: python -m train.start [-u] -m MODULE [ARG ...]")
    sys.argv = [args[1], *args[2:]]
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    finally:
        early.end_leftovers()  # nothing this task started outlives it


if __name__ == "__main__":
    main(sys.argv[1:])
