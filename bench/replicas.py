"""The global minibatch across data-parallel replicas, predicted: each assignment of the
sequences to the replicas (umopt/search/replicas.py), every replica then planned by umopt's own
planner, so that only the assignment differs; the slowest replica's step against the bound no
assignment beats.

    python bench/replicas.py [--replicas 8] [--stages 8] [--size 32] [--minibatches 8]
                             [--samplers chat lmsys long-context] [--model tuned|heldout]
                             [--delay 2] [--scale] [--sweep] [--tried] [--markdown]

For each sampler, ``--minibatches`` global minibatches of ``--size`` sequences per replica
(seeded). Per assignment: the mean over minibatches of the step (the slowest replica's plan),
its ratio to contiguous (torch's DistributedSampler, Megatron-LM, DeepSpeed) and to the best peer,
its distance above the lower bound, the slowest replica over the mean one, and the assignment's
time on this core. ``--delay K``: WLB-LLM's outlier delay beside it (sequences longer than a
threshold wait until there is one for each replica, at most K steps; the best of the stream's
90th, 95th and 99th percentiles as the threshold), reported apart: it changes which step trains
a sequence. ``--scale``: the assignment's time and its step (every replica planned) against the
contiguous split's, from D=4 to 64 replicas, up to 8192 sequences of chat. ``--sweep``: the
share of the heaviest sequence's fill umopt counts (1 - 2/S) against all of it, on synthetic
profiles of 2 to 16 stages (about 3 minutes). ``--tried``: what else was tried for the targets
missed (other shares of the fill; moves judged by the planner itself), on minibatches of seed 11
(about a minute). ``--model heldout``: a transformer the assignment was not developed on (32 blocks of
width 4096, a 128k vocabulary, 400 TFLOP/s): its figures are the check.

Targets (issue 70), D=8, S=8: >= 1.10x contiguous on chat and lmsys, >= 1.05x on long-context;
>= 1.03x the best peer; within 3% of the bound on the mean; D=8, 512 sequences assigned within
10 ms on one core. About 40 s (the scale study a minute more).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import print_table, working  # noqa: E402

from umopt.samplers import minibatches  # noqa: E402
from umopt.search.replicas import ASSIGNERS, assign, delay_outliers, lower_bound_ms, plan_global  # noqa: E402
from umopt.synthetic import synthetic_token_profile  # noqa: E402

MODELS = {
    "tuned": {},
    "heldout": dict(
        blocks=32, d_model=4096, vocab=128256, tflops=400.0, op_ms=0.05, memory_limit_bytes=64 << 30
    ),
}
PEERS = [m for m in ASSIGNERS if m != "umopt"]


def row(profile, spec: str, args, step) -> tuple[list[list[str]], str]:
    D = args.replicas
    batches = minibatches(
        spec, args.minibatches, D * args.size, seed=args.seed, cap=profile.lengths.max_length
    )
    steps = {m: [] for m in ASSIGNERS}
    spent = {m: [] for m in ASSIGNERS}
    spread = {m: [] for m in ASSIGNERS}
    bounds, own = [], []  # own: each of umopt's replicas' plan over its own one-pipeline bound
    for L in map(np.asarray, batches):
        bounds.append(lower_bound_ms(profile, L, D))
        for m in ASSIGNERS:
            g = plan_global(profile, L, D, m)
            steps[m].append(g.step_ms)
            spent[m].append(1e3 * g.assignment.seconds)
            spread[m].append(g.step_ms / g.mean_ms)
            if m == "umopt":
                own += [
                    p.iteration_ms / lower_bound_ms(profile, L[seqs], 1)
                    for p, seqs in zip(g.plans, g.assignment.replicas)
                ]
        step(spec)
    mean = {m: float(np.mean(v)) for m, v in steps.items()}
    best_peer = min(PEERS, key=lambda m: mean[m])
    cells = []
    for m in ASSIGNERS:
        cells.append(
            [
                spec,
                m,
                f"{mean[m]:.1f}",
                f"{mean['contiguous'] / mean[m]:.3f}x",
                "" if m == "umopt" else f"{mean[m] / mean['umopt']:.3f}",
                f"{100 * (mean[m] / float(np.mean(bounds)) - 1):.1f}%",
                f"{np.mean(spread[m]):.3f}",
                f"{np.median(spent[m]):.1f}",
            ]
        )
    line = (
        f"{spec}: umopt {mean['contiguous'] / mean['umopt']:.3f}x contiguous, {mean[best_peer] / mean['umopt']:.3f}x "
        f"the best peer ({best_peer}), {100 * (mean['umopt'] / np.mean(bounds) - 1):.1f}% above the bound; "
        f"each replica's plan {100 * (np.mean(own) - 1):.0f}% above its own one-pipeline bound on the mean "
        "(the planner's distance, which no assignment closes)"
    )
    if args.delay:  # WLB-LLM's outlier delay at its best threshold of three (the stream's percentiles)
        best = None
        for pct in (90, 95, 99):
            threshold = int(np.percentile(np.concatenate(batches), pct))
            delayed, waited = delay_outliers(batches, threshold, args.delay, D)
            gain = sum(steps["umopt"]) / sum(plan_global(profile, L, D, "umopt").step_ms for L in delayed)
            if best is None or gain > best[0]:
                best = (gain, pct, waited)
        line += (
            f"; with outlier delay (K={args.delay}, over the {best[1]}th percentile, {best[2]} of "
            f"{sum(len(L) for L in batches)} sequences waited): {best[0]:.3f}x umopt's tokens/s without it"
        )
    return cells, line


def scale(profile, args) -> list[str]:
    """The assignment's time on this core and its step (every replica planned) against the
    contiguous split's and the bound, from 4 to 64 replicas."""
    out = []
    for D, G in ((4, 256), (8, 512), (16, 1024), (32, 2048), (64, 4096), (64, 8192)):
        L = minibatches("chat", 1, G, seed=args.seed, cap=profile.lengths.max_length)[0]
        a = assign(profile, L, D, "umopt")
        ms = (
            min(a.seconds, assign(profile, L, D, "umopt").seconds) * 1e3
        )  # the better of two: this core's, not a neighbour's
        steps = {m: plan_global(profile, L, D, m).step_ms for m in ("umopt", "contiguous")}
        bound = lower_bound_ms(profile, L, D)
        out.append(
            f"D={D}, {G} sequences: assigned in {ms:.1f} ms; step {steps['umopt']:.1f} ms, "
            f"{steps['contiguous'] / steps['umopt']:.3f}x contiguous, {100 * (steps['umopt'] / bound - 1):.1f}% above the bound"
        )
    return out


