"""The paper's dual-chromosome genetic algorithm (DGAP), scored a population at a time (TiDGAP).

An individual carries, for every stage, a forward chromosome and a backward chromosome: each a row
of B booleans, true where a chunk ends (so every row is a partition of the minibatch). Without
recompute a stage's backward chunks must be its forward chunks, so only the forward chromosomes
evolve; with recompute both evolve independently, in either order. Each generation:

* the elite survive unchanged;
* parents are picked by tournament; a child takes each stage's chromosome from one parent up to a
  random sample and from the other after it (a one-point crossover per stage, which at the ends
  degenerates to copying a whole stage);
* mutations shift, add or remove a chunk end, copy a neighbouring stage, or reset a stage to
  equal chunks; a repair pass splits any chunk longer than the profile's largest size;
* the whole population is scored at once, by each family's population evaluator
  (:meth:`umopt.schedules.family.ScheduleFamily.score`). An individual also carries its order as a
  gene (which of the families searched it is in: every family built by rule under ``--order auto``,
  GPipe and 1F1B and any registered beside them), so the search picks the order along with the
  partitions, and an individual of a family with warm-ups (1F1B) carries each stage's warm-up (forwards before its first backward) as a third
  chromosome: PipeDream-flush fixes it at ``S - s - 1``, but the stage holding the most work
  often does best with fewer in flight and the stages feeding it with more (all forwards first,
  GPipe-like), which is how the best schedules of small instances look when solved exactly.
  With ``weights`` (zero bubble) each individual also carries a W cap per stage (how many samples
  may await their weight gradient before a W op runs, :class:`umopt.search.problem.Candidate`), so the
  partitions are searched with where their W ops go, not before it.

Seeds (the best equal schedules and any the caller brings) start the population, so the result is
never worse than they are; a best-improvement local search (:mod:`.local`) polishes the best
individual now and then. Once the population stalls (or 90% of the time is gone) the best of each
order goes to an iterated local search for the rest of the time: kicks of a few random moves, each
followed by a climb. Evolution finds the region, the kicks find what no single move reaches
(several stages changed together), which pays better than restarting evolution. Ties in
iteration time, which are common because it is a max over stages, are broken by the sum of the
stages' finish times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ...schedules import pipedream_warmup
from ...schedules.family import ScheduleFamily, ruled
from ...schedules.partition import ends_to_sizes, equal_sizes, repair_ends, sizes_to_ends
from ..baselines import best_equal, feasible_m
from ..problem import Candidate, Problem, Progress, SolverResult
from .entry import entry
from .local import hill_climb, iterated_climb

__all__ = ["solve_ga"]


def _textbook(S: int) -> np.ndarray:
    return np.array(pipedream_warmup(S))


def _to_ends(
    problem: Problem, cands: Sequence[Candidate], families: Sequence[ScheduleFamily]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidates as rows: forward and backward end masks, the order gene (the index of each
    one's family in ``families``) and warm-ups."""
    B = problem.minibatch
    f_ends = np.array([[sizes_to_ends(p, B) for p in c.fsizes] for c in cands])
    b_ends = np.array([[sizes_to_ends(p, B) for p in c.bsizes] for c in cands])
    warm = np.array([c.warmups for c in cands], dtype=np.int64)
    return f_ends, b_ends, np.array([families.index(c.family) for c in cands]), warm


def _to_candidate(
    f_ends: np.ndarray,
    b_ends: np.ndarray,
    fam: ScheduleFamily,
    warmup: np.ndarray,
    wcap: Optional[np.ndarray] = None,
) -> Candidate:
    """One individual's (S, B) end masks (and warm-ups, where its family has them; W caps with W
    ops) as a candidate."""
    fs = [[int(x) for x in row if x] for row in ends_to_sizes(f_ends)]
    bs = [[int(x) for x in row if x] for row in ends_to_sizes(b_ends)]
    w_caps = None if wcap is None else [int(c) for c in wcap]
    if not fam.warmups:
        return Candidate(fs, bs, fam.name, wcap=w_caps)
    warm = [int(w) for w in warmup]
    return Candidate(fs, bs, fam.name, warmup=None if warm == list(_textbook(len(fs))) else warm, wcap=w_caps)


