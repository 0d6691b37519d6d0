"""A model for the tests that need a job to last: the kit's convnet, each forward pass paced by a
sleep, so that a run spans a time limit or a signal on little work while its CPU mostly waits
(as a rank waits on its GPU). The same arithmetic as `model.name=convnet`: a run of either ends
with the same parameters.

A factory, named `model.name=tests.paced:convnet` (the repository on the job's Python path).
Torch is imported when the job builds the model, not when the launcher checks the factory.
"""

from __future__ import annotations

import time
from typing import Any

PACE_S = 0.6  # per forward pass: 6 steps an epoch make about 4 s
PACED = "model.name=tests.paced:convnet"  # the setting that picks it
PACED_GPT = "model.name=tests.paced:gpt"  # the tiny GPT, paced: with data.dataset=tokens
# Twice the pace: 12 epochs of `test_resume.WORK` take about 115 s, longer than a 2-minute job
# trains before its 30-s lead even where the job starts in no time.
SLOW_PACED = "model.name=tests.paced:slow_convnet"
# A run that must still be training when a test strikes (a signal, a cancel, a stall): 6 paced
# steps an epoch on 384 samples, about 4 s, whatever the machine's load; add train.epochs.
LASTING = ["data.train_size=384", "data.test_size=128", "train.global_batch_size=64", PACED]


def convnet(shape: tuple[int, ...], classes: int) -> Any:
    return _paced(shape, classes, PACE_S)


def slow_convnet(shape: tuple[int, ...], classes: int) -> Any:
    return _paced(shape, classes, 2 * PACE_S)


def gpt(shape: tuple[int, ...], classes: int) -> Any:
    """The GPT of `model.name=gpt` at kit.TINY_GPT's width, depth and heads on the tokens
    (`shape`: the sequence length, `classes`: the vocabulary), each forward pass paced."""
    from slurm_ddp_kit.train.model import GPT

    model = GPT(shape[0], classes, width=32, depth=2, heads=2)
    model.register_forward_pre_hook(lambda module, args: time.sleep(PACE_S))
    return model


def _paced(shape: tuple[int, ...], classes: int, seconds: float) -> Any:
    from slurm_ddp_kit.train.model import ConvNet

    model = ConvNet(shape, classes)
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model
