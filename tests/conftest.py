"""Shared fixtures.

Slurm: tests marked `slurm` run against one real test cluster (2 nodes x 4 fake GPUs, with
accounting) that the session starts on first use and stops at the end. Where Slurm cannot be
installed they are skipped, except on CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from slurm_cluster import SlurmCluster, install


def slurm_unavailable(reason: str) -> NoReturn:
    """Skip a Slurm test that cannot run here, but fail it on CI: there the Slurm tests must
    always run, so a missing cluster is an error and never a silent skip."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(f"CI=true but the Slurm test cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _why_no_slurm() -> str | None:
    """None when the Slurm test cluster can run here (installing its packages if needed),
    else the reason why not."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (the daemons run as root; apt-get installs them)"
    done = install()
    if done.returncode != 0:
        return (
            f"slurm/testcluster/install.sh failed: {(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One running 2-node cluster for the whole session, with SLURM_CONF exported in os.environ
    (so subprocesses and submitit see it) until the session ends."""
    reason = _why_no_slurm()
    if reason is not None:
        slurm_unavailable(reason)
    # tmp_path_factory folders are short (/tmp/pytest-of-root/pytest-N/slurm0): fine for the
    # Unix sockets that live inside.
    folder: Path = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster.start(folder, nodes=2)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in cluster.env.items():
                patch.setenv(name, value)
            yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _slurm_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """A test marked `slurm` gets the cluster (and its skip or failure) even when it does not
    ask for the fixture by name."""
    if request.node.get_closest_marker("slurm") is not None:
        request.getfixturevalue("slurm_cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `pytest -n 2 --dist loadgroup` (`make test`): every Slurm test runs in one worker,
    one after another on the one test cluster, while the other worker runs the rest."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
