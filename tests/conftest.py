"""Shared fixtures.

`make test` runs the files in parallel workers (`pytest -n 4 --dist loadfile`: a file's tests run
in one worker, so its module-scoped runs are made once). Runs that several files compare against
are made once for all workers (`shared_runs`).

Slurm: tests marked `slurm` run against a real test cluster (2 nodes x 4 fake GPUs, tasks bound
to CPUs and GPUs through cgroups as on production clusters, with accounting;
slurm/testcluster/README.md) that each worker starts on first use and stops at the end: the Slurm
files run side by side, each cluster with ids and node names of its own. Where Slurm cannot be
installed they are skipped, except on CI (CI=true), where that is a failure.
TESTCLUSTER_SLURM_PREFIX runs them on a Slurm built apart (slurm/testcluster/build-slurm.sh)
instead of the system's.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from kit import SMALL, kit, run_folder
from slurm_cluster import SlurmCluster, install, slurm_path, slurm_prefix

from slurm_ddp_kit.core.cli import DISTRIBUTION
from slurm_ddp_kit.train.distenv import PORT_COUNT

# Every process the tests start inherits this: torch's OpenMP threads sleep when idle instead of
# spinning. Four workers share two cores; a spinning thread burns the CPU another job's rank
# needs (a local DP job: 20 CPU-s spinning, 13 passive, on the loaded machine). The arithmetic
# is the same either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# On a Slurm built apart, every client that any test or the kit starts (sbatch, srun, sacct, and
# submitit's) must be that release's: put it first on PATH for the whole session.
os.environ["PATH"] = slurm_path(os.environ.get("PATH", os.defpath), slurm_prefix())


def pytest_report_header() -> str:
    """Which Slurm the test clusters run on, at the top of the session's output."""
    return f"testcluster Slurm: {slurm_prefix() or 'the system’s'}"


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
    """One running 2-node cluster for this worker's whole session (each worker that runs Slurm
    tests starts its own), with SLURM_CONF exported in os.environ (so subprocesses and submitit
    see it) until the session ends."""
    reason = _why_no_slurm()
    if reason is not None:
        slurm_unavailable(reason)
    # tmp_path_factory folders are short (/tmp/pytest-of-root/pytest-N/slurm0): fine for the
    # Unix sockets that live inside.
    folder: Path = tmp_path_factory.mktemp("slurm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TESTCLUSTER_FIRST_JOB_ID", str(_first_job_id()))
        cluster = SlurmCluster.start(folder, nodes=2)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in cluster.env.items():
                patch.setenv(name, value)
            yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _tried_workloads: Path) -> None:
    """Each test's `summarize` keeps its cache (analysis.cache) beside the test's own folder,
    never in the user's home and never shared with another test. The launcher's remembered
    trials (launch.checks._passed_mark) are the session's, as they are a user's: without them
    every test that submits a paced run paid a Python with torch to try the same factory."""
    cache = tmp_path.parent / f"{tmp_path.name}-cache"
    cache.mkdir(exist_ok=True)
    (cache / DISTRIBUTION).symlink_to(_tried_workloads, target_is_directory=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))


@pytest.fixture(scope="session")
def _tried_workloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's folder in the cache for every test of the session, in every worker (a trial is
    keyed by the workload's settings and its files: a test that writes or edits a factory, or
    sets XDG_CACHE_HOME itself, is tried as a user's would be)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "kit-cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def _slurm_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """A test marked `slurm` gets the cluster (and its skip or failure) even when it does not
    ask for the fixture by name."""
    if request.node.get_closest_marker("slurm") is not None:
        request.getfixturevalue("slurm_cluster")


def _first_job_id() -> int:
    """A first job id of this worker's own. A Slurm job's port comes from its id modulo 12768
    (train.distenv.port_for_job) and the workers' clusters share the host's addresses, so each
    worker starts at its own eighth of that cycle: their jobs get different ports for the first
    1596 jobs each. The clock picks the cycle, so ids differ between sessions."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    cycle = time.time_ns() // 1_000_000_000 % 4000  # ids stay below 6_000_000 + 51_073_000
    return 1000 + cycle * PORT_COUNT + worker % 8 * (PORT_COUNT // 8)


def namespaced_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    nodes: int,
    ids_from: int,
    timeout: float = 120,
    **env: str,
) -> Iterator[SlurmCluster]:
    """A module's test cluster whose slurmd each run in a network namespace of their own
    (TESTCLUSTER_NETNS=1), with job ids `ids_from` above this worker's own and any more
    TESTCLUSTER_* settings; skipped where Slurm cannot run, stopped at the end."""
    reason = _why_no_slurm()
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"TESTCLUSTER_NETNS": "1", **env}.items():
            patch.setenv(key, value)
        patch.setenv("TESTCLUSTER_FIRST_JOB_ID", str(_first_job_id() + ids_from))
        cluster = SlurmCluster.start(folder, nodes=nodes, timeout=timeout)
    try:
        yield cluster
    finally:
        cluster.stop()


