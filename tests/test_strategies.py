"""The strategies beside DP and DDP, end to end on CPU with gloo: ZeRO, FSDP and DDP's
communication hooks train through the same loop, run folder and table; the sharded ones save
their whole state and resume from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from kit import SMALL, kit, records, run_folder

from slurm_ddp_kit.core import runfolder, strategies
from slurm_ddp_kit.core.strategies.base import HOOK_LABELS

TWO_RANKS = ["cluster.gpus_per_node=2"]
# From the registry: every strategy past the article's pair (DP and DDP: tests/test_local_jobs),
# and DDP with each communication hook; a new strategy is tested here without a word changed.
STRATEGIES = {
    **{s.name: ["--mode", s.name] for s in strategies.STRATEGIES.values() if not s.always_shown},
    **{f"ddp+{hook}": ["--mode", "ddp", f"dist.comm_hook={hook}"] for hook in HOOK_LABELS},
}


def _submit(tmp: Path, *args: str, wait: bool = True) -> Path:
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data", "cluster.backend=local"]
    done = kit("launch", "submit", *args, *where, *(["--wait"] if wait else []))
    assert done.returncode == 0, done.stdout + done.stderr
    return run_folder(done.stdout)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, small_runs: dict[str, Path]
) -> tuple[Path, dict[str, Path]]:
    """Each strategy's run of kit.SMALL on two ranks, beside the plain DDP run of the same
    settings that other files read too (conftest.small_runs: not changed here)."""
    tmp = tmp_path_factory.mktemp("strategies")
    made = {name: _submit(tmp, *args, *TWO_RANKS, *SMALL) for name, args in STRATEGIES.items()}
    made["ddp"] = small_runs["ddp"]
    return tmp, made


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_trains_with_its_ranks_in_step(
    runs: tuple[Path, dict[str, Path]], name: str
) -> None:
    """Both ranks end with the same parameters (ZeRO's owners broadcast their updates; a hook
    gives every rank the same decompressed average), and the loss falls."""
    run_dir = runs[1][name]
    # Rank 0's progress records come every output.progress_s: on a slow machine, within epochs.
    per_rank = [[r for r in records(run_dir, rank) if r["kind"] != "progress"] for rank in (0, 1)]
    for recs in per_rank:
        assert [r["kind"] for r in recs] == ["start", "epoch", "epoch", "summary"]
    assert per_rank[0][0]["mode"] == name.split("+")[0]
    summaries = [recs[-1] for recs in per_rank]
    assert summaries[0]["parameters_sha256"] == summaries[1]["parameters_sha256"]
    epochs = [r for r in per_rank[0] if r["kind"] == "epoch"]
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]


def test_zero_saves_the_whole_optimizer_state(runs: tuple[Path, dict[str, Path]]) -> None:
    """Each rank holds a shard; the checkpoint holds all of it (gathered to rank 0), in the
    layout a plain SGD's state has, so the run resumes on any rank count's shards."""
    state = torch.load(runfolder.state_path(runs[1]["zero"]), weights_only=False)
    momenta = state["optimizer"]["state"]
    assert len(momenta) == 8  # the ConvNet's 4 weights and 4 biases, each with its buffer
    assert all("momentum_buffer" in s for s in momenta.values())


def test_fsdp_saves_each_ranks_shards(runs: tuple[Path, dict[str, Path]]) -> None:
    """FSDP's checkpoint: no rank gathers the training state; each writes its own shards into a
    torch.distributed.checkpoint folder that state.pt names; the last save's folder alone stays."""
    import torch.distributed.checkpoint as dcp

    run_dir = runs[1]["fsdp"]
    state = torch.load(runfolder.state_path(run_dir), weights_only=False)
    assert "model" not in state and "optimizer" not in state
    (folder,) = (run_dir / runfolder.SHARDS).iterdir()  # two epochs saved, one folder kept
    assert folder.name == state["shards"] and folder.name.startswith("epoch3-batch0-")
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    assert "model.fc1.weight" in stored and "optimizer.state.fc1.weight.momentum_buffer" in stored


