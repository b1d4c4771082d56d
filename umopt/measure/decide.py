"""Deciding between schedules measured in turns: a paired test over rounds, at a stated confidence.

Schedules that take turns on the same processes meet a machine's drift alike, so each round pairs
them: the reference's median step in round k against a candidate's in round k. The figure tested
is the log of their ratio, one per round; its mean over the rounds is the candidate's gain, and a
one-sided Student t test on those figures says how sure the measurement is that the gain is
above zero. The rule (:func:`decide`), as README states it:

- the reference is the equal schedule (every chunk the same size) with the lowest median;
- a candidate that is not equal is recommended only if it is faster than the reference at the
  given confidence (default 95%); of several such, the one with the lowest median;
- otherwise the reference is recommended: an unequal schedule has to earn its place.

The call is *decided* when every candidate (and every other equal schedule, against the
reference) is either faster at that confidence or, at the same confidence, not faster by more
than a margin (1%: a gain too small to be worth a schedule nobody
else runs). Until then more rounds can be measured (``umopt run --decide``, ``umopt tune``); where
a budget ends first the rule still picks, and the confidence printed beside the pick says how far
from decided it was.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..words import count

__all__ = ["CONFIDENCE", "MARGIN", "Comparison", "Decision", "compare", "decide", "is_equal", "pick_sure"]

CONFIDENCE = 0.95
MARGIN = 0.01


@dataclass(frozen=True)
class Comparison:
    """One candidate against the reference, over paired rounds."""

    name: str
    gain: float  # geometric mean over rounds of reference / candidate, minus 1
    faster: float  # confidence that the candidate is faster than the reference
    not_worth: float  # confidence that it is not faster by more than the margin


@dataclass(frozen=True)
class Decision:
    winner: str
    reference: str
    confidence: float  # in the winner being faster than the reference; for the reference, that no candidate is worth it
    decided: bool
    rounds: int
    comparisons: tuple[Comparison, ...]
    reason: str


def pick_sure(decision) -> bool:
    """Whether a decision's pick is decided, whatever else is open (a :class:`Decision`, or a run
    report's record of one): a candidate is kept only once it beat the reference at the
    confidence; the reference once no candidate is worth it."""
    return decision.decided or decision.winner != decision.reference


def compare(
    name: str, reference_ms: Sequence[float], candidate_ms: Sequence[float], margin: float = MARGIN
) -> Comparison:
    """The paired one-sided t test of ``log(reference / candidate)`` over rounds."""
    d = [math.log(r / c) for r, c in zip(reference_ms, candidate_ms)]
    mean = statistics.fmean(d) if d else 0.0
    bound = math.log1p(margin)
    if len(d) < 2:
        return Comparison(name, math.expm1(mean), 0.5, 0.5)
    sd = statistics.stdev(d)
    if sd == 0.0:  # every round alike: the sign is certain
        return Comparison(name, math.expm1(mean), float(mean > 0), float(mean < bound))
    se = sd / math.sqrt(len(d))
    # imported here: scipy.stats costs every rank process half a second at its start
    from scipy.special import stdtr  # Student's t CDF

    df = len(d) - 1
    return Comparison(
        name, math.expm1(mean), float(stdtr(df, mean / se)), float(stdtr(df, (bound - mean) / se))
    )


def decide(
    rounds_ms: Mapping[str, Sequence[float]],
    equal: Sequence[str],
    confidence: float = CONFIDENCE,
    margin: float = MARGIN,
) -> Decision:
    """The schedule to keep, from each schedule's median step per round (rounds paired by index)."""
    refs = [n for n in rounds_ms if n in equal]
    if not refs:
        raise ValueError("no equal schedule was measured: nothing to compare with")
    ref = min(refs, key=lambda n: statistics.median(rounds_ms[n]))
    rounds = min(len(v) for v in rounds_ms.values())
    comps = tuple(compare(n, rounds_ms[ref], v, margin) for n, v in rounds_ms.items() if n not in equal)
    # the reference against the other equal schedules: which order of equal chunks is faster
    # matters too (on CPUs it is often the larger difference), though either is safe to keep
    peers = tuple(compare(ref, rounds_ms[n], rounds_ms[ref], margin) for n in refs if n != ref)
    decided = all(c.faster >= confidence or c.not_worth >= confidence for c in comps + peers)
    winners = [c for c in comps if c.faster >= confidence]
    if winners:
        best = min(winners, key=lambda c: statistics.median(rounds_ms[c.name]))
        reason = f"{100 * best.gain:.1f}% faster than {ref} over {count(rounds, 'paired round')}, at {_percent(best.faster)} confidence"
        # what keeps the turns going once the winner is sure: the references told apart, or not
        open_refs = [
            n for n, c in zip((n for n in refs if n != ref), peers) if max(c.faster, c.not_worth) < confidence
        ]
        if open_refs:
            reason += f"; {ref} against {', '.join(open_refs)}: not told apart yet"
        return Decision(best.name, ref, best.faster, decided, rounds, comps, reason)
    sure = min([c.not_worth for c in comps] + [max(c.faster, c.not_worth) for c in peers], default=1.0)
    if comps:
        top = max(comps, key=lambda c: c.gain)
        reason = (
            f"no other schedule faster than {ref} at {100 * confidence:.0f}% confidence over {count(rounds, 'paired round')} "
            f"(closest: {top.name}, {100 * top.gain:+.1f}%, {_percent(top.faster)} confidence)"
        )
    else:
        reason = f"equal schedules only, over {count(rounds, 'paired round')}"
    for n, c in zip((n for n in refs if n != ref), peers):
        if c.gain >= 0:
            reason += f"; {ref} {100 * c.gain:.1f}% faster than {n} at {_percent(c.faster)} confidence"
        else:  # its median is the lower, its rounds' mean not: the two cannot be told apart
            reason += (
                f"; {ref} has the lower median, {n} the faster rounds on average ({100 * -c.gain:.1f}%): "
                "not told apart"
            )
    return Decision(ref, ref, sure, decided, rounds, comps, reason)


def _percent(p: float) -> str:
    """A confidence as people read one: never a rounded 100%."""
    return ">99.9%" if p > 0.999 else f"{100 * p:.1f}%" if p > 0.99 else f"{100 * p:.0f}%"


def is_equal(op_lists: Sequence[Sequence[tuple]]) -> bool:
    """Whether a schedule is what a pipeline runs today: on every stage (and virtual stage) one
    partition into M chunks, as equal as the minibatch allows (sizes differ by at most one, as
    torch's and Megatron's microbatches of a minibatch that M does not divide), forwards and
    backwards alike."""
    counts: dict[tuple, int] = {}
    sizes: set[int] = set()
    for r, ops in enumerate(op_lists):
        for kind, lo, hi, *rest in ops:
            if kind not in ("F", "B"):  # a W op's chunk is its backward's
                continue
            key = (r, rest[0] if rest else r, kind)
            counts[key] = counts.get(key, 0) + 1
            sizes.add(hi - lo)
    return bool(sizes) and len(set(counts.values())) == 1 and max(sizes) - min(sizes) <= 1
