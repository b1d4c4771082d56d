"""What a step of sequences costs a rank beyond the same plan played as one of fixed length: the
work each rank does on the step's critical path to take up a new plan (issue 67, target <= 1 ms at
S=8), timed component by component on this core.

    python bench/varlen_overhead.py [--stages 8] [--size 64] [--sampler chat] [--repeats 200]

A rank other than the maker reads the plan the maker shared (its bytes unpickled, as from the
store), takes it up as Pipeline._use does (its ops, its token rows, each direction's messages,
the player; no check against the profile: the maker's planning process made it), and sizes its
receive buffers as views of its pool; the maker does the same after pickling it. A plan of fixed
length, taken up once, costs a step none of it. The per-step check against the profile, which
every rank used to make, is timed beside it for reference.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import print_table  # noqa: E402

from umopt.costmodel import ChunkOp, OpKind  # noqa: E402
from umopt.predict import check_against_profile  # noqa: E402
from umopt.run.links import messages  # noqa: E402
from umopt.run.tokens import TokenRows  # noqa: E402
from umopt.samplers import minibatches  # noqa: E402
from umopt.search.solve_lengths import plan_schedule  # noqa: E402
from umopt.search.solvers.per_step import plan  # noqa: E402
from umopt.synthetic import synthetic_token_profile  # noqa: E402


def take_up(sched, me: int = 3) -> None:
    """What Pipeline._use and _play do with a new plan, for rank ``me`` (the stages' modules
    aside): its ops and its neighbours'."""
    near = {me - 1, me, me + 1}
    ops = [
        [ChunkOp(op[0], op[1], op[2], op[3] if len(op) == 4 else r) for op in st.op_list()]
        if r in near
        else []
        for r, st in enumerate(sched.stages)
    ]
    ln = sched.lengths
    rows = TokenRows.of_plan(ln.lengths, ln.samples, ln.mode, ln.pad_to, ln.row)
    ranks_of = list(range(len(ops)))
    messages(ops, ranks_of)
    messages([[op for op in o if op.kind == OpKind.F] for o in ops], ranks_of)
    rows.rows(0, len(ln.samples))


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--sampler", default="chat")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    profile = synthetic_token_profile(args.stages)
    L = minibatches(args.sampler, 1, args.size, seed=0)[0]
    sched = plan_schedule(plan(profile, np.asarray(L), budget_ms=50), profile)
    blob = pickle.dumps(sched)
    parts = {
        "the plan read (unpickled, as from the store)": lambda: pickle.loads(blob),
        "the plan shared (pickled, the maker)": lambda: pickle.dumps(sched),
        "taken up (ops, token rows, messages)": lambda: take_up(sched),
    }
    cells = [[name, f"{timed(fn, args.repeats):.3f}"] for name, fn in parts.items()]
    reader = float(cells[0][1]) + float(cells[2][1])
    maker = float(cells[1][1]) + float(cells[2][1])
    check = timed(lambda: check_against_profile(sched, profile), max(10, args.repeats // 10))
    cells.append(["(the check against the profile, now made once where the plan is made)", f"{check:.3f}"])
    ops = sum(len(st.ops) for st in sched.stages)
    print_table(
        f"a step of sequences beyond a fixed-length one, per rank: S={args.stages}, {args.size} sequences",
        ["what", "ms"],
        cells,
        [
            f"a rank that reads the plan: {reader:.3f} ms a step; the maker: {maker:.3f} ms (target <= 1 ms); "
            f"the plan: {ops} ops over {args.stages} stages, {sched.minibatch} samples",
        ],
        args.markdown,
        left=["what"],
    )


if __name__ == "__main__":
    main()