class SharedRuns:
    """Runs that several test files compare against, made once per pytest session by whichever
    worker asks first; the others wait for it and take what it returned (kept as JSON)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, key: str, make: Callable[[Path], Any]) -> Any:
        self.root.mkdir(parents=True, exist_ok=True)
        result = self.root / f"{key}.json"
        with (self.root / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
            if not result.is_file():  # a maker that failed left none: this one tries again
                folder = self.root / key
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                result.write_text(json.dumps(make(folder)))
            return json.loads(result.read_text())


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """Under xdist every worker's temporary root lies in one folder: the shared runs go there."""
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared")


@pytest.fixture(scope="session")
def small_runs(small_runs_said: dict[str, tuple[Path, str]]) -> dict[str, Path]:
    """Finished local runs of kit.SMALL on 2 ranks, made once for every file that reads them:
    a DP and a DDP run of the same settings and a DP run of another global batch, in one
    output.root. Tests that change a run change a copy."""
    return {name: run_dir for name, (run_dir, _) in small_runs_said.items()}


@pytest.fixture(scope="session")
def small_runs_said(shared_runs: SharedRuns) -> dict[str, tuple[Path, str]]:
    """The same runs, each with what `launch submit --wait` printed for it."""
    made = shared_runs.get("small_runs", _small_runs)
    return {name: (Path(path), said) for name, (path, said) in made.items()}


# torchrun's variables left over in a user's shell: every local job inherits them, and must not
# take its ranks from them (the DDP run is made with them set).
STRAY = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


def _small_runs(tmp: Path) -> dict[str, tuple[str, str]]:
    settings = {"dp": ["--mode", "dp"], "ddp": ["--mode", "ddp"],
                "dp-256": ["--mode", "dp", "train.global_batch_size=256"]}  # fmt: skip
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data", "cluster.backend=local"]
    made = {}
    for name, args in settings.items():
        env = STRAY if name == "ddp" else None
        done = kit("launch", "submit", *args, *SMALL, "cluster.gpus_per_node=2", *where, "--wait",
                   env=env)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        made[name] = (str(run_folder(done.stdout)), done.stdout)
    return made


# The order files are handed out in: with `--dist loadfile` a worker takes the next file in
# collection order as it frees, so a long file collected last would run on after the rest. Six
# workers on two cores: the files that mostly wait on Slurm (time limits, requeues, a node given
# up) start beside two that keep the CPU busy, then the rest longest first; the short files left
# at the end even out the workers' finishing times. (Seconds per file, summed over its tests, in
# a whole suite of 2026-12-07: docs/benchmarks/test-suite.md.)
LONGEST_FIRST = (
    "test_requeue",  # 442, waits
    "test_netns",  # 359, waits
    "test_failures",  # 293, waits
    "test_slurm_jobs",  # 271, waits
    "test_workloads_script",  # 194, CPU
    "test_strategies_resume",  # 193, CPU
    "test_program",  # 186
    "test_strategies",  # 180
    "test_workloads",  # 164
    "test_interrupt",  # 143
    "test_resume",  # 102
    "test_bad_input",  # 94
    "test_compile_cache",  # 94
    "test_summarize_speed",  # 75
    "test_sweep",
    "test_local_jobs",
    "test_maxbatch",
    "test_benchmark_script",
    "test_signals",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: files stay whole
