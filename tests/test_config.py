"""The config: the article's defaults, the merge order, and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit import REPO, kit

from slurm_ddp_kit.core.settings.loading import load_config, to_yaml
from slurm_ddp_kit.core.settings.rules import per_rank_batch, world_size
from slurm_ddp_kit.core.settings.schema import ConfigError
from slurm_ddp_kit.train.data import prepare_synthetic


def test_defaults_are_the_articles() -> None:
    cfg = load_config()
    assert (cfg.train.global_batch_size, cfg.train.epochs, cfg.train.lr) == (512, 10, 0.01)
    assert (cfg.model.name, cfg.cluster.gpus_per_node, cfg.mode) == ("convnet", 4, "ddp")
    assert (world_size(cfg), per_rank_batch(cfg)) == (4, 128)


def test_file_then_overrides_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "exp.yaml"
    file.write_text("train:\n  epochs: 3\n  lr: 0.1\ncluster:\n  nodes: 1\n")
    cfg = load_config([file], ["train.lr=0.05"], mode="dp")
    assert (cfg.train.epochs, cfg.train.lr, cfg.mode) == (3, 0.05, "dp")
    assert per_rank_batch(cfg) == 512  # DP: one process takes the whole batch
    assert load_config([file], ["cluster.nodes=2"], nodes=2).cluster.nodes == 2
    with pytest.raises(ConfigError, match=r"--nodes 2 and cluster.nodes=1 both set cluster\.nodes"):
        load_config([file], ["cluster.nodes=1"], nodes=2)  # one of them would be dropped


def test_nested_lists_and_free_sbatch_options() -> None:
    cfg = load_config(
        overrides=['cluster.setup=["module load cuda"]', "cluster.sbatch_extra.mail-type=END"]
    )
    assert cfg.cluster.setup == ["module load cuda"]
    assert cfg.cluster.sbatch_extra == {"mail-type": "END"}


# Text settings as YAML 1.1 would misread them: octal, boolean, sexagesimal, hex, float.
AS_WRITTEN = {
    "cluster.account": "0123",
    "cluster.qos": "yes",
    "cluster.partition": "1:30",
    "cluster.constraint": "0x1F",
    "output.name": "1e3",
}


def test_text_settings_keep_what_was_written(tmp_path: Path) -> None:
    overrides = [f"{key}={value}" for key, value in AS_WRITTEN.items()]
    setup = "cluster.setup=[on, 1e3, 0x1F, '007']"
    file = tmp_path / "exp.yaml"
    file.write_text(
        "cluster:\n  account: 0123\n  qos: yes\n  partition: 1:30\n  constraint: 0x1F\n"
        "  setup: [on, 1e3, 0x1F, '007']\n  sbatch_extra: {mail-user: 010}\n"
        "output:\n  name: 1e3\n"
    )
    from_line = load_config(overrides=[*overrides, setup, "cluster.sbatch_extra.mail-user=010"])
    for cfg in (from_line, load_config([file])):
        c = cfg.cluster
        assert (c.account, c.qos, c.partition, c.constraint, cfg.output.name) == tuple(
            AS_WRITTEN.values()
        )
        assert c.setup == ["on", "1e3", "0x1F", "007"]
        assert c.sbatch_extra == {"mail-user": "010"}
    # What the job reads back from its run folder's config.yaml is the same.
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(from_line))
    assert load_config([saved]) == from_line
    quoted = load_config(overrides=['cluster.account="0123"', "cluster.qos=null"]).cluster
    assert (quoted.account, quoted.qos) == ("0123", None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.epoch=3"],
            "unknown setting 'train.epoch'. Did you mean 'epochs'? Valid keys here: channels_last, checkpoint, compile, compile_mode, cuda_graph, cudnn_benchmark, epochs,",
        ),
        (["trian.epochs=3"], "Did you mean 'train'?"),
        (["train.epochs=three"], "train.epochs='three' must be a whole number"),
        (
            ["cluster.backend=slrum"],
            "cluster.backend='slrum' is not valid; choose one of: auto, slurm, local",
        ),
        (["train.epochs=0"], "train.epochs=0 must be between 1 and 1000000"),
        (["train.global_batch_size=510"], "use a multiple of 4, e.g. train.global_batch_size=512"),
        (["train.grad_accum_steps=3"], "4 rank(s) × 3 accumulation step(s)"),
        (
            ["mode=dp", "cluster.nodes=2"],
            "use DDP for several nodes (--mode ddp; a sweep's --modes ddp; slurm/ddp.sbatch), or one node (--nodes 1; sbatch --nodes=1)",
        ),
        (["train.epochs"], "is not of the form key=value"),
    ],
)
def test_bad_settings_name_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_an_escaped_shell_variable_reaches_the_setup_line_as_written(tmp_path: Path) -> None:
    """`\\${HOME}` (OmegaConf's escape) and `$HOME` are text for the job's shell: config.yaml
    keeps them so, and the job reads back the same line."""
    cfg = load_config(overrides=["cluster.setup=['cd \\${HOME}/a \\${X} $PATH']"])
    assert cfg.cluster.setup == ["cd ${HOME}/a ${X} $PATH"]
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config([saved]).cluster.setup == cfg.cluster.setup


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([tmp_path / "missing.yaml"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [epochs: 3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([broken])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("cluster:\n  gpus: 4\n")
    with pytest.raises(
        ConfigError, match=r"unknown setting 'cluster.gpus'. Did you mean 'gpus_per_node'"
    ):
        load_config([unknown])


def test_config_command_prints_resolved_yaml() -> None:
    done = kit("launch", "config", "--mode", "dp", "train.epochs=3")
    assert done.returncode == 0, done.stderr
    assert "mode: dp\n" in done.stdout and "  epochs: 3\n" in done.stdout
    assert "  global_batch_size: 512\n" in done.stdout


def test_a_cluster_file_then_an_experiment_file_merge_key_by_key(tmp_path: Path) -> None:
    """`--config cluster.yaml --config exp.yaml`: the cluster's partition, account and set-up
    survive the experiment's file, which wins where both set a key; settings on the line win
    over both."""
    cluster, exp = tmp_path / "cluster.yaml", tmp_path / "exp.yaml"
    cluster.write_text(
        "cluster:\n  partition: gpu\n  account: proj1\n  setup: [module load cuda]\n"
        "  timeout_min: 240\ntrain:\n  epochs: 5\n"
    )
    exp.write_text("cluster:\n  timeout_min: 30\ntrain:\n  epochs: 3\n  lr: 0.1\n")
    done = kit("launch", "config", "--config", str(cluster), "--config", str(exp), "train.lr=0.2")
    assert done.returncode == 0, done.stderr
    for line in ("  partition: gpu", "  account: proj1", "  - module load cuda",
                 "  timeout_min: 30", "  epochs: 3", "  lr: 0.2"):  # fmt: skip
        assert f"\n{line}\n" in done.stdout, (line, done.stdout)


def test_config_command_error_exit_code() -> None:
    done = kit("launch", "config", "train.epoch=3")
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown setting 'train.epoch'")


@pytest.mark.parametrize(
    "example", sorted((REPO / "docs" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_example_configs_reach_the_batch_script(example: Path, tmp_path: Path) -> None:
    """Each example's shape and Slurm settings appear in the script a dry run shows."""
    cfg = load_config([example])
    data = prepare_synthetic(tmp_path / "data", seed=0, train_size=10, test_size=10)
    done = kit(
        "launch", "submit", "--config", str(example), "--dry-run", "cluster.backend=slurm",
        f"output.root={tmp_path}/runs", f"data.root={data}",  # MNIST's files, where submit looks
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    c = cfg.cluster
    tasks = c.gpus_per_node if cfg.mode == "ddp" else 1
    for line in (
        f"#SBATCH --nodes={c.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --gpus-per-node={c.gpus_per_node}",
        f"#SBATCH --cpus-per-task={c.cpus_per_task * c.gpus_per_node // tasks}",
        *(f"#SBATCH --{k}={v}" for k, v in c.sbatch_extra.items()),
        *c.setup,
    ):
        assert line in done.stdout, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "example", sorted((REPO / "docs" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_example_configs_survive_the_run_folder(example: Path, tmp_path: Path) -> None:
    """A job reads its config back from the run folder's config.yaml: it must be the one that
    was resolved (a choice whose value differs from its Python name once failed here)."""
    cfg = load_config([example])
    written = tmp_path / "config.yaml"
    written.write_text(to_yaml(cfg))
    assert load_config([written]) == cfg


@pytest.mark.parametrize(
    ("written", "read"),
    [("true", True), ("yes", True), ("on", True), ("1", True), ("False", False), ("no", False),
     ("off", False), ("n", False), ("0", False)],
)  # fmt: skip
def test_a_boolean_reads_the_words_the_readme_lists(written: str, read: bool) -> None:
    assert load_config(overrides=[f"cluster.exclusive={written}"]).cluster.exclusive is read
