"""What a run trains: a dataset and a model built for its shape, built-in or the user's own.

Every workload reaches the loop the same way: both splits as (inputs, labels) tensors, inputs of
uint8 pixels (normalised by the loaders, on the host or on the GPU) or float32 (used as given).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from slurm_ddp_kit.core import datafiles, factories, strategies
from slurm_ddp_kit.core.errors import KitError
from slurm_ddp_kit.core.settings.loading import from_dict
from slurm_ddp_kit.core.settings.schema import MODELS, Config, ConfigError
from slurm_ddp_kit.train import data, early, model

log = logging.getLogger("kit")

Batch = tuple[torch.Tensor, torch.Tensor]
Shape = model.Shape


@dataclass(frozen=True)
class Workload:
    train: Batch
    test: Batch
    classes: int
    mean: float = 0.0  # of the pixels scaled to [0, 1]; float inputs are used as given
    std: float = 1.0

    @property
    def sample_shape(self) -> Shape:
        return tuple(self.train[0].shape[1:])

    def normalise(self, inputs: torch.Tensor) -> torch.Tensor:
        """uint8 pixels → normalised float32 (the same arithmetic on any device)."""
        if inputs.dtype != torch.uint8:
            return inputs
        return (inputs.float() / 255 - self.mean) / self.std


def load(cfg: Config, local_rank: int, barrier: Callable[[], None]) -> Workload:
    """Both splits of the run's dataset. `barrier`: all ranks of the job wait there, after the
    node's first rank wrote the embedded digits where they were missing."""
    d, seed = cfg.data, cfg.train.seed
    if d.dataset == "patterns":  # generated in memory by every rank: the same from the seed
        rng = np.random.default_rng(seed)
        grids = data.pattern_grids(d.classes, d.channels, rng)
        make = (data.synthetic_patterns(n, grids, d.image_size, rng) for n in
                (d.train_size, d.test_size))  # fmt: skip
        train, test = ((torch.from_numpy(x), torch.from_numpy(y).long()) for x, y in make)
        return Workload(train, test, d.classes, data.PATTERN_MEAN, data.PATTERN_STD)
    if d.dataset == "tokens":  # generated in memory by every rank: the same from the seed
        rng = np.random.default_rng(seed)
        successors = data.token_successors(d.vocab, rng)
        made = (data.synthetic_tokens(n, d.seq_len, successors, rng) for n in
                (d.train_size, d.test_size))  # fmt: skip
        train, test = ((torch.from_numpy(x), torch.from_numpy(y)) for x, y in made)
        return Workload(train, test, d.vocab)
    if d.dataset not in ("synthetic", "mnist"):
        return _from_factory(d.dataset)
    folder = datafiles.dataset_dir(d.dataset, d.root, seed, d.train_size, d.test_size)
    if d.dataset == "synthetic" and local_rank == 0:
        data.prepare_synthetic(folder, seed, d.train_size, d.test_size)
    barrier()
    train, test = (data.load_raw(folder, d.dataset, train=split) for split in (True, False))
    return Workload(train, test, classes=10, mean=data.MEAN, std=data.STD)


def shape(
    cfg: Config, local_rank: int, barrier: Callable[[], None]
) -> tuple[Shape, int, Workload | None]:
    """One sample's shape and the number of classes, without the data where the settings say
    them; only a user's dataset is loaded to learn them, and then returned too."""
    if declared := declared_shape(cfg):
        return (*declared, None)
    work = load(cfg, local_rank, barrier)
    return work.sample_shape, work.classes, work


def declared_shape(cfg: Config) -> tuple[Shape, int] | None:
    """The sample shape and classes where the settings say them; None for a user's dataset."""
    d = cfg.data
    if d.dataset == "patterns":
        return (d.channels, d.image_size, d.image_size), d.classes
    if d.dataset in ("synthetic", "mnist"):
        return (1, 28, 28), 10
    if d.dataset == "tokens":
        return (d.seq_len,), d.vocab
    return None


