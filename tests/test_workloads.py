"""Workloads beside the digits: the built-in ResNet-18 on embedded patterns, and a user's own
model and dataset (the factories below, in this file) through DP and DDP, the run folder and the
table; a factory that breaks its contract gets an error that says how."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from kit import REPO, alive, kit, records, run_folder, wait_for
from torch import nn

from slurm_ddp_kit.core import factories
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.train import workloads

TESTS = Path(__file__).resolve().parent
# The job finds the factories as any user's: on the Python path it inherits from the launcher.
ON_PATH = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
USER = ["model.name=test_workloads:tiny_mlp", "data.dataset=test_workloads:blobs"]
CENTRES = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])


def tiny_mlp(shape: tuple[int, ...], classes: int) -> nn.Module:
    """A user's model factory: whatever the sample shape, flattened into a small MLP."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(shape), 32), nn.ReLU(), nn.Linear(32, classes)
    )


def blobs(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's dataset factory: three Gaussian blobs in 4 dimensions, float inputs."""
    g = torch.Generator().manual_seed(0 if train else 1)
    labels = torch.randint(0, 3, (384 if train else 96,), generator=g)
    inputs = CENTRES[labels] + 0.5 * torch.randn(len(labels), 4, generator=g)
    return inputs.double(), labels  # float64: the kit trains in float32 all the same


def blobs_and_a_helper(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset factory that forks a helper process and leaves it running; the fork inherits
    the rank's signal handlers (SIGTERM only sets a flag there). Its PID goes to $HELPER_PIDS."""
    pid = os.fork()
    if pid == 0:  # the helper: outlives the job unless the kit ends it
        time.sleep(600)
        os._exit(0)
    with open(os.environ["HELPER_PIDS"], "a") as pids:
        pids.write(f"{pid}\n")
    return blobs(train)


def float_labels(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Breaks the contract: labels must be integers."""
    return torch.zeros(8, 4), torch.zeros(8)


def ignores_classes(shape: tuple[int, ...], classes: int) -> nn.Module:
    """Breaks the contract: a head of 10 whatever the dataset's class count (3 for blobs)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 10))


def stray_label(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes and one label of 10⁹ (a typo, a sentinel): not a model of 10⁹ classes."""
    labels = torch.arange(12) % 3
    labels[5] = 10**9 if train else labels[5]
    return torch.zeros(12, 4), labels


def nan_inputs(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.zeros(12, 4)
    inputs[3, 1] = math.nan if train else math.inf
    return inputs, torch.arange(12) % 3


def not_a_model(shape: tuple[int, ...], classes: int) -> object:
    """Breaks the contract: a model factory must return a torch.nn.Module."""
    return (shape, classes)


def _submit(tmp: Path, *args: str) -> tuple[int, str, Path | None]:
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data", "cluster.backend=local"]
    done = kit("launch", "submit", *args, *where, "--wait", env=ON_PATH)
    folder = run_folder(done.stdout) if "run folder: " in done.stdout else None
    return done.returncode, done.stdout + done.stderr, folder


def test_user_factories_train_with_dp_and_ddp(tmp_path: Path) -> None:
    settings = [*USER, "train.epochs=3", "train.global_batch_size=32", "cluster.gpus_per_node=2"]
    folders = {}
    for mode in ("dp", "ddp"):
        code, out, folders[mode] = _submit(tmp_path, "--mode", mode, *settings)
        assert code == 0, out
    for mode, folder in folders.items():
        assert folder is not None
        start, *_, summary = records(folder)
        assert start["sample_shape"] == [4] and start["classes"] == 3
        assert start["parameters"] == sum(p.numel() for p in tiny_mlp((4,), 3).parameters())
        assert summary["final_test_accuracy"] > 0.9, mode  # the blobs are well apart
    ddp = folders["ddp"]
    assert ddp is not None
    assert records(ddp, 1)[-1]["parameters_sha256"] == records(ddp, 0)[-1]["parameters_sha256"]
    table = kit("analysis", "summarize", str(tmp_path / "runs"))
    assert table.returncode == 0, table.stderr
    assert "test_workloads:blobs" in table.stdout and "test_workloads:tiny_mlp" in table.stdout
    assert "| DP " in table.stdout and "| DDP " in table.stdout


def test_resnet18_on_patterns_with_dp_and_ddp(tmp_path: Path) -> None:
    from slurm_ddp_kit.train.model import resnet18

    shape = ["data.dataset=patterns", "data.image_size=16", "data.train_size=256"]
    settings = [*shape, "data.test_size=64", "model.name=resnet18", "train.epochs=1"]
    expected = sum(p.numel() for p in resnet18((3, 16, 16), 10).parameters())
    for mode in ("dp", "ddp"):
        code, out, folder = _submit(
            tmp_path, "--mode", mode, *settings, "train.global_batch_size=32",
            "cluster.gpus_per_node=2",
        )  # fmt: skip
        assert code == 0, out
        assert folder is not None
        start = records(folder)[0]
        assert (start["sample_shape"], start["classes"]) == ([3, 16, 16], 10)
        assert start["parameters"] == expected > 11_000_000
        if mode == "ddp":  # equal parameters; BatchNorm's running statistics are each rank's own
            fingerprints = {records(folder, rank)[-1]["parameters_sha256"] for rank in (0, 1)}
            assert len(fingerprints) == 1


@pytest.mark.parametrize(
    ("setting", "fragments"),
    [
        (
            "data.dataset=test_workloads:float_labels",
            ["labels of shape (8,) and torch.float32", "labels integers (N,)"],
        ),
        ("model.name=test_workloads:not_a_model", ["returned a tuple", "-> torch.nn.Module"]),
        (
            "model.name=test_workloads:ignores_classes",
            ["gave (2, 10) for 2 samples of shape (4,): it must give (N, 3)", "0..2"],
        ),
        ("train.channels_last=true", ["gives samples of shape (4,): drop it"]),
        (
            "model.name=convnet",
            [
                "model.name=convnet takes images (channels, height, width) of at least 6×6 pixels",
                "gives samples of shape (4,): set model.name to a factory of your own",
            ],
        ),
        ("data.train_size=100", ["data.train_size sizes the embedded datasets", "drop"]),
    ],
)
def test_a_broken_factory_or_a_setting_it_cannot_take_is_refused_at_submit(
    tmp_path: Path, setting: str, fragments: list[str]
) -> None:
    """The launcher tries the workload on the CPU (`python -m train check-workload`) before
    anything is made or queued: one line naming the fix, exit 2, no run folder."""
    other = [u for u in USER if u.split("=")[0] != setting.split("=")[0]]
    code, out, folder = _submit(tmp_path, "--mode", "ddp", setting, *other,
                                "cluster.gpus_per_node=1", "train.global_batch_size=8")  # fmt: skip
    assert code == 2 and "Traceback" not in out, out
    for fragment in fragments:
        assert fragment in out, out
    assert folder is None and not (tmp_path / "runs").exists()


def test_a_broken_model_found_in_the_job_is_named_the_same_way(tmp_path: Path) -> None:
    """Where the launcher's check did not run (a run folder made for an sbatch script), the job
    builds the model with the same check: one error line, no traceback of the kit."""
    settings = ["model.name=test_workloads:ignores_classes", USER[1], f"output.root={tmp_path}"]
    prepared = kit("launch", "prepare", "--mode", "ddp", "cluster.gpus_per_node=1", *settings,
                   env=ON_PATH)  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    done = kit("train", "run", prepared.stdout.strip(), env=ON_PATH)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "gave (2, 10) for 2 samples of shape (4,): it must give (N, 3)" in done.stderr


@pytest.mark.parametrize(
    ("factory", "fragments"),
    [
        (
            "stray_label",
            ["labels up to 1000000000, but only 4 of the 1000000001 classes", "none of 3, 4, 5"],
        ),
        ("nan_inputs", ["(train=True) gave train inputs holding NaN or infinite values"]),
    ],
)
def test_a_dataset_with_a_stray_label_or_nan_inputs_is_named(
    factory: str, fragments: list[str]
) -> None:
    """Checked where the job loads the data (the same code in every rank), in this process."""
    cfg = load_config(overrides=[f"data.dataset=test_workloads:{factory}", "mode=dp"])
    with pytest.raises(factories.FactoryError) as err:
        workloads.load(cfg, 0, lambda: None)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_factory_of_the_wrong_signature_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    """The launcher binds the contract's arguments to the factory's signature (calling nothing):
    a dataset factory named as the model fails there, in one line, and no run folder is made."""
    code, out, folder = _submit(tmp_path, "--mode", "ddp", "model.name=test_workloads:blobs",
                                USER[1], "cluster.gpus_per_node=1")  # fmt: skip
    assert code == 2 and folder is None
    assert "model.name=test_workloads:blobs cannot be called so" in out
    assert "Traceback" not in out and not (tmp_path / "runs").exists()


def test_a_workload_that_passed_its_trial_is_not_tried_again_until_its_file_changes(
    tmp_path: Path,
) -> None:
    """The trial (a Python with torch: seconds) is remembered in the user's cache, keyed by the
    workload's settings and the factory module's file: the same workload submitted again skips
    it, whatever data.root; an edited module is tried again, and a broken one is never
    remembered."""
    module = tmp_path / "lib" / "mymodels.py"
    module.parent.mkdir()
    module.write_text(
        "import torch\n\n\ndef mlp(shape, classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(classes))\n"
    )
    env = {"PYTHONPATH": f"{module.parent}:{REPO}", "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def tried(root: str) -> bool:
        done = kit("launch", "submit", "--mode", "ddp", "model.name=mymodels:mlp", "--dry-run",
                   "cluster.backend=local", f"data.root={tmp_path}/{root}", "-v", env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return "workload tried before" not in done.stderr

    assert [tried("a"), tried("b")] == [True, False]
    module.write_text(module.read_text().replace("LazyLinear(classes)", "LazyLinear(3)"))
    for _ in range(2):  # the edit is tried, and found wrong: each time
        done = kit("launch", "submit", "--mode", "ddp", "model.name=mymodels:mlp", "--dry-run",
                   "cluster.backend=local", env=env)  # fmt: skip
        assert done.returncode == 2 and "it must give (N, 10)" in done.stderr, done.stderr


def test_a_batch_larger_than_a_users_training_split_is_refused_at_submit_and_in_the_job(
    tmp_path: Path,
) -> None:
    """The blobs' training split holds 384 samples: a global batch of 512 (the default) would
    be one step of 384 an epoch while the run said 512. The launcher's trial learns the split's
    size (and remembers it with the trial); the job checks it again where it loads the data."""
    env = {**ON_PATH, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    where = [f"output.root={tmp_path}/runs", "cluster.backend=local"]
    for _ in range(2):  # tried, then remembered: refused both times
        done = kit("launch", "submit", "--mode", "ddp", *USER, *where, "--dry-run", "-v", env=env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "train.global_batch_size=512 is larger than the 384 training samples" in done.stderr
        assert "use train.global_batch_size=384" in done.stderr
    assert "workload tried before" in done.stderr
    assert not (tmp_path / "runs").exists()
    prepared = kit("launch", "prepare", "--mode", "dp", *USER, f"output.root={tmp_path}", env=env)
    assert prepared.returncode == 0, prepared.stderr  # an sbatch script's folder: no trial there
    ran = kit("train", "run", prepared.stdout.strip(), env=env)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert "is larger than the 384 training samples of data.dataset=test_workloads:blobs" in (
        ran.stderr
    )


def test_processes_a_factory_leaves_behind_end_with_the_job(tmp_path: Path) -> None:
    pids = tmp_path / "helpers"
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "cluster.backend=local"]
    settings = [
        "model.name=test_workloads:tiny_mlp",
        "data.dataset=test_workloads:blobs_and_a_helper",
    ]
    done = kit(
        "launch", "submit", "--mode", "dp", *settings, "train.epochs=1", *where, "--wait",
        "train.global_batch_size=64", env={**ON_PATH, "HELPER_PIDS": str(pids)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    helpers = [int(pid) for pid in pids.read_text().split()]
    assert helpers  # the job's process called the factory (train and test split)
    try:
        assert wait_for(lambda: not any(alive(pid) for pid in helpers), 10), helpers
    finally:
        for pid in filter(alive, helpers):
            os.kill(pid, signal.SIGKILL)
