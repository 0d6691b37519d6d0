"""How long `python -m analysis summarize` takes over many run folders, and how much it prints.

Makes N copies of finished run folders (round robin over the --source folders), each under its own
run id of the kit's format, `YYYYmmdd-HHMMSS-<mode>-<n>n<g>g-<4 hex>`, with run.json's "run_id" set
to it. The records are hard links where the file system allows (real copies elsewhere); checkpoints
are left out, since summarize never reads them. Then it times `python -m analysis summarize ROOT`
in a fresh interpreter, as a user runs it, per output format: reading every run (`--no-cache`: one
warm-up call, so the file cache is warm and the figure is the reader's own work, not the disk's,
then the median of three), the first call with summarize's cache (which fills it), and the median
of three calls after it; and the size of what the command printed.

usage: python docs/benchmarks/summarize_speed.py --runs 10000 --source RUN_DIR [--source RUN_DIR]
           --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("markdown", "json")
SKIPPED = {"checkpoints"}  # megabytes per run, and never read by summarize
RUN_ID = re.compile(r"\d{8}-\d{6}-(?P<shape>.+)-[0-9a-f]{4}")  # shape: <mode>-<n>n<g>g[-<name>]
FIRST_STAMP = datetime.datetime(2030, 1, 1)  # copies get one second each from here on


def copy_runs(sources: Sequence[Path], count: int, root: Path) -> list[Path]:
    """`count` copies of the sources, in turn, as run folders under root (made, must be empty)."""
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise SystemExit(f"{root} is not empty: pick a new --out, the copies go there")
    return [copy_run(sources[i % len(sources)], root, i) for i in range(count)]


def copy_run(source: Path, root: Path, number: int) -> Path:
    """Copy number `number` of one run folder, under a run id no other copy has."""
    target = root / copy_id(source.name, number)
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        into = target / Path(folder).relative_to(source)
        into.mkdir(parents=True)
        for name in files:
            if name != "run.json":
                _link_or_copy(Path(folder) / name, into / name)
    meta = json.loads((source / "run.json").read_text()) | {"run_id": target.name}
    (target / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    return target


def copy_id(source_id: str, number: int) -> str:
    """The source's mode and shape, under a time stamp and a hex suffix of the copy's own."""
    match = RUN_ID.fullmatch(source_id)
    if not match:
        raise SystemExit(f"{source_id} is not a run id of the kit (YYYYmmdd-HHMMSS-mode-NnGg-hhhh)")
    stamp = (FIRST_STAMP + datetime.timedelta(seconds=number)).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{match['shape']}-{number % 0x10000:04x}"


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # 10,000 runs in seconds, and no disk
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def summarize(root: Path, fmt: str, *more: str) -> tuple[float, int]:
    """One `python -m analysis summarize ROOT --format fmt` in a fresh interpreter: seconds, bytes.
    Its cache (analysis.cache) is kept beside the copies, under ROOT/../cache."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(root.parent / "cache"),
    }
    command = [sys.executable, "-m", "analysis", "summarize", str(root), "--format", fmt, *more]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, check=False)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr.decode()[-2000:]}")
    return seconds, len(done.stdout)


def time_summarize(root: Path, fmt: str, repeats: int = 3) -> dict[str, tuple[float, int]]:
    """Per kind of call, the median wall time of `repeats` calls and the output's size: every run
    read (--no-cache, after one warm-up call that fills the file cache and Python's bytecode
    cache), the first call that fills summarize's own cache, and calls with it full."""
    summarize(root, fmt, "--no-cache")
    read = [summarize(root, fmt, "--no-cache") for _ in range(repeats)]
    shutil.rmtree(root.parent / "cache", ignore_errors=True)
    first = summarize(root, fmt)
    again = [summarize(root, fmt) for _ in range(repeats)]
    return {
        "every run read": _median(read),
        "first, filling the cache": first,
        "again, from the cache": _median(again),
    }


def _median(timings: list[tuple[float, int]]) -> tuple[float, int]:
    return statistics.median(seconds for seconds, _ in timings), timings[-1][1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000, help="copies to make (default 10000)")
    parser.add_argument("--source", type=Path, action="append", required=True, help="a run folder")
    parser.add_argument("--out", type=Path, required=True, help="an empty (or new) folder")
    args = parser.parse_args(argv)
    root = args.out / "runs"
    began = time.perf_counter()
    copy_runs(args.source, args.runs, root)
    print(f"{args.runs} runs copied to {root} in {time.perf_counter() - began:.1f} s")
    for fmt in FORMATS:
        for kind, (seconds, size) in time_summarize(root, fmt).items():
            print(f"summarize --format {fmt:8} {kind:25}: {seconds:.2f} s, {size:,} bytes out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