def random_batch(
    cfg: Config, shape: Shape, classes: int, size: int, device: torch.device | str
) -> Batch:
    """`size` random samples as the run's loaders give them (normalised images, or token ids
    with a next token each), for compiling ahead of the data and for the largest-batch search."""
    if cfg.data.dataset == "tokens":
        tokens, following = (torch.randint(classes, (size, *shape), device=device) for _ in "xy")
        return tokens, following
    return torch.randn(size, *shape, device=device), torch.randint(classes, (size,), device=device)


def init_device(cfg: Config, device: torch.device) -> torch.device:
    """Where the model is built and initialised: the GPT on its GPU (a large one's initialisation
    takes minutes on the CPU, and its weights may not fit the host's memory once per rank), the
    others on the CPU, as they always were (their initial weights stay what they were)."""
    return device if cfg.model.name == "gpt" and device.type == "cuda" else torch.device("cpu")


def build_model(cfg: Config, shape: Shape, classes: int) -> nn.Module:
    if cfg.train.channels_last and len(shape) != 3:
        raise ConfigError(
            f"train.channels_last=true lays out images (channels, height, width), but "
            f"data.dataset={cfg.data.dataset} gives samples of shape {tuple(shape)}: drop it"
        )
    name = cfg.model.name
    if name in MODELS:
        _check_image_size(cfg, shape)
        return model.build(name, shape, classes, cfg.model)
    built = factories.call("model.name", name, shape, classes)
    if not isinstance(built, nn.Module):
        raise factories.broken("model.name", name, f"returned a {type(built).__name__}")
    if not any(p.requires_grad for p in built.parameters()):  # DDP refuses it in every rank
        raise factories.broken(
            "model.name", name, "returned a model with no trainable parameters (none, or all "
            "frozen): there is nothing to train"
        )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        sample = random_batch(cfg, shape, classes, 2, "cpu")
    _check_outputs(name, built, sample, classes)
    return built


_SMALLEST_IMAGE = {"convnet": 6, "resnet18": 1}  # height and width: two 3×3 convolutions, a pool


def _check_image_size(cfg: Config, shape: Shape) -> None:
    """The built-in image models take (channels, height, width) samples of some least size."""
    least = _SMALLEST_IMAGE.get(cfg.model.name)
    if least is not None and (len(shape) != 3 or min(shape[1:]) < least):
        raise ConfigError(
            f"model.name={cfg.model.name} takes images (channels, height, width) of at least "
            f"{least}×{least} pixels, but data.dataset={cfg.data.dataset} gives samples of shape "
            f"{tuple(shape)}: set model.name to a factory of your own (module:function)"
        )


def _check_outputs(name: str, built: nn.Module, sample: Batch, classes: int) -> None:
    """A user's model run once on two samples (on the CPU, before it is moved or wrapped): it
    must give one logit per class (per label), or training would end in the loss with PyTorch's
    words."""
    inputs, labels = sample
    shape = tuple(inputs.shape[1:])
    try:
        with torch.no_grad():
            out = built.eval()(inputs)
    except Exception as err:
        raise factories.broken(
            "model.name", name, f"failed on 2 samples of shape {shape}: {type(err).__name__}: {err}"
        ) from None
    finally:
        built.train()
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    wanted = (2, classes, *labels.shape[1:])
    if got != wanted:
        dims = ", ".join(["N", str(classes), *map(str, labels.shape[1:])])
        raise factories.broken(
            "model.name", name,
            f"gave {got} for 2 samples of shape {shape}: it must give ({dims}), "
            f"a logit per class of the dataset (its labels are 0..{classes - 1})",
        )  # fmt: skip


def trial(values: dict[str, Any]) -> tuple[str, int | None]:
    """`tried` in the launcher's trial process (settings as plain values): ('', the training
    split's size where a user's dataset gave one) if the workload passes, else (the error in one
    line, None). Whatever the factories started there is ended."""
    try:
        return "", tried(from_dict(values))[1]
    except KitError as err:  # the factory broke its contract: the message names the fix
        return str(err), None
    except Exception as err:
        return f"trying the workload on the CPU failed: {type(err).__name__}: {err}", None
    finally:
        early.end_leftovers()


def check(cfg: Config) -> str:
    """A user's workload tried on the CPU before anything is submitted (`launch submit` runs it
    as `python -m train check-workload`): what was found, in words."""
    return tried(cfg)[0]


