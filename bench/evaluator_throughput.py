"""How many schedules per second the vectorized evaluators score, against the reference simulator.

    python bench/evaluator_throughput.py

Target (issue 2): at least 50,000 GPipe schedules per second for S=8, B=256 on a 2-core machine.
Populations are GA-like: per stage, equal chunks for a random M perturbed by random chunk-end
flips, as the GA's mutation makes them. Each row is the best of 3 runs.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from umopt.costmodel import CostTables, simulate
from umopt.schedules import gpipe_ops, population_sim
from umopt.schedules.partition import ends_to_sizes, equal_sizes, repair_ends, sizes_to_ends
from umopt.schedules.population_sim import evaluate_1f1b, evaluate_gpipe
from umopt.synthetic import synthetic_profile


def population(rng, P, S, B, mx, m_range):
    ends = np.zeros((P, S, B), dtype=bool)
    for p in range(P):
        for s in range(S):
            ends[p, s] = sizes_to_ends(equal_sizes(B, int(rng.integers(*m_range))), B)
    flips = rng.random((P, S, B)) < 2.0 / B
    ends ^= flips
    return repair_ends(ends, mx)


def best_of(fn, n=3):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    rng = np.random.default_rng(0)
    table = Table(title="schedules scored per second (best of 3)")
    cols = (
        "S",
        "B",
        "P",
        "chunks/stage (max)",
        "GPipe",
        "GPipe incl. mask->sizes",
        "GPipe, numpy",
        "1F1B",
        "1F1B, numpy",
        "reference simulator",
    )
    for col in cols:
        table.add_column(col, justify="right")
    # P = 128: the GA's population, what it scores each generation
    for S, B, P, m_range in [
        (4, 32, 128, (4, 17)),
        (4, 32, 1024, (4, 17)),
        (4, 64, 2048, (4, 33)),
        (8, 128, 2048, (8, 33)),
        (8, 256, 128, (8, 33)),
        (8, 256, 2048, (8, 33)),
        (8, 256, 4096, (8, 33)),
    ]:
        tables = CostTables.from_profile(synthetic_profile(S, max_size=64, seed=1))
        ends = population(rng, P, S, B, 64, m_range)
        sizes = ends_to_sizes(ends)
        t_g = best_of(lambda: evaluate_gpipe(tables, sizes))
        t_gc = best_of(lambda: evaluate_gpipe(tables, ends_to_sizes(ends)))
        t_1 = best_of(lambda: evaluate_1f1b(tables, sizes))
        # the same in numpy (and a Python loop for 1F1B): what runs where the C++ part did not build
        compiled, population_sim._compiled = population_sim._compiled, None
        try:
            t_gpy = best_of(lambda: evaluate_gpipe(tables, sizes))
            t_1py = best_of(lambda: evaluate_1f1b(tables, sizes))
        finally:
            population_sim._compiled = compiled
        n_ref = 20
        parts = [[[int(x) for x in sizes[p, s] if x] for s in range(S)] for p in range(n_ref)]
        t_ref = best_of(
            lambda: [simulate(tables, [gpipe_ops(f, f) for f in pp], B, record=False) for pp in parts], 1
        )
        table.add_row(
            str(S),
            str(B),
            str(P),
            str(sizes.shape[2]),
            f"{P / t_g:,.0f}",
            f"{P / t_gc:,.0f}",
            f"{P / t_gpy:,.0f}",
            f"{P / t_1:,.0f}",
            f"{P / t_1py:,.0f}",
            f"{n_ref / t_ref:,.0f}",
        )
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
