"""On a real GPU: NVML sampling, memory figures and the largest-batch search. Skipped without one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from kit import SMALL, TINY_GPT, kit, records, run_folder

from slurm_ddp_kit.train.gpustats import GpuSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _busy(seconds: float) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()


def test_sampler_sees_a_busy_gpu_and_an_idle_one() -> None:
    sampler = GpuSampler([0])
    assert sampler.available
    sampler.resume()
    _busy(1.5)
    sampler.pause()
    busy = sampler.figures()[0]
    sampler.close()
    assert busy["util_pct"] > 50 and busy["util_samples"] >= 10, busy
    assert busy["max_allocated_mb"] >= 64  # three 4096² float32 matrices at least
    assert (
        busy["nvml_used_mb_peak"] > busy["max_allocated_mb"]
    )  # the driver also counts the context

    time.sleep(
        2.0
    )  # NVML averages over its last sample period (up to 1 s): let the busy part age out
    idle = GpuSampler([0])
    idle.resume()
    time.sleep(1.0)
    idle.pause()
    assert idle.figures()[0]["util_pct"] < 30, idle.figures()
    idle.close()


def _submit(tmp_path: Path, *args: str) -> Path:
    gpus = torch.cuda.device_count()
    done = kit(
        "launch",
        "submit",
        *SMALL,
        *args,  # after SMALL: a test's own settings win
        "cluster.backend=local",
        f"cluster.gpus_per_node={gpus}",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
        "--wait",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return run_folder(done.stdout)


def test_dp_measures_every_card_it_drives(tmp_path: Path) -> None:
    run_dir = _submit(tmp_path, "--mode", "dp")
    start, *_, summary = records(run_dir)
    assert start["backend"] == "none" and start["gpu_count"] == torch.cuda.device_count()
    cards = summary["gpus"]
    assert [c["cuda_index"] for c in cards] == list(range(torch.cuda.device_count()))
    assert all(c["util_pct"] is not None and c["max_allocated_mb"] > 0 for c in cards)
    assert cards[0]["max_allocated_mb"] >= max(
        c["max_allocated_mb"] for c in cards
    )  # DP gathers on card 0


def test_ddp_ranks_each_measure_their_own_card(tmp_path: Path) -> None:
    run_dir = _submit(tmp_path, "--mode", "ddp")
    cards = [records(run_dir, rank)[-1]["gpus"] for rank in range(torch.cuda.device_count())]
    assert [c[0]["cuda_index"] for c in cards] == list(range(torch.cuda.device_count()))
    assert records(run_dir)[0]["backend"] == "nccl"
    assert all(len(c) == 1 and c[0]["util_pct"] is not None for c in cards)


class GpuProcesses(threading.Thread):
    """The processes NVML sees on any GPU while it runs, sampled every 50 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: set[int] = set()
        self.missing: set[int] = set()  # seen by NVML but not here: another PID namespace
        self.done = threading.Event()

    def run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        while not self.done.wait(0.05):
            for handle in handles:
                for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    self.pids.add(process.pid)
                    if not Path(f"/proc/{process.pid}").exists():
                        self.missing.add(process.pid)
        pynvml.nvmlShutdown()

    def stop(self) -> set[int]:
        self.done.set()
        self.join()
        return self.pids


LARGEST = {
    "dp": ["--mode", "dp"],
    "ddp": ["--mode", "ddp"],
    "ddp-bf16": ["--mode", "ddp", "dist.comm_hook=bf16"],
    "zero": ["--mode", "zero"],
    "fsdp": ["--mode", "fsdp"],
}


@pytest.mark.parametrize("strategy", list(LARGEST.values()), ids=list(LARGEST))
def test_largest_batch_search_recovers_from_oom(tmp_path: Path, strategy: list[str]) -> None:
    """Real steps with the strategy's collectives run out of memory on the GPUs; the search
    carries on past every failure to a size within 5 % of the smallest that failed, and the
    job's own processes never hold GPU memory (the steps run in their workers)."""
    watcher = GpuProcesses()
    watcher.start()
    run_dir = _submit(tmp_path, *strategy, "task=largest_batch")
    seen = watcher.stop()
    summary = records(run_dir)[-1]
    trials = summary["trials"]
    assert any(not t["fits"] for t in trials), (
        "the search must have hit out-of-memory and carried on"
    )
    largest = summary["largest_global_batch"]
    assert largest > 512
    failed = min(t["global_batch"] for t in trials if not t["fits"])
    assert (failed - largest) / largest <= 0.05 + 1e-9
    ranks = torch.cuda.device_count() if strategy[1] != "dp" else 1
    job = {records(run_dir, rank)[0]["pid"] for rank in range(ranks)}
    assert seen and not watcher.missing, (seen, watcher.missing)
    assert not seen & job, f"the job processes {job} held GPU memory"


