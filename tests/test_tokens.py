"""The token workload: the embedded synthetic language, the GPT that learns it, and both through
every strategy, the run folder and the table (on CPU with gloo, at a size that trains in
seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from kit import TINY_GPT, kit, records, run_folder

from slurm_ddp_kit.core.settings.schema import ModelConfig
from slurm_ddp_kit.core.strategies.fsdp import shard_units
from slurm_ddp_kit.train import data, loaders
from slurm_ddp_kit.train.model import GPT, build

STRATEGIES = ("dp", "ddp", "zero", "fsdp")


def test_synthetic_tokens_come_from_the_seed_and_reward_reading_two_tokens_back() -> None:
    def made(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        successors = data.token_successors(64, rng)
        return (successors, *data.synthetic_tokens(4000, 24, successors, rng))

    successors, inputs, following = made(0)
    again = made(0)
    assert all(
        np.array_equal(a, b) for a, b in zip((successors, inputs, following), again, strict=True)
    )
    assert not np.array_equal(inputs, made(1)[1])
    assert inputs.shape == following.shape == (4000, 24) and inputs.dtype == np.int64
    assert np.array_equal(inputs[:, 1:], following[:, :-1])  # each label is the next input
    # Every next token is one of the last token's successors ...
    followers = successors[inputs[:, 1:]]  # (samples, positions, 4)
    assert (followers == following[:, 1:, None]).any(-1).all()
    # ... and the token before names which one, 3 times in 4 (plus a quarter of the rest).
    named = np.take_along_axis(followers, (inputs[:, :-1] % 4)[..., None], -1)[..., 0]
    assert 0.79 < (named == following[:, 1:]).mean() < 0.84


def test_gpt_predicts_each_next_token_from_the_tokens_before_it_only() -> None:
    torch.manual_seed(0)
    model = GPT(seq_len=12, vocab=20, width=32, depth=2, heads=4, dropout=False).eval()
    tokens = torch.randint(20, (3, 12))
    logits = model(tokens)
    assert logits.shape == (3, 20, 12)  # (N, classes, positions), as cross_entropy takes them
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 20
    moved = model(changed)
    assert torch.allclose(logits[..., :7], moved[..., :7], atol=1e-6)  # the past does not see it
    assert not torch.allclose(logits[..., 7:], moved[..., 7:])
    built = build("gpt", (12,), 20, ModelConfig(name="gpt", width=32, depth=3, heads=2))
    assert sum(p.numel() for p in built.parameters()) == _gpt_parameters(12, 20, 32, 3)


def _gpt_parameters(seq_len: int, vocab: int, width: int, depth: int) -> int:
    norms, attention = 2 * 2 * width, 3 * width * (width + 1) + width * (width + 1)
    mlp = 4 * width * (width + 1) + (4 * width + 1) * width
    block = norms + attention + mlp
    return (vocab + seq_len) * width + depth * block + 2 * width + width * vocab


def test_an_uneven_test_split_of_sequences_is_padded_with_a_blank_sequence() -> None:
    tokens = torch.arange(5 * 4).reshape(5, 4)
    (inputs, labels), shard = loaders.evaluation_shard((tokens, tokens + 1), 1, 2, even=True)
    assert list(shard) == [1, 3, 5]  # two samples and the blank appended at index 5
    assert inputs[5].tolist() == [0, 0, 0, 0] and labels[5].tolist() == [-1, -1, -1, -1]


def test_fsdp_gathers_the_gpt_block_by_block() -> None:
    model = build("gpt", (8,), 16, ModelConfig(name="gpt", width=16, depth=3, heads=2))
    units = shard_units(model)
    assert [type(unit).__name__ for unit in units] == [
        "Embedding", "Embedding", "Dropout", "Block", "Block", "Block", "LayerNorm", "Linear",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The tiny GPT trained on the tokens by each strategy with AdamW, 2 ranks (or DP's one
    process)."""
    tmp = tmp_path_factory.mktemp("tokens")
    folders = {}
    for mode in STRATEGIES:
        done = kit(
            "launch", "submit", "--mode", mode, *TINY_GPT, "data.train_size=768",
            "data.test_size=100", "train.epochs=3", "train.global_batch_size=32",
            "train.optimizer=adamw", "train.lr=0.003", "train.weight_decay=0.01",
            "cluster.gpus_per_node=2", "cluster.backend=local", f"output.root={tmp}/runs",
            f"data.root={tmp}/data", "--wait",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        folders[mode] = run_folder(done.stdout)
    return tmp, folders


def test_every_strategy_trains_the_gpt_on_the_tokens(runs: tuple[Path, dict[str, Path]]) -> None:
    expected = _gpt_parameters(16, 16, 32, 2)
    summaries = {}
    for mode, folder in runs[1].items():
        start, *_, summary = records(folder)
        assert (start["sample_shape"], start["classes"], start["parameters"]) == (
            [16],
            16,
            expected,
        )
        summaries[mode] = summary
        # Learned: a guess gets 1/16 of the tokens right, the best reader of two tokens back 81 %.
        assert summary["final_test_accuracy"] > 0.35, mode
    # ZeRO and FSDP take DDP's steps (AdamW's, sharded): the same weights' loss, to rounding.
    for mode in ("zero", "fsdp"):
        assert summaries[mode]["final_test_loss"] == pytest.approx(
            summaries["ddp"]["final_test_loss"], rel=1e-4
        ), mode
    for mode in ("ddp", "zero", "fsdp"):  # the replicas (or gathered shards) agree
        folder = runs[1][mode]
        assert (
            records(folder, 1)[-1]["parameters_sha256"]
            == records(folder, 0)[-1]["parameters_sha256"]
        )


def test_the_table_names_the_token_workload(runs: tuple[Path, dict[str, Path]]) -> None:
    table = kit("analysis", "summarize", str(runs[0] / "runs"))
    assert table.returncode == 0, table.stderr
    heading = table.stdout.split("\n")[0]
    assert "tokens (sequences of 16, vocabulary 16)" in heading
    assert "gpt width 32, depth 2, 2 heads" in heading and "adamw (weight decay 0.01)" in heading
    assert "| runs | 1 | 1 | 1 | 1 |" in table.stdout
    rows = {line.split(" | ")[0]: line.split(" | ")[1:5] for line in table.stdout.splitlines()}
    samples = rows["| throughput (samples/s, all ranks, steady state)"]
    tokens = rows["| throughput (tokens/s, all ranks, steady state; token workloads)"]
    for per_sequence, per_token in zip(samples, tokens, strict=True):  # 16 tokens a sequence
        assert float(per_token) == pytest.approx(16 * float(per_sequence), abs=16)


def _searched(run_dir: Path, width: int | None, trials: list[tuple[int, bool]]) -> None:
    """Make a CPU largest-model run read as a GPU search that made these trials."""
    path = run_dir / "metrics" / "rank-00000.jsonl"
    parameters = width and _gpt_parameters(16, 16, width, 2)
    found = {
        "largest_width": width,
        "largest_model_parameters": parameters,
        "trials": [{"width": w, "fits": ok} for w, ok in trials],
    }
    edited = [r | found if r["kind"] == "summary" else r for r in records(run_dir)]
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))


