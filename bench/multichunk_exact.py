"""Several chunks per rank on small instances: how far the search and torch's orders are from optimal.

    python bench/multichunk_exact.py [--search 10] [--exact 60] [--markdown]

For each row, umopt's search (:func:`umopt.search.solvers.multichunk.solve_chunks`, v = 2, looped or
V-shaped, ``--search`` seconds, then its order polished for a quarter of that) picks a shape; on
that shape's cut and placement the exact CP-SAT model (:mod:`umopt.search.solvers.cpsat_chunks`, no
start given, ``--exact`` seconds) finds its own schedule and a lower bound on every schedule
there (any partitions, any order; with W ops: every virtual stage split). torch's orders of the
same placement and kind are scored on the same cut at every M. The last columns say how far the
search and torch are above the bound (0% where the model proves optimality).
"""

from __future__ import annotations

import argparse
import time

from tables import print_table

from umopt.costmodel import simulate
from umopt.errors import UmoptError
from umopt.formats.profile import load_profile
from umopt.search.peers.schedules import TORCH_MULTI, torch_ops
from umopt.search.problem import LayoutProblem
from umopt.search.solvers.cpsat_chunks import solve_chunks_exact
from umopt.search.solvers.multichunk import improve_order, solve_chunks
from umopt.synthetic import synthetic_profile

ROWS = [  # (profile, B, W ops)
    ("synthetic 2 ranks", 4, False),
    ("synthetic 2 ranks", 4, True),
    ("synthetic 2 ranks", 6, False),
    ("synthetic 2 ranks", 8, True),
    ("vgg16-chunks-cpu", 4, False),
    ("vgg16-chunks-cpu", 8, True),
    ("gpt-sim", 8, False),
]


def _profile(name: str):
    if name == "synthetic 2 ranks":
        return synthetic_profile(2, max_size=16, seed=3, layers_per_stage=6)
    return load_profile(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search", type=float, default=10.0)
    ap.add_argument("--exact", type=float, default=60.0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    cells, gaps = [], []
    for name, B, w in ROWS:
        profile = _profile(name)
        sol = solve_chunks(LayoutProblem(profile, B), chunk_counts=(2,), weights=w, seconds=args.search)
        ops, search_ms, _ = improve_order(sol.tables, sol.ops, B, args.search / 4)
        torch_ms, torch_name = float("inf"), "-"
        for peer, (place, _, with_w) in TORCH_MULTI.items():
            if place != sol.shape.placement or with_w != w:
                continue
            for m in range(1, B + 1):
                try:
                    ms = simulate(sol.tables, torch_ops(peer, profile.num_stages, 2, B, m), B).iteration_ms
                except UmoptError:  # torch refuses the shape
                    continue
                if ms < torch_ms:
                    torch_ms, torch_name = ms, f"{peer.removeprefix('Schedule')} M={m}"
        t0 = time.perf_counter()
        exact = solve_chunks_exact(sol.tables, B, time_limit=args.exact, weights=w)
        seconds = time.perf_counter() - t0
        bound = exact.lower_bound_ms
        gaps.append((name, B, w, search_ms / bound - 1))
        cells.append(
            [
                name,
                str(profile.num_stages),
                str(B),
                "yes" if w else "no",
                f"{sol.shape.placement}, {sol.shape.cut} cut",
                f"{search_ms:.2f}",
                "-" if torch_name == "-" else f"{torch_ms:.2f} ({torch_name})",
                f"{exact.iteration_ms:.2f}",
                f"{bound:.2f}" + (" (optimal)" if exact.optimal else ""),
                f"{100 * (search_ms / bound - 1):.1f}%",
                "-" if torch_name == "-" else f"{100 * (torch_ms / bound - 1):.1f}%",
                f"{seconds:.0f}",
            ]
        )
    proven = [g for g, c in zip(gaps, cells) if "optimal" in c[8]]
    print_table(
        "several chunks per rank, small instances: search and torch against the exact model",
        [
            "profile",
            "ranks",
            "B",
            "W ops",
            "shape (v=2)",
            "search ms",
            "best torch ms",
            "exact model ms",
            "bound ms",
            "search above bound",
            "torch above bound",
            "exact s",
        ],
        cells,
        [
            f"proven optimal: {len(proven)} of {len(cells)} rows; search above optimum there: "
            + ", ".join(f"{100 * g[3]:.1f}%" for g in proven),
            f"search above bound, worst: {100 * max(g[3] for g in gaps):.1f}%",
        ],
        args.markdown,
        left=("profile", "shape (v=2)", "best torch ms", "bound ms"),
    )


if __name__ == "__main__":
    main()
