"""Sequence lengths to plan for, without a download: samplers fitted to published statistics of
the data people train language models on, and a user's own lengths from a file.

Each sampler draws a sequence's length (prompt and response together, for chat data) from
lognormal distributions whose means are the published ones; the spreads are umopt's choice (the
papers report means only: a spread close to what such data shows, a coefficient of variation
above 1), and are said below. Seeded, so a minibatch stream is reproducible.

- ``chat``: ShareGPT conversations, prompts of mean 161 tokens and responses of mean 338 (as the
  vLLM paper reports them, Kwon et al., SOSP'23);
- ``instruction``: Alpaca, prompts of mean 19 and responses of mean 58 (the same paper);
- ``lmsys``: LMSYS-Chat-1M, prompts of mean 70 and responses of mean 215 (Zheng et al., 2023);
- ``long-context``: documents of a long-context pretraining corpus, median 1,914, mean 3,052,
  p90 6,051 and p99 16,269 tokens, for which a lognormal of mu 7.68 and sigma 0.74 stands (the
  longest 5% of documents carry a quarter of the tokens);
- ``NAME/K``: a sampler's lengths divided by K (rounded up): the same spread at a length a CPU
  trains at a useful pace (``chat/16``: conversations of a 256-token world);
- ``file:PATH``: lengths from a file (one integer per line, or a JSON list), drawn in order and
  round again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .errors import UmoptError

__all__ = ["SAMPLERS", "Sampler", "sampler", "minibatches", "minibatch_of_step", "cut_note"]


@dataclass(frozen=True)
class _Part:
    mean: float
    sigma: float  # of the underlying normal: umopt's choice where the source gives a mean only

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma**2 / 2  # a lognormal of this mean
        return rng.lognormal(mu, self.sigma, n)


@dataclass(frozen=True)
class Sampler:
    """A distribution of sequence lengths: the sum of its parts' draws, capped."""

    name: str
    parts: tuple[_Part, ...]
    cap: int  # the longest sequence a model of that data would take
    source: str

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        total = sum(p.draw(rng, n) for p in self.parts)
        return np.clip(np.round(total), 1, self.cap).astype(np.int64)


SAMPLERS: dict[str, Sampler] = {
    "chat": Sampler(
        "chat", (_Part(161.0, 1.0), _Part(338.0, 0.8)), 4096, "ShareGPT, as the vLLM paper reports it"
    ),
    "instruction": Sampler(
        "instruction", (_Part(19.0, 0.8), _Part(58.0, 0.9)), 2048, "Alpaca, as the vLLM paper reports it"
    ),
    "lmsys": Sampler("lmsys", (_Part(70.0, 1.0), _Part(215.0, 0.9)), 4096, "the LMSYS-Chat-1M paper"),
    # mu 7.68, sigma 0.74: mean exp(7.68 + 0.74^2 / 2)
    "long-context": Sampler(
        "long-context",
        (_Part(float(np.exp(7.68 + 0.74**2 / 2)), 0.74),),
        32768,
        "a long-context corpus's documents",
    ),
}


def sampler(spec: str, cap: Optional[int] = None) -> Callable[[np.random.Generator, int], np.ndarray]:
    """``draw(rng, n)``: ``n`` lengths from a named sampler or ``file:PATH``, each at most ``cap``
    (default: the sampler's own)."""
    if spec.startswith("file:"):
        values = _read_lengths(spec[5:])
        position = [0]

        def from_file(rng: np.random.Generator, n: int) -> np.ndarray:
            take = np.take(values, np.arange(position[0], position[0] + n), mode="wrap")
            position[0] += n
            return np.minimum(take, cap) if cap else take

        return from_file
    name, _, by = spec.partition("/")
    if name not in SAMPLERS:
        raise UmoptError(
            f"unknown lengths {spec!r}: one of {', '.join(SAMPLERS)} (NAME/K: scaled down K times), or file:PATH"
        )
    try:
        k = float(by) if by else 1.0
    except ValueError:
        k = 0.0
    if not k >= 1:
        raise UmoptError(
            f"lengths {spec!r}: NAME/K scales the lengths down K times, K a number of at least 1"
        )
    s = SAMPLERS[name]
    limit = min(cap, s.cap) if cap else s.cap
    return lambda rng, n: np.minimum(np.maximum(1, np.ceil(s.draw(rng, n) / k).astype(np.int64)), limit)


