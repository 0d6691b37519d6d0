"""`slurm-ddp-kit COMMAND …`, the command `pip install` gives: `python -m launch …` and
`python -m analysis summarize …` under one name, which works from any folder (a project's own
`launch.py` beside it included)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["summarize"]:
        from slurm_ddp_kit.analysis.__main__ import main as analysis

        return analysis(words, prog="slurm-ddp-kit")
    from slurm_ddp_kit.launch.cli import main as launch

    return launch(words, prog="slurm-ddp-kit")
