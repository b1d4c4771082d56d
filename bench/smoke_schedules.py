"""Schedule files with several chunks per rank for bench/gpu_smoke.sh: torch's V-shaped and
looped orders on a layered profile's own cut, so that the smoke script plays both placements
whatever the solver would pick.

    python bench/smoke_schedules.py PROFILE -B 32 --out DIR      # writes DIR/vshape.json, DIR/looped.json

vshape.json is ScheduleZBVZeroBubble (W ops: the profile needs --split-backward) where the
profile has 2 ranks or more, looped.json ScheduleInterleaved1F1B where it has 3 or more; each at
the microbatch count the cost model finds fastest within the memory limit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from umopt.chunks import chunking
from umopt.costmodel import CostTables, rank_peak_memory, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import load_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.search.peers.schedules import torch_ops


def write(profile_path: str, B: int, out: Path, name: str, place: str, file: str) -> None:
    prof = load_profile(profile_path)
    S = prof.num_stages
    ch = chunking(prof, 2, place)
    tables = CostTables.from_profile(prof, False, chunks=ch, minibatch=B)
    best = None
    for m in range(S, B + 1):
        try:
            ops = torch_ops(name, S, 2, B, m)
        except UmoptError:
            continue
        if max(hi - lo for rank in ops for _, lo, hi, _ in rank) > prof.max_size:
            continue
        tl = simulate(tables, ops, B)
        limit = prof.memory_limit_bytes
        if limit is not None and any(rank_peak_memory(tables, r, o) > limit for r, o in enumerate(ops)):
            continue
        if best is None or tl.iteration_ms < best[0].iteration_ms:
            best = (tl, ops)
    if best is None:
        raise SystemExit(f"no {name} schedule fits the profile at B={B}")
    solver = {"name": name, "status": "feasible", "seconds": 0.0}
    sched = make_schedule(prof, B, False, best[1], best[0], solver, {}, chunks=ch, placement=place)
    save_schedule(sched, str(out / file))
    print(
        f"wrote {out / file}: {name}, {len(best[1][0]) // 2} ops per rank, predicted {best[0].iteration_ms:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("-B", "--minibatch", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    S = load_profile(args.profile).num_stages
    if S >= 2:
        write(args.profile, args.minibatch, out, "ScheduleZBVZeroBubble", "vshape", "vshape.json")
    if S >= 3:
        write(args.profile, args.minibatch, out, "ScheduleInterleaved1F1B", "looped", "looped.json")


if __name__ == "__main__":
    main()
