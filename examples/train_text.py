"""Train a small character-level transformer on text files with umopt, end to end.

Your own model and data, your own loop: the stages are plain modules defined here, the data is
text read from disk (by default this repository's own documents), and umopt profiles the stages,
solves for an unequal schedule and runs it with ``umopt.Pipeline``, taking turns with the best
equal schedule so that the two are timed side by side.

    python examples/train_text.py prepare --stages 2 --minibatch 32 --out run/     # profile + solve
    torchrun --standalone --nproc-per-node 2 examples/train_text.py train --out run/ --steps 300

``prepare`` writes ``run/profile.json``, ``run/umopt.json`` (umopt's schedule) and
``run/equal.json`` (the best equal one); ``train`` prints the loss as it falls and, at the end,
the median time per step of each schedule.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]


# --- data: characters of text files on disk ------------------------------------------------------
def load_text(paths: list[str]) -> tuple[torch.Tensor, int]:
    files = [Path(p) for p in paths] or sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)


def batch(data: torch.Tensor, step: int, n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows of ``seq`` characters and the characters after them; the same on every rank."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq - 1, (n,), generator=g)
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return x, y


# --- model: the user's own stages -----------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device)
        return self.layer(h, src_mask=mask, is_causal=True)


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def stages(cfg: dict) -> list[nn.Module]:
    """The model cut into ``cfg["stages"]`` stages of consecutive layers, the same weights on every rank."""
    torch.manual_seed(0)
    layers = (
        [Embed(cfg["vocab"], cfg["d"], cfg["seq"])]
        + [Block(cfg["d"], cfg["heads"]) for _ in range(cfg["layers"])]
        + [Head(cfg["d"], cfg["vocab"])]
    )
    cuts = [round(i * len(layers) / cfg["stages"]) for i in range(cfg["stages"] + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(cuts, cuts[1:])]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- the two phases -------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> None:
    import umopt
    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.schedule import make_schedule, save_schedule
    from umopt.search.baselines import gpipe_equal, onef1b_equal
    from umopt.search.solve import make_problem, solve

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data, vocab = load_text(args.text)
    cfg = {
        "vocab": vocab,
        "d": args.d,
        "heads": 4,
        "layers": args.layers,
        "seq": args.seq,
        "stages": args.stages,
        "text": args.text,
    }
    (out / "model.json").write_text(json.dumps(cfg))
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.minibatch]
    profile = umopt.profile_stages(
        stages(cfg),
        batch(data, 0, sizes[-1], args.seq),
        loss_fn,
        name="examples/train_text.py",
        sizes=sizes,
        link_latency_ms=args.link_latency_ms,
        link_gbps=args.link_gbps,
    )
    save_profile(profile, out / "profile.json")
    profile = load_profile(out / "profile.json")
    report = solve(profile, args.minibatch, time_limit=args.time_limit)
    save_schedule(report.schedule, str(out / "umopt.json"))
    problem = make_problem(profile, args.minibatch, False)
    best = min(
        (b for b in (gpipe_equal(problem), onef1b_equal(problem)) if b.candidate is not None),
        key=lambda b: b.iteration_ms,
    )
    tl = best.candidate.simulate(problem)
    save_schedule(
        make_schedule(
            profile,
            args.minibatch,
            False,
            best.candidate.ops(),
            tl,
            {"name": best.name, "status": "feasible", "seconds": 0.0},
            {},
        ),
        str(out / "equal.json"),
    )
    print(
        f"umopt's schedule: predicted {report.timeline.iteration_ms:.2f} ms ({report.schedule.solver.recommended}); "
        f"best equal ({best.name}, M={best.microbatches}): {best.iteration_ms:.2f} ms; wrote {out}/"
    )


def train(args: argparse.Namespace) -> None:
    import umopt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    cfg = json.loads((out / "model.json").read_text())
    data, _ = load_text(cfg["text"])
    stage = stages(cfg)[rank]
    first, last = rank == 0, rank == cfg["stages"] - 1
    pipes = {
        name: umopt.Pipeline(stage, str(out / f"{name}.json"), loss_fn=loss_fn) for name in ("umopt", "equal")
    }
    B = pipes["umopt"].schedule.minibatch
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    ms: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(args.steps):
        name = "umopt" if (step // args.turn) % 2 == 0 else "equal"  # the two take turns
        x, y = batch(data, step, B, cfg["seq"])
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipes[name].step(x if first else None, targets=y if last else None)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        ms[name].append(1e3 * (time.perf_counter() - t0))
        if last and (step % args.every == 0 or step == args.steps - 1):
            print(f"step {step:4d} ({name:5s}): loss {float(loss):.3f}, {ms[name][-1]:.1f} ms", flush=True)
    if last:
        med = {name: statistics.median(v) for name, v in ms.items() if v}
        line = ", ".join(f"{name} {v:.1f} ms/step" for name, v in med.items())
        speed = f"; umopt / equal = {med['umopt'] / med['equal']:.3f}" if len(med) == 2 else ""
        print(f"median over the run: {line}{speed}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    pre = sub.add_parser("prepare", help="profile the stages and solve")
    pre.add_argument("--stages", type=int, default=2)
    pre.add_argument("--minibatch", type=int, default=32)
    pre.add_argument("--layers", type=int, default=4)
    pre.add_argument("--d", type=int, default=128)
    pre.add_argument("--seq", type=int, default=64)
    pre.add_argument("--time-limit", type=float, default=10.0)
    pre.add_argument(
        "--text", nargs="*", default=[], help="text files (default: this repository's documents)"
    )
    pre.add_argument(
        "--link-latency-ms", type=float, help="the link, given instead of measured (with --link-gbps)"
    )
    pre.add_argument("--link-gbps", type=float)
    pre.add_argument("--out", default="run")
    tr = sub.add_parser("train", help="train under torchrun, one process per stage")
    tr.add_argument("--out", default="run")
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument(
        "--turn", type=int, default=10, help="steps each schedule runs before the other takes over"
    )
    tr.add_argument("--every", type=int, default=20, help="print the loss every so many steps")
    tr.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    prepare(args) if args.phase == "prepare" else train(args)


if __name__ == "__main__":
    main()
