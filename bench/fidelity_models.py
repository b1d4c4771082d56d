"""A user's own model for bench/fidelity.py, loaded as ``fidelity_models:uneven``: layers of very
different weight (a wide block between narrow ones, a convolution up front), as a user's factory
returns them."""

import torch
from torch import nn
from torch.nn import functional as F


def uneven(channels: int = 16, width: int = 64, heavy: int = 768, classes: int = 10):
    layers = [
        nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()),
        nn.Sequential(nn.Linear(channels * 16 * 16, width), nn.ReLU()),
        nn.Sequential(
            nn.Linear(width, heavy),
            nn.ReLU(),
            nn.Linear(heavy, heavy),
            nn.ReLU(),
            nn.Linear(heavy, width),
            nn.ReLU(),
        ),
        nn.Sequential(nn.Linear(width, width), nn.ReLU()),
        nn.Linear(width, classes),
    ]

    def make_batch(n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss(out, target):
        return F.cross_entropy(out, target, reduction="sum")

    return layers, make_batch, loss
