"""Sequences of different lengths, measured on 2 CPU ranks (one thread each), in turns.

    python bench/varlen_measured.py [--samplers chat long-context] [--minibatches 8] [--size 32]
                                    [--max-length 256] [--rounds 2] [--device cpu|cuda]
                                    [--chunks 2] [--markdown]

With ``--device cuda`` (bench/gpu_smoke.sh runs it): a GPT of 8 blocks of width 1024 in bfloat16
on GPUs 0 and 1 (nccl; packed attention is varlen flash attention there).

A GPT nobody tuned umopt to (``gpt``: 4 blocks of width 128, 4 heads, a 1024 vocabulary) is
profiled over lengths (``umopt profile --stages 2 --lengths``, probe runs included), and its
costs by tokens fitted to a probe run of umopt's plans (``umopt run --report``, ``umopt
calibrate``, as ``umopt tune --lengths`` does; ``--no-fit`` leaves it out). Each
sampler's ``--minibatches`` minibatches of ``--size`` sequences are drawn (seeded) and their
lengths scaled by ``--max-length`` over the sampler's cap (this CPU cannot run 4k-token
sequences at a useful pace; the scaling keeps the spread of the lengths). Every minibatch is
planned ahead: umopt's planner (warm-started from the previous minibatch, as in training), and
the peers at their best knobs as the cost model sees them: padding to the longest, packing into
rows, DynaPipe's DP. Then two processes (gloo) build ``umopt.Pipeline`` once and play every
minibatch with every method in turns (``--rounds`` rounds, the order rotating; one untimed
warm-up round), each step timed from a barrier to the slower rank's end. Printed per sampler and
method: measured tokens per second (real tokens, no padding), predicted, measured / predicted on
the mean step, and umopt against it.

``--chunks V``: the model profiled layer by layer (``umopt profile --chunks V``), and every method
trains on the layout it chooses on the first minibatch, one chunk per rank or V
(umopt/search/layouts.py, as ``umopt tune --lengths --chunks`` does): umopt's multi-chunk plans,
padding and packing on torch's multi-chunk schedules, DynaPipe one chunk per rank; each layout
its own copy of the model. The table's "chunks" column says which.

It takes about 6 minutes on 2 cores (profile, probe run, 2 samplers of 8 minibatches, 3 rounds);
with ``--chunks 2`` about 9.

A fifth row, "umopt, planned ahead", plays umopt's plans made during the steps: rank 0 runs
:class:`umopt.run.ahead.PlanAhead` (a process of its own), submits minibatch k + 1's lengths as
step k starts, and rank 1 reads each plan from the store, as in training.

Targets (issue 57): at least 1.5x pad-to-longest and 1.10x packing in tokens per second,
measured / predicted within 0.85-1.15 on the mean step, and steps planned ahead within 2% of
steps with precomputed plans (this machine's 2 cores also run the 2 ranks: the planning process
takes its time from them, where a GPU node has cores to spare).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = {"layers": 4, "d_model": 128, "heads": 4, "vocab": 1024}
# with --device cuda: a model a GPU is not idle on, in bfloat16 (packed attention: varlen flash)
MODEL_GPU = {"layers": 8, "d_model": 1024, "heads": 16, "vocab": 32768}
METHODS = ("umopt", "pad", "pack", "dynapipe")
AHEAD = "umopt, planned ahead"  # umopt's plans made during the steps, by umopt.run.ahead.PlanAhead


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import umopt
    import umopt.errors
    from umopt.run.ahead import PlanAhead
    from umopt.zoo import Layers, build_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{args.store}", rank=rank, world_size=2
    )
    job = pickle.loads(Path(args.job).read_bytes())
    profile = job["profile"]
    methods = (*METHODS, AHEAD)
    # each method's pipeline on its layout (the first plan's), each layout its own model copy
    modules: dict[str, list] = {}
    pipes: dict[str, umopt.Pipeline] = {}
    for m in methods:
        first = job["plans"][0][m if m != AHEAD else "umopt"]
        layout = first.layout(profile)
        key = str(layout)
        if key not in modules:
            parts = build_model("gpt", job["model_args"], seed=0)
            modules[key] = [
                Layers(parts.layers[lo:hi]).to(device)
                for (lo, hi), r in zip(layout.layers, layout.ranks)
                if r == rank
            ]
        mods = modules[key] if first.chunks is not None else modules[key][0]
        pipes[m] = umopt.Pipeline(
            mods, first, profile=profile, loss_fn=nn.CrossEntropyLoss(), select=False, device=device
        )
    parts = build_model("gpt", job["model_args"], seed=0)  # the sequences' maker
    times: dict[str, list] = {m: [[] for _ in job["plans"]] for m in methods}
    predicted_ahead: list[list[float]] = [[] for _ in job["plans"]]
    # rank 0 makes the planned-ahead plans: minibatch k + 1's planned while step k runs (a data
    # loader's prefetch); rank 1 reads each step's plan from the store
    ahead = PlanAhead(profile, on=job["plans"][0]["umopt"].chunking()) if rank == 0 else None
    K = len(job["plans"])

    def plan_of(k: int, m: str):
        if m != AHEAD:
            return job["plans"][k][m]
        if ahead is None:
            return None
        got = ahead.next()
        if k + 1 < K:
            ahead.submit(job["lengths"][k + 1])
        predicted_ahead[k].append(got.predicted.iteration_ms)
        return got

    def play(k: int, m: str) -> float:
        seqs = parts.sequences.make(job["lengths"][k], k)
        kw = {"inputs": [x for x, _ in seqs]} if rank == 0 else {"targets": [y for _, y in seqs]}
        dist.barrier()
        t0 = time.perf_counter()
        pipes[m].step(plan=lambda: plan_of(k, m), **kw)  # a plan not made yet is waited for within the step
        if cuda:
            torch.cuda.synchronize(device)
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        for mods in modules.values():
            for mod in mods:
                mod.zero_grad(set_to_none=True)
        return float(ms)

    for r in range(args.rounds + 1):
        if ahead is not None:
            ahead.submit(job["lengths"][0])
        for k in range(K):
            order = methods[(r + k) % len(methods) :] + methods[: (r + k) % len(methods)]
            for m in order:
                if job["plans"][k][m if m != AHEAD else "umopt"] is None:
                    if m == AHEAD and ahead is not None:  # keep the queue in step: take it, plan the next
                        try:
                            plan_of(k, m)
                        except umopt.errors.UmoptError:
                            if k + 1 < K:
                                ahead.submit(job["lengths"][k + 1])
                    continue
                ms = play(k, m)
                if r:  # round 0 warms every plan's shapes up
                    times[m][k].append(ms)
    if ahead is not None:
        ahead.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "predicted_ahead": predicted_ahead}))
    dist.destroy_process_group()


def plans_for(profile, batches, chunks: int = 1):
    """Every minibatch's plans (as schedules): umopt's warm-started, and each peer's, each method
    on the layout its plan of the first minibatch chose among one chunk per rank and ``chunks``."""
    from umopt.search.layouts import choose_layouts
    from umopt.search.method import Request
    from umopt.search.methods import named
    from umopt.search.solve_lengths import plan_schedule

    on = {m: p.chunking for m, p in choose_layouts(profile, batches[0], METHODS, (1, chunks)).items()}
    out, last = [], {}
    for L in batches:
        got = {m: named(m).plan(Request(profile, L, on=on[m], previous=last.get(m))) for m in METHODS}
        last.update({m: p for m, p in got.items() if p is not None})
        out.append({m: None if p is None else (plan_schedule(p, profile), p) for m, p in got.items()})
    return out


def fit_to_a_run(prof_path: Path, work: Path, sampler: str, max_length: int, size: int) -> Path:
    """The profile's costs by tokens fitted to a probe run of umopt's and padding's plans (4 steps of the first
    sampler's lengths, drawn by `umopt run`'s own seeds, not the bench's minibatches), with the
    commands a user runs: umopt solve --lengths, umopt run --report, umopt calibrate."""
    from umopt.samplers import SAMPLERS

    spec = f"{sampler}/{SAMPLERS[sampler].cap / max_length:g}"
    umopt = [sys.executable, "-m", "umopt.cli"]
    plan, fitted = work / "probe-plan.json", work / "profile-fitted.json"
    report = work / "probe-report-{name}.json"
    quiet = dict(check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        [*umopt, "solve", str(prof_path), "--lengths", spec, "-B", str(size), "-o", str(plan)], **quiet
    )
    # umopt's plans and padding's: ops of both modes to fit (umopt's may all be packed)
    run = ["run", str(plan), "--lengths", spec, "--methods", "umopt,pad", "--steps", "4", "--warmup", "1"]
    subprocess.run([*umopt, *run, "--report", str(report)], **quiet)
    reports = [str(report).replace("{name}", m) for m in ("umopt", "pad")]
    subprocess.run([*umopt, "calibrate", str(prof_path), *reports, "-o", str(fitted)], **quiet)
    return fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", nargs="+", default=["chat", "long-context"])
    ap.add_argument("--minibatches", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", help="a profile over lengths of this bench's model (default: measured now)")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: a larger GPT in bfloat16 on GPUs 0 and 1",
    )
    ap.add_argument(
        "--no-fit", action="store_true", help="leave out the probe run of sequences the costs are fitted to"
    )
    ap.add_argument("--chunks", type=int, default=1, help="each method may hold this many chunks per rank")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--job")
    ap.add_argument("--store")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("--device cuda needs 2 GPUs (NCCL takes one rank per GPU)")
    sys.path.insert(0, str(HERE))
    import numpy as np
    from tables import print_table

    from umopt.formats.profile import load_profile
    from umopt.samplers import SAMPLERS, minibatches

    work = Path(tempfile.mkdtemp(prefix="umopt-varlen-"))
    model_args = dict(MODEL_GPU if args.device == "cuda" else MODEL, seq_len=args.max_length)
    prof_path = Path(args.profile) if args.profile else work / "profile.json"
    if not args.profile:
        cmd = [sys.executable, "-m", "umopt.cli", "profile", "--model", "gpt", "--stages", "2"]
        cmd += [f"--model-arg={k}={v}" for k, v in model_args.items()]
        cmd += ["--max-size", "8", "--lengths", str(args.max_length), "-o", str(prof_path)]
        cmd += ["--chunks", str(args.chunks)] if args.chunks > 1 else []
        if args.device == "cuda":
            cmd += ["--device", "cuda", "--dtype", "bfloat16"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if not args.no_fit:  # as umopt tune --lengths does: the costs by tokens fitted to a probe run
        prof_path = fit_to_a_run(prof_path, work, args.samplers[0], args.max_length, args.size)
    profile = load_profile(prof_path)
    cells, summary = [], []
    for spec in args.samplers:
        scale = args.max_length / SAMPLERS[spec].cap
        batches = [
            np.maximum(1, np.round(L * scale)).astype(np.int64)
            for L in minibatches(spec, args.minibatches, args.size, seed=0)
        ]
        made = plans_for(profile, batches, args.chunks)
        job = {
            "profile": profile,
            "model_args": model_args,
            "lengths": [[int(x) for x in L] for L in batches],
            "plans": [{m: None if got is None else got[0] for m, got in p.items()} for p in made],
        }
        (work / "job.pkl").write_bytes(pickle.dumps(job))
        out = work / f"times-{spec}.json"
        base = [sys.executable, __file__, "--worker", "--job", str(work / "job.pkl")]
        base += ["--store", str(work / f"store-{spec}"), "--out", str(out), "--rounds", str(args.rounds)]
        base += ["--device", args.device]
        procs = [
            subprocess.Popen(base, env=dict(os.environ, RANK=str(r), OMP_NUM_THREADS="1")) for r in range(2)
        ]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit("a rank failed")
        got = json.loads(out.read_text())
        times = got["times"]
        tokens = [int(L.sum()) for L in batches]
        # over the minibatches every method fits, so the rates compare
        ks = [k for k in range(len(batches)) if all(made[k][m] is not None for m in METHODS)]
        measured = {m: [float(np.median(times[m][k])) for k in ks] for m in METHODS}
        predicted = {m: [made[k][m][1].iteration_ms for k in ks] for m in METHODS}
        rate = {m: 1e3 * sum(tokens[k] for k in ks) / sum(measured[m]) for m in METHODS}
        for m in METHODS:
            ratio = np.mean(measured[m]) / np.mean(predicted[m])
            first = made[0][m][0] if made[0][m] is not None else None
            v = 1 if first is None or first.chunks is None else len(first.chunks.ranks) // 2
            cells.append(
                [
                    spec,
                    m,
                    str(v),
                    f"{len(ks)}/{len(batches)}",
                    f"{rate[m] / 1e3:.2f}",
                    f"{1e3 * sum(tokens[k] for k in ks) / sum(predicted[m]) / 1e3:.2f}",
                    f"{ratio:.2f}",
                    "" if m == "umopt" else f"{rate['umopt'] / rate[m]:.2f}x",
                ]
            )
        # planning hidden: steps whose plan was made during the step before, against the same
        # minibatches' precomputed plans (the predicted ratio says how much of it is the plans)
        ahead_ms = [float(np.median(times[AHEAD][k])) for k in ks]
        ahead_pred = [float(np.mean(got["predicted_ahead"][k])) for k in ks]
        hidden = sum(ahead_ms) / sum(measured["umopt"])
        cells.append(
            [
                spec,
                AHEAD,
                cells[-len(METHODS)][2],
                f"{len(ks)}/{len(batches)}",
                f"{1e3 * sum(tokens[k] for k in ks) / sum(ahead_ms) / 1e3:.2f}",
                f"{1e3 * sum(tokens[k] for k in ks) / sum(ahead_pred) / 1e3:.2f}",
                f"{np.mean(ahead_ms) / np.mean(ahead_pred):.2f}",
                f"{rate['umopt'] / (1e3 * sum(tokens[k] for k in ks) / sum(ahead_ms)):.2f}x",
            ]
        )
        summary.append(
            f"{spec}: planning hidden: steps planned ahead / steps with precomputed plans = {hidden:.3f} "
            f"(target <= 1.02; predicted {sum(ahead_pred) / sum(predicted['umopt']):.3f})"
        )
        summary.append(
            f"{spec}: umopt {rate['umopt'] / rate['pad']:.2f}x pad-to-longest (target >= 1.5), "
            f"{rate['umopt'] / rate['pack']:.2f}x packing (target >= 1.10); lengths x {scale:.4f} "
            f"(mean {np.mean(np.concatenate(batches)):.0f}, longest {max(int(L.max()) for L in batches)})"
        )
    summary.append(f"profile {prof_path}; {args.rounds} timed rounds, medians per minibatch and method")
    print_table(
        f"gpt {model_args['layers']} blocks of {model_args['d_model']}, 2 {args.device.upper()} ranks, "
        f"{args.size} sequences a minibatch",
        [
            "sampler",
            "method",
            "chunks",
            "minibatches",
            "measured ktok/s",
            "predicted ktok/s",
            "measured / predicted",
            "umopt vs it",
        ],
        cells,
        summary,
        args.markdown,
        left=("sampler", "method"),
    )


if __name__ == "__main__":
    main()