FAST = ["data.on_device=true", "train.precision=bf16", "train.channels_last=true"]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["train.cuda_graph=true"], id="graph"),
        pytest.param(["train.cuda_graph=true", "train.grad_accum_steps=2"], id="graph-accum2"),
        pytest.param(["train.compile=true"], id="compile"),
    ],
)
def test_speed_options_keep_ranks_equal_and_learn(tmp_path: Path, options: list[str]) -> None:
    """The captured step does DDP's work itself: every rank must end with the same parameters,
    and the run must learn."""
    more = ["data.train_size=16384", "train.epochs=3"]  # past warm-up and capture: 96 steps
    run_dir = _submit(tmp_path, "--mode", "ddp", *FAST, *options, *more)
    ranks = range(torch.cuda.device_count())
    summaries = [records(run_dir, rank)[-1] for rank in ranks]
    assert len({s["parameters_sha256"] for s in summaries}) == 1
    assert summaries[0]["final_test_accuracy"] > 0.5  # chance is 0.1


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(["--mode", "zero"], id="zero"),
        pytest.param(["--mode", "fsdp"], id="fsdp"),
        pytest.param(["--mode", "ddp", "dist.comm_hook=bf16"], id="ddp-bf16"),
        pytest.param(["--mode", "ddp", "dist.comm_hook=powersgd"], id="ddp-powersgd"),
    ],
)
def test_strategies_over_nccl_keep_ranks_equal_save_and_learn(
    tmp_path: Path, strategy: list[str]
) -> None:
    """Each strategy over NCCL: ranks end with the same weights, the run learns, and the saved
    weights (gathered from the shards where sharded) are the ones the ranks ended with."""
    from slurm_ddp_kit.train.loop import parameters_sha256
    from slurm_ddp_kit.train.model import ConvNet

    run_dir = _submit(tmp_path, *strategy, "data.train_size=16384", "train.epochs=3")
    ranks = range(torch.cuda.device_count())
    starts = [records(run_dir, rank)[0] for rank in ranks]
    summaries = [records(run_dir, rank)[-1] for rank in ranks]
    assert {s["backend"] for s in starts} == {"nccl"}
    assert len({s["parameters_sha256"] for s in summaries}) == 1
    assert summaries[0]["final_test_accuracy"] > 0.5  # chance is 0.1
    weights = torch.load(run_dir / "checkpoints" / "model.pt")
    ConvNet().load_state_dict(weights)  # strict: whole tensors under the bare model's names
    assert parameters_sha256(weights) == summaries[0]["parameters_sha256"]


