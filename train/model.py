"""The small CNN of the comparison: pytorch/examples' MNIST ConvNet (about 1.2 M parameters)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from train.config import ModelName


class ConvNet(nn.Module):
    def __init__(self, dropout: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; the loss applies log-softmax


MODELS = {ModelName.convnet: ConvNet}  # one entry per ModelName


def build(name: ModelName, dropout: bool = True) -> nn.Module:
    return MODELS[name](dropout)