class _Scorer:
    """Fitness of populations of end masks (iteration ms, ties broken by a hair); counts calls."""

    def __init__(self, problem: Problem, families: Sequence[ScheduleFamily]):
        self.problem = problem
        self.families = families
        self.count = 0

    def __call__(
        self,
        f_ends: np.ndarray,
        b_ends: np.ndarray,
        gene: np.ndarray,
        warmup: np.ndarray,
        wcap: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        self.count += f_ends.shape[0]
        fit = np.empty(f_ends.shape[0])
        rec = self.problem.recompute
        for i, fam in enumerate(self.families):  # the order gene picks the family
            who = gene == i
            if who.any():
                bs = ends_to_sizes(b_ends[who]) if rec else None
                w_caps = None if wcap is None else wcap[who]
                warm = warmup[who] if fam.warmups else None
                it, sc = fam.score(self.problem.tables, ends_to_sizes(f_ends[who]), bs, warm, w_caps)
                fit[who] = it + 1e-7 * sc.finish_ms.mean(axis=1)
        return fit


def _polish(
    problem: Problem,
    f_ends: np.ndarray,
    b_ends: np.ndarray,
    fam: ScheduleFamily,
    warmup: np.ndarray,
    wcap: Optional[np.ndarray],
    deadline: float,
    free_warmup: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray], int]:
    cand, n = hill_climb(
        problem, _to_candidate(f_ends, b_ends, fam, warmup, wcap), deadline, free_warmup=free_warmup
    )
    B = problem.minibatch
    warm = np.array(cand.warmups)
    w_caps = None if cand.wcap is None else np.array(cand.wcap)
    return (
        np.array([sizes_to_ends(p, B) for p in cand.fsizes]),
        np.array([sizes_to_ends(p, B) for p in cand.bsizes]),
        warm,
        w_caps,
        n,
    )


def _equal_rows(rng: np.random.Generator, n: int, problem: Problem) -> np.ndarray:
    ms = np.array(list(feasible_m(problem)))
    B = problem.minibatch
    # log-uniform M: small and large chunk counts are equally likely to be tried
    pick = ms[np.minimum((np.exp(rng.uniform(0, np.log(len(ms) + 1), n)) - 1).astype(int), len(ms) - 1)]
    return np.array([sizes_to_ends(equal_sizes(B, int(m)), B) for m in pick]).reshape(n, B)


def _mutate(rng: np.random.Generator, pop: np.ndarray, problem: Problem, rate: float) -> None:
    """Mutate (P, S, B) end masks in place; about ``rate`` mutations per individual."""
    P, S, B = pop.shape
    n = rng.poisson(rate * P)
    if n == 0 or B == 1:
        return
    who = rng.integers(0, P, n)
    st = rng.integers(0, S, n)
    kind = rng.choice(5, size=n, p=[0.45, 0.2, 0.2, 0.1, 0.05])
    rows = pop[who, st].copy()  # (n, B)
    inner = rows[:, :-1]
    # 0: shift a random chunk end by 1..3 samples either way
    # 1: add an end at a random sample; 2: remove a random end
    rand_end = np.argmax(rng.random(inner.shape) * inner, axis=1)
    has_end = inner.any(axis=1)
    rand_pos = rng.integers(0, B - 1, n)
    shift = rng.choice([-3, -2, -1, 1, 2, 3], size=n, p=[0.05, 0.15, 0.3, 0.3, 0.15, 0.05])
    idx = np.arange(n)
    m = (kind == 0) & has_end
    dest = np.clip(rand_end + shift, 0, B - 2)
    inner[idx[m], rand_end[m]] = False
    inner[idx[m], dest[m]] = True
    m = kind == 1
    inner[idx[m], rand_pos[m]] = True
    m = (kind == 2) & has_end
    inner[idx[m], rand_end[m]] = False
    # 3: copy a neighbouring stage's chromosome
    m = kind == 3
    if S > 1 and m.any():
        other = np.clip(st[m] + rng.choice([-1, 1], size=int(m.sum())), 0, S - 1)
        rows[m] = pop[who[m], other]
    # 4: reset to equal chunks
    m = kind == 4
    if m.any():
        rows[m] = _equal_rows(rng, int(m.sum()), problem)
    repair_ends(rows, problem.max_size)
    pop[who, st] = rows


