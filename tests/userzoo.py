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


def gpt_sequences(step: int, n: int):
    """``--data`` for a plan of sequences of different lengths (tests/test_varlen_run.py): ``n``
    sequences of the small gpt there, of lengths 1-48 drawn by the step, as two lists."""
    import numpy as np

    from umopt.zoo import build_model

    parts = build_model("gpt", {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 48}, seed=0)
    lengths = np.random.default_rng(step).integers(1, 49, n + step % 3)  # not always the plan's count
    pairs = parts.sequences.make([int(x) for x in lengths], step)
    return [x for x, _ in pairs], [y for _, y in pairs]


def hf_sequences(step: int, n: int):
    """``--data`` for a transformers model of a 128-token vocabulary (tests/test_hf.py): ``n``
    sequences of 1-48 tokens drawn by the step, a seventh of the targets ignored (-100)."""
    import numpy as np

    g = torch.Generator().manual_seed(step)
    xs, ys = [], []
    for k in np.random.default_rng(step).integers(1, 49, n):
        t = torch.randint(0, 128, (int(k) + 1,), generator=g)
        y = t[1:].clone()
        y[torch.rand(int(k), generator=g) < 0.15] = -100
        xs.append(t[:-1])
        ys.append(y)
    return xs, ys