def test_dp_main_card_carries_the_gathered_outputs(tmp_path: Path) -> None:
    """The many-class workload: DataParallel gathers every replica's logits (and their
    gradients) on its main card, so that card peaks higher than the others; DDP's cards match."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    many = ["data.dataset=patterns", "data.channels=1", "data.image_size=28",
            "data.classes=100000", "train.epochs=1", "train.checkpoint=false"]  # fmt: skip
    peaks = {}
    for mode in ("dp", "ddp"):
        run_dir = _submit(tmp_path, "--mode", mode, *many)
        cards = [c for rank in range(torch.cuda.device_count() if mode == "ddp" else 1)
                 for c in records(run_dir, rank)[-1]["gpus"]]  # fmt: skip
        peaks[mode] = [c["max_allocated_mb"] for c in cards]
    dp_main, *dp_others = peaks["dp"]
    assert dp_main > 1.5 * max(dp_others), peaks  # measured 850 against 356 MB on 2 × H200
    assert max(peaks["ddp"]) < 1.1 * min(peaks["ddp"]), peaks


def test_a_second_compiled_job_of_the_workload_loads_the_first_ones_compile(
    tmp_path: Path,
) -> None:
    """The first job compiles and saves its artifacts; the second job of the same workload, with
    an Inductor folder of its own (another node), starts warm and spends less on its warm-up;
    a job of another batch size is another workload: cold."""
    settings = ["--mode", "ddp", *FAST, "train.compile=true", "train.epochs=1"]
    firsts, states = [], []
    for node, batch in (("node1", 512), ("node2", 512), ("node3", 256)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / node))
            run_dir = _submit(tmp_path, *settings, f"train.global_batch_size={batch}")
        start = next(r for r in records(run_dir, 0) if r["kind"] == "start")
        states.append(start["compile_cache"])
        firsts.append(start["startup_parts"]["warm_up"])  # the compile, on a random batch
    assert states == ["cold", "warm", "cold"]
    assert firsts[1] < firsts[0] / 2, firsts
    saved = list((tmp_path / "runs" / "compile-cache").glob("*/cuda0.bin"))
    assert len(saved) == 2, saved  # one file per workload


def test_warm_up_then_captured_steps_match_plain_steps() -> None:
    """The CUDA-graph step warmed up and captured on a random batch, then trained: its weights
    follow the plain step's from the same start (the warm-up's steps and momentum undone)."""
    import copy

    from slurm_ddp_kit.train import steps
    from slurm_ddp_kit.train.model import ConvNet

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = ConvNet(dropout=False).to(device)
    twin = copy.deepcopy(model)
    cast = steps.autocast(device, "fp32", cache=False)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, twin)]
    graph = steps.GraphStep(model, sgd[0], 64, 1, cast)
    plain = steps.EagerStep(twin, sgd[1], torch.amp.GradScaler(enabled=False), 1, cast)
    noise = (torch.randn(64, 1, 28, 28, device=device), torch.randint(10, (64,), device=device))
    rng = torch.cuda.get_rng_state(device)
    steps.warm_up(graph, model, model, noise, cast, ([64, 24], [64, 16]))
    assert graph.micro_graph is not None  # captured in the warm-up, replayed from here on
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    batch = (torch.randn(64, 1, 28, 28, device=device), torch.randint(10, (64,), device=device))
    for _ in range(3):  # the later steps read the momentum the first one made
        for step in (graph, plain):
            step.micro(*batch, last=True)
            step.update()
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_batches_normalised_on_the_gpu_equal_those_normalised_on_the_host(tmp_path: Path) -> None:
    """The host path copies uint8 pixels and normalises them on the GPU: the batches are the
    host's, up to float32's last place (CUDA divides by a number as a multiplication by its
    reciprocal)."""
    from torch.utils.data import DistributedSampler, TensorDataset

    from slurm_ddp_kit.train import data, loaders

    folder = data.prepare_synthetic(tmp_path / "digits", seed=3, train_size=3000, test_size=10)
    images, labels = data.load_raw(folder, "synthetic", train=True)
    sampler = DistributedSampler(TensorDataset(labels), 1, 0, shuffle=True, seed=3)
    host = loaders.host_loader(data.normalise(images), labels, sampler, 512, 0, False, 3)
    raw = loaders.host_loader(images, labels, sampler, 512, 0, True, 3)
    on_gpu = loaders.ToDevice(raw, torch.device("cuda", 0), data.normalise)
    served = list(on_gpu)
    assert len(served) == len(host) == 6
    for (x, y), (hx, hy) in zip(served, host, strict=True):
        assert x.device.type == "cuda" and x.dtype == torch.float32
        torch.testing.assert_close(x.cpu(), hx, rtol=0, atol=1e-6)
        assert torch.equal(y.cpu(), hy)


def test_energy_is_read_per_epoch_and_per_run(tmp_path: Path) -> None:
    """NVML's counter: each epoch's training joules, and a run total that holds them (the total
    also counts evaluation and start-up); the table shows the rows. Each epoch (the article's
    60,000 digits, about 0.4 s) spans several updates of the counter, which moves in steps: an
    epoch of 0.1 s could read 0 J on a card that updates it coarsely."""
    run_dir = _submit(tmp_path, "--mode", "ddp", "data.train_size=60000", "train.epochs=2")
    ranks = range(torch.cuda.device_count())
    for rank in ranks:
        epochs = [r for r in records(run_dir, rank) if r["kind"] == "epoch"]
        summary = records(run_dir, rank)[-1]
        assert all(e["energy_j"] > 0 for e in epochs), epochs
        (card,) = summary["gpus"]
        assert card["energy_j"] > sum(e["energy_j"] for e in epochs)
    table = kit("analysis", "summarize", str(run_dir)).stdout
    for row in (
        "energy per epoch",
        "energy per 1,000 samples",
        "energy per run",
        "GPU time per run",
    ):
        assert f"| {row} (" in table, table


# A GPT of 20 M parameters on sequences of 256 tokens, trained with AdamW: big enough for tensor
# cores and FSDP's gathers, small enough for seconds an epoch.
GPT = [*TINY_GPT, "data.seq_len=256", "data.vocab=512", "model.width=512", "model.depth=6",
       "model.heads=8", "data.train_size=4096", "data.test_size=512", "train.optimizer=adamw",
       "train.lr=0.001",
       "train.global_batch_size=64", "train.epochs=3"]  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--mode", "dp"], id="dp"),
        pytest.param(["--mode", "fsdp", "train.precision=bf16"], id="fsdp-bf16"),
        pytest.param(["--mode", "ddp", *FAST[:2], "train.cuda_graph=true"], id="ddp-graph"),
        pytest.param(["--mode", "ddp", "train.compile=true"], id="ddp-compile"),
    ],
)
def test_the_token_workload_learns_on_the_gpus(tmp_path: Path, options: list[str]) -> None:
    """The GPT on the tokens over NCCL, eager, sharded, captured and compiled (their warm-ups on
    random token batches): every rank ends with the same weights and the run learns."""
    run_dir = _submit(tmp_path, *GPT, *options)
    ranks = range(torch.cuda.device_count() if options[1] != "dp" else 1)
    summaries = [records(run_dir, rank)[-1] for rank in ranks]
    assert len({s["parameters_sha256"] for s in summaries}) == 1
    # A guess gets 1/512 of the tokens; reading two tokens back, 81 %.
    assert summaries[0]["final_test_accuracy"] > 0.3, summaries[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_largest_model_search_finds_the_widest_gpt_that_trains(tmp_path: Path, mode: str) -> None:
    """Real steps of ever wider GPTs at a fixed batch run out of memory; the search carries on
    past every failure to a width within 5 % of the narrowest that failed, in steps of the
    heads, and counts the widest one's parameters."""
    from slurm_ddp_kit.core.settings.schema import ModelConfig
    from slurm_ddp_kit.train.model import build

    run_dir = _submit(tmp_path, "--mode", mode, *GPT, "task=largest_model", "model.width=1024")
    summary = records(run_dir)[-1]
    trials = summary["trials"]
    assert any(not t["fits"] for t in trials), "the search must have hit out-of-memory"
    widest = summary["largest_width"]
    failed = min(t["width"] for t in trials if not t["fits"])
    assert widest >= 1024 and widest % 8 == 0 and (failed - widest) / widest <= 0.05 + 1e-9
    with torch.device("meta"):
        model = build("gpt", (256,), 512, ModelConfig("gpt", width=widest, depth=6, heads=8))
    assert summary["largest_model_parameters"] == sum(p.numel() for p in model.parameters())