def _initial_warmups(rng: np.random.Generator, n: int, S: int, minibatch: int) -> np.ndarray:
    """(n, S) warm-ups: a third PipeDream-flush's, a third "feed the last stage" (every other
    stage forwards all it can first, the last runs one forward, one backward), a third random."""
    warm = np.tile(_textbook(S), (n, 1))
    pick = rng.integers(0, 3, n)
    warm[pick == 1, :-1] = minibatch
    warm[pick == 1, -1] = 0
    warm[pick == 2] = rng.integers(0, 2 * S, (int((pick == 2).sum()), S))
    return warm


def _mutate_warmup(rng: np.random.Generator, warm: np.ndarray, f_ends: np.ndarray, rate: float) -> None:
    """Mutate (P, S) warm-ups in place: one more or one fewer forward in flight on a stage, now and
    then all forwards first (GPipe-like) or back to PipeDream-flush's. ``f_ends``: the (P, S, B) chunk
    ends, so a warm-up never counts past the stage's chunks (where more would change nothing)."""
    P, S = warm.shape
    B = f_ends.shape[2]
    n = rng.poisson(rate * P)
    if n == 0:
        return
    who, st = rng.integers(0, P, n), rng.integers(0, S, n)
    chunks = f_ends[who, st].sum(axis=1)
    kind = rng.choice(4, size=n, p=[0.4, 0.4, 0.1, 0.1])
    new = np.minimum(warm[who, st], chunks) + np.where(kind == 0, 1, np.where(kind == 1, -1, 0))
    new = np.where(kind == 3, S - 1 - st, new)
    # "all forwards first" is kept as the minibatch, so it stays so when the partition changes
    warm[who, st] = np.where((kind == 2) | (new >= chunks), B, np.maximum(new, 0))


def _initial_caps(
    rng: np.random.Generator, f_ends: np.ndarray, gene: np.ndarray, families: Sequence[ScheduleFamily]
) -> np.ndarray:
    """(P, S) W caps: a third each family's first caps (1F1B: ZB-H1's, 1F1B's peak, S of the
    stage's largest chunks; GPipe order: every W at the end), a third every W at the end, a third
    random."""
    P, S, B = f_ends.shape
    pick = rng.integers(0, 3, (P, S))
    largest = ends_to_sizes(f_ends).max(axis=2)
    zb = np.empty((P, S), dtype=np.int64)
    for i, fam in enumerate(families):
        zb[gene == i] = fam.first_wcaps(largest[gene == i], S, B)
    return np.where(pick == 0, np.minimum(zb, B), np.where(pick == 1, B, rng.integers(0, B + 1, (P, S))))


def _mutate_caps(
    rng: np.random.Generator, wcap: np.ndarray, minibatch: int, max_size: int, rate: float
) -> None:
    """Mutate (P, S) W caps in place, about ``rate`` mutations per individual: up to a chunk's
    worth more or fewer, halved or doubled, every W at the end, now and then the stage's backward
    whole (-1); a whole one is split again with a random cap by any other mutation."""
    P, S = wcap.shape
    n = rng.poisson(rate * P)
    if n == 0:
        return
    who, st = rng.integers(0, P, n), rng.integers(0, S, n)
    cur = wcap[who, st]
    kind = rng.choice(6, size=n, p=[0.3, 0.3, 0.1, 0.1, 0.15, 0.05])
    step = rng.integers(1, max_size + 1, n)
    new = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
        [cur + step, cur - step, cur // 2, 2 * cur + 1, np.full(n, minibatch)],
        -1,
    )
    new = np.where((cur < 0) & (kind != 5), rng.integers(0, minibatch + 1, n), new)
    wcap[who, st] = np.where(kind == 5, -1, np.clip(new, 0, minibatch))


