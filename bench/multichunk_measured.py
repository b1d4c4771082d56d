"""Several chunks per rank, measured on 2 CPU ranks (one thread each), in turns.

    python bench/multichunk_measured.py [--layers 6] [--minibatch 16] [--rounds 5] [--markdown]

A GPT (``gpt``, ``--layers`` blocks, d_model 128, sequence 32) is profiled layer by layer
(``umopt profile --chunks 2``), then ``umopt solve --chunks 2`` picks a schedule with two chunks
per rank. Three schedules then take turns on the same two processes (a turn: 3 steps, the first
not timed), ``--rounds`` rounds: torch's ``ScheduleInterleaved1F1B`` through torch's own runtime
(stock ``PipelineStage``s, two per rank) at the M the cost model likes best for it, umopt's runtime
(``umopt.Pipeline`` given the two chunk modules) on exactly torch's order, and umopt's pick.
Printed: each one's median ms per step, predicted ms, measured / predicted, and each against
torch's. Targets (issue 45): umopt's runtime on torch's order at most 1.05x torch's time, and
measured / predicted within 0.85-1.15 for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    import umopt
    from umopt.formats.schedule import load_schedule
    from umopt.zoo import build_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=2)
    plan = json.loads(Path(args.plan).read_text())
    parts = build_model("gpt", plan["model_args"], seed=0)

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    def chunks_of(schedule):
        spans = schedule.chunks.layers
        mine = [j for j, r in enumerate(schedule.chunks.ranks) if r == rank]
        return mine, [nn.Sequential(*parts.layers[spans[j][0] : spans[j][1]]) for j in mine]

    x, y = parts.make_batch(plan["minibatch"], seed=1)
    players = {}
    equal = load_schedule(plan["equal"])
    mine, mods = chunks_of(equal)
    V = len(equal.chunks.ranks)
    stages = [PipelineStage(m, j, V, torch.device("cpu")) for j, m in zip(mine, mods)]
    torch_sched = ScheduleInterleaved1F1B(stages, n_microbatches=plan["microbatches"], loss_fn=loss_fn)

    def torch_step():
        if rank == 0:
            torch_sched.step(x)
        else:
            torch_sched.step(target=y)

    players["torch"] = torch_step
    for name in ("equal", "pick"):
        schedule = load_schedule(plan[name])
        mine, mods = chunks_of(schedule)
        pipe = umopt.Pipeline(mods, schedule, loss_fn=loss_fn)
        has_first, has_last = 0 in mine, V - 1 in mine

        def step(pipe=pipe, has_first=has_first, has_last=has_last):
            pipe.step(x if has_first else None, target=y if has_last else None)

        players[name] = step
    times = {name: [] for name in players}
    for _ in range(args.rounds):
        for name, step in players.items():
            for k in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                if k:
                    times[name].append(1000 * (time.perf_counter() - t0))
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--plan")
    ap.add_argument("--store")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(HERE))
    from tables import print_table

    from umopt.chunks import chunking
    from umopt.errors import UmoptError
    from umopt.formats.profile import load_profile
    from umopt.formats.schedule import make_schedule, save_schedule
    from umopt.search.peers.schedules import score_peer
    from umopt.search.problem import LayoutProblem
    from umopt.search.solve_chunks import solve_chunked

    work = Path(tempfile.mkdtemp(prefix="umopt-multichunk-"))
    model_args = {"layers": args.layers, "d_model": 128, "heads": 4, "vocab": 512, "seq_len": 32}
    prof_path = work / "profile.json"
    cmd = [sys.executable, "-m", "umopt.cli", "profile", "--model", "gpt", "--stages", "2", "--chunks", "2"]
    cmd += [f"--model-arg={k}={v}" for k, v in model_args.items()]
    cmd += ["--max-size", str(args.minibatch), "--repeats", "5", "-o", str(prof_path)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    profile = load_profile(prof_path)
    B = args.minibatch
    rep = solve_chunked(profile, B, (2,), time_limit=20)
    save_schedule(rep.schedule, str(work / "pick.json"))
    # M dividing B only: torch's runtime splits inputs and targets alike only then
    scored = []
    problem = LayoutProblem(profile, B)
    for m in (m for m in range(2, B + 1) if B % m == 0):
        try:
            scored.append((score_peer(problem, "ScheduleInterleaved1F1B", 2, m), m))
        except UmoptError:
            continue
    (tables, ops, tl), M = min(scored, key=lambda x: x[0][2].iteration_ms)
    ch = chunking(profile, 2, "looped")
    equal = make_schedule(
        profile,
        B,
        False,
        ops,
        tl,
        {"name": "ScheduleInterleaved1F1B", "status": "feasible", "seconds": 0.0},
        {},
        chunks=ch,
        placement="looped",
    )
    save_schedule(equal, str(work / "equal.json"))
    plan = {
        "model_args": model_args,
        "minibatch": B,
        "microbatches": M,
        "equal": str(work / "equal.json"),
        "pick": str(work / "pick.json"),
    }
    (work / "plan.json").write_text(json.dumps(plan))
    out = work / "times.json"
    base = [
        sys.executable,
        __file__,
        "--worker",
        "--plan",
        str(work / "plan.json"),
        "--store",
        str(work / "store"),
    ]
    base += ["--out", str(out), "--rounds", str(args.rounds)]
    procs = [subprocess.Popen(base, env=dict(os.environ, RANK=str(r), OMP_NUM_THREADS="1")) for r in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a rank failed")
    times = json.loads(out.read_text())
    predicted = {"torch": tl.iteration_ms, "equal": tl.iteration_ms, "pick": rep.timeline.iteration_ms}
    names = {
        "torch": f"torch ScheduleInterleaved1F1B, torch's runtime (v=2, M={M})",
        "equal": "the same order, umopt's runtime",
        "pick": f"umopt's pick ({rep.layouts.picked})",
    }
    med = {k: statistics.median(v) for k, v in times.items()}
    cells = [
        [
            names[k],
            f"{med[k]:.1f}",
            f"{predicted[k]:.1f}",
            f"{med[k] / predicted[k]:.2f}",
            f"{med['torch'] / med[k]:.3f}",
        ]
        for k in ("torch", "equal", "pick")
    ]
    print_table(
        f"gpt {args.layers} blocks, 2 CPU ranks x 2 chunks, B={B}, {args.rounds} rounds",
        ["schedule", "measured ms", "predicted ms", "measured / predicted", "x torch"],
        cells,
        [
            f"umopt's runtime on torch's order: {med['equal'] / med['torch']:.3f}x torch's time (target <= 1.05)",
            f"files in {work}",
        ],
        args.markdown,
        left=("schedule",),
    )


if __name__ == "__main__":
    main()
