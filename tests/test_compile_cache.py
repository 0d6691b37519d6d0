"""The compile cache (train/compile_cache.py): one writer at a time, whole files only, a damaged
file a cold start, and, where a C compiler exists, a compiled function that a fresh process
loads instead of compiling."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.train import compile_cache

PAYLOADS = [bytes([n]) * (3 << 20) for n in range(4)]  # 3 MB each: a write takes several syscalls


def _writer(path: str, payload: int, times: int) -> None:
    for _ in range(times):
        compile_cache._store(Path(path), PAYLOADS[payload])


def test_concurrent_writers_leave_one_whole_file_and_readers_never_see_half(
    tmp_path: Path,
) -> None:
    """Four processes write the same file over and over while this one reads it: every read is
    one payload whole, and no temporary file is left behind."""
    path = tmp_path / "key" / "cuda0.bin"
    path.parent.mkdir()
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(str(path), n, 15)) for n in range(4)]
    for writer in writers:
        writer.start()
    seen = set()
    while any(writer.is_alive() for writer in writers):
        if path.exists():
            data = path.read_bytes()
            assert data in PAYLOADS, f"a read of {len(data)} bytes is no whole payload"
            seen.add(data[0])
    assert [writer.exitcode for writer in writers] == [0, 0, 0, 0]
    assert path.read_bytes() in PAYLOADS and seen
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "cuda0.bin"]


def test_a_damaged_or_unreadable_cache_is_a_cold_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert compile_cache.load(tmp_path / "absent.bin") == "cold"
    damaged = tmp_path / "cuda0.bin"
    damaged.write_bytes(b"not the artifacts of any torch")
    assert compile_cache.load(damaged) == "cold"
    assert "cannot be loaded" in caplog.text and "compiling from scratch" in caplog.text


def test_the_key_follows_what_the_graphs_depend_on() -> None:
    base = load_config(overrides=["train.compile=true"])
    key = compile_cache.workload_key(base, "NVIDIA H200")
    assert key == compile_cache.workload_key(base, "NVIDIA H200")
    assert key != compile_cache.workload_key(base, "NVIDIA A100-SXM4-80GB")
    for change in ("train.precision=bf16", "train.global_batch_size=256", "model.name=resnet18"):
        other = load_config(overrides=["train.compile=true", change])
        assert compile_cache.workload_key(other, "NVIDIA H200") != key, change
    same = load_config(overrides=["train.compile=true", "train.lr=0.5", "train.epochs=3"])
    assert compile_cache.workload_key(same, "NVIDIA H200") == key


COMPILE_ONCE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from slurm_ddp_kit.train import compile_cache

    path = Path(sys.argv[1])
    state = compile_cache.load(path)
    f = torch.compile(lambda x: (x.sin() * 3 + x.cos()).relu())
    f(torch.randn(64))
    if state == "cold":
        assert compile_cache.save(path)
    print(state, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
    """
)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_a_fresh_process_on_a_fresh_node_cache_loads_what_the_first_compiled(
    tmp_path: Path,
) -> None:
    """The first process compiles and saves; the second, with an empty Inductor folder of its own
    (another node), loads the artifacts and finds its graph there instead of compiling it."""
    path = tmp_path / "shared" / "key" / "cuda0.bin"
    runs = []
    for node in ("node1", "node2"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / node)}
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_ONCE, str(path)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout.split())
    (cold, hits1, misses1), (warm, hits2, misses2) = runs
    assert (cold, warm) == ("cold", "warm")
    assert int(misses1) >= 1 and int(hits1) == 0
    assert int(hits2) >= 1 and int(misses2) == 0