def sweep(args) -> list[str]:
    """The fill share umopt counts (1 - 2/S) against all of it, on synthetic profiles of 2 to 16
    stages (seed 7: minibatches the share was not chosen on), each sampler's 4 minibatches of
    D x 32 sequences; and Hydraulis beside them."""
    from umopt.search import replicas

    rule = replicas.fill_share
    out = []
    for S, blocks, D in ((2, 8, 8), (4, 8, 4), (4, 16, 8), (8, None, 8), (8, 16, 8), (16, 32, 8)):
        profile = synthetic_token_profile(
            S, **({} if blocks is None else {"blocks": blocks, "max_length": 8192})
        )
        ratios = []
        for spec in ("chat", "lmsys", "long-context"):
            Ls = minibatches(spec, 4, D * 32, seed=7, cap=profile.lengths.max_length)

            def mean(method: str) -> float:
                return float(np.mean([plan_global(profile, L, D, method).step_ms for L in Ls]))

            base, hyd = mean("contiguous"), mean("hydraulis")
            replicas.fill_share = lambda stages: 1.0
            whole = mean("umopt")
            replicas.fill_share = rule
            share = mean("umopt")
            ratios.append((base / whole, base / share, hyd / share))
        r = np.mean(ratios, axis=0)
        name = "the tuned model" if blocks is None else f"{blocks} blocks"
        out.append(
            f"S={S} ({name}), D={D}: umopt {r[1]:.3f}x contiguous counting 1-2/S of the fill, {r[0]:.3f}x counting "
            f"all of it; {r[2]:.3f}x Hydraulis"
        )
    return out


