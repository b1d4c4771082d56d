"""Synthetic profiles (``"device": {"type": "sim"}``) for tests, examples and bundled defaults.

Each stage's forward time follows ``overhead + per_sample * b ** exponent`` (an exponent below 1
models a device that gets more efficient with bigger chunks), backward about twice forward, split
into input and weight gradients by ``weight_share`` (half each, as in a transformer layer); the
numbers are drawn from a seeded generator so a profile is reproducible from its arguments.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .formats.profile import PROFILE_FORMAT, Profile, default_sizes

__all__ = ["synthetic_profile"]


def synthetic_profile(
    num_stages: int,
    *,
    max_size: int = 64,
    seed: int = 0,
    overhead_ms: Sequence[float] | None = None,
    per_sample_ms: Sequence[float] | None = None,
    exponent: float = 0.85,
    backward_ratio: float = 2.0,
    latency_ms: float = 0.05,
    bytes_per_sample: int = 1 << 16,
    bytes_per_ms: float = 1e7,
    memory_limit_bytes: int | None = None,
    name: str = "synthetic",
    op_overhead_ms: float = 0.0,
    message_overhead_ms: float = 0.0,
    param_bytes: Sequence[int] | None = None,
    weight_share: float | None = 0.5,
    layers_per_stage: int = 1,
) -> Profile:
    """With ``layers_per_stage`` > 1, each stage is that many equal layers, listed in the
    profile's ``layers`` (so a rank's layers can be cut into several chunks); the stages' entries
    are the same either way."""
    rng = np.random.default_rng(seed)
    S = num_stages
    over = np.asarray(overhead_ms if overhead_ms is not None else rng.uniform(0.2, 3.0, S), dtype=float)
    per = np.asarray(per_sample_ms if per_sample_ms is not None else rng.uniform(0.2, 1.5, S), dtype=float)
    sizes = default_sizes(max_size)
    b = np.asarray(sizes, dtype=float)
    stages = []
    for s in range(S):
        f = over[s] + per[s] * b**exponent
        g = backward_ratio * f * rng.uniform(0.9, 1.1)
        stages.append(
            {
                "layers": [s * layers_per_stage, (s + 1) * layers_per_stage],
                "forward_ms": [round(float(x), 6) for x in f],
                "backward_ms": [round(float(x), 6) for x in g],
                "input_bytes_per_sample": 0 if s == 0 else bytes_per_sample,
                "output_bytes_per_sample": bytes_per_sample if s + 1 < S else 0,
                "stash_bytes_per_sample": int(4 * bytes_per_sample),
                "static_bytes": int(1 << 24),
                # parameters, gradients and two optimizer states (AdamW) make the static memory
                "param_bytes": int(param_bytes[s]) if param_bytes is not None else int(1 << 22),
                # the backward split into the input gradient and the weight gradient (W ops);
                # in a transformer layer each is about one forward, so half the backward each
                **(
                    {
                        "backward_input_ms": [round(float(x * (1 - weight_share)), 6) for x in g],
                        "backward_weight_ms": [round(float(x * weight_share), 6) for x in g],
                    }
                    if weight_share is not None
                    else {}
                ),
                "optimizer_ms": round(float(0.1 + 0.2 * rng.random()), 6),
                "op_overhead_ms": op_overhead_ms,
            }
        )
    return Profile.model_validate(
        {
            "format": PROFILE_FORMAT,
            "model": {"name": name, "args": {"stages": S, "seed": seed}},
            "device": {"type": "sim", "name": "synthetic", "dtype": "float32"},
            "sizes": sizes,
            "stages": stages,
            "links": [
                {
                    "latency_ms": latency_ms,
                    "bytes_per_ms": bytes_per_ms,
                    "message_overhead_ms": message_overhead_ms,
                }
                for _ in range(S - 1)
            ],
            "memory_limit_bytes": memory_limit_bytes,
            **({"layers": _layers(stages, layers_per_stage)} if layers_per_stage > 1 else {}),
        }
    )


def _layers(stages: list[dict], n: int) -> list[dict]:
    """Each stage's entry as ``n`` equal layers (the activations between them as big as the
    stage's output)."""

    def part(values: list[float]) -> list[float]:
        return [round(x / n, 6) for x in values]

    out = []
    for s, st in enumerate(stages):
        inner = st["output_bytes_per_sample"] or st["input_bytes_per_sample"]
        for k in range(n):
            out.append(
                {
                    "forward_ms": part(st["forward_ms"]),
                    "backward_ms": part(st["backward_ms"]),
                    **(
                        {
                            "backward_input_ms": part(st["backward_input_ms"]),
                            "backward_weight_ms": part(st["backward_weight_ms"]),
                        }
                        if "backward_input_ms" in st
                        else {}
                    ),
                    "input_bytes_per_sample": st["input_bytes_per_sample"] if k == 0 else inner,
                    "output_bytes_per_sample": st["output_bytes_per_sample"] if k == n - 1 else inner,
                    "stash_bytes_per_sample": st["stash_bytes_per_sample"] // n,
                    "static_bytes": st["static_bytes"] // n,
                    "param_bytes": st["param_bytes"] // n,
                }
            )
    return out
