"""The code snapshot (`core.snapshot`): what a submission copies into the run folder's code/, what
a job started from it imports, and what a damaged or crafted manifest gets (one line, no code
from outside the run folder). Real files, and a real git repository made here."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

from slurm_ddp_kit.core import runfolder, snapshot
from slurm_ddp_kit.core.settings.loading import load_config, to_yaml
from slurm_ddp_kit.core.settings.schema import CodeConfig, Config, ConfigError, Snapshot
from slurm_ddp_kit.core.snapshot import SnapshotError
from slurm_ddp_kit.core.snapshot.sources import PACKAGE

AUTO, ON, OFF = Snapshot.auto, Snapshot.on, Snapshot.off


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A user's project as it stands mid-work: committed files, one edited since, one deleted,
    one new and untracked, ignored ones, an executable script, and links in and out."""
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "sub").mkdir()
    (project / "train.py").write_text("VALUE = 'committed'\n")
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "model.py").write_text("WIDTH = 8\n")
    (project / "sub" / "notes.txt").write_text("notes\n")
    (project / "old.py").write_text("gone\n")
    (project / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (project / "run.sh").chmod(0o755)
    (project / ".gitignore").write_text("*.log\nbuild/\n")
    (project / "model-link.py").symlink_to("pkg/model.py")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"x" * 100)
    (project / "data").symlink_to(outside)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "first")
    (project / "train.py").write_text("VALUE = 'edited'\n")  # uncommitted
    (project / "old.py").unlink()
    (project / "new.py").write_text("NEW = 1\n")  # untracked, not ignored
    (project / "secret.log").write_text("ignored\n")
    (project / "build").mkdir()
    (project / "build" / "out.py").write_text("ignored too\n")
    return project


def snap(
    tmp_path: Path,
    workdir: Path,
    pythonpath: str = "",
    name: str = "run",
    **settings: object,
) -> Path:
    """A run folder whose code was snapshotted as `launch submit` would, from `workdir`."""
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    snapshot.take(run_dir, snapshot.plan(config(**settings), workdir, pythonpath))
    return run_dir


def config(**code: object) -> Config:
    return Config(code=CodeConfig(**code))  # type: ignore[arg-type]