def minibatches(
    spec: str, count: int, size: int, seed: int = 0, cap: Optional[int] = None
) -> list[np.ndarray]:
    """``count`` minibatches of ``size`` sequence lengths each, seeded."""
    if size < 1 or count < 1:
        raise UmoptError("a stream needs at least one minibatch of at least one sequence")
    draw = sampler(spec, cap)
    rng = np.random.default_rng(seed)
    return [draw(rng, size) for _ in range(count)]


def cut_note(spec: str, cap: int, drawn: Optional[list[np.ndarray]] = None) -> Optional[str]:
    """What a cap of ``cap`` tokens (the profile's longest) cuts from ``spec``'s lengths, in one
    line (None: nothing): of ``drawn`` (minibatches drawn without the cap) where given, else of a
    file's every length, or of the first 64 minibatches of 64 a run would draw."""
    source = f"file {spec[5:]}" if spec.startswith("file:") else spec
    if drawn is not None:
        what = f"the lengths drawn from {source}"
    elif spec.startswith("file:"):
        drawn, what = [_read_lengths(spec[5:])], f"the lengths in {source}"
    else:
        drawn = [minibatch_of_step(spec, k, 64) for k in range(64)]
        what = f"{source}'s lengths (64 minibatches of 64 drawn)"
    every = np.concatenate([np.asarray(d) for d in drawn])
    over = every[every > cap]
    if not len(over):
        return None
    return (
        f"{len(over)} of {len(every)} of {what} ({100 * len(over) / len(every):.1f}%) are longer than the "
        f"{cap} tokens the profile costs (up to {int(over.max())}): each is cut to {cap} (profile with a larger "
        "--lengths to train them whole)"
    )


def minibatch_of_step(spec: str, step: int, size: int, cap: Optional[int] = None) -> np.ndarray:
    """The ``size`` lengths of step ``step``'s minibatch, the same whenever asked (a training run
    that plays a step's minibatch again, as turns do, gets it again): a named sampler seeded by the
    step, a file's lengths from position ``step * size`` on."""
    if spec.startswith("file:"):
        values = _read_lengths(spec[5:])
        take = np.take(values, np.arange(step * size, (step + 1) * size), mode="wrap")
        return np.minimum(take, cap) if cap else take
    return sampler(spec, cap)(np.random.default_rng([7, step]), size)


def _read_lengths(path: str) -> np.ndarray:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UmoptError(f"lengths file {path}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise UmoptError(f"lengths file {path}: not a JSON list ({exc})") from None
        where = [f"item {i}" for i in range(len(values))] if isinstance(values, list) else []
    else:  # one or more integers a line; each named by its line
        values, where = [], []
        for n, line in enumerate(text.splitlines(), 1):
            for word in line.split():
                values.append(word)
                where.append(f"line {n}")
    if not isinstance(values, list) or not values:
        raise UmoptError(
            f"lengths file {path}: needs one or more positive integers (one per line, or a JSON list)"
        )
    out = []
    for v, w in zip(values, where):
        try:
            n = int(v) if not isinstance(v, float) or v.is_integer() else None
        except (ValueError, TypeError):
            n = None
        if n is None or isinstance(v, bool) or n < 1:
            raise UmoptError(f"lengths file {path}, {w}: {v!r} is not a length (a positive integer)")
        out.append(n)
    return np.asarray(out, dtype=np.int64)
