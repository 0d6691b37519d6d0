"""The code's shape, checked: the kit's code lives under one name of its own (`slurm_ddp_kit`)
and imports nothing by the short names a user's project may use; imports go analysis → launch →
core and train → core, the launcher and the analysis start without torch (and so does every
module of core), only core/runfolder/ spells the run folder's file names, only core/slurm.py
runs Slurm's commands, no part of the kit but a strategy's own module names a strategy, and no
part but a backend's own module (`launch/backends/`) asks which backend runs a job."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

from slurm_ddp_kit.core import strategies

KIT = REPO / "slurm_ddp_kit"
LAYERS = {"core": set(), "train": {"core"}, "launch": {"core"}, "analysis": {"core", "launch"}}
RUN_FOLDER_NAMES = (
    "config.yaml", "run.json", "rank-", "metrics/", "checkpoints/", "_log.out", "manifest.json"
)  # fmt: skip
SLURM_COMMANDS = ("sacct", "squeue", "scontrol", "scancel", "sinfo")
BACKENDS = KIT / "launch" / "backends"
EXECUTOR_READER = KIT / "core" / "submitted.py"  # the job side's one reader of SUBMITIT_EXECUTOR
BACKEND_WORDS = {"slurm", "local"}
SUBMITIT_KINDS = {"LocalJob", "SlurmJob", "LocalExecutor", "SlurmExecutor"}


def _modules(package: str) -> list[Path]:
    return sorted((KIT / package).rglob("*.py"))


def _all_modules() -> list[Path]:
    return [path for package in LAYERS for path in _modules(package)]


def _imported(path: Path) -> set[str]:
    """The absolute names of the modules `path` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def _imported_packages(path: Path) -> set[str]:
    """The kit's packages (core, train, …) that `path` imports."""
    inside = [name.split(".") for name in _imported(path) if name.startswith("slurm_ddp_kit.")]
    return {parts[1] for parts in inside} & set(LAYERS)


def test_the_kit_never_imports_a_name_a_users_project_may_use() -> None:
    """A user's `train.py`, `core/` or `analysis.py` on the path is never taken for the kit's:
    every import of the kit's own code goes through `slurm_ddp_kit`."""
    for path in KIT.rglob("*.py"):
        short = {name for name in _imported(path) if name.split(".")[0] in LAYERS}
        assert not short, f"{path.relative_to(REPO)} imports {sorted(short)}"


def _strings(path: Path) -> list[str]:
    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@pytest.mark.parametrize("package", list(LAYERS))
def test_imports_go_one_way(package: str) -> None:
    for path in _modules(package):
        upward = _imported_packages(path) - LAYERS[package] - {package}
        assert not upward, f"{path.relative_to(REPO)} imports {sorted(upward)}"


def test_launcher_analysis_and_core_start_without_torch() -> None:
    core = [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in _modules("core")
    ]
    readers = [f"slurm_ddp_kit.{name}" for name in (
        "launch.cli", "launch.jobs", "launch.submit", "analysis.__main__", "analysis.plot"
    )]  # fmt: skip
    _assert_not_imported("torch", core + readers)


def test_the_launcher_starts_without_numpy() -> None:
    """Every `launch` command pays for what it imports (numpy was 40 ms of it on the build
    machine): a job's start-up begins with the launcher."""
    launcher = [
        "slurm_ddp_kit.launch.cli",
        "slurm_ddp_kit.launch.jobs",
        "slurm_ddp_kit.launch.submit",
    ]
    _assert_not_imported("numpy", launcher)


def test_status_and_cancel_start_without_submitit() -> None:
    """The backends load submitit only where a job is submitted or followed: `launch status`
    and `cancel` (which ask the backends) pay nothing for it."""
    readers = ["launch.cli", "launch.jobs", "launch.backends.local", "launch.backends.slurm"]
    _assert_not_imported("submitit", [f"slurm_ddp_kit.{name}" for name in readers])


def _assert_not_imported(module: str, importers: list[str]) -> None:
    """Importing `importers` in a fresh interpreter leaves `module` unimported."""
    code = f"import sys, {', '.join(importers)}; sys.exit({module!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or f"{module} was imported"


