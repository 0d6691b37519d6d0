"""Mapping each launcher's environment to RANK/LOCAL_RANK/WORLD_SIZE/... and refusing bad launches."""

from __future__ import annotations

import dataclasses
import datetime
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import submitit

from slurm_ddp_kit.core import slurmtext
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.train.distenv import (
    PICK_PORT,
    DistEnv,
    DistEnvError,
    LaunchError,
    check_launch,
    detect,
    first_host,
    port_for_job,
    tasks_on_node,
)
from slurm_ddp_kit.train.job import _rendezvous

# What a real `srun -N2 -n4` sets for its third task (node 1, local rank 0).
SRUN_TASK_2 = {
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "127.0.0.[11-12]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_slurm_srun_task() -> None:
    env = detect(SRUN_TASK_2)
    assert env == DistEnv(2, 0, 4, 2, 1, "127.0.0.11", port_for_job("1234"), "1234", "slurm")


def test_torchrun_wins_over_slurm() -> None:
    torchrun = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }
    env = detect(
        {
            **SRUN_TASK_2,
            **torchrun,
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "x",
        }
    )
    assert (env.source, env.rank, env.local_rank, env.world_size, env.local_world_size) == (
        "torchrun",
        3,
        1,
        8,
        2,
    )
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "n1", 29400)


def test_batch_script_without_srun_is_single() -> None:
    batch = {k: v for k, v in SRUN_TASK_2.items() if k != "SLURM_STEP_ID"}
    alone = detect(batch)
    assert alone.source == "single" and alone.kit_store and alone.serves_store
    assert alone.master_port == PICK_PORT  # its store takes a free port: no id to derive one from


def test_explicit_port_wins() -> None:
    assert detect(SRUN_TASK_2, port=31000).master_port == 31000


def test_ports_of_jobs_that_may_share_a_node_differ() -> None:
    """Neighbouring jobs; the elements of neighbouring arrays; ids whose digits read the same."""
    jobs = [str(job) for job in range(5000, 5000 + 12768)]
    elements = [f"{array}_{task}" for array in range(7000, 7010) for task in range(100)]
    for ids in (jobs, elements):
        ports = [port_for_job(job) for job in ids]
        assert len(set(ports)) == len(ports) and all(20000 <= p < 32768 for p in ports)
    for a, b in (("8_3", "83"), ("12_3", "123"), ("1_23", "123"), ("12_3", "1_23")):
        assert port_for_job(a) != port_for_job(b), (a, b)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("127.0.0.[11-12]", "127.0.0.11"),
        ("gpu[003-004,010],cpu1", "gpu003"),
        ("a1,b2", "a1"),
        ("n7", "n7"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_tasks_on_node() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]


def test_an_array_element_takes_its_port_from_its_own_job_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """submitit names an element J_K, but Slurm gives it a job id of its own: the port comes from
    that, so the element never shares a port with the plain job Slurm numbers after the array
    (J_K against J+1 did: port(J_997) = port(J+1))."""
    element = {
        "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "1998", "SLURM_ARRAY_JOB_ID": "1000",
        "SLURM_ARRAY_TASK_ID": "997", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1",
        "SLURM_STEP_ID": "0",
    }  # fmt: skip
    for name, value in element.items():
        monkeypatch.setenv(name, value)
    env = detect(element)
    assert env.source == "submitit" and env.job_id == "1000_997"
    assert env.master_port == port_for_job("1998") != port_for_job("1001")
    assert port_for_job("1000_997") == port_for_job("1001")  # the collision it avoids


def test_submitit_local_tasks(tmp_path: Path) -> None:
    """A real LocalExecutor job with two tasks: each learns its own place."""
    executor = submitit.LocalExecutor(folder=tmp_path)
    executor.update_parameters(tasks_per_node=2, timeout_min=2)
    envs = executor.submit(detect).results()
    assert [(e.rank, e.local_rank, e.world_size, e.local_world_size) for e in envs] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    assert {e.source for e in envs} == {"submitit"}
    # A local job's id is a process id, which may be a Slurm job's too: its store picks a port.
    assert envs[0].master_port == envs[1].master_port == PICK_PORT


LOCAL_RANK_0 = DistEnv(
    rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0,
    master_addr="127.0.0.1", master_port=PICK_PORT, job_id="4242", source="submitit",
)  # fmt: skip
LOCAL_RANK_1 = dataclasses.replace(LOCAL_RANK_0, rank=1, local_rank=1)