def tried(cfg: Config) -> tuple[str, int | None]:
    """The dataset's splits checked, the model built and run once; what was found in words, and
    the training split's size where the data had to be loaded to learn it (a user's dataset)."""
    sample, classes, work = shape(cfg, 0, lambda: None)
    build_model(cfg, sample, classes)
    samples = len(work.train[1]) if work else None
    found = f"samples of shape {tuple(sample)}, {classes} classes"
    if samples:
        found += f", {samples} for training"
    return f"{found}: {cfg.model.name} gives a logit each", samples


def _from_factory(spec: str) -> Workload:
    train, test = (
        _checked(spec, split, factories.call("data.dataset", spec, train=split))
        for split in (True, False)
    )
    if train[0].shape[1:] != test[0].shape[1:]:
        raise factories.broken(
            "data.dataset", spec,
            f"gave samples of {tuple(train[0].shape[1:])} for training and "
            f"{tuple(test[0].shape[1:])} for testing",
        )  # fmt: skip
    return Workload(train, test, max(_classes(spec, train[1], test[1]), 2))


def _classes(spec: str, *splits: torch.Tensor) -> int:
    """The class count the labels give (the largest + 1), when every class in it occurs: one
    stray label must not make a model of thousands (or, at 10⁹, a 512 GB) of empty classes."""
    present = torch.unique(torch.cat(splits))
    classes = int(present[-1]) + 1
    if len(present) == 1:  # every prediction of that one class is right: accuracy says nothing
        log.warning(
            "warning: data.dataset=%s gave labels of one class only (%d): a model that always "
            "answers it scores 100 %%, so the accuracy says nothing; is it the right data?",
            spec, classes - 1,
        )  # fmt: skip
    if len(present) < classes:
        missing = sorted(set(range(min(classes, 10**6))) - set(present.tolist()))[:3]
        raise factories.broken(
            "data.dataset", spec,
            f"gave labels up to {classes - 1}, but only {len(present)} of the {classes} classes "
            f"0..{classes - 1} occur (none of {', '.join(map(str, missing))}, …): labels must "
            "be the class indices 0..classes-1 — a stray label?",
        )  # fmt: skip
    return classes


def _checked(spec: str, train: bool, made: Any) -> Batch:
    """The factory's (inputs, labels) for one split, or an error saying what is wrong with it."""
    split = "train" if train else "test"

    def wrong(problem: str) -> factories.FactoryError:
        return factories.broken("data.dataset", spec, f"(train={train}) {problem}")

    if not (isinstance(made, tuple | list) and len(made) == 2):
        raise wrong(f"returned a {type(made).__name__}, not a pair (inputs, labels)")
    inputs, labels = made
    if not (isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)):
        raise wrong(f"returned ({type(inputs).__name__}, {type(labels).__name__}), not tensors")
    if inputs.dtype != torch.uint8 and not inputs.is_floating_point():
        raise wrong(f"gave {split} inputs of {inputs.dtype}: use uint8 pixels or floats")
    if labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool:
        raise wrong(f"gave {split} labels of shape {tuple(labels.shape)} and {labels.dtype}")
    if inputs.dim() < 2 or len(inputs) != len(labels) or not len(labels):
        raise wrong(f"gave {len(inputs)} {split} inputs of {tuple(inputs.shape)} for "
                    f"{len(labels)} labels")  # fmt: skip
    if labels.min() < 0:
        raise wrong(f"gave a negative {split} label ({int(labels.min())})")
    if inputs.is_floating_point():
        inputs = inputs.float()  # float32, as the model's weights (float64 would not mix)
        if not torch.isfinite(inputs).all():
            raise wrong(f"gave {split} inputs holding NaN or infinite values")
    return inputs.contiguous(), labels.long()


def prepare(
    cfg: Config, model: nn.Module, device: torch.device, gpus: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The bare model on its device, in the run's memory layout, wrapped by the run's strategy;
    and its optimizer."""
    model = model.to(device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    strategy = strategies.of(cfg)
    wrapped = strategy.wrap(cfg, model, device, gpus)
    return wrapped, strategy.optimizer(cfg, wrapped)
