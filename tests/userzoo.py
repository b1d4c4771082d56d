"""A user's own model for the profiler tests: imported as ``userzoo:uneven``."""

import torch
from torch import nn
from torch.nn import functional as F


def uneven(width: int = 32, heavy: int = 512):
    """Five layers, one of them far heavier than the rest."""
    layers = [
        nn.Sequential(nn.Linear(16, width), nn.ReLU()),
        nn.Sequential(
            nn.Linear(width, heavy),
            nn.ReLU(),
            nn.Linear(heavy, heavy),
            nn.ReLU(),
            nn.Linear(heavy, width),
            nn.ReLU(),
        ),
        nn.Sequential(nn.Linear(width, width), nn.ReLU()),
        nn.Sequential(nn.Linear(width, width), nn.ReLU()),
        nn.Linear(width, 4),
    ]

    def make_batch(n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    def loss(out, target):
        return F.cross_entropy(out, target, reduction="sum")

    return layers, make_batch, loss


def broken():
    return "not a model"


def mlp_data(step: int, n: int):
    """A ``--data`` hook for the zoo's mlp of tests/test_runtime.py that notes which rank asked."""
    import os
    from pathlib import Path

    log = Path(os.environ["UMOPT_DATA_LOG"])
    log.mkdir(exist_ok=True)
    (log / f"rank{os.environ['RANK']}").touch()
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)
