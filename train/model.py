"""The built-in models (config.MODELS), each built for a sample shape and a number of classes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Shape = tuple[int, ...]  # one sample: (channels, height, width)


class ConvNet(nn.Module):
    """pytorch/examples' MNIST ConvNet: 1.2 M parameters on 1 × 28² digits, 10 classes."""

    def __init__(self, shape: Shape = (1, 28, 28), classes: int = 10, dropout: bool = True) -> None:
        super().__init__()
        channels, height, width = shape
        self.conv1 = nn.Conv2d(channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; the loss applies log-softmax


def resnet18(shape: Shape, classes: int, dropout: bool = True) -> nn.Module:
    """torchvision's ResNet-18 (no dropout in it); for small images the CIFAR-style stem (a 3×3
    convolution, no max-pool), which keeps 32² images from shrinking to 1² before the last block."""
    from torchvision.models import resnet18 as torchvision_resnet18

    model = torchvision_resnet18(num_classes=classes)
    channels, height, _ = shape
    if channels != 3 or height < 96:
        model.conv1 = nn.Conv2d(channels, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[Shape, int, bool], nn.Module]] = {  # one entry per config.MODELS
    "convnet": ConvNet,
    "resnet18": resnet18,
}


def build(
    name: str, shape: Shape = (1, 28, 28), classes: int = 10, dropout: bool = True
) -> nn.Module:
    return MODELS[name](shape, classes, dropout)
