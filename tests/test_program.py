"""A user's own program launched by the kit (`launch submit … -- python my_train.py ARGS`, or
`sbatch slurm/ddp.sbatch … -- python my_train.py ARGS`): each task gets its place in the job, the
program's records and failures are reported as the kit's own loop's are, and a program that saves
on a stop is requeued and goes on."""

from __future__ import annotations

import contextlib
import json
import math
import os
import reprlib
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from kit import (
    REPO,
    alive,
    in_project,
    kit,
    kit_here,
    project,
    records,
    run_folder,
    submit_without_pipes,
    wait_for,
)
from slurm_cluster import SlurmCluster

EXAMPLE = str(REPO / "docs" / "examples" / "ddp_script.py")

# Writes the place each task was given, one JSON file per rank, then exits as RANK says.
PLACE = """
import json, os, sys
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "KIT_RUN_DIR", "KIT_CHECKPOINT_DIR")
with open(os.path.join(sys.argv[1], "rank-" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"env": {n: os.environ.get(n) for n in names}, "argv": sys.argv[2:]}, f)
if os.environ["RANK"] == sys.argv[2]:
    sys.exit("rank " + os.environ["RANK"] + " gave up: no data here")
"""


def _submit(
    tmp_path: Path, *settings: str, program: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return kit(
        "launch", "submit", *settings, f"output.root={tmp_path}/runs", "--wait", "--", *program,
        env=env, timeout=480,
    )  # fmt: skip


def _place(tmp_path: Path) -> list[str]:
    """The command of PLACE, written into the test's folder."""
    script = tmp_path / "place.py"
    script.write_text(PLACE)
    return [sys.executable, str(script)]


Made = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """The example script, 3 epochs, under --mode dp and --mode ddp on 2 local "GPUs": each run's
    folder and what `--wait` printed. Made once: several tests read them."""
    tmp = tmp_path_factory.mktemp("example")
    made = {}
    for mode in ("dp", "ddp"):
        done = _submit(
            tmp, "--mode", mode, "cluster.backend=local", "cluster.gpus_per_node=2",
            program=[sys.executable, EXAMPLE, "--epochs", "3"],
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        made[mode] = (run_folder(done.stdout), done)
    return made


def test_a_users_ddp_script_trains_and_its_records_are_shown(example_runs: Made) -> None:
    """The example script (its own model, loss, DataLoader and schedule) on two local ranks:
    `--wait` shows what it logged and its end; every rank starts, logs and ends; its checkpoint
    is in the run folder."""
    folder, done = example_runs["ddp"]
    lines = done.stdout.splitlines()
    # The script, named by its path in the checkout, runs from the run's code copy.
    script = folder / "code" / "project" / Path(EXAMPLE).relative_to(REPO)
    assert f"2 rank(s) started `{sys.executable} {script} --epochs 3`" in lines
    logged = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(",")[0] for line in logged] == ["epoch 1", "epoch 2", "epoch 3"], lines
    assert "accuracy 1" in logged[-1] and "lr 0" in logged[-1]
    assert (
        lines[-1].startswith("job ")
        and " done: the program ended with status 0 after " in lines[-1]
    )
    for rank in (0, 1):
        start, *logs, summary = records(folder, rank)
        assert (start["kind"], start["task"], start["rank"], start["world_size"]) == (
            "start", "program", rank, 2,
        )  # fmt: skip
        assert [r["fields"]["epoch"] for r in logs] == [1, 2, 3]
        assert (summary["kind"], summary["exit_code"]) == ("summary", 0)
    assert (folder / "checkpoints" / "program" / "last.pt").is_file()
    status = kit("launch", "status", str(folder))
    assert status.returncode == 0 and " COMPLETED " in status.stdout, status.stdout


def test_each_task_gets_its_place_and_the_failing_rank_is_named(tmp_path: Path) -> None:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and the run folder's places
    reach every task; `{train.lr}` in an argument is the run's setting; the rank that failed is
    named with the program's own last words, and the run's status says FAILED."""
    out = tmp_path / "places"
    out.mkdir()
    done = _submit(
        tmp_path, "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=3",
        "train.lr=0.25", program=[*_place(tmp_path), str(out), "2", "--lr={train.lr}"],
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    folder = run_folder(done.stdout)
    places = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(3)]
    for rank, place in enumerate(places):
        env = place["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert env["KIT_RUN_DIR"] == str(folder)
        assert env["KIT_CHECKPOINT_DIR"] == str(folder / "checkpoints" / "program")
        assert place["argv"] == ["2", "--lr=0.25"]
    assert len({(p["env"]["MASTER_ADDR"], p["env"]["MASTER_PORT"]) for p in places}) == 1
    assert int(places[0]["env"]["MASTER_PORT"]) > 0
    failed = next(line for line in done.stdout.splitlines() if " failed: " in line)
    assert failed.endswith(f"rank 2 on {records(folder, 2)[-1]['host']} failed first: "
                           f"{sys.executable} exited with status 1"), failed  # fmt: skip
    assert "rank 2 gave up: no data here" in done.stdout
    status = kit("launch", "status", str(folder))
    assert " FAILED " in status.stdout, status.stdout
    # summarize flags it as a failed run of the kit's loop: left out, named, the failing rank's
    # exit status said (the others may have been ended before they recorded theirs).
    summary = kit_here("analysis", "summarize", str(folder))
    assert summary.returncode == 1 and summary.stdout == "", summary.stdout
    skipped = f"skipped {folder.name}: the program failed (exit status per rank: status 1 on rank 2"
    assert skipped in summary.stderr.splitlines()[0], summary.stderr


def test_dp_runs_one_task_that_sees_the_whole_node(tmp_path: Path) -> None:
    """--mode dp: one task; a program that logs nothing still has a row in summarize's table,
    its wall time, with every figure it could not give left out (null in json)."""
    out = tmp_path / "places"
    out.mkdir()
    done = _submit(
        tmp_path, "--mode", "dp", "cluster.backend=local", "cluster.gpus_per_node=4",
        program=[*_place(tmp_path), str(out), "none"],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in out.iterdir()] == ["rank-0.json"]
    env = json.loads((out / "rank-0.json").read_text())["env"]
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1")
    folder = run_folder(done.stdout)
    summary = kit_here("analysis", "summarize", str(folder))
    assert summary.returncode == 0, summary.stderr
    ((heading, table),) = _program_tables(summary.stdout).items()
    assert f"program `{sys.executable} {tmp_path}/place.py {out} none`, 1 node(s) × 4" in heading
    assert table["runs"] == ["1", "0", ""]
    wall = records(folder)[-1]["total_seconds"]
    assert table["wall time per run"] == [f"{wall:.2f}", "n/m", "n/m"]
    assert list(table) == ["runs", "wall time per run"]
    left_out = "left out (null in csv/json): seconds per epoch, final accuracy, final loss, GPU"
    assert left_out in summary.stdout, summary.stdout
    tidy = json.loads(kit_here("analysis", "summarize", "--format", "json", str(folder)).stdout)
    values = {(r["metric"], r["mode"]): r["value"] for r in tidy["records"]}
    assert values[("epoch_s", "dp")] is None and values[("program_accuracy", "dp")] is None
    assert values[("wall_s", "dp")] == pytest.approx(wall)


def _program_tables(markdown: str) -> dict[str, dict[str, list[str]]]:
    """A program group's heading → its table as {row name, without its unit: [--mode dp,
    --mode ddp, the comparison]}."""
    tables = {}
    for block in markdown.split("## ")[1:]:
        heading, *lines = block.splitlines()
        rows = [
            [c.strip() for c in line.strip("|").split("|")] for line in lines if line[:1] == "|"
        ]
        assert rows[0][1:3] == ["--mode dp (one task per node)", "--mode ddp (one task per GPU)"]
        tables[heading] = {row[0].split(" (")[0]: row[1:] for row in rows[2:]}
    return tables


def _epoch_seconds(folder: Path, ranks: int, ranks_from: int = 0) -> float:
    """The example's seconds per epoch as the table gives it: the median over epochs 2..N of
    the time between its records of consecutive epochs, the slowest rank's."""
    times = [
        {r["fields"]["epoch"]: r["time"] for r in records(folder, rank) if r["kind"] == "log"}
        for rank in range(ranks_from, ranks)
    ]
    epochs = sorted(times[0])[1:]
    return statistics.median(max(t[n] - t[n - 1] for t in times) for n in epochs)