def test_only_the_run_folder_package_spells_its_file_names() -> None:
    owners = set((KIT / "core" / "runfolder").glob("*.py"))
    for path in [p for p in _all_modules() if p not in owners]:
        for name in RUN_FOLDER_NAMES:
            assert not any(name in s for s in _strings(path)), (
                f"{path.relative_to(REPO)} spells {name!r}"
            )
    for script in (REPO / "slurm").glob("*.sbatch"):
        lines = script.read_text().splitlines()
        body = "\n".join(line for line in lines if not line.startswith("#"))
        assert "launch prepare --shell" in body and "/logs" not in body, script.name


def test_only_the_slurm_module_runs_slurm_commands() -> None:
    owner = KIT / "core" / "slurm.py"
    # A task of a user's program starts that program, and the code snapshot asks git which
    # files the user's repository holds (and neither runs a Slurm command: the loop below).
    others = {KIT / "train" / "program.py", KIT / "core" / "snapshot" / "sources.py"}
    for path in [p for p in _all_modules() if p != owner]:
        source = path.read_text()
        runs = "subprocess" in source and path not in others
        assert not runs, f"{path.relative_to(REPO)} runs a command itself"
        for command in SLURM_COMMANDS:
            assert command not in _strings(path), f"{path.relative_to(REPO)} runs {command}"


def test_only_a_strategy_names_itself() -> None:
    """Submission, the job, the settings and the table ask the strategy: none compares its
    name. (The table's article pair and baseline come from the strategies' own flags.)"""
    owners = {KIT / "core" / "strategies" / f"{name}.py" for name in strategies.names()}
    owners.add(KIT / "core" / "settings" / "schema.py")  # the default of `mode`
    for path in [p for p in _all_modules() if p not in owners]:
        named = set(_strings(path)) & set(strategies.names())
        assert not named, f"{path.relative_to(REPO)} spells the strategy {sorted(named)}"


def test_the_registry_holds_one_strategy_per_module() -> None:
    modules = {p.stem for p in (KIT / "core" / "strategies").glob("*.py")} - {"__init__", "base"}
    assert set(strategies.names()) == modules
    assert [s.order for s in strategies.STRATEGIES.values()] == sorted(
        s.order for s in strategies.STRATEGIES.values()
    )
    # The table's article comparison: exactly two strategies always shown (DP, then DDP).
    assert [c.key for c in strategies.columns() if c.always_shown] == ["dp", "ddp"]


def _name(node: ast.AST) -> str:
    """The name a node spells: a name, an attribute's last part, an imported name; else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.name if isinstance(node, ast.alias) else ""


def _words(node: ast.expr) -> set[str]:
    """The text constants a comparison's operand is, or holds (`x in ("slurm", "local")`)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def _backend_branches(path: Path) -> list[str]:
    """Where `path` asks which backend runs a job: Backend.local/slurm, submitit's executor and
    job classes by name, a comparison with "slurm" or "local", SUBMITIT_EXECUTOR read."""
    reader = path == EXECUTOR_READER
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and _name(node.value) == "Backend":
            found += [f"{where}: Backend.{node.attr}"] if node.attr in BACKEND_WORDS else []
        if _name(node).rsplit(".", 1)[-1] in SUBMITIT_KINDS:
            found.append(f"{where}: {_name(node)}")
        if isinstance(node, ast.Compare) and not reader:
            words = set().union(*map(_words, [node.left, *node.comparators])) & BACKEND_WORDS
            found += [f"{where}: compares with {word!r}" for word in sorted(words)]
        if isinstance(node, ast.Constant) and node.value == "SUBMITIT_EXECUTOR" and not reader:
            found.append(f"{where}: reads SUBMITIT_EXECUTOR")
    return found


def test_only_a_backend_asks_which_backend_runs_a_job() -> None:
    """Submission, its checks, the dry run, sweeps, status, cancel and --wait ask the run's
    backend (`launch.backends`: chosen from the settings, a run folder's record or a job); the
    job side asks `core.submitted`, the one reader of what submitit says started it. (The
    settings schema defines the choice `cluster.backend`: a definition, not a question.)"""
    assert EXECUTOR_READER.is_file() and (BACKENDS / "__init__.py").is_file()
    outside = [p for p in KIT.rglob("*.py") if BACKENDS not in p.parents]
    asking = {str(p.relative_to(REPO)): found for p in outside if (found := _backend_branches(p))}
    assert not asking, asking
