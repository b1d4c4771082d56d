"""A stage's costs by tokens (``umopt profile --lengths``): chunks of sequences of different
lengths timed, packed and padded, and fitted to ``a + b * tokens + c * squares``.

The grid: chunks of n sequences of one length L (n from 1 up, L from a sixteenth of the longest
up to it, within a token budget), and chunks mixing one long sequence with short ones, which
tell padding (every sequence counted at the chunk's longest) apart from packing. Every point is
timed once per round, rounds alternating their order, so a machine that slows down for a while
slows every point alike; each point's median is kept. The fit minimizes the relative error (a
short chunk's 1 ms counts as much as a long one's 100), with coefficients that cannot go below
zero (scipy's non-negative least squares); its residual (root-mean-square relative error) is
written beside it. Memory and messages go by tokens: the bytes a stage keeps for backward per
token (from two chunk sizes), and what its boundaries carry per token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from scipy.optimize import nnls

from ..devices import TensorSpec
from ..errors import UmoptError
from ..parts import ModelParts, pack, pad
from .chunk import StageProbe, Timer, stash_bytes
from .memory import peak_during
from .options import ProgressFn

__all__ = ["MODES", "TokenPoint", "grid", "check_lengths", "stage_token_costs", "fit"]

MODES = ("packed", "padded")


@dataclass(frozen=True)
class TokenPoint:
    """A chunk to time: its sequences' lengths."""

    lengths: tuple[int, ...]

    def counted(self, mode: str) -> tuple[int, int, int]:
        """(tokens, squares, sequences) as the cost model counts them in ``mode`` (padded: at the
        longest)."""
        n = len(self.lengths)
        if mode == "padded":
            m = max(self.lengths)
            return n * m, n * m * m, n
        return sum(self.lengths), sum(x * x for x in self.lengths), n