def test_summarize_tables_a_programs_runs_beside_the_kits(
    example_runs: Made, small_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A kit DDP run and the example program's DP and DDP runs: the program's runs are one group
    of their own, with the seconds per epoch and the final accuracy and loss of their records;
    the kit's group reads as it did without them. The plot draws both groups."""
    dp, ddp = example_runs["dp"][0], example_runs["ddp"][0]
    alone = kit_here("analysis", "summarize", str(small_runs["ddp"]))
    plot = tmp_path / "both.png"
    both = kit_here(
        "analysis", "summarize", str(small_runs["ddp"]), str(dp), str(ddp), "--plot", str(plot)
    )
    assert alone.returncode == 0 and both.returncode == 0, both.stderr
    kits, programs = both.stdout.split("\n\n## ")
    assert kits + "\n" == alone.stdout  # the kit's group: every line as before
    ((heading, table),) = _program_tables("## " + programs).items()
    assert heading.startswith(f"Group 2: program `{sys.executable} {EXAMPLE} --epochs 3`")
    assert f"--mode dp (one task per node): {dp.name}; --mode ddp" in programs
    assert table["runs"] == ["1", "1", ""]
    seconds = table["seconds per epoch"]
    assert seconds[:2] == [f"{_epoch_seconds(dp, 1):.2f}", f"{_epoch_seconds(ddp, 2):.2f}"]
    assert seconds[2].endswith(("× faster", "× slower"))
    for row, field in (("final accuracy", "accuracy"), ("final loss", "loss")):
        logged = [
            f"{[r for r in records(run) if r['kind'] == 'log'][-1]['fields'][field]:.4f}"
            for run in (dp, ddp)
        ]
        assert table[row][:2] == logged, (row, table)
    walls = [max(records(run, rank)[-1]["total_seconds"] for rank in range(ranks))
             for run, ranks in ((dp, 1), (ddp, 2))]  # fmt: skip
    assert table["wall time per run"][:2] == [f"{wall:.2f}" for wall in walls]
    gpu = "GPU util main card, GPU util other cards, peak memory main card, peak memory other"
    assert f"left out (null in csv/json): {gpu} cards, energy per run." in programs
    assert plot.stat().st_size > 0 and both.stderr.splitlines()[-1] == f"plot: {plot}"


ONCE = """
import os, sys
marker = os.path.join(os.environ["KIT_CHECKPOINT_DIR"], "tried-" + os.environ["RANK"])
if os.environ["RANK"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit("rank 1: no data yet")
print("rank", os.environ["RANK"], "argv", sys.argv[1:])
"""


def test_a_failed_program_run_resumes_and_a_sweep_gives_each_run_its_values(tmp_path: Path) -> None:
    """`launch resume` starts the program again in its run folder (its checkpoint folder as
    left); a local sweep runs the program once per grid point, `{train.lr}` being each point's;
    the program may come from a settings file."""
    script = tmp_path / "once.py"
    script.write_text(ONCE)
    settings = ["cluster.backend=local", "cluster.gpus_per_node=2"]
    done = _submit(tmp_path, "--mode", "ddp", *settings, program=[sys.executable, str(script)])
    assert done.returncode == 1 and "rank 1: no data yet" in done.stdout, done.stdout
    folder = run_folder(done.stdout)
    again = kit("launch", "resume", str(folder), "--wait")
    assert again.returncode == 0 and " done: the program ended with status 0" in again.stdout, (
        again.stdout + again.stderr
    )
    assert "COMPLETED" in kit("launch", "status", str(folder)).stdout
    config = tmp_path / "program.yaml"
    config.write_text(f"program: [{sys.executable}, {script}, --lr, '{{train.lr}}']\n")
    sweep = kit(
        "launch", "sweep", "--modes", "ddp", "--config", str(config), *settings,
        "--grid", "train.lr=0.5,0.25", f"output.root={tmp_path}/sweep",
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    argvs = sorted(
        line.split("argv ", 1)[1]
        for log in (tmp_path / "sweep").rglob("*_0_log.out")
        for line in log.read_text().splitlines()
        if line.startswith("rank 0 argv")
    )
    assert argvs == ["['--lr', '0.25']", "['--lr', '0.5']"], argvs


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (
            ["--mode", "fsdp", "--", "python", "x.py"],
            "error: --mode fsdp wraps the kit's own loop; a program of yours chooses its strategy "
            "itself: give --mode ddp (one task per GPU) or --mode dp (one task per node)",
        ),
        (
            ["--mode", "ddp", "--", "no-such-command-here"],
            "error: the program `no-such-command-here` is not found here (the job looks for it "
            "the same way): give a path, or a command on PATH (e.g. `-- python my_train.py`)",
        ),
        (
            ["--mode", "ddp", "--", "python", "-u", "no_such_script.py", "--epochs", "3"],
            f"error: the program's script no_such_script.py is not a file in {REPO} (the job "
            "starts the program from this folder): check its path",
        ),
        (
            ["--mode", "ddp", "program=[python]", "--", "python", "x.py"],
            "error: -- python x.py and program=[python] both set program: give one of them",
        ),
        (
            ["--mode", "ddp", "--"],
            "error: nothing follows `--`: give the program to run, e.g. `-- python my_train.py "
            "--epochs 3` (see `python -m launch submit --help`)",
        ),
    ],
)
def test_a_program_the_kit_cannot_run_is_refused_in_one_line(
    tmp_path: Path, words: list[str], message: str
) -> None:
    done = kit("launch", "submit", "cluster.backend=local", f"output.root={tmp_path}/runs", *words)
    assert done.returncode == 2 and done.stderr.splitlines() == [message], done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slurm