def test_a_local_jobs_store_picks_a_port_and_tells_the_other_processes(tmp_path: Path) -> None:
    """The store binds a port the system picks and publishes it in the run folder; the other
    process, started first, waits for it there, and both meet at that port."""
    timeout = datetime.timedelta(seconds=60)
    with ThreadPoolExecutor(2) as pool:
        client = pool.submit(_rendezvous, LOCAL_RANK_1, tmp_path, timeout)
        server = pool.submit(_rendezvous, LOCAL_RANK_0, tmp_path, timeout)
        (env0, meet0), (env1, meet1) = server.result(), client.result()
    assert env0.master_port == env1.master_port != PICK_PORT
    meet0["store"].set("greeting", "hello")
    assert meet1["store"].get("greeting") == b"hello"
    # Forgotten once both came: a requeued attempt of the job cannot read this port.
    assert not list(tmp_path.rglob("*.port"))


def test_a_store_whose_peer_never_comes_names_it(tmp_path: Path) -> None:
    with pytest.raises(DistEnvError, match=r"rank\(s\) 1 did not come .*--rank 1"):
        _rendezvous(LOCAL_RANK_0, tmp_path, datetime.timedelta(seconds=0.5))


def test_a_process_whose_store_never_starts_names_where_to_look(tmp_path: Path) -> None:
    with pytest.raises(DistEnvError, match=r"published no rendezvous port .*launch logs"):
        _rendezvous(LOCAL_RANK_1, tmp_path, datetime.timedelta(seconds=0.5))


def test_script_started_without_srun_names_the_fix() -> None:
    cfg = load_config()
    batch = {k: v for k, v in SRUN_TASK_2.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(LaunchError, match=r"without srun.*`srun python -m train run RUN_DIR`"):
        check_launch(cfg, detect(batch), environ=batch)


def test_ddp_task_count_must_match_gpus() -> None:
    cfg = load_config(overrides=["cluster.gpus_per_node=2"])  # expects 2, srun started 4
    with pytest.raises(LaunchError, match=r"expects .* = 2 processes, but 4 were started"):
        check_launch(cfg, detect(SRUN_TASK_2), environ=SRUN_TASK_2)


def test_dp_refuses_several_processes() -> None:
    with pytest.raises(LaunchError, match="DataParallel drives all GPUs from one process"):
        check_launch(load_config(mode="dp"), detect(SRUN_TASK_2), environ=SRUN_TASK_2)


def random_hostlists(count: int, seed: int = 21, slurm_accepts: bool = False) -> list[str]:
    """Hostlists made at random: several entries, each with bracketed ranges anywhere in the name,
    zero-padded or not, ranges and single numbers mixed. slurm_accepts: only what Slurm 22.05's
    own reader takes (at most two brackets an entry, nothing after the last; it refuses text
    there and reads only the first value of a middle bracket of three), a grammar Slurm's own
    node lists never leave."""
    pick = random.Random(seed)

    def numbers() -> str:
        parts = []
        for _ in range(pick.randint(1, 3)):
            width, low = pick.choice([1, 2, 3, 5]), pick.randint(0, 120)
            high = low + pick.choice([0, 1, 3, 9])
            parts.append(f"{low:0{width}d}" + (f"-{high:0{width}d}" if high > low else ""))
        return f"[{','.join(parts)}]"

    def entry() -> str:
        brackets = pick.randint(0, 2 if slurm_accepts else 3)
        pieces = [pick.choice(["node", "rack", "gpu-a100-", "c1001a-s", "10.0.", "nid"])]
        for n in range(brackets):
            last = n == brackets - 1
            pieces += [
                numbers(),
                "" if last and slurm_accepts else pick.choice(["", "-n", ".", "x"]),
            ]
        return "".join(pieces)

    return [",".join(entry() for _ in range(pick.randint(1, 4))) for _ in range(count)]


def test_the_hostlist_reader_agrees_with_python_hostlist() -> None:
    """python-hostlist (GPL: a test-only oracle, never a dependency of the kit) expands 500
    random lists as the kit does; `test_slurm_jobs` checks a sample against scontrol itself."""
    oracle = pytest.importorskip("hostlist")
    for nodelist in random_hostlists(500):
        expected = oracle.expand_hostlist(nodelist, allow_duplicates=True)
        assert slurmtext.hostnames(nodelist) == expected, nodelist
        assert slurmtext.first_host(nodelist) == expected[0], nodelist
    for bad in ("n[3-1]", "n[1-2", "n1-2]", "n[a-b]", "n[[1-2]]"):
        with pytest.raises(oracle.BadHostlist):
            oracle.expand_hostlist(bad)
        with pytest.raises(ValueError):
            slurmtext.hostnames(bad)