# A user's program that keeps its GPU busy for a few seconds from a process of its own (as a
# DataLoader worker or a spawned rank would), then logs nothing: all it says is sampled from outside.
BUSY_PROGRAM = """
import multiprocessing as mp, time, torch

def busy():
    a = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + 4
    while time.perf_counter() < end:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=busy)
    child.start()
    child.join()
    raise SystemExit(child.exitcode)
"""


def test_a_programs_gpu_is_sampled_from_outside_and_tabled(tmp_path: Path) -> None:
    """A program on one GPU, its work in a process it started: the task finds the card by the
    program's processes and records its use, the program's memory and the energy, which
    `summarize` puts in the program's group."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY_PROGRAM)
    done = kit(
        "launch", "submit", "--mode", "ddp", "cluster.backend=local", "cluster.gpus_per_node=1",
        f"output.root={tmp_path}/runs", "--wait", "--", "python", str(script), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = run_folder(done.stdout)
    summary = records(run_dir)[-1]
    (card,) = summary["gpus"]
    assert card["util_pct"] > 50 and card["util_samples"] >= 4, card
    assert card["nvml_used_mb_peak"] >= 64 and card["energy_j"] > 0, card
    table = kit("analysis", "summarize", str(tmp_path / "runs")).stdout
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.count("|") > 2}
    for metric in ("GPU util main card", "peak memory main card", "energy per run"):
        found = next(line for name, line in rows.items() if name.startswith(metric))
        assert found.split("|")[3].strip() != "n/m", table  # the ddp column (no dp run here)
