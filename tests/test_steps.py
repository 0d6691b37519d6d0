"""What a rank does around its steps: DDP's gradient buckets as views, the warm-up that leaves
no trace, `torch._dynamo` imported aside."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kit import REPO


def test_gradient_buckets_are_views_backward_writes_into() -> None:
    """The captured step's buckets (built on any device): every `.grad` is a view of its bucket
    with its parameter's strides, channels_last included, and backward writes the same
    gradients into them as into a plain model's."""
    import copy

    import torch
    from torch.nn import functional as F

    from slurm_ddp_kit.train import steps
    from slurm_ddp_kit.train.model import ConvNet

    torch.manual_seed(0)
    plain = ConvNet().to(memory_format=torch.channels_last)
    bucketed = copy.deepcopy(plain)
    buckets = steps._bucket_gradients(list(bucketed.parameters()))
    x = torch.randn(8, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    for model in (plain, bucketed):
        torch.manual_seed(1)  # the same dropout masks
        F.cross_entropy(model(x), torch.arange(8)).backward()
    pointers = {b.untyped_storage().data_ptr() for b in buckets}
    for p, q in zip(plain.parameters(), bucketed.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None
        assert q.grad.stride() == q.stride() and q.grad.untyped_storage().data_ptr() in pointers
        assert torch.allclose(p.grad, q.grad)
    in_buckets = sum(float(b.abs().sum()) for b in buckets)
    assert in_buckets == pytest.approx(sum(float(p.grad.abs().sum()) for p in plain.parameters()))


def test_a_rank_imports_torch_dynamo_aside() -> None:
    """A per-GPU rank imports torch._dynamo (which DDP's constructor needs) on a thread while it
    waits on the driver and its peers: after the join it is imported."""
    probe = (
        "import sys, torch; from slurm_ddp_kit.train import job\n"
        "had = 'torch._dynamo' in sys.modules\n"
        "job._import_dynamo_aside().join()\n"
        "print(had, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_warm_up_leaves_model_optimizer_and_generators_as_it_found_them() -> None:
    """The compile warm-up trains on a random batch; afterwards weights, BatchNorm's statistics,
    gradients, optimizer state and the random generator are as before, so the first real step
    is the step a run without the warm-up takes (dropout masks included)."""
    import copy

    from torch import nn

    from slurm_ddp_kit.train import steps

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5),
        nn.Linear(4 * 26 * 26, 10),
    )  # fmt: skip
    twin = copy.deepcopy(model)
    step, twin_step = (
        steps.EagerStep(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        torch.amp.GradScaler(enabled=False), 1, steps.autocast(torch.device("cpu"), "fp32"))
        for m in (model, twin)
    )  # fmt: skip
    noise = (torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))
    rng = torch.get_rng_state()
    cast = steps.autocast(torch.device("cpu"), "fp32")
    steps.warm_up(step, model, model, noise, cast, ([8, 3], [8, 5]))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert not step.optimizer.state
    for name, tensor in twin.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    batch = (torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))
    rng = torch.get_rng_state()
    for s in (step, twin_step):
        torch.set_rng_state(rng)  # the same dropout masks for both
        for _ in range(2):  # the second step reads the momentum the first one made
            s.micro(*batch, last=True)
            s.update()
    for name, tensor in twin.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
