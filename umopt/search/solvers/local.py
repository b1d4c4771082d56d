"""Best-improvement hill climbing over per-stage partitions, in GPipe or 1F1B order, and an
iterated local search around it.

A move changes one stage's forward partition (and, with recompute, its backward partition on its
own): shift the boundary between two neighbouring chunks by one sample, merge two chunks, or split
one in half; in 1F1B order, with ``free_warmup``, it may also run one forward more or fewer before
a stage's first backward; in a schedule with W ops (zero bubble), it may change a stage's W cap
(samples awaiting their W: a chunk's worth more or fewer, halved, doubled, all W at the end, the
backward whole again); an aligned move shifts (or removes) a chunk end shared by several
stages on all of them at once. All moves of a step are built together as chunk-end masks (as
the GA's population is) and scored in one call of the population evaluator, and the best one is
taken, until none helps or time runs out.

The iteration time is a max over stages, so many moves tie; ties are broken by the sum of the
stages' finish times, which lets the climb cross plateaus where the slowest stage does not move yet.

A climb stops where no single move helps, and good schedules sit in such places more often than
not: a schedule can be a local optimum of every single move while the optimum differs from it on
every stage at once. The iterated climb (:func:`iterated_climb`) kicks the incumbent with a few
random moves on random stages, climbs again, and keeps the result when it is no worse.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, NamedTuple, Optional

import numpy as np

from ...costmodel import simulate, stage_peak_memory
from ...schedules.partition import ends_to_sizes, sizes_to_ends
from ..problem import Candidate, Problem, pack

__all__ = ["moves", "aligned_moves", "score_batch", "hill_climb", "iterated_climb"]


def moves(part: list[int], max_size: int) -> Iterator[list[int]]:
    """Every partition one move away from ``part``."""
    for j in range(len(part) - 1):
        a, b = part[j], part[j + 1]
        if a > 1 and b < max_size:
            yield part[:j] + [a - 1, b + 1] + part[j + 2 :]
        if b > 1 and a < max_size:
            yield part[:j] + [a + 1, b - 1] + part[j + 2 :]
        if a + b <= max_size:
            yield part[:j] + [a + b] + part[j + 2 :]
    for j, a in enumerate(part):
        if a > 1:
            yield part[:j] + [a // 2, a - a // 2] + part[j + 1 :]


def aligned_moves(parts: list[list[int]], max_size: int) -> Iterator[list[list[int]]]:
    """Every set of partitions one *aligned* move away from ``parts``: a chunk end shared by
    several stages moves by one sample, or goes, on all of them at once. Good schedules often
    share chunk ends between stages (the stages below the slowest one in the same chunks, the
    slowest one in unions of them), and then no single stage's move helps."""
    B = sum(parts[0])
    ends = [set(np.cumsum(p)[:-1].tolist()) for p in parts]
    for i in sorted(set().union(*ends)):
        group = [s for s, e in enumerate(ends) if i in e]
        if len(group) < 2:
            continue
        for new_i in (i - 1, i + 1, None):  # shift down, shift up, remove
            if new_i is not None and not 0 < new_i < B:
                continue
            out = []
            for s, e in enumerate(ends):
                if s in group:
                    e = (e - {i}) | ({new_i} if new_i is not None else set())
                bounds = [0, *sorted(e), B]
                sizes = [b - a for a, b in zip(bounds, bounds[1:])]
                if max(sizes) > max_size:
                    break
                out.append(sizes)
            else:
                yield out


def _warmup(w: int, chunks: int, minibatch: int) -> int:
    """A stage's warm-up as stored: ``chunks`` or more means "all forwards first", kept as the
    minibatch so that it survives later splits of the partition."""
    return minibatch if w >= chunks else max(w, 0)


def _cap_moves(cap: int, chunk: int, minibatch: int) -> list[int]:
    """A stage's other W caps one move away (see :class:`Candidate`): a chunk more or fewer,
    halved, doubled, every W at the end, the backward whole (-1) and back."""
    if cap < 0:
        return [0, minibatch]
    out = {
        max(0, cap - chunk),
        min(minibatch, cap + chunk),
        cap // 2,
        min(minibatch, 2 * cap + 1),
        minibatch,
        -1,
    }
    return sorted(out - {cap})