def test_a_largest_model_search_joins_the_table_of_its_model_family(
    runs: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """task=largest_model of the GPT's family (another width, another batch) shows beside the
    training runs; on CPU it searches nothing and says so; alone, it is a note."""
    done = kit(
        "launch", "submit", "--mode", "ddp", "task=largest_model", *TINY_GPT, "model.width=64",
        "train.global_batch_size=8", "train.optimizer=adamw", "train.weight_decay=0.01",
        "cluster.gpus_per_node=2", "cluster.backend=local",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "--wait",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    search = run_folder(done.stdout)
    summary = records(search)[-1]
    assert (summary["largest_width"], summary["trials"]) == (None, [])  # no GPU: not searched
    trained = [runs[1][mode] for mode in STRATEGIES]
    table = kit("analysis", "summarize", *map(str, trained), str(search))
    assert table.returncode == 0, table.stderr
    assert "largest model." in table.stdout  # measured by none: left out, and said
    assert f"Largest-model runs (at a global batch of 8): DDP: {search.name}" in table.stdout
    _searched(search, 1536, [(64, True), (1024, True), (2048, False), (1536, True)])
    table = kit("analysis", "summarize", *map(str, trained), str(search))
    rows = {line.split(" | ")[0]: line for line in table.stdout.splitlines()}
    width = rows["| largest model (model.width, widest gpt of the depth that trains at the "
                "search's global batch, within 5 %; task=largest_model runs)"]  # fmt: skip
    assert width.split(" | ")[1:3] == ["n/m", "1536"], width  # DP: none searched
    parameters = _gpt_parameters(16, 16, 1536, 2) / 1e6
    assert f"| {parameters:.1f} |" in rows["| largest model (M parameters, of that width)"]
    alone = kit("analysis", "summarize", str(search), str(runs[1]["dp"]))
    assert alone.returncode == 0
    assert f"note {search.name}: a largest-model run is shown beside training runs" in alone.stderr
    assert "(widest model.width: 1536)" in alone.stderr