def _elite(fit: np.ndarray, gene: np.ndarray, k: int, families: int) -> np.ndarray:
    """The ``k`` fittest, of which the best quarter of each order present (the last family's
    first), so that no order dies out once another leads: which one wins often shows only after
    all have evolved."""
    order = np.argsort(fit, kind="stable")
    q = max(1, k // 4)
    keep = [i for o in reversed(range(families)) for i in order[gene[order] == o][:q]]
    keep += [i for i in order[: 2 * k] if i not in keep]
    return np.array(keep[:k])


def _crossover(rng: np.random.Generator, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per stage, one-point crossover in sample space: samples before the cut from one parent."""
    P, S, B = a.shape
    cut = rng.integers(0, B + 1, (P, S, 1))
    swap = rng.random((P, S, 1)) < 0.5
    first, second = np.where(swap, b, a), np.where(swap, a, b)
    return np.where(np.arange(B) < cut, first, second)


@dataclass
class _Population:
    """Individuals as rows: forward chunk ends ``f_ends`` (P, S, B), backward ones (``f_ends`` itself
    without recompute: one partition per stage), the order gene ``gene`` (P,: the index of each
    one's family among those searched), the warm-ups (P, S) and the fitness (P,)."""

    f_ends: np.ndarray
    b_ends_own: Optional[np.ndarray]  # only with recompute
    gene: np.ndarray
    warmup: np.ndarray
    fit: np.ndarray
    wcap: Optional[np.ndarray] = None  # (P, S) W caps, only with W ops

    @property
    def b_ends(self) -> np.ndarray:
        return self.f_ends if self.b_ends_own is None else self.b_ends_own

    @classmethod
    def scored(
        cls,
        scorer: "_Scorer",
        f_ends,
        b_ends,
        gene,
        warmup,
        recompute: bool,
        wcap: Optional[np.ndarray] = None,
    ) -> "_Population":
        return cls(
            f_ends,
            b_ends if recompute else None,
            gene,
            warmup,
            scorer(f_ends, b_ends, gene, warmup, wcap),
            wcap,
        )

    def take(self, idx: np.ndarray) -> "_Population":
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return _Population(
            self.f_ends[idx],
            pick(self.b_ends_own),
            self.gene[idx],
            self.warmup[idx],
            self.fit[idx],
            pick(self.wcap),
        )

    def __add__(self, other: "_Population") -> "_Population":
        cat = lambda a, b: None if a is None else np.concatenate([a, b])  # noqa: E731
        return _Population(
            cat(self.f_ends, other.f_ends),
            cat(self.b_ends_own, other.b_ends_own),
            cat(self.gene, other.gene),
            cat(self.warmup, other.warmup),
            cat(self.fit, other.fit),
            cat(self.wcap, other.wcap),
        )

    def candidate(self, k: int, families: Sequence[ScheduleFamily]) -> Candidate:
        return _to_candidate(
            self.f_ends[k],
            self.b_ends[k],
            families[int(self.gene[k])],
            self.warmup[k],
            None if self.wcap is None else self.wcap[k],
        )


@entry
def solve_ga(
    problem: Problem,
    *,
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    seeds: Sequence[Candidate] = (),
    population: int = 128,
    elite: int = 8,
    mutation_rate: float = 1.5,
    stall_generations: int = 300,
    max_restarts: Optional[int] = 0,
    max_generations: int = 1_000_000,
    order: Optional[ScheduleFamily] = None,
    polish_share: float = 0.1,
    polish_kicks: Optional[int] = None,
    stop: Optional[Callable[[float], bool]] = None,
    weights: bool = False,
) -> SolverResult:
    """The GA within ``time_limit`` seconds. ``stop(best ms)``, asked every generation and every
    kick of the polish, ends the search early when True (``auto``: a bound proved it optimal).
    ``order``: the one family to search (None: every family built by rule, 1F1B's warm-ups free).
    ``weights``: every individual carries W caps too (a fourth chromosome, :class:`Candidate`'s
    ``wcap``: each stage's backward split into B and W ops, the W ops deferred under the cap),
    mutated and crossed over like the warm-ups; the profile must have the split."""
    t0 = time.perf_counter()
    deadline = t0 + (1 - polish_share) * time_limit
    run = _Run(problem, np.random.default_rng(seed), population, elite, order, weights)
    pop = run.initial(seeds)
    best_fit, stall, gen, polished, restarts = float(pop.fit.min()), 0, 0, 0, 0
    last_report = 0.0
    while gen < max_generations and time.perf_counter() < deadline:
        if stall >= stall_generations:
            # converged: after max_restarts restarts (None: no limit) the iterated local search
            # gets the rest of the time, which finds better schedules than more generations do
            if max_restarts is not None and restarts >= max_restarts:
                break
            restarts += 1
            stall = 0
            pop = run.restart(pop)
        gen += 1
        pop = run.generation(pop, mutation_rate)
        if gen % 50 == 0:  # memetic step: now and then polish the best individual by local search
            polished += run.polish_best(pop, min(deadline, time.perf_counter() + 0.05 * time_limit))
        now_best = float(pop.fit.min())
        if now_best < best_fit - 1e-9:
            best_fit, stall = now_best, 0
        else:
            stall += 1
        if progress and time.perf_counter() - last_report > 0.1:
            last_report = time.perf_counter()
            progress(min(1.0, (last_report - t0) / time_limit), best_fit)
        if stop is not None and stop(best_fit):
            break
    end = max(deadline, time.perf_counter()) + polish_share * time_limit
    clock = (t0, time_limit, best_fit, last_report)
    cand, n = _climb_leaders(problem, pop, run, end, seed, polish_kicks, progress, stop, clock)
    if progress:
        progress(1.0, cand.iteration_ms)
    return SolverResult(
        "ga",
        cand,
        "feasible",
        evaluated=run.scorer.count + polished + n,
        generations=gen,
        restarts=restarts,
    )


class _Run:
    """One GA run's fixed settings and its steps: the first population, a restart, a
    generation, the memetic polish of the best. Which families evolve (``order``'s, or every
    family built by rule) is the order gene's range; individuals of a family with warm-ups carry
    them, and with ``weights`` all carry W caps (the W placement modifier's genes)."""

    def __init__(
        self,
        problem: Problem,
        rng: np.random.Generator,
        population: int,
        elite: int,
        order: Optional[ScheduleFamily],
        weights: bool,
    ):
        self.problem, self.rng, self.P, self.elite = problem, rng, population, elite
        self.S, self.B, self.mx = problem.num_stages, problem.minibatch, problem.max_size
        self.rec = problem.recompute
        self.families = ruled() if order is None else [order]
        # --order 1f1b means PipeDream-flush's warm-ups; auto searches them
        self.free_warmup = order is None and any(f.warmups for f in self.families)
        self.weights = weights
        self.scorer = _Scorer(problem, self.families)

    def _random_orders(self, n: int) -> np.ndarray:
        """Order genes drawn evenly over the families (the last for the lowest draws)."""
        k = len(self.families)
        return np.minimum(k - 1 - np.floor(self.rng.random(n) * k), k - 1).astype(np.int64)

    def initial(self, seeds: Sequence[Candidate]) -> _Population:
        """The best equal schedules and the caller's seeds (up to half), the rest random equal
        partitions, mutated."""
        problem, rng, P, S, B, rec = self.problem, self.rng, self.P, self.S, self.B, self.rec
        start = [c for c in seeds if c.family in self.families]
        for fam in self.families:  # the best equal schedules first, the last family's leading
            base = best_equal(problem, fam)
            if base.candidate is not None:
                start.insert(0, base.candidate)
        fwd_ends = np.empty((P, S, B), dtype=bool)
        bwd_ends = np.empty((P, S, B), dtype=bool)
        gene = np.zeros(P, dtype=np.int64)
        warmups = np.tile(_textbook(S), (P, 1))
        n_seed = min(len(start), P // 2)
        if n_seed:
            fwd_ends[:n_seed], bwd_ends[:n_seed], gene[:n_seed], warmups[:n_seed] = _to_ends(
                problem, start[:n_seed], self.families
            )
        rest = P - n_seed
        fwd_ends[n_seed:] = _equal_rows(rng, rest * S, problem).reshape(rest, S, B)
        bwd_ends[n_seed:] = (
            fwd_ends[n_seed:] if not rec else _equal_rows(rng, rest * S, problem).reshape(rest, S, B)
        )
        gene[n_seed:] = self._random_orders(rest)
        _mutate(rng, fwd_ends[n_seed:], problem, 1.0)
        if self.free_warmup:
            warmups[n_seed:] = _initial_warmups(rng, rest, S, B)
        if rec:
            _mutate(rng, bwd_ends[n_seed:], problem, 1.0)
        caps = None
        if self.weights:  # seeds without W caps get them too: each start both ways
            caps = _initial_caps(rng, fwd_ends, gene, self.families)
            for i, c in enumerate(start[:n_seed]):
                if c.wcap is not None:
                    caps[i] = c.wcap
        bwd = bwd_ends if rec else fwd_ends
        return _Population.scored(self.scorer, fwd_ends, bwd, gene, warmups, rec, caps)

    def restart(self, pop: _Population) -> _Population:
        """The elite kept; the rest refilled with fresh and heavily mutated individuals."""
        problem, rng, P, S, B, elite = self.problem, self.rng, self.P, self.S, self.B, self.elite
        kept = pop.take(_elite(pop.fit, pop.gene, elite, len(self.families)))
        fresh = P - elite
        new_f = np.concatenate(
            [
                kept.f_ends[rng.integers(0, elite, fresh // 2)],
                _equal_rows(rng, (fresh - fresh // 2) * S, problem).reshape(-1, S, B),
            ]
        )
        _mutate(rng, new_f, problem, 4.0)
        new_b = new_f
        if self.rec:
            new_b = np.concatenate(
                [
                    kept.b_ends[rng.integers(0, elite, fresh // 2)],
                    _equal_rows(rng, (fresh - fresh // 2) * S, problem).reshape(-1, S, B),
                ]
            )
            _mutate(rng, new_b, problem, 4.0)
        pick = rng.integers(0, elite, fresh // 2)
        new_o = np.concatenate([kept.gene[pick], self._random_orders(fresh - fresh // 2)])
        new_w = np.concatenate([kept.warmup[pick], np.tile(_textbook(S), (fresh - fresh // 2, 1))])
        if self.free_warmup:
            _mutate_warmup(rng, new_w, new_f, 2.0)
        new_c = None
        if self.weights:
            new_c = np.concatenate(
                [kept.wcap[pick], _initial_caps(rng, new_f[fresh // 2 :], new_o[fresh // 2 :], self.families)]
            )
            _mutate_caps(rng, new_c, B, self.mx, 2.0)
        return kept + _Population.scored(self.scorer, new_f, new_b, new_o, new_w, self.rec, new_c)

    def generation(self, pop: _Population, mutation_rate: float) -> _Population:
        """The elite, and children of tournament-picked parents: crossed over, mutated, repaired."""
        rng, P, S, mx = self.rng, self.P, self.S, self.mx
        k = len(self.families)
        elite_idx = _elite(pop.fit, pop.gene, self.elite, k)
        nchild = P - self.elite
        # tournament selection of 2 parents per child; with several orders, the children come
        # evenly from tournaments among each order's individuals, so trailing orders keep evolving
        cand = rng.integers(0, P, (2, nchild, 3))
        rank = pop.fit[cand]
        if k > 1:
            want = np.arange(nchild) % k  # the order each child's tournaments favour
            rank = np.where(pop.gene[cand] == want[None, :, None], rank, rank + 1e9)
        parents = np.take_along_axis(cand, np.argmin(rank, axis=2)[..., None], axis=2)[..., 0]
        child_f = _crossover(rng, pop.f_ends[parents[0]], pop.f_ends[parents[1]])
        _mutate(rng, child_f, self.problem, mutation_rate)
        repair_ends(child_f, mx)
        child_b = child_f
        if self.rec:
            child_b = _crossover(rng, pop.b_ends[parents[0]], pop.b_ends[parents[1]])
            _mutate(rng, child_b, self.problem, mutation_rate)
            # now and then hand a stage's forward chunks to its backward chromosome
            flip = rng.random((nchild, S)) < 0.02
            child_b[flip] = child_f[flip]
            repair_ends(child_b, mx)
        child_o = pop.gene[parents[0]].copy()
        if k > 1:  # now and then a child moves to another order (draw / 0.03 picks which)
            draw = rng.random(nchild)
            moved = draw < 0.03
            child_o[moved] = (child_o[moved] + 1 + (draw[moved] / 0.03 * (k - 1)).astype(np.int64)) % k
        child_w = np.where(rng.random((nchild, S)) < 0.5, pop.warmup[parents[0]], pop.warmup[parents[1]])
        if self.free_warmup:
            _mutate_warmup(rng, child_w, child_f, 0.3)
        child_c = None
        if self.weights:
            child_c = np.where(rng.random((nchild, S)) < 0.5, pop.wcap[parents[0]], pop.wcap[parents[1]])
            _mutate_caps(rng, child_c, self.B, mx, 0.3)
        children = _Population.scored(self.scorer, child_f, child_b, child_o, child_w, self.rec, child_c)
        return pop.take(elite_idx) + children

    def polish_best(self, pop: _Population, deadline: float) -> int:
        """The best individual climbed by local search until ``deadline``, in place; the
        schedules scored."""
        k = int(np.argmin(pop.fit))
        own_c = None if pop.wcap is None else pop.wcap[k]
        pf, pb, pw, pc, n = _polish(
            self.problem,
            pop.f_ends[k],
            pop.b_ends[k],
            self.families[int(pop.gene[k])],
            pop.warmup[k],
            own_c,
            deadline,
            self.free_warmup,
        )
        pop.f_ends[k] = pf
        if self.rec:
            pop.b_ends[k] = pb
        pop.warmup[k] = pw
        if pc is not None:
            pop.wcap[k] = pc
        one = slice(k, k + 1)
        caps = None if pop.wcap is None else pop.wcap[one]
        pop.fit[k] = self.scorer(pop.f_ends[one], pop.b_ends[one], pop.gene[one], pop.warmup[one], caps)[0]
        return n


def _climb_leaders(
    problem: Problem,
    pop: _Population,
    run: _Run,
    end: float,
    seed: int,
    polish_kicks: Optional[int],
    progress: Optional[Progress],
    stop: Optional[Callable[[float], bool]],
    clock: tuple[float, float, float, float],
) -> tuple[Candidate, int]:
    """The best of each order climbed by iterated local search until ``end``: the climb cannot
    change the order, and the runner-up order's best is often a few moves away from beating the
    leader. ``clock``: the run's start, time limit, best so far and last report, for the bar."""
    t0, time_limit, best_fit, last_report = clock
    gene, fit = pop.gene, pop.fit
    leaders = [
        int(np.flatnonzero(gene == o)[np.argmin(fit[gene == o])])
        for o in range(len(run.families))
        if (gene == o).any()
    ]
    leaders.sort(key=lambda i: fit[i])
    cand, n = None, 0
    shown = [best_fit, last_report]

    def report(ms: float) -> None:  # the local search can take most of the time: keep the bar moving
        shown[0] = min(shown[0], ms)
        if progress and time.perf_counter() - shown[1] > 0.1:
            shown[1] = time.perf_counter()
            progress(min(1.0, (shown[1] - t0) / time_limit), shown[0])

    for j, k in enumerate(leaders):
        share = (end - time.perf_counter()) * (1.0 if j == len(leaders) - 1 else 0.75)
        c, m = iterated_climb(
            problem,
            pop.candidate(k, run.families),
            time.perf_counter() + share,
            seed=seed + j,
            free_warmup=run.free_warmup,
            max_kicks=polish_kicks,
            report=report,
            stop=stop,
        )
        n += m
        if cand is None or c.iteration_ms < cand.iteration_ms - 1e-9:
            cand = c
    return cand, n
