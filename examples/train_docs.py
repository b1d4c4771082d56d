"""Train a small GPT on documents of different lengths with umopt, no padding to one length.

The documents are the paragraphs of text files on disk (by default this repository's own
documents), characters as tokens: a few characters to a few hundred. umopt profiles the model's
two stages over lengths, then every step trains on a minibatch of whole documents, planned for
that minibatch alone (its order, each stage's cut into chunks, the op order), ahead of the step in
a process of its own on the first stage's rank, which hands each plan to the other rank. Every
few steps the turn passes to padding every document to the minibatch's longest, with equal
microbatches (what pipeline tools do today), so the two are timed side by side.

    python examples/train_docs.py prepare --out run-docs/                 # profile over lengths
    torchrun --standalone --nproc-per-node 2 examples/train_docs.py train --out run-docs/ --steps 60

``train`` prints the loss as it falls and, at the end, tokens per second of each. The model is
umopt's built-in GPT; examples/train_hf.py runs the same with a Llama of transformers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from umopt.zoo import Layers

ROOT = Path(__file__).resolve().parents[1]


# --- data: paragraphs of text files, characters as tokens -----------------------------------------
def documents(paths: list[str], longest: int) -> tuple[list[torch.Tensor], int]:
    files = [Path(p) for p in paths] or sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    docs = [p.strip() for p in text.split("\n\n")]
    # a document of n + 1 characters trains on n: its tokens and the next character of each
    docs = [p[: longest + 1] for p in docs if len(p) >= 3]
    return [torch.tensor([index[c] for c in p], dtype=torch.long) for p in docs], len(vocab)


def minibatch(docs: list[torch.Tensor], step: int, n: int) -> list[torch.Tensor]:
    """``n`` documents drawn for ``step``: the same on every rank."""
    rng = np.random.default_rng(step)
    return [docs[i] for i in rng.choice(len(docs), n, replace=False)]


# --- the model: umopt's GPT (examples/train_hf.py gives another) ------------------------------------
def gpt_args(vocab: int, longest: int, args: argparse.Namespace) -> dict:
    return {"layers": args.layers, "d_model": args.d, "heads": 4, "vocab": vocab, "seq_len": longest}


# --- the two phases -------------------------------------------------------------------------------
def prepare(args: argparse.Namespace, model: str, model_args_of: Callable[..., dict]) -> None:
    from umopt.formats.profile import save_profile
    from umopt.measure import ProfileOptions
    from umopt.probes import profile_in_pipeline

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, vocab = documents(args.text, args.longest)
    model_args = model_args_of(vocab, args.longest, args)
    (out / "model.json").write_text(
        json.dumps({"model": model, "model_args": model_args, "text": args.text, "longest": args.longest})
    )
    opts = ProfileOptions(
        model=model,
        model_args=model_args,
        stages=2,
        max_size=8,
        lengths=args.longest,
        link_latency_ms=args.link_latency_ms,
        link_gbps=args.link_gbps,
        concurrent=False if args.sequential else None,
    )
    profile = profile_in_pipeline(opts, probes=not args.no_probes, say=print)
    save_profile(profile, out / "profile.json")
    print(f"wrote {out}/profile.json: 2 stages timed over sequences of up to {args.longest} tokens")


def train(args: argparse.Namespace) -> None:
    import umopt
    from umopt.formats.profile import load_profile
    from umopt.run.ahead import PlanAhead
    from umopt.search.method import Request
    from umopt.search.peers import PEERS
    from umopt.search.solve_lengths import plan_schedule
    from umopt.zoo import build_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    cfg = json.loads((out / "model.json").read_text())
    profile = load_profile(out / "profile.json")
    docs, _ = documents(cfg["text"], cfg["longest"])
    parts = build_model(cfg["model"], cfg["model_args"], seed=0)
    a, b = profile.stages[rank].layers
    stage = Layers(parts.layers[a:b])
    tied = parts.tied_in(range(a, b), parts.layers[a:b])  # a tied embedding's copy on this rank
    first, last = rank == 0, rank == profile.num_stages - 1
    n = args.minibatch

    def lengths(step: int) -> list[int]:
        return [len(d) - 1 for d in minibatch(docs, step, n)]

    def method(step: int) -> str:
        return "umopt" if (step // args.turn) % 2 == 0 else "pad"

    def pad_plan(step: int):
        return plan_schedule(PEERS["pad"].plan(Request(profile, lengths(step))), profile)

    ahead = PlanAhead(profile) if first else None
    made = [None]
    if first:  # umopt's plans run one step ahead, in the planning process
        ahead.submit(lengths(0))
        made = [ahead.next()]
    dist.broadcast_object_list(made, src=0)  # the layout, for building the pipeline
    pipe = umopt.Pipeline(stage, made[0], profile=profile, loss_fn=nn.CrossEntropyLoss(), tied=tied)
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    tokens = {"umopt": 0, "pad": 0}
    seconds = {"umopt": 0.0, "pad": 0.0}
    for step in range(args.steps):
        plan = None
        if first:
            if step + 1 < args.steps and method(step + 1) == "umopt":
                ahead.submit(lengths(step + 1))  # plans while this step trains
            plan = (made[0] if step == 0 else ahead.next()) if method(step) == "umopt" else pad_plan(step)
        seqs = minibatch(docs, step, n)
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.step(
            inputs=[d[:-1] for d in seqs] if first else None,
            targets=[d[1:] for d in seqs] if last else None,
            plan=plan,
        )
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= args.turn:  # the first turn warms up
            seconds[method(step)] += time.perf_counter() - t0
            tokens[method(step)] += sum(lengths(step))
        if last and (step % args.every == 0 or step == args.steps - 1):
            print(f"step {step:4d} ({method(step):5s}): loss {float(loss):.3f}", flush=True)
    if ahead is not None:
        ahead.close()
    if last:
        rate = {m: tokens[m] / seconds[m] for m in tokens if seconds[m]}
        line = ", ".join(f"{m} {r:,.0f} tokens/s" for m, r in rate.items())
        gain = f"; umopt / pad = {rate['umopt'] / rate['pad']:.2f}x" if len(rate) == 2 else ""
        print(f"over the run after the first turn: {line}{gain}", flush=True)
    dist.destroy_process_group()


def main(model: str = "gpt", model_args_of: Callable[..., dict] = gpt_args, doc: str = __doc__) -> None:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    pre = sub.add_parser("prepare", help="profile the model's stages over lengths")
    pre.add_argument("--layers", type=int, default=4)
    pre.add_argument("--d", type=int, default=128)
    pre.add_argument("--longest", type=int, default=1024, help="documents are cut to this many tokens")
    pre.add_argument(
        "--text", nargs="*", default=[], help="text files (default: this repository's documents)"
    )
    pre.add_argument(
        "--no-probes", action="store_true", help="skip the probe runs that fit the runtime's costs"
    )
    pre.add_argument("--sequential", action="store_true", help="time the stages one after another")
    pre.add_argument(
        "--link-latency-ms", type=float, help="the link, given instead of measured (with --link-gbps)"
    )
    pre.add_argument("--link-gbps", type=float)
    pre.add_argument("--out", default="run-docs")
    tr = sub.add_parser("train", help="train under torchrun, one process per stage")
    tr.add_argument("--out", default="run-docs")
    tr.add_argument("--steps", type=int, default=60)
    tr.add_argument("--minibatch", type=int, default=16, help="documents per minibatch")
    tr.add_argument("--turn", type=int, default=5, help="steps each method runs before the other takes over")
    tr.add_argument("--every", type=int, default=10, help="print the loss every so many steps")
    tr.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    prepare(args, model, model_args_of) if args.phase == "prepare" else train(args)


if __name__ == "__main__":
    main()