class _Move(NamedTuple):
    """One neighbour of a schedule: on the forward (``side`` 0) or backward (1) chunk ends of
    ``stages``, the end at sample ``clear`` removed and one at ``put`` set (-1: none); or stage
    ``stage``'s ``gene`` ("warmup": its 1F1B warm-up, "wcap": its W cap) set to ``value``."""

    side: int = 0
    stages: tuple = ()
    clear: int = -1
    put: int = -1
    gene: str = ""
    stage: int = -1
    value: int = 0


def _all_moves(
    problem: Problem, cand: Candidate, fmask: np.ndarray, bmask: Optional[np.ndarray], free_warmup: bool
) -> list[_Move]:
    """Every move from ``cand``, whose chunk ends are ``fmask`` (and with recompute ``bmask``)."""
    S, B = problem.num_stages, problem.minibatch
    warm = np.array(cand.warmups)
    found: list[_Move] = []

    def add(sd: int, stages, c: int, p: int) -> None:
        found.append(_Move(sd, tuple(int(x) for x in stages), c, p))

    # aligned: an end (sample index) shared by two or more stages' forward partitions
    inner = fmask[:, :-1]
    for e in np.flatnonzero(inner.sum(axis=0) >= 2):
        group = np.flatnonzero(inner[:, e])
        for to in (e - 1, e + 1, -1):
            if to != -1 and not 0 <= to < B - 1:
                continue
            add(0, group, int(e), int(to))
    for sd, mask in ((0, fmask), (1, bmask)) if problem.recompute else ((0, fmask),):
        for s in range(S):
            ends = np.flatnonzero(mask[s])  # the last is B - 1
            starts = np.concatenate([[0], ends[:-1] + 1])
            for j, e in enumerate(ends[:-1]):
                if e > starts[j]:  # shift down: the chunk before keeps a sample at least
                    add(sd, [s], int(e), int(e) - 1)
                if ends[j + 1] > e + 1:  # shift up: the chunk after keeps one
                    add(sd, [s], int(e), int(e) + 1)
                add(sd, [s], int(e), -1)  # merge
            for a, z in zip(starts, ends):
                if z > a:  # split in half: the first half has (size // 2) samples
                    add(sd, [s], -1, int(a + (z - a + 1) // 2 - 1))
    if free_warmup and cand.family.warmups:
        for s in range(S):
            n = len(cand.fsizes[s])
            for w in (min(warm[s], n) - 1, min(warm[s], n) + 1):
                if 0 <= w <= n and w != min(warm[s], n):
                    found.append(_Move(gene="warmup", stage=s, value=_warmup(w, n, B)))
    if cand.wcap is not None:
        for s in range(S):
            for c in _cap_moves(cand.wcap[s], max(cand.bsizes[s]), B):
                found.append(_Move(gene="wcap", stage=s, value=c))
    return found


def _neighbours(
    problem: Problem, cand: Candidate, free_warmup: bool = False
) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray, Optional[np.ndarray]]:
    """Every schedule one move from ``cand`` (GPipe or 1F1B order), as arrays: ``(fsizes (N, S,
    K), bsizes or None without recompute, warm-ups (N, S), W caps (N, S) or None without W
    ops)``: :func:`moves` on each stage's partition (and with recompute its backward one),
    :func:`aligned_moves` on the forward ones, in 1F1B order with ``free_warmup`` a warm-up one
    up or down, with W ops :func:`_cap_moves`. Built on chunk-end masks the way the GA's
    population is, not as lists of lists: at the largest sizes building the neighbours had taken
    most of a climb's time (docs/results.md, "Evaluator throughput")."""
    S, B, mx = problem.num_stages, problem.minibatch, problem.max_size
    fmask = np.array([sizes_to_ends(p, B) for p in cand.fsizes])
    bmask = np.array([sizes_to_ends(p, B) for p in cand.bsizes]) if problem.recompute else None
    warm = np.array(cand.warmups)
    found = _all_moves(problem, cand, fmask, bmask, free_warmup)
    N = len(found)
    if N == 0:
        return np.zeros((0, S, 1), dtype=np.int64), None, np.zeros((0, S), dtype=np.int64), None
    cap = max(1, _NEIGHBOUR_CELLS // (S * B * (2 if problem.recompute else 1)))
    if N > cap:  # on the largest instances a step looks at an even spread of the moves, in bounded memory
        found = [found[i] for i in np.linspace(0, N - 1, cap).round().astype(int)]
        N = cap
    side, clear, put = (np.array([getattr(m, k) for m in found]) for k in ("side", "clear", "put"))
    stage_rows = [m.stages for m in found]
    gene = np.array([m.gene for m in found])
    gene_stage = np.array([m.stage for m in found])
    gene_value = np.array([m.value for m in found])
    masks = [np.repeat(fmask[None], N, axis=0)] + (
        [np.repeat(bmask[None], N, axis=0)] if problem.recompute else []
    )
    rows = np.repeat(np.arange(N), [len(g) for g in stage_rows])
    st = (
        np.concatenate([np.asarray(g, dtype=np.int64) for g in stage_rows])
        if len(rows)
        else np.zeros(0, dtype=np.int64)
    )
    sd, cl, pt = (x[rows] for x in (side, clear, put))
    for k, m in enumerate(masks):
        on = sd == k
        c = on & (cl >= 0)
        m[rows[c], st[c], cl[c]] = False
        p = on & (pt >= 0)
        m[rows[p], st[p], pt[p]] = True
    n_warm = np.repeat(warm[None], N, axis=0)
    w_rows = np.flatnonzero(gene == "warmup")
    n_warm[w_rows, gene_stage[w_rows]] = gene_value[w_rows]
    n_caps = None
    if cand.wcap is not None:
        n_caps = np.repeat(np.asarray(cand.wcap)[None], N, axis=0)
        c_rows = np.flatnonzero(gene == "wcap")
        n_caps[c_rows, gene_stage[c_rows]] = gene_value[c_rows]
    fs = ends_to_sizes(masks[0])
    bs = ends_to_sizes(masks[1]) if problem.recompute else None
    # a move that made a chunk longer than the largest size, or changed nothing, is no move
    ok = fs.max(axis=(1, 2)) <= mx
    if bs is not None:
        ok &= bs.max(axis=(1, 2)) <= mx
    ok &= (
        (masks[0] != fmask).any(axis=(1, 2))
        | (gene != "")
        | ((masks[1] != bmask).any(axis=(1, 2)) if bs is not None else False)
    )
    return (
        fs[ok],
        (bs[ok] if bs is not None else None),
        n_warm[ok],
        (n_caps[ok] if n_caps is not None else None),
    )


def score_batch(problem: Problem, cands: list[Candidate]) -> tuple[np.ndarray, np.ndarray]:
    """(iteration ms, sum of stage finish times) per candidate; ``inf`` over the memory limit."""
    limit = problem.memory_limit
    # without recompute the backward partitions are the forward ones: packed once
    bsizes = (lambda: pack([c.bsizes for c in cands])) if problem.recompute else (lambda: None)
    split = {c.wcap is None for c in cands} == {False}
    wcap = np.array([c.wcap for c in cands]) if split else None
    families = {c.family for c in cands}
    fam = families.pop() if len(families) == 1 else None
    if fam is not None and fam.by_rule and (split or all(c.wcap is None for c in cands)):
        n_warm = np.array([c.warmups for c in cands]) if fam.warmups else None
        it, sc = fam.score(problem.tables, pack([c.fsizes for c in cands]), bsizes(), n_warm, wcap)
        return it, sc.finish_ms.sum(axis=1)
    it = np.empty(len(cands))
    tie = np.empty(len(cands))
    for i, c in enumerate(cands):
        ops = c.ops()
        if limit is not None and any(
            stage_peak_memory(problem.tables, s, o) > limit for s, o in enumerate(ops)
        ):
            it[i] = tie[i] = np.inf
            continue
        tl = simulate(problem.tables, ops, problem.minibatch, record=False)
        it[i], tie[i] = tl.iteration_ms, sum(tl.finish_ms)
    return it, tie


# neighbours scored in one call of the population simulator at most
_SLICE = 512
# (neighbour, stage, sample) cells one step builds at most
_NEIGHBOUR_CELLS = 1 << 24


def hill_climb(
    problem: Problem, cand: Candidate, deadline: float, max_steps: int = 10_000, free_warmup: bool = False
) -> tuple[Candidate, int]:
    """Climb from ``cand`` (GPipe or 1F1B order); returns the best candidate found and how many
    schedules were scored."""
    if not cand.family.by_rule:
        raise ValueError(f"the climb moves partitions of GPipe or 1F1B order, not {cand.order!r}")
    (it,), (tie,) = score_batch(problem, [cand])
    scored = 1
    for _ in range(max_steps):
        if time.perf_counter() > deadline:
            break
        fs, bs, n_warm, n_caps = _neighbours(problem, cand, free_warmup)
        if not len(fs):
            break
        # scored in slices, so that a step on a large instance (thousands of neighbours, a
        # second or more) stops at the deadline with the best of those scored so far
        its_parts, tie_parts = [], []
        for a in range(0, len(fs), _SLICE):
            if a and time.perf_counter() > deadline:
                break
            cut = slice(a, a + _SLICE)
            wc_cut = None if n_caps is None else n_caps[cut]
            its_a, sc = cand.family.score(
                problem.tables,
                fs[cut],
                None if bs is None else bs[cut],
                None if n_warm is None else n_warm[cut],
                wc_cut,
            )
            its_parts.append(its_a)
            tie_parts.append(sc.finish_ms.sum(axis=1))
        its, ties = np.concatenate(its_parts), np.concatenate(tie_parts)
        scored += len(its)
        k = int(np.lexsort((ties, its))[0])
        if not (its[k] < it - 1e-9 or (its[k] <= it + 1e-12 and ties[k] < tie - 1e-9)):
            break
        f = [[int(x) for x in row if x] for row in fs[k]]
        b = [[int(x) for x in row if x] for row in bs[k]] if bs is not None else f
        w = [int(x) for x in n_warm[k]]
        warmup = None if not cand.family.warmups else cand.warmup if w == cand.warmups else w
        wcap = None if n_caps is None else [int(x) for x in n_caps[k]]
        cand, it, tie = Candidate(f, b, cand.order, warmup=warmup, wcap=wcap), float(its[k]), float(ties[k])
    cand.iteration_ms = it
    return cand, scored


def _kick(
    rng: np.random.Generator, problem: Problem, cand: Candidate, n_moves: int, free_warmup: bool
) -> Candidate:
    """``cand`` after ``n_moves`` random moves, each on a random stage's forward partition (with
    recompute, as often its backward one), in 1F1B order its warm-up, with W ops its W cap."""
    mx, S, B = problem.max_size, problem.num_stages, problem.minibatch
    f = [list(p) for p in cand.fsizes]
    b = [list(p) for p in cand.bsizes] if problem.recompute else f
    n_warm = cand.warmups
    wcap = None if cand.wcap is None else list(cand.wcap)
    for _ in range(n_moves):
        s = int(rng.integers(S))
        if wcap is not None and rng.random() < 0.2:
            options = _cap_moves(wcap[s], max(b[s]), B)
            wcap[s] = options[int(rng.integers(len(options)))]
            continue
        if free_warmup and cand.family.warmups and rng.random() < 0.2:
            n = len(f[s])
            w = min(n_warm[s], n) + int(rng.choice([-1, 1]))
            n_warm[s] = _warmup(w, n, B)
            continue
        part = b if problem.recompute and rng.random() < 0.5 else f
        options = list(moves(part[s], mx))
        if options:
            part[s] = options[int(rng.integers(len(options)))]
    return Candidate(f, b, cand.order, warmup=n_warm if cand.family.warmups else None, wcap=wcap)


def iterated_climb(
    problem: Problem,
    cand: Candidate,
    deadline: float,
    seed: int = 0,
    free_warmup: bool = False,
    kick_size: int = 4,
    max_kicks: Optional[int] = None,
    report: Optional[Callable[[float], None]] = None,
    stop: Optional[Callable[[float], bool]] = None,
) -> tuple[Candidate, int]:
    """Iterated local search: climb, then until ``deadline`` (or ``max_kicks`` kicks) kick the
    incumbent with 2 to ``kick_size`` random moves and climb again, keeping the result when it is
    no worse (so the search drifts along plateaus instead of returning to the same optimum).
    Returns the best candidate and how many schedules were scored; ``report(best ms)``, when
    given, is called after every kick (for a progress bar); ``stop(best ms)`` True ends it early
    (a bound proved the best optimal)."""
    rng = np.random.default_rng(seed)
    best, scored = hill_climb(problem, cand, deadline, free_warmup=free_warmup)
    cur, kicks = best, 0
    while time.perf_counter() < deadline and (max_kicks is None or kicks < max_kicks):
        if stop is not None and stop(best.iteration_ms):
            break
        kicks += 1
        trial = _kick(rng, problem, cur, int(rng.integers(2, kick_size + 1)), free_warmup)
        trial, n = hill_climb(problem, trial, deadline, free_warmup=free_warmup)
        scored += n
        if trial.iteration_ms <= cur.iteration_ms + 1e-9:
            cur = trial
            if cur.iteration_ms < best.iteration_ms - 1e-9:
                best = cur
        if report:
            report(best.iteration_ms)
    return best, scored