def test_a_program_on_two_slurm_nodes_is_stopped_requeued_and_goes_on(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Two nodes through submitit on the test cluster, a one-minute limit: Slurm's warning stops
    the program, which saves and exits; the kit requeues the job and the program goes on from its
    checkpoint to its last epoch. Submitted with the console command from a user's project whose
    script is `train.py` and which has a `core/` of its own, on PYTHONPATH: nothing of it is
    taken for the kit's, in the launcher or in the tasks."""
    here = project(tmp_path)
    done = in_project(
        here, "submit", "--mode", "ddp", "--nodes", "2", "cluster.backend=slurm",
        "cluster.gpus_per_node=1", "cluster.cpus_per_task=1", "cluster.timeout_min=1",
        f"output.root={tmp_path}/runs", "--wait", "--", sys.executable, "train.py", "--epochs",
        "12", "--pause", "0.25", env=slurm_cluster.env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    folder = run_folder(done.stdout)
    starts = [r for r in records(folder) if r["kind"] == "start"]
    assert len(starts) >= 2, starts
    other = [r for r in records(folder, 1) if r["kind"] == "start"][-1]
    assert starts[-1]["node"] != other["node"], (starts[-1], other)  # a rank on each node
    stops = [r for r in records(folder) if r["kind"] == "stop"]
    assert stops and stops[0]["saved"] is True and stops[0]["requeue"], stops
    epochs = [r["fields"]["epoch"] for r in records(folder) if r["kind"] == "log"]
    assert epochs[-1] == 12 and sorted(set(epochs)) == list(range(1, 13)), epochs
    assert "started again (requeued or resumed)" in done.stdout


def test_train_run_of_a_program_run_runs_the_program_without_torch(tmp_path: Path) -> None:
    """`python -m train run RUN_DIR`, what the sbatch scripts start in each task, on a run folder
    whose config names a program (`launch prepare … -- PROGRAM`): the task runs the program, not
    the kit's loop, and never imports torch."""
    program = [sys.executable, "-c", "print('program ran')"]
    prepared = kit(
        "launch", "prepare", "--mode", "ddp", "cluster.gpus_per_node=1",
        f"output.root={tmp_path}/runs", "--", *program,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    run_dir = Path(prepared.stdout.strip())
    task = (
        "import sys\nfrom slurm_ddp_kit.train.__main__ import main\n"
        f"code = main(['run', {str(run_dir)!r}])\nprint('torch' in sys.modules, code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", task], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.splitlines() == ["program ran", "False 0"], done.stdout + done.stderr
    start, summary = records(run_dir)
    assert (start["task"], start["program"]) == ("program", program)
    assert (summary["kind"], summary["exit_code"]) == ("summary", 0)


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (
            ["--"],
            "error: nothing follows `--`: give the program to run, e.g. `-- python my_train.py "
            "--epochs 3` (see the usage lines at the top of slurm/ddp.sbatch)",
        ),
        (
            ["--", "no-such-command-here"],
            "error: the program `no-such-command-here` is not found here (the job looks for it "
            "the same way): give a path, or a command on PATH (e.g. `-- python my_train.py`)",
        ),
        (
            ["python", "my_train.py"],
            "error: override 'python' is not of the form key=value, e.g. train.epochs=3 (a "
            "program to run goes after `--`: `-- python my_train.py`)",
        ),
    ],
)
def test_a_program_the_sbatch_scripts_pass_on_is_refused_in_one_line(
    tmp_path: Path, words: list[str], message: str
) -> None:
    """What `sbatch slurm/ddp.sbatch WORDS` hands its `launch prepare`: one line, no run folder."""
    done = kit_here(
        "launch", "prepare", "--shell", "--mode", "ddp", "cluster.backend=slurm",
        f"output.root={tmp_path}/runs", *words,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.splitlines() == [message], done.stderr
    assert not (tmp_path / "runs").exists()


def _descendants(pid: int) -> list[int]:
    """The live processes below `pid`: a local job's tasks and the programs they run."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def _long_example_run(tmp_path: Path) -> Path:
    """The example on two local ranks for 50 slow epochs, submitted without waiting: its folder."""
    done = submit_without_pipes(
        tmp_path, "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=2",
        f"output.root={tmp_path}/runs", "--", sys.executable, EXAMPLE, "--epochs", "50",
        "--pause", "0.2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    return run_folder(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cancel_ends_a_running_program_run(tmp_path: Path) -> None:
    """`launch cancel` of a local program run in its first epochs: the job's controller, its
    tasks and the programs they run all end, the program writes no summary, and `status` says
    CANCELLED."""
    run_dir = _long_example_run(tmp_path)
    controller = int(json.loads((run_dir / "run.json").read_text())["job_id"])
    started: list[int] = []
    try:
        logged = lambda: any(r["kind"] == "log" for r in records(run_dir))  # noqa: E731
        assert wait_for(lambda: (run_dir / "metrics" / "rank-00000.jsonl").is_file(), 60)
        assert wait_for(logged, 120), "the program never logged an epoch"
        started = _descendants(controller)
        assert len(started) >= 4, started  # two tasks, each running the program
        assert " RUNNING " in kit("launch", "status", str(run_dir)).stdout

        cancelled = kit("launch", "cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"{run_dir.name}: cancelled local job {controller}"
        gone = lambda: not any(alive(pid) for pid in [controller, *started])  # noqa: E731
        assert wait_for(gone, 30), [pid for pid in started if alive(pid)]
        status = kit("launch", "status", str(run_dir))
        assert " CANCELLED " in status.stdout, status.stdout
        assert all(r["kind"] != "summary" for rank in (0, 1) for r in records(run_dir, rank))
    finally:
        for pid in [controller, *started]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_a_stop_only_one_rank_saw_ends_every_rank_of_the_example_at_one_epoch(
    tmp_path: Path,
) -> None:
    """Slurm's warning reaches each task at its own moment; here only rank 1's task has seen it
    (its stop file, as the task writes it). The example agrees on the stop, so both ranks save and
    end after the same epoch: none is left in a collective its peer has quit."""
    run_dir = _long_example_run(tmp_path)
    job = json.loads((run_dir / "run.json").read_text())["job_id"]
    rank_file = run_dir / "metrics" / "rank-00001.jsonl"
    logged = lambda: rank_file.is_file() and any(r["kind"] == "log" for r in records(run_dir, 1))  # noqa: E731
    assert wait_for(logged, 120), "rank 1 never logged an epoch"
    (run_dir / "logs" / f".stop-{job}-1").touch()
    ended = lambda: all(records(run_dir, rank)[-1]["kind"] == "summary" for rank in (0, 1))  # noqa: E731
    assert wait_for(ended, 120), kit("launch", "logs", str(run_dir)).stdout
    last = [[r["fields"]["epoch"] for r in records(run_dir, rank) if r["kind"] == "log"][-1]
            for rank in (0, 1)]  # fmt: skip
    assert last[0] == last[1] < 50, last
    assert [records(run_dir, rank)[-1]["exit_code"] for rank in (0, 1)] == [0, 0]


@pytest.mark.slurm
def test_the_sbatch_script_runs_a_users_program(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sbatch slurm/ddp.sbatch SETTINGS -- python docs/examples/ddp_script.py --epochs 2` from the
    repository, the kit's environment active: each of the job's two tasks runs the program (not
    the kit's loop), its epochs are in the run folder's records, and `launch status` says
    COMPLETED. `--` with nothing after it ends the job in one line."""
    monkeypatch.setenv("KIT_PYTHON", sys.executable)  # sbatch passes the environment on
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    # `python` is the environment's, as where a user activated it.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    program = ["python", "docs/examples/ddp_script.py", "--epochs", "2"]
    state, out = _sbatch_script(slurm_cluster, tmp_path, "--", *program)
    assert state == "COMPLETED", out
    run_dir = Path(out.split("run folder: ")[1].split()[0])
    assert json.loads((run_dir / "run.json").read_text())["launcher"] == "sbatch"
    for rank in (0, 1):
        start, *logs, summary = records(run_dir, rank)
        assert (start["kind"], start["task"], start["source"]) == ("start", "program", "slurm")
        assert (start["rank"], start["world_size"], start["program"]) == (rank, 2, program)
        assert [r["fields"]["epoch"] for r in logs] == [1, 2], logs
        assert (summary["kind"], summary["exit_code"]) == ("summary", 0)
    assert (run_dir / "checkpoints" / "program" / "last.pt").is_file()
    status = kit("launch", "status", str(run_dir), env=slurm_cluster.env)
    assert status.returncode == 0 and " COMPLETED " in status.stdout, status.stdout

    state, out = _sbatch_script(slurm_cluster, tmp_path / "bad", "--")
    assert state == "FAILED", out
    assert out.splitlines() == [
        "error: nothing follows `--`: give the program to run, e.g. `-- python my_train.py "
        "--epochs 3` (see the usage lines at the top of slurm/ddp.sbatch)"
    ], out
    assert not (tmp_path / "bad" / "runs").exists()


def _sbatch_script(cluster: SlurmCluster, tmp: Path, *words: str) -> tuple[str, str]:
    """slurm/ddp.sbatch on two tasks of one node, one CPU each, submitted from the repository and
    waited for: the job's final state and its Slurm log."""
    tmp.mkdir(exist_ok=True)
    done = cluster.run(
        "sbatch", "--parsable", "--wait", "--cpus-per-task=1", "--ntasks-per-node=2",
        "--gpus-per-node=2", f"--output={tmp}/slurm-%j.out", "slurm/ddp.sbatch",
        f"output.root={tmp}/runs", *words, cwd=REPO, timeout=300,
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    assert job_id, done.stderr
    return cluster.wait_job(job_id), (tmp / f"slurm-{job_id}.out").read_text()


def test_what_a_program_logged_is_read_defensively(example_runs: Made, tmp_path: Path) -> None:
    """A program's `fields` may hold anything: an epoch that is no whole number, a loss past
    float's range, an accuracy in words, a NaN. Each such value is n/m (said once on stderr),
    never a figure, and never stops the command; a `fields` that is no mapping is a skipped
    record, said in one warning."""
    made = example_runs["ddp"][0]
    run = Path(shutil.copytree(made, tmp_path / made.name))  # a copy: the fixture's stays whole
    path = run / "metrics" / "rank-00000.jsonl"
    odd = iter([{"epoch": "one", "accuracy": "high"}, {"epoch": True, "loss": 10**400},
                {"epoch": 3.5, "test_accuracy": math.nan, "loss": 10**400}])  # fmt: skip
    edited = [r | {"fields": next(odd)} if r["kind"] == "log" else r for r in records(run)]
    lines = [json.dumps(r) for r in edited]
    path.write_text("\n".join([*lines[:-1], json.dumps(edited[1] | {"fields": [1]}), lines[-1]]))
    done = kit_here("analysis", "summarize", str(run))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    ((_, table),) = _program_tables(done.stdout).items()
    # Rank 1's records are untouched: its epochs still give the seconds per epoch.
    assert table["seconds per epoch"][1] == f"{_epoch_seconds(run, 2, ranks_from=1):.2f}"
    assert "final accuracy" not in table and "final loss" not in table
    said = done.stderr.splitlines()
    assert said[0].startswith(f"warning: {path}:5: record skipped: its fields is [1], not dict")
    assert said[1:] == [
        f"note {run.name}: rank 0's last `test_accuracy` is nan, not a finite number: n/m",
        f"note {run.name}: rank 0's last `loss` is {reprlib.repr(10**400)}, not a finite "
        "number: n/m",
    ]


class _StandInNvml:
    """NVML's calls the outside sampler makes, for two cards, on a machine without any: card 1
    runs `pids` (their memory 512 MiB each), busy at 80 %; its energy counter moves 1 J a call."""

    class NVMLError(Exception):
        pass

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.energy = pids, 0

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, card: int) -> list[object]:
        found = self.pids if card == 1 else [os.getpid()]  # card 0: someone else's
        return [type("P", (), {"pid": pid, "usedGpuMemory": 512 << 20})() for pid in found]

    def nvmlDeviceGetUtilizationRates(self, card: int) -> object:
        return type("U", (), {"gpu": 80})()

    def nvmlDeviceGetName(self, card: int) -> str:
        return f"Card {card}"

    def nvmlDeviceGetTotalEnergyConsumption(self, card: int) -> int:
        self.energy += 1000
        return self.energy


def test_the_outside_sampler_finds_a_programs_card_by_its_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program whose GPU work runs in a process it started (a shell's child here): the card
    that lists that process is the program's, sampled from when it was found; a card of other
    processes is not. Its figures are a summary's `gpus` entry. (NVML stood in for: this machine
    has no GPU; test_gpu.py runs the same on a real one.)"""
    from slurm_ddp_kit.train import outside

    program = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        assert wait_for(lambda: bool(outside.processes.descendants(program.pid)), 10)
        (worker,) = outside.processes.descendants(program.pid)
        nvml = _StandInNvml([worker])
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        sampler = outside.OutsideSampler(program.pid, interval_s=3600)  # sampled by hand
        for _ in range(3):
            sampler.sample()
        (card,) = sampler.close()
    finally:
        program.kill()
        program.wait()
    assert card == {
        "cuda_index": None, "name": "Card 1", "util_pct": 80.0, "util_samples": 3,
        "nvml_used_mb_peak": 512.0, "energy_j": 1.0,
    }  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML here: no figure, no failure
    assert outside.OutsideSampler(os.getpid()).close() == []
