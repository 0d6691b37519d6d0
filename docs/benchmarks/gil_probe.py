"""Which of a rank's start-up calls let go of Python's GIL: a thread counts in Python while the
main thread makes each call; the share of its usual count it reaches during the call says how
much of the call another thread (the kit's `torch._dynamo` import) could overlap. Near 0 %: the
call holds the GIL; 100 % or more: it lets go (the count runs faster with the main thread idle).

Usage (on a CUDA machine, one GPU): python docs/benchmarks/gil_probe.py
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable

began = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

print(f"import torch {time.perf_counter() - began:.3f} s")
counted = 0
stop = threading.Event()


def count() -> None:
    global counted
    while not stop.is_set():
        counted += 1


def probe(name: str, call: Callable[[], object], rate: float) -> None:
    before, began = counted, time.perf_counter()
    call()
    took = time.perf_counter() - began
    print(
        f"{name:28s} {took:.3f} s, the counting thread ran {(counted - before) / rate / took:5.0%}"
    )


def make_communicator() -> None:
    """NCCL makes its communicator at the first collective."""
    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()


def main() -> None:
    threading.Thread(target=count, daemon=True).start()
    time.sleep(0.2)
    before, began = counted, time.perf_counter()
    time.sleep(0.2)  # the thread's rate with the main thread asleep
    rate = (counted - before) / (time.perf_counter() - began)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    probe("torch.cuda.is_available()", torch.cuda.is_available, rate)
    probe("torch.cuda.device_count()", torch.cuda.device_count, rate)
    probe("torch.cuda.set_device(0)", lambda: torch.cuda.set_device(0), rate)
    probe("torch.empty(0, device=cuda)", lambda: torch.empty(0, device="cuda"), rate)
    probe("init_process_group(nccl)", lambda: dist.init_process_group("nccl"), rate)
    probe("all_reduce (communicator)", make_communicator, rate)
    stop.set()
    began = time.perf_counter()
    importlib.import_module("torch._dynamo")
    print(f"import torch._dynamo {time.perf_counter() - began:.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
