"""The built-in models (config.MODELS), each built for a sample shape and a number of classes
(for the token model: a sequence length and a vocabulary)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from slurm_ddp_kit.core.settings.schema import ModelConfig

Shape = tuple[int, ...]  # one sample: (channels, height, width), or (sequence length,)


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


class GPT(nn.Module):
    """A decoder-only transformer in GPT-2's layout (learned positions, pre-norm blocks of causal
    self-attention and a 4× MLP, the head not tied to the embedding, so that every block and the
    two ends are separate units for FSDP): token ids (N, T) → next-token logits (N, vocab, T),
    the classes on dim 1 as cross_entropy and the accuracy count take them."""

    def __init__(
        self, seq_len: int, vocab: int, width: int = 256, depth: int = 4, heads: int = 4,
        dropout: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        p = 0.1 if dropout else 0.0
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq_len, width)
        self.dropout = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(width, heads, p) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, weight in self.named_parameters():  # GPT-2's initialisation
            if weight.dim() == 2:
                # The projections back into the residual stream shrink with depth.
                std = (
                    0.02 / (2 * depth) ** 0.5
                    if name.endswith(("out.weight", "down.weight"))
                    else 0.02
                )
                nn.init.normal_(weight, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        where = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.embed(tokens) + self.position(where))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (n, heads, t, head width)
        p = self.p if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.dropout(self.out(attended.transpose(1, 2).reshape(n, t, width)))
        return x + self.dropout(self.down(F.gelu(self.up(self.norm2(x)))))


def gpt(shape: Shape, classes: int, m: ModelConfig) -> nn.Module:
    return GPT(shape[0], classes, m.width, m.depth, m.heads, m.dropout)


MODELS: dict[str, Callable[[Shape, int, ModelConfig], nn.Module]] = {  # one per config.MODELS
    "convnet": lambda shape, classes, m: ConvNet(shape, classes, m.dropout),
    "resnet18": lambda shape, classes, m: resnet18(shape, classes, m.dropout),
    "gpt": gpt,
}


def build(
    name: str, shape: Shape = (1, 28, 28), classes: int = 10, options: ModelConfig | None = None
) -> nn.Module:
    return MODELS[name](shape, classes, options or ModelConfig())
