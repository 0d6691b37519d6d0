"""The published comparison is re-derivable: its run folders are in the repository, and
`summarize` on them prints the published table, byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit import REPO, kit

PUBLISHED = sorted(p.parent for p in (REPO / "docs" / "benchmarks").glob("*/table.md"))


@pytest.mark.parametrize("folder", PUBLISHED, ids=[p.name for p in PUBLISHED])
def test_summarize_prints_the_published_table(folder: Path) -> None:
    runs = folder / "runs"
    assert runs.is_dir(), f"{folder}: the run folders behind table.md are missing"
    done = kit("analysis", "summarize", str(runs.relative_to(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (folder / "table.md").read_text()


def test_readme_shows_the_published_table() -> None:
    """The README's table is the published one's table part (its rows, unchanged)."""
    readme = (REPO / "README.md").read_text()
    table = [
        line
        for line in (PUBLISHED[0] / "table.md").read_text().splitlines()
        if line.startswith("|")
    ]
    assert "\n".join(table) in readme