def test_fsdp_without_its_shards_folder_cannot_resume_and_says_so(
    runs: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    from slurm_ddp_kit.train import checkpoint

    run_dir = tmp_path / "copy"
    shutil.copytree(runs[1]["fsdp"], run_dir)
    shutil.rmtree(run_dir / runfolder.SHARDS)
    cfg = runfolder.load_job_config(run_dir)
    with pytest.raises(runfolder.RunFolderError, match=r"missing or incomplete.*cannot resume"):
        checkpoint.load(run_dir, cfg, rank=0, world_size=2)


def test_fsdp_scores_an_uneven_test_split_once(tmp_path: Path) -> None:
    """255 test images over 2 ranks: FSDP's ranks score padded shards of one length (every
    forward is a collective) and the padding counts nowhere: the accuracy is the saved model's."""
    from kit import load_split

    from slurm_ddp_kit.train.model import ConvNet

    run_dir = _submit(tmp_path, "--mode", "fsdp", *TWO_RANKS, *SMALL, "data.test_size=255",
                      "train.epochs=1")  # fmt: skip
    model = ConvNet()
    model.load_state_dict(torch.load(run_dir / runfolder.CHECKPOINT))
    test = load_split(next((tmp_path / "data").iterdir()), train=False)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    assert len(test.tensors[1]) == 255
    assert accuracy == pytest.approx(records(run_dir)[-1]["final_test_accuracy"], abs=1e-6)


def test_fsdp_scores_the_model_it_saves_with_batchnorm(tmp_path: Path) -> None:
    """ResNet-18's BatchNorm statistics are each rank's own under FSDP: the ranks must score,
    and the checkpoint hold, one model, so the reported accuracy is the saved model's."""
    from slurm_ddp_kit.core.settings.loading import load_config
    from slurm_ddp_kit.train import workloads

    settings = ["model.name=resnet18", "data.dataset=patterns", "data.image_size=8",
                "data.train_size=256", "data.test_size=96", "train.global_batch_size=32",
                "train.epochs=1"]  # fmt: skip
    run_dir = _submit(tmp_path, "--mode", "fsdp", *TWO_RANKS, *settings)
    work = workloads.load(load_config((), settings), 0, lambda: None)
    model = workloads.build_model(load_config((), settings), work.sample_shape, work.classes)
    model.load_state_dict(torch.load(run_dir / runfolder.CHECKPOINT))
    model.eval()
    with torch.no_grad():
        predicted = model(work.normalise(work.test[0])).argmax(1)
    accuracy = (predicted == work.test[1]).float().mean().item()
    assert accuracy == pytest.approx(records(run_dir)[-1]["final_test_accuracy"], abs=1e-6)


def test_fsdp_averages_gradients_as_ddp_does(runs: tuple[Path, dict[str, Path]]) -> None:
    """Gathered from its shards, FSDP's model ends where DDP's does from the same start (a
    gradient summed instead of averaged over the ranks would leave it far off)."""
    fsdp, ddp = (torch.load(runs[1][name] / "checkpoints" / "model.pt") for name in ("fsdp", "ddp"))
    assert fsdp.keys() == ddp.keys()  # the bare model's keys: loads into a plain ConvNet
    for key in ddp:
        assert torch.allclose(fsdp[key], ddp[key], atol=1e-5), key


def test_the_table_shows_each_strategy_beside_dp_and_ddp(
    runs: tuple[Path, dict[str, Path]],
) -> None:
    done = kit("analysis", "summarize", f"{runs[0]}/runs", str(runs[1]["ddp"]))
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("| metric"))
    assert header == (
        "| metric | DP (one process, no DataParallel) | DDP | DDP + fp16 hook | DDP + bf16 hook "
        "| DDP + PowerSGD | ZeRO | FSDP | DDP vs DP (one process, no DataParallel) "
        "| DDP + fp16 hook vs DDP | DDP + bf16 hook vs DDP | DDP + PowerSGD vs DDP "
        "| ZeRO vs DDP | FSDP vs DDP |"
    )
    assert done.stdout.count("## Group") == 1  # one table: only the strategy differs
