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

__all__ = ["synthetic_profile", "synthetic_token_profile"]


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
    stage's output), its costs by tokens too where it has them."""

    def part(values: list[float]) -> list[float]:
        return [round(x / n, 6) for x in values]

    def tokens_part(costs: dict, k: int) -> dict:
        inner = costs["output_bytes_per_token"] or costs["input_bytes_per_token"]
        fits = ("forward", "backward", "backward_input", "backward_weight")
        return {
            **{f: {t: v / n for t, v in costs[f].items()} for f in fits if f in costs},
            "input_bytes_per_token": costs["input_bytes_per_token"] if k == 0 else inner,
            "output_bytes_per_token": costs["output_bytes_per_token"] if k == n - 1 else inner,
            "stash_bytes_per_token": costs["stash_bytes_per_token"] // n,
        }

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
                    **(
                        {"tokens": {m: tokens_part(c, k) for m, c in st["tokens"].items()}}
                        if "tokens" in st
                        else {}
                    ),
                }
            )
    return out


def synthetic_token_profile(
    num_stages: int,
    *,
    blocks: int = 30,
    d_model: int = 2048,
    vocab: int = 50304,
    tflops: float = 300.0,
    op_ms: float = 0.08,
    max_length: int = 32768,
    link_gbps: float = 400.0,
    latency_ms: float = 0.02,
    memory_limit_bytes: int | None = 40 << 30,
    reference_length: int = 512,
    max_size: int = 64,
    name: str = "gpt-tokens-sim",
    layers_per_stage: int = 1,
) -> Profile:
    """A transformer language model's pipeline costed by tokens (``"type": "sim"``): ``blocks``
    blocks of width ``d_model`` cut over the stages so that the slowest is as fast as it can be
    (the LM head, ``vocab``, on the last; the embedding on the first), at ``tflops`` of bfloat16
    matmul throughput per GPU.

    A block's forward is 24 d^2 FLOPs per token (its projections and MLP) plus 2 d L FLOPs per
    token of a causal attention over L tokens (so 2 d per squared length, summed over
    sequences), an op ``op_ms`` of launches and sync; the backward twice the forward, half of it
    the input gradient; the LM head 2 d vocab FLOPs per token. A token's stash is 34 d bytes per
    block (Korthikanti et al.'s count in bfloat16), a message 2 d bytes per token. Packed and
    padded modes share the costs (padded ones count the padding). The tables by sample count,
    which every profile has, are those of sequences of ``reference_length``. With
    ``layers_per_stage`` > 1 each stage is that many equal layers, listed in ``layers`` with their
    costs by tokens (so a rank's layers can be cut into several chunks)."""
    S = num_stages
    flop_ms = 1.0 / (tflops * 1e9)  # ms per FLOP
    # the blocks cut over the stages as `umopt profile --stages` cuts layers: the slowest stage
    # as fast as it can be, the LM head (2 d vocab FLOPs per token) counted with the last
    block = 24 * d_model * d_model
    head = 2 * d_model * vocab
    from .chunks import min_max_cut

    cut = min_max_cut([block] * blocks + [head], S)
    counts = [hi - lo - (1 if hi == blocks + 1 else 0) for lo, hi in cut]
    stages = []
    sizes = default_sizes(max_size)
    for s in range(S):
        n = counts[s]
        b_tok = 24 * d_model * d_model * n * flop_ms
        c_sq = 2 * d_model * n * flop_ms
        if s == S - 1:
            b_tok += 2 * d_model * vocab * flop_ms  # the LM head
        a = op_ms * (1 + n / 4)
        fwd = {"a_ms": a, "b_ms": b_tok, "c_ms": c_sq}
        bwd = {"a_ms": 2 * a, "b_ms": 2 * b_tok, "c_ms": 2 * c_sq}
        half = {"a_ms": a, "b_ms": b_tok, "c_ms": c_sq}
        costs = {
            "forward": fwd,
            "backward": bwd,
            "backward_input": half,
            "backward_weight": half,
            "input_bytes_per_token": 0 if s == 0 else 2 * d_model,
            "output_bytes_per_token": 2 * d_model if s + 1 < S else 0,
            "stash_bytes_per_token": 34 * d_model * n + (4 * vocab if s == S - 1 else 0),
        }
        params = 12 * d_model * d_model * n + (d_model * vocab if s in (0, S - 1) else 0)
        L = reference_length

        def at(fit: dict, b: float) -> float:
            return round(fit["a_ms"] + fit["b_ms"] * b * L + fit["c_ms"] * b * L * L, 6)

        stages.append(
            {
                "layers": [s * layers_per_stage, (s + 1) * layers_per_stage],
                "forward_ms": [at(fwd, b) for b in sizes],
                "backward_ms": [at(bwd, b) for b in sizes],
                "backward_input_ms": [at(half, b) for b in sizes],
                "backward_weight_ms": [at(half, b) for b in sizes],
                "input_bytes_per_sample": costs["input_bytes_per_token"] * L,
                "output_bytes_per_sample": costs["output_bytes_per_token"] * L,
                "stash_bytes_per_sample": costs["stash_bytes_per_token"] * L,
                # bfloat16 weights, float32 gradients and AdamW's two states, and a float32 master copy
                "static_bytes": int(params * (2 + 4 + 8 + 4)),
                "param_bytes": int(params * 4),
                "optimizer_ms": round(float(params * 16 / 2e9), 6),  # AdamW streaming its states at 2 TB/s
                "tokens": {"packed": costs, "padded": costs},
            }
        )
    gbps = link_gbps * 1e9 / 8 / 1e3  # bytes per ms
    return Profile.model_validate(
        {
            "format": PROFILE_FORMAT,
            "model": {"name": name, "args": {"blocks": blocks, "d_model": d_model, "vocab": vocab}},
            "device": {"type": "sim", "name": f"synthetic {tflops:g} TFLOP/s", "dtype": "bfloat16"},
            "sizes": sizes,
            "stages": stages,
            "links": [{"latency_ms": latency_ms, "bytes_per_ms": gbps} for _ in range(S - 1)],
            "memory_limit_bytes": memory_limit_bytes,
            "lengths": {"max_length": max_length, "modes": ["packed", "padded"]},
            **({"layers": _layers(stages, layers_per_stage)} if layers_per_stage > 1 else {}),
        }
    )