def refined(profile, L, D: int, moves: int = 20):
    """umopt's assignment, then moves judged by the planner itself (not by the assignment's rule):
    one of the slowest replica's 4 heaviest sequences on its busiest stage to one of the 2 fastest
    replicas, both replanned, kept while the slowest replica's plan shortens (0.2-1.5 s a step:
    for what it would gain, not for every step)."""
    from umopt.search.replicas import work_of
    from umopt.search.solvers.per_step import plan

    W, _ = work_of(profile, L)
    reps = [list(r) for r in assign(profile, L, D).replicas]
    steps = [plan(profile, L[r]).iteration_ms for r in reps]
    for _ in range(moves):
        w = int(np.argmax(steps))
        busiest = int(np.argmax(W[reps[w]].sum(axis=0)))
        best = None
        for q in np.argsort(steps)[:2]:
            for i in sorted(reps[w], key=lambda i: -W[i, busiest])[:4]:
                left, got = [x for x in reps[w] if x != i], reps[q] + [i]
                if not left:
                    continue
                a, b = plan(profile, L[left]).iteration_ms, plan(profile, L[got]).iteration_ms
                if max(a, b) < steps[w] and (best is None or max(a, b) < best[0]):
                    best = (max(a, b), int(q), left, got, a, b)
        if best is None:
            break
        _, q, reps[w], reps[q], steps[w], steps[q] = best
    return max(steps)


def tried(profile, args) -> list[str]:
    """Other shares of the heaviest sequence's fill, and moves judged by the planner, against
    contiguous and Hydraulis (seed 11: minibatches none of it was chosen on)."""
    from umopt.search import replicas

    rule, out = replicas.fill_share, []
    for spec in args.samplers:
        Ls = [
            np.asarray(L)
            for L in minibatches(spec, 4, args.replicas * args.size, seed=11, cap=profile.lengths.max_length)
        ]

        def mean(method: str) -> float:
            return float(np.mean([plan_global(profile, L, args.replicas, method).step_ms for L in Ls]))

        base, hyd = mean("contiguous"), mean("hydraulis")
        cells = []
        for share in (0.5, None, 1.0, 1.25):
            replicas.fill_share = rule if share is None else (lambda stages, share=share: share)
            got = mean("umopt")
            cells.append(f"{'1-2/S' if share is None else share} {base / got:.3f}x/{hyd / got:.3f}x")
        replicas.fill_share = rule
        ref = float(np.mean([refined(profile, L, args.replicas) for L in Ls]))
        out.append(
            f"{spec}, the share of the fill counted: "
            + ", ".join(cells)
            + f" (x contiguous/x Hydraulis); moves "
            f"judged by the planner: {base / ref:.3f}x/{hyd / ref:.3f}x"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument(
        "--size", type=int, default=32, help="sequences per replica (the global minibatch: D x this)"
    )
    ap.add_argument("--minibatches", type=int, default=8)
    ap.add_argument("--samplers", nargs="+", default=["chat", "lmsys", "long-context"])
    ap.add_argument("--model", choices=sorted(MODELS), default="tuned")
    ap.add_argument("--delay", type=int, default=2, help="outlier delay's most steps (0: not shown)")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="the fill share against all of it, 2-16 stages")
    ap.add_argument(
        "--tried", action="store_true", help="other shares of the fill, moves judged by the planner"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    profile = synthetic_token_profile(args.stages, **MODELS[args.model])
    cells, summary = [], []
    t0 = time.perf_counter()
    with working(len(args.samplers) * args.minibatches, "bench/replicas.py") as step:
        for spec in args.samplers:
            rows, line = row(profile, spec, args, step)
            cells += rows
            summary.append(line)
    if args.scale:
        summary += scale(profile, args)
    if args.sweep:
        summary += sweep(args)
    if args.tried:
        summary += tried(profile, args)
    summary.append(
        f"model {args.model}, {args.replicas} replicas of {args.stages} stages, {args.minibatches} global minibatches "
        f"of {args.replicas * args.size} sequences per sampler, seed {args.seed}, {time.perf_counter() - t0:.0f} s"
    )
    print_table(
        "the global minibatch across replicas, predicted: each assignment, every replica planned by umopt",
        [
            "sampler",
            "assignment",
            "step ms",
            "x contiguous",
            "vs umopt",
            "over bound",
            "max/mean",
            "assign ms",
        ],
        cells,
        summary,
        args.markdown,
        left=["sampler", "assignment"],
    )


if __name__ == "__main__":
    main()
