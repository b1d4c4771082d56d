"""Compare the gradients a run saved (``umopt run --save-grads DIR --steps 1 --warmup 0``) with one
process training the whole minibatch on the profile's device, under its autocast.

    python bench/grad_check.py SCHEDULE GRADS_DIR [--rtol 1e-3]

Prints the largest relative difference (per tensor, by norm) and exits 1 when it is over rtol.
On a CPU the runtime matches to rtol 1e-5; on a GPU (kernels chosen by chunk size, TF32
convolutions, atomics) to about 1e-3; in bfloat16, chunks round on their own (about 1e-2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from umopt.devices import autocast
from umopt.formats.profile import load_profile
from umopt.formats.schedule import load_schedule
from umopt.zoo import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("schedule")
    p.add_argument("grads")
    p.add_argument("--rtol", type=float, default=1e-3)
    args = p.parse_args()
    sched = load_schedule(args.schedule)
    prof = load_profile(sched.profile.path)
    device = torch.device("cuda", 0) if prof.device.type == "cuda" else torch.device("cpu")
    parts = build_model(prof.model.name, prof.model.args, seed=prof.model.seed)
    model = torch.nn.Sequential(*parts.layers).to(device)
    x, y = parts.make_batch(sched.minibatch, 0)
    with autocast(device, prof.device.dtype):
        loss = parts.loss(model(x.to(device)), y.to(device)) / sched.minibatch
    loss.backward()
    want = {f"layers.{name}": param.grad.float().cpu() for name, param in model.named_parameters()}
    got: dict = {}
    for f in sorted(Path(args.grads).glob("grads_stage*.pt")):
        got.update(torch.load(f, weights_only=True))
    if set(got) != set(want):
        print(f"FAIL: the run saved {len(got)} gradients, the model has {len(want)}")
        sys.exit(1)
    worst = max(
        (float((got[k].float() - want[k]).norm() / max(float(want[k].norm()), 1e-12)), k) for k in want
    )
    ok = worst[0] <= args.rtol
    print(
        f"{'PASS' if ok else 'FAIL'}: largest relative difference {worst[0]:.2e} ({worst[1]}), rtol {args.rtol:g}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