def check_lengths(parts: ModelParts, model: str, max_length: int, modes: Sequence[str]) -> int:
    """The longest length to time (``max_length``, at most what the model takes); refuses a model
    without sequences, or packing where its layers cannot keep documents apart."""
    seqs = parts.sequences
    if seqs is None:
        raise UmoptError(
            f"--lengths: model {model} does not say how it takes sequences of different lengths "
            "(its factory's ModelParts needs `sequences`, see umopt/zoo.py)"
        )
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UmoptError(f"--length-modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    if not seqs.modes:
        raise UmoptError(
            f"--lengths: model {model}'s layers take no lengths= and it is not causal, so its chunks can neither "
            "be packed nor padded without one sequence seeing another or its padding (see [Note: packed "
            "sequences] in umopt/zoo.py)"
        )
    if "packed" in modes and not seqs.packed:
        raise UmoptError(
            f"--length-modes packed: model {model}'s layers do not take a packed row's document lengths "
            "(use --length-modes padded)"
        )
    if "padded" in modes and "padded" not in seqs.modes:
        raise UmoptError(
            f"--length-modes padded: model {model} is not causal and its layers take no lengths= to mask the "
            "padding with (use --length-modes packed)"
        )
    if max_length < 2:
        raise UmoptError(f"--lengths must be at least 2, got {max_length}")
    return min(max_length, seqs.max_length)


def grid(max_length: int, max_tokens: Optional[int] = None) -> list[TokenPoint]:
    """The chunks to time for sequences up to ``max_length`` tokens, each at most ``max_tokens``
    (default: four of the longest) tokens."""
    budget = max_tokens or 4 * max_length
    lengths = sorted({max(1, round(max_length / 2**k)) for k in range(5)})
    points = set()
    for L in lengths:
        n = 1
        while n * L <= budget and n <= 64:
            points.add((L,) * n)
            n *= 2
    for k in (2, 4, 8):  # one long sequence and k short ones (padding counts them at the long)
        short = max(1, max_length // 8)
        if max_length + k * short <= budget:
            points.add((max_length,) + (short,) * k)
    return [TokenPoint(p) for p in sorted(points, key=lambda p: (sum(p), len(p)))]


def fit(points: Sequence[TokenPoint], ms: Sequence[float], mode: str) -> dict:
    """``a + b * tokens + c * squares + d * sequences`` fitted to the points' times, by relative
    error, with no coefficient below zero: the TokenFit fields, with the fit's residual."""
    counted = np.array([p.counted(mode) for p in points], dtype=float)
    y = np.asarray(ms, dtype=float)
    X = np.column_stack([np.ones(len(y)), counted])
    scale = X.max(axis=0)  # columns of comparable size, for a well-conditioned solve
    weight = 1.0 / np.maximum(y, 1e-9)
    coef, _ = nnls(X / scale * weight[:, None], y * weight)
    coef = coef / scale
    residual = math.sqrt(float(np.mean(((X @ coef) - y) ** 2 * weight**2)))
    return {
        "a_ms": float(coef[0]),
        "b_ms": float(coef[1]),
        "c_ms": float(coef[2]),
        "d_ms": float(coef[3]),
        "residual": round(residual, 4),
    }


def _chunk(probe: StageProbe, point: TokenPoint, mode: str, seed: int):
    """(input, targets, lengths) of a chunk entering the stage: tokens on the first stage, an
    activation of the boundary's shape elsewhere; packed, one row with its documents' lengths;
    padded, a row a sequence with their lengths."""
    seqs = probe.parts.sequences.make(point.lengths, seed)
    if mode == "packed":
        x, y, lengths = pack(seqs)
    else:  # each row's length, as the runtime gives a padded chunk (layers that take none ignore it)
        (x, y), lengths = pad(seqs), torch.tensor(point.lengths, dtype=torch.long)
    if not probe.first:
        shape = tuple(x.shape) + tuple(probe.boundary.shape[2:])
        if probe.boundary.is_floating_point():
            x = torch.randn(shape, dtype=probe.boundary.dtype, device=probe.device).requires_grad_(True)
        else:
            x = torch.zeros(shape, dtype=probe.boundary.dtype, device=probe.device)
    return x.to(probe.device), y.to(probe.device), lengths


def _time_point(probe: StageProbe, point: TokenPoint, mode: str, timer: Timer) -> tuple[float, float]:
    x, y, lengths = _chunk(probe, point, mode, seed=0)
    tf, out = timer(lambda: probe.forward(x, y, lengths))
    grad = probe.output_grad(out)
    tb, _ = timer(lambda: out.backward(grad))
    probe.stage.zero_grad(set_to_none=True)
    return tf, tb


def stage_token_costs(
    probes: Sequence[StageProbe],
    bounds: list[torch.Tensor],
    cuts: Sequence[int],
    max_length: int,
    modes: Sequence[str],
    repeats: int = 5,
    warmup: int = 1,
    budget_s: float = 60.0,
    progress: Optional[ProgressFn] = None,
) -> list[dict]:
    """Each stage's ``tokens`` entry of the profile (per mode, TokenCosts' fields): every grid
    point timed ``repeats`` times in rounds (fewer where ``budget_s`` runs out, never under
    three), fitted per op kind."""
    points = grid(max_length)
    timer = Timer(probes[0].device)
    units = [(s, m, k) for s in range(len(probes)) for m in modes for k in range(len(points))]
    for s, m, k in units:
        for _ in range(warmup):
            _time_point(probes[s], points[k], m, timer)
    runs: dict[tuple, list[tuple[float, float]]] = {u: [] for u in units}
    t0 = time.perf_counter()
    for r in range(repeats):
        if r >= 3 and time.perf_counter() - t0 > budget_s:
            break
        for u in units if r % 2 == 0 else units[::-1]:
            runs[u].append(_time_point(probes[u[0]], points[u[2]], u[1], timer))
        if progress:
            progress(r + 1, repeats, f"sequences of up to {max_length} tokens: round {r + 1}")
    out = []
    for s, probe in enumerate(probes):
        entry = {}
        for m in modes:
            fwd = [float(np.median([t[0] for t in runs[(s, m, k)]])) for k in range(len(points))]
            bwd = [float(np.median([t[1] for t in runs[(s, m, k)]])) for k in range(len(points))]
            entry[m] = {
                "forward": fit(points, fwd, m),
                "backward": fit(points, bwd, m),
                **_bytes_per_token(probe, bounds, cuts[s], cuts[s + 1], m, max_length),
            }
        out.append(entry)
    return out


def _bytes_per_token(
    probe: StageProbe, bounds: list[torch.Tensor], a: int, b: int, mode: str, max_length: int
) -> dict:
    """What the stage receives, sends and keeps for backward per token: its boundaries' bytes
    per sample over their sequence length; the stash, and what a forward and backward allocate
    beyond it, from two chunks of one sequence."""

    def per_token(t: torch.Tensor) -> int:
        return int(TensorSpec.of(t).bytes_per_sample) // max(1, t.shape[1] if t.dim() > 1 else 1)

    def forward_backward(x, y, lengths) -> None:
        out = probe.forward(x, y, lengths)
        out.backward(probe.output_grad(out))

    lo, hi = max(1, max_length // 4), max_length
    kept, work = [], []
    # the gradients allocated before either size is measured: the first forward and backward
    # would otherwise count them in its peak and the second not, and the difference came out
    # below zero (0 bytes a token on every stage)
    forward_backward(*_chunk(probe, TokenPoint((lo,)), mode, seed=0))
    for L in (lo, hi):
        x, y, lengths = _chunk(probe, TokenPoint((L,)), mode, seed=0)
        with probe.cast():
            kept.append(stash_bytes(probe.stage, x, y if probe.last else None, lengths))
        # what the forward and backward allocate beyond what backward keeps (the gradients of
        # the first chunk stay, as in a step that accumulates them)
        _, peak = peak_during(lambda: forward_backward(x, y, lengths), probe.device)
        work.append(peak - kept[-1])
    probe.stage.zero_grad(set_to_none=True)
    return {
        "input_bytes_per_token": per_token(bounds[a]),
        "output_bytes_per_token": 0 if probe.last else per_token(bounds[b]),
        "stash_bytes_per_token": max(0, (kept[1] - kept[0]) // max(1, hi - lo)),
        "work_bytes_per_token": max(0, (work[1] - work[0]) // max(1, hi - lo)),
    }
