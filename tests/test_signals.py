"""Slurm's warning (SIGUSR2) and preemption (SIGTERM) reach every process of a job step at any
instant. From the first instruction of a kit process on, neither ends it, nor any process it
starts: they are held until the job acts on them at a step boundary (`train.early`)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from kit import REPO, SMALL, free_port, kit
from paced import LASTING

from slurm_ddp_kit.core import runfolder, slurm
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.launch.executor import task_python

STOP = (signal.SIGUSR2, signal.SIGTERM)

# Starts every kind of process a job starts, while the signals keep coming: a DataLoader worker
# (fork), a forkserver worker (as the largest-batch search's) and a plain command.
PROBE = """
import multiprocessing, subprocess, sys, time
import torch
from torch.utils.data import DataLoader
from slurm_ddp_kit.train import early

def square(x):
    return x * x

def ended_by_terminate(context):  # a worker the job ends itself, as a pool's exit does
    worker = context.Process(target=time.sleep, args=(60,))
    worker.start()
    time.sleep(0.5)  # outside signals reach it meanwhile, and pass it by
    # Standard signals do not queue: a SIGTERM sent while one from outside is still pending is
    # merged into it (every 50 ms here, under load), so the job's own is sent again if need be.
    for _ in range(20):
        worker.terminate()
        worker.join(1)
        if worker.exitcode is not None:
            break
    return worker.exitcode

if __name__ == "__main__":
    batches = [b.tolist() for b in DataLoader(list(range(4)), batch_size=2, num_workers=1)]
    with early.forkserver().Pool(1) as pool:  # the largest-batch search's workers
        squares = pool.map(square, range(4))
    slept = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"]).returncode
    forked = ended_by_terminate(multiprocessing.get_context("fork"))
    served = ended_by_terminate(early.forkserver())
    print("batches", batches, "squares", squares, "slept", slept)
    print("terminated", forked, served)
    print("held", sorted(early.take()))
"""


def _covered(pid: int) -> bool:
    """Whether the process ignores or blocks SIGUSR2 and SIGTERM yet: the task's shell has set
    its trap, or the kit's first instruction has run."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = (re.search(rf"^{f}:\s*(\w+)", status, re.M) for f in ("SigBlk", "SigIgn"))
    mask = 0
    for found in masks:
        mask |= int(found.group(1), 16) if found else 0
    return all(mask & (1 << (s - 1)) for s in STOP)


def _signalled_throughout(command: list[str], env: dict[str, str], signals: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """Run `command` in its own process group (as a job step is) and send `signals` to the whole
    group every 50 ms from the moment it ignores or holds them (its first instruction, or the
    trap of the task's shell) until it ends."""
    process = subprocess.Popen(
        command, cwd=REPO, env=env, start_new_session=True, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not _covered(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    sent = 0
    while process.poll() is None and time.monotonic() < deadline + 300:
        for signum in signals:
            try:
                os.killpg(process.pid, signum)
                sent += 1
            except ProcessLookupError:
                break
        time.sleep(0.05)
    out, err = process.communicate()
    return process.returncode, out, err, sent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])}


def test_no_process_of_a_task_dies_of_the_stop_signals(tmp_path: Path) -> None:
    """submitit's task command with the kit's start ahead of it: the heavy import, workers of
    every kind and a subprocess all live through both signals, sent over and over, and the
    workers still end when the task itself terminates them."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{_env()['PYTHONPATH']}"}
    command = [*shlex.split(task_python(load_config())), "-u", "-m", "probe"]  # as submitit's srun
    code, out, err, sent = _signalled_throughout(command, env, STOP)
    assert code == 0 and sent > 10, (code, sent, err)
    assert "batches [[0, 1], [2, 3]] squares [0, 1, 4, 9] slept 0" in out
    assert "terminated 143 143" in out, out  # its own SIGTERM still ends a worker
    assert f"held [{signal.SIGUSR2.value}, {signal.SIGTERM.value}]" in out


def test_a_warning_during_start_up_stops_the_job_at_a_step_with_its_state_saved(
    tmp_path: Path,
) -> None:
    """The sbatch path's `python -m train run`, warned from its first instruction to its end
    (imports, data, a DataLoader worker's start): it saves and says how to continue."""
    prepared = kit(
        "launch", "prepare", "--mode", "dp", *SMALL, "data.num_workers=1",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    run_dir = Path(prepared.stdout.strip().splitlines()[-1])
    command = [*slurm.TASK_START, sys.executable, "-m", "train", "run", str(run_dir)]
    code, _, err, sent = _signalled_throughout(command, _env(), (signal.SIGUSR2,))
    assert code == 2 and sent > 10, (code, sent, err)
    assert re.search(
        r"stopped by time limit \(SIGUSR2\) at epoch 1, batch \d+, checkpoint saved: continue "
        rf"with `python -m launch resume {re.escape(str(run_dir))}`",
        err,
    ), err
    assert runfolder.checkpoint_path(run_dir).is_file(), err


def test_a_cancelled_rank_ends_at_once_while_it_waits_for_a_stalled_peer(tmp_path: Path) -> None:
    """As Slurm cancels a step (SIGTERM to every process) after `launch cancel` marked the run:
    rank 0, waiting in a collective for a peer stopped dead, ends within seconds instead of at
    dist.timeout_s or Slurm's SIGKILL, and writes nothing more."""
    prepared = kit(
        "launch", "prepare", "--mode", "ddp", "cluster.gpus_per_node=2", "cluster.cpus_per_task=1",
        *LASTING, "train.epochs=50", "dist.timeout_s=300",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
    )  # fmt: skip
    run_dir = Path(prepared.stdout.strip().splitlines()[-1])
    port = free_port()
    dist = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "train", "run", str(run_dir)],
            env={**_env(), **dist, "MASTER_PORT": str(port), "RANK": r, "LOCAL_RANK": r},
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in ("0", "1")
    ]
    try:
        deadline = time.monotonic() + 240
        while not runfolder.of_kind(runfolder.read_rank(run_dir, 0), "epoch"):
            assert time.monotonic() < deadline and ranks[0].poll() is None, "no first epoch"
            time.sleep(0.3)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        time.sleep(2)  # rank 0 now waits for rank 1 in the next all-reduce
        runfolder.update_meta(run_dir, cancel_requested=True)
        written = runfolder.metrics_path(run_dir, 0).stat().st_size
        for rank in ranks:
            os.kill(rank.pid, signal.SIGTERM)
        assert ranks[0].wait(timeout=20) == 143
        assert runfolder.metrics_path(run_dir, 0).stat().st_size == written
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_both_sbatch_scripts_start_each_task_through_the_shell_that_ignores_them() -> None:
    """The sbatch path's tasks start as the submit path's do (`core.slurm.TASK_START`)."""
    for script in ("ddp.sbatch", "dp.sbatch"):
        text = (REPO / "slurm" / script).read_text()
        srun = " ".join(text[text.index("\nsrun ") :].replace("\\\n", " ").split())
        task = '"${task_python[@]}" -m slurm_ddp_kit.train run "$run_dir"'  # $KIT_PYTHON, or in the container
        assert f"{shlex.join(slurm.TASK_START)} {task}" in srun, script