def test_the_repository_is_copied_as_git_lists_it(
    tmp_path: Path, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kit"):
        run_dir = snap(tmp_path, repo)
    copy = run_dir / "code" / "project"
    assert (copy / "train.py").read_text() == "VALUE = 'edited'\n"  # the working tree's
    assert (copy / "new.py").is_file() and (copy / "pkg" / "model.py").is_file()
    assert not (copy / "old.py").exists()  # deleted: git lists it, the tree has it no more
    assert not (copy / "secret.log").exists() and not (copy / "build").exists()  # ignored
    assert not (copy / ".git").exists()
    assert stat.S_IMODE((copy / "run.sh").stat().st_mode) == 0o755  # still executable
    assert os.readlink(copy / "model-link.py") == "pkg/model.py"  # leads to the copy's own
    assert not os.path.lexists(copy / "data")  # a link out of the repository: left out
    assert "leaves out project/data" in caplog.text and len(caplog.records) == 1
    kit = run_dir / "code" / "kit" / "slurm_ddp_kit"
    assert (kit / "core" / "snapshot" / "sources.py").is_file()
    assert (kit / "sbatch" / "ddp.sbatch").is_file() and (kit / "examples" / "quick.yaml").is_file()
    assert not list(kit.rglob("__pycache__"))
    commit = git(repo, "rev-parse", "HEAD")
    line = snapshot.describe(run_dir)
    assert line.startswith(f"code: the copy made at submission ({run_dir / 'code'}: ")
    assert f"project {repo} at git {commit[:7]} with uncommitted changes, copied 20" in line
    manifest = json.loads((run_dir / "code" / "manifest.json").read_text())
    project = next(part for part in manifest["parts"] if part["copy"] == "project")
    assert (project["source"], project["commit"], project["changed"]) == (str(repo), commit, True)
    assert project["files"] == 8 and project["left_out"] == 1  # .gitignore and the link count


def test_an_edit_after_the_snapshot_changes_nothing_a_job_runs(tmp_path: Path, repo: Path) -> None:
    """A job started from the copy (its folder, its PYTHONPATH) imports the kit and the user's
    code as they were at submission, whatever the checkout holds by then."""
    run_dir = snap(tmp_path, repo, pythonpath=str(repo))
    (repo / "train.py").write_text("VALUE = 'edited after submission'\n")
    (repo / "pkg" / "model.py").write_text("WIDTH = 9\n")
    workdir, pythonpath = snapshot.job_paths(run_dir, {"PYTHONPATH": str(repo)}, tmp_path)
    code = run_dir / "code"
    assert workdir == code / "project"
    assert pythonpath == [str(code / "kit"), str(code / "project")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import slurm_ddp_kit, train, pkg.model; "
            "print(slurm_ddp_kit.__file__, train.VALUE, pkg.model.WIDTH)",
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    kit_file = code / "kit" / "slurm_ddp_kit" / "__init__.py"
    assert done.stdout.split() == [str(kit_file), "edited", "8"]


def test_the_working_folder_and_pythonpath_map_into_the_copy(tmp_path: Path, repo: Path) -> None:
    """Entries the copy holds map to it; the rest (a folder outside, an ignored one) are the
    job's own, as is a working folder that was not copied."""
    (repo / "src").mkdir()
    (repo / "src" / "lib.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    launching = os.pathsep.join([str(repo / "src"), str(elsewhere), str(repo / "build")])
    run_dir = snap(tmp_path, repo / "sub", pythonpath=launching)
    code = run_dir / "code"
    workdir, pythonpath = snapshot.job_paths(run_dir, {"PYTHONPATH": launching}, tmp_path)
    assert workdir == code / "project" / "sub"
    assert pythonpath == [
        str(code / "kit"),
        str(code / "project" / "src"),
        str(elsewhere),
        str(repo / "build"),  # ignored: not copied, so the job's own entry
    ]
    # The job's own environment decides what is on its path: an entry it lacks is not added.
    assert snapshot.job_paths(run_dir, {}, tmp_path)[1] == [str(code / "kit")]
    # A working folder git does not list (ignored) is not copied: the job starts where it does.
    run_dir = snap(tmp_path, repo / "build", name="from-build")
    assert snapshot.job_paths(run_dir, {}, tmp_path) == (tmp_path, [str(run_dir / "code/kit")])


def test_outside_any_repository_only_the_kit_is_copied(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.py").write_text("")
    run_dir = snap(tmp_path, plain, pythonpath=str(plain))
    assert sorted(p.name for p in (run_dir / "code").iterdir()) == ["kit", "manifest.json"]
    assert "; the kit alone, copied " in snapshot.describe(run_dir)
    assert snapshot.job_paths(run_dir, {"PYTHONPATH": str(plain)}, plain) == (
        plain,
        [str(run_dir / "code" / "kit"), str(plain)],
    )


def test_code_folders_are_copied_whole_but_for_git_and_caches(tmp_path: Path, repo: Path) -> None:
    lib = tmp_path / "mylib"
    (lib / "inner").mkdir(parents=True)
    (lib / "inner" / "mod.py").write_text("X = 1\n")
    (lib / ".git").mkdir()
    (lib / ".git" / "HEAD").write_text("ref\n")
    (lib / "__pycache__").mkdir()
    (lib / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    os.mkfifo(lib / "pipe")  # no regular file: left out, never read (it would block)
    run_dir = snap(tmp_path, repo, pythonpath=str(lib), folders=["../mylib"])
    copy = run_dir / "code" / "folders" / "1-mylib"
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == ["inner", "inner/mod.py"]
    assert "1 folder of code.folders" in snapshot.describe(run_dir)
    assert snapshot.job_paths(run_dir, {"PYTHONPATH": str(lib)}, tmp_path)[1][1] == str(copy)
    with pytest.raises(SnapshotError, match=r"^code.folders names nowhere, and .+ is no folder: "):
        snapshot.plan(config(folders=["nowhere"]), repo)


def test_the_runs_and_the_data_are_no_code(tmp_path: Path, repo: Path) -> None:
    """output.root and data.root inside the repository, and not ignored there, stay out (else
    each run would copy the runs before it, checkpoints and all); so do they in code.folders."""
    (repo / "lib" / "runs").mkdir(parents=True)
    (repo / "lib" / "runs" / "state.pt").write_bytes(b"\0" * 100)
    (repo / "lib" / "mod.py").write_text("")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "all")
    for folder in ("runs/old-run", "datasets"):  # untracked, not ignored
        (repo / folder).mkdir(parents=True)
        (repo / folder / "state.pt").write_bytes(b"\0" * 100)
    cfg = Config(code=CodeConfig(folders=["lib"]))
    cfg.output.root, cfg.data.root = "runs", str(repo / "datasets")

    def copied() -> list[str]:
        parts = snapshot.plan(cfg, repo).parts[1:]  # the project, then the folder
        return sorted(f"{part.copy}/{e.path}" for part in parts for e in part.entries)

    states = [path for path in copied() if path.endswith("state.pt")]
    assert states == ["folders/1-lib/runs/state.pt", "project/lib/runs/state.pt"]
    assert "folders/1-lib/mod.py" in copied() and "project/lib/mod.py" in copied()
    assert snapshot.plan(cfg, repo).parts[1].changed is False  # new runs change no code
    cfg.output.root = "lib/runs"
    states = [path for path in copied() if path.endswith("state.pt")]
    assert states == ["project/runs/old-run/state.pt"]
    assert snapshot.plan(cfg, repo).parts[1].changed is True  # runs/ is a new folder now


def test_over_the_limit_auto_runs_the_live_code_saying_so(
    tmp_path: Path, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (repo / "weights.bin").write_bytes(b"\0" * (2 << 20))  # untracked, not ignored: counted
    planned = snapshot.plan(config(max_mb=1), repo)
    size = f"{planned.bytes / 2**20:.1f} MB"  # the weights' 2 MB and the kit's own
    assert f"no snapshot: the code is {size}, over code.max_mb=1" in snapshot.describe_plan(planned)
    with caplog.at_level(logging.WARNING, logger="kit"):
        run_dir = snap(tmp_path, repo, max_mb=1)
    [warning] = caplog.messages
    assert warning.startswith(f"warning: the code to copy is {size}, over code.max_mb=1 (of it ")
    assert "the largest weights.bin of 2.0 MB" in warning and "raise code.max_mb" in warning
    assert sorted(p.name for p in (run_dir / "code").iterdir()) == ["manifest.json"]
    assert snapshot.describe(run_dir) == (
        f"code: the live checkout (no snapshot: the code was {size}, over code.max_mb=1: raise "
        "code.max_mb to copy it)"
    )
    assert snapshot.job_paths(run_dir, {"PYTHONPATH": "a"}, tmp_path) == (tmp_path, ["a"])


def test_over_the_limit_on_is_one_line_naming_the_fix(repo: Path) -> None:
    (repo / "weights.bin").write_bytes(b"\0" * (2 << 20))
    with pytest.raises(SnapshotError) as refused:
        snapshot.plan(config(snapshot=ON, max_mb=1), repo)
    message = str(refused.value)
    assert "\n" not in message
    assert re.match(
        r"code.snapshot=on: the code to copy is \d\.\d MB, over code.max_mb=1 ", message
    )
    assert "raise code.max_mb (e.g. code.max_mb=64)" in message and "code.snapshot=auto" in message


def test_off_copies_nothing_and_says_so(tmp_path: Path, repo: Path) -> None:
    run_dir = snap(tmp_path, repo, snapshot=OFF)
    assert snapshot.describe(run_dir) == "code: the live checkout (no snapshot: code.snapshot=off)"
    assert sorted(p.name for p in (run_dir / "code").iterdir()) == ["manifest.json"]
    assert snapshot.job_paths(run_dir, {"PYTHONPATH": "a:b"}, tmp_path) == (tmp_path, ["a", "b"])
    older = tmp_path / "older"  # a run folder of a kit before snapshots
    older.mkdir()
    assert "no snapshot: the run was made without one" in snapshot.describe(older)
    (older / "code").mkdir()  # a copy cut short: no manifest, so never used
    assert "was cut short" in snapshot.describe(older)
    assert snapshot.job_paths(older, {}, tmp_path) == (tmp_path, [])


def test_a_full_disk_is_one_line_and_leaves_no_half_copy(
    tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(source: str, target: Path) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot, "_copy_file", full)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(SnapshotError) as refused:
        snapshot.take(run_dir, snapshot.plan(config(), repo))
    assert str(refused.value) == (
        f"could not copy the code into {run_dir / 'code'}: No space left on device; free space "
        "there, or set code.snapshot=off to run the live code"
    )
    assert list(run_dir.iterdir()) == []


def test_a_sweeps_runs_share_one_copy_through_hard_links(tmp_path: Path, repo: Path) -> None:
    first = snap(tmp_path, repo, pythonpath=str(repo))
    second = tmp_path / "runs" / "second"
    second.mkdir()
    snapshot.share(first, second)
    one, two = (run / "code" / "project" / "train.py" for run in (first, second))
    assert one.stat().st_ino == two.stat().st_ino  # the bytes once
    assert os.readlink(second / "code" / "project" / "model-link.py") == "pkg/model.py"
    assert stat.S_IMODE((second / "code" / "project" / "run.sh").stat().st_mode) == 0o755
    workdir, pythonpath = snapshot.job_paths(second, {"PYTHONPATH": str(repo)}, tmp_path)
    assert workdir == second / "code" / "project"  # the second run's own copy
    assert pythonpath == [str(second / "code" / "kit"), str(workdir)]
    assert snapshot.describe(second).startswith(f"code: the copy made at submission ({second}")


def test_sharing_across_file_systems_copies(
    tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = snap(tmp_path, repo)
    second = tmp_path / "runs" / "second"
    second.mkdir()

    def cross_device(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    snapshot.share(first, second)
    one, two = (run / "code" / "project" / "run.sh" for run in (first, second))
    assert one.stat().st_ino != two.stat().st_ino and two.read_text() == one.read_text()
    assert stat.S_IMODE(two.stat().st_mode) == 0o755
    nothing = tmp_path / "runs" / "nothing"
    nothing.mkdir()
    with pytest.raises(SnapshotError, match="holds no whole code snapshot to share"):
        snapshot.share(nothing, tmp_path / "runs" / "second")


def _manifest(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "code" / "manifest.json").read_text())


def _crafted(run_dir: Path, change: str) -> None:
    """Damage the run's manifest one way, as a hand or another user could."""
    path = run_dir / "code" / "manifest.json"
    manifest = _manifest(run_dir)
    if change == "dot-dot":
        manifest["workdir"] = {"source": "/x", "copy": "project/../../../../etc"}
    elif change == "absolute":
        manifest["pythonpath"] = [{"source": "/x", "copy": "/usr/lib/python3"}]
    elif change == "wrong-type":
        manifest["files"] = "many"
    elif change == "part-type":
        manifest["parts"] = [{"copy": "project", "source": "/x", "files": 1, "bytes": 1}]
    elif change == "newer":
        manifest["schema"] = 99
    elif change == "link-out":
        (run_dir / "code" / "project" / "evil").symlink_to("/usr/lib")
        manifest["workdir"] = {"source": "/x", "copy": "project/evil"}
    elif change == "missing":
        manifest["workdir"] = {"source": "/x", "copy": "project/nowhere"}
    if change == "huge":
        path.write_text(json.dumps(manifest) + " " * (2 << 20))
    elif change == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif change == "manifest-link":
        elsewhere = run_dir.parent / "elsewhere.json"
        elsewhere.write_text(json.dumps(manifest))
        path.unlink()
        path.symlink_to(elsewhere)
    else:
        path.write_text(json.dumps(manifest))


CRAFTED = {
    "dot-dot": "it names 'project/../../../../etc', not a path inside code/",
    "absolute": "it names '/usr/lib/python3', not a path inside code/",
    "wrong-type": "its files is 'many', not int",
    "part-type": "its parts[0].left_out is missing, not int",
    "newer": "its schema 99 is newer than this kit's 1",
    "link-out": "project/evil leads out of code/",
    "missing": "project/nowhere is not in the copy",
    "huge": "it is over 1,048,576 bytes",
    "deep": "it is no JSON",
    "manifest-link": "it is a symbolic link",
}


@pytest.mark.parametrize("change", list(CRAFTED))
def test_a_crafted_manifest_is_refused_in_one_line(tmp_path: Path, repo: Path, change: str) -> None:
    run_dir = snap(tmp_path, repo, pythonpath=str(repo))
    _crafted(run_dir, change)
    with pytest.raises(SnapshotError) as refused:
        snapshot.job_paths(run_dir, {"PYTHONPATH": "/x"}, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and CRAFTED[change] in message
    assert message.startswith(f"{run_dir / 'code' / 'manifest.json'} is damaged: ")
    assert message.endswith(
        "start a new run (or, to run the live code, move the run's code/ folder away)"
    )


def test_a_code_folder_that_is_a_link_is_refused(tmp_path: Path, repo: Path) -> None:
    made = snap(tmp_path, repo)
    run_dir = tmp_path / "runs" / "linked"
    run_dir.mkdir()
    (run_dir / "code").symlink_to(made / "code")  # another run's copy, or anything else
    with pytest.raises(SnapshotError, match=r"code is a symbolic link; "):
        snapshot.describe(run_dir)


def test_the_settings_read_as_written_and_bad_values_name_the_fix(tmp_path: Path) -> None:
    assert load_config(overrides=["code.snapshot=off"]).code.snapshot == OFF  # not YAML's false
    assert load_config(overrides=["code.snapshot=on"]).code.snapshot == ON
    file = tmp_path / "exp.yaml"
    file.write_text("code:\n  snapshot: off\n  folders: [../lib]\n  max_mb: 200\n")
    cfg = load_config([file])
    assert (cfg.code.snapshot, cfg.code.folders, cfg.code.max_mb) == (OFF, ["../lib"], 200)
    back = tmp_path / "config.yaml"
    back.write_text(to_yaml(cfg))
    assert load_config([back]).code == cfg.code
    assert load_config().code == CodeConfig(snapshot=AUTO, folders=[], max_mb=64)
    refusals = {
        "code.max_mb=0": "code.max_mb=0 must be between 1 and 1048576; to copy no code at all, "
        "set code.snapshot=off",
        "code.max_mb=2000000": "code.max_mb=2000000 must be between 1 and 1048576",
        "code.snapshot=maybe": "code.snapshot='maybe' is not valid; choose one of: auto, on, off",
        "code.folders=['']": "code.folders holds an empty path: give each folder of code to copy",
    }
    for override, line in refusals.items():
        with pytest.raises(ConfigError) as refused:
            load_config(overrides=[override])
        assert str(refused.value).startswith(line)


def test_the_kits_package_data_is_where_pyproject_puts_it() -> None:
    """The copy of the kit holds what a wheel ships: pyproject.toml's package-dir and data."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = {
        package.removeprefix("slurm_ddp_kit."): (folder, tuple(p.removeprefix("*") for p in data))
        for package, folder in tool["package-dir"].items()
        for data in [tool["package-data"][package]]
    }
    assert declared == snapshot.KIT_DATA
    assert runfolder.code_dir(Path("r")) == Path("r") / runfolder.CODE


def test_a_task_started_after_the_setup_lines_runs_the_copy(
    tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lines a job's set-up runs before its tasks: a shell that runs them, then Python, is in
    the copy of the launching folder and imports the copied kit and project; without a copy
    there are none."""
    run_dir = snap(tmp_path, repo, pythonpath=str(repo))
    (repo / "train.py").write_text("VALUE = 'edited after submission'\n")
    monkeypatch.setenv("PYTHONPATH", str(repo))
    lines = snapshot.setup_lines(run_dir)
    show = (
        "import os, slurm_ddp_kit, train; print(os.getcwd(), slurm_ddp_kit.__file__, train.VALUE)"
    )
    script = "\n".join([*lines, f"{shlex.quote(sys.executable)} -c {shlex.quote(show)}"])
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    code = run_dir / "code"
    kit_file = code / "kit" / "slurm_ddp_kit" / "__init__.py"
    assert done.stdout.split() == [str(code / "project"), str(kit_file), "edited"], done.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    assert snapshot.setup_lines(bare) == []


def test_a_program_named_by_absolute_paths_runs_the_copies_the_copy_holds(
    tmp_path: Path, repo: Path
) -> None:
    """The command and the Python script, where the copy holds them; other words, and paths it
    does not hold (an ignored file, one outside the project), as given."""
    run_dir = snap(tmp_path, repo)
    code = snapshot.job_code(run_dir, {}, tmp_path)
    copy = run_dir / "code" / "project"
    argv = ["python", "-u", str(repo / "train.py"), str(repo / "pkg" / "model.py")]
    assert snapshot.program_in_copy(code, argv) == ["python", "-u", str(copy / "train.py"),
                                                    str(repo / "pkg" / "model.py")]  # fmt: skip
    assert snapshot.program_in_copy(code, [str(repo / "run.sh")]) == [str(copy / "run.sh")]
    outside = str(tmp_path / "elsewhere.py")
    assert snapshot.program_in_copy(code, ["python", outside]) == ["python", outside]
    assert snapshot.program_in_copy(None, ["python", str(repo / "train.py")])[1] == str(
        repo / "train.py"
    )


def test_a_manifest_whose_part_leads_out_of_the_copy_maps_no_program(
    tmp_path: Path, repo: Path
) -> None:
    """A crafted manifest (run folders are others' data) naming a part outside code/: refused
    in one line, not followed."""
    run_dir = snap(tmp_path, repo)
    manifest = run_dir / "code" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["parts"][0]["copy"] = "../../.."
    manifest.write_text(json.dumps(data))
    code = snapshot.job_code(run_dir, {}, tmp_path)
    assert code is not None
    with pytest.raises(SnapshotError, match="not a path inside code/"):
        snapshot.program_in_copy(code, ["python", str(PACKAGE / "__init__.py")])
