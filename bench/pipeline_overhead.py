"""Does a runtime change cost time? ``umopt run`` from this tree and from another checkout (the
baseline) on the same two schedules of a 2-stage MLP (equal and unequal 1F1B chunks), in turns,
four rounds with the order alternating: the medians, and their ratio round by round.

    git worktree add /tmp/baseline COMMIT
    cp umopt/*.so /tmp/baseline/umopt/; cp umopt/search/bounds/*.so /tmp/baseline/umopt/bounds/
    python bench/pipeline_overhead.py --baseline /tmp/baseline      # about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from umopt.costmodel import CostTables, simulate
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile

MLP = {"layers": 6, "width": 512, "in_features": 256, "num_classes": 10}
B = 64
SCHEDULES = {"equal": [[16] * 4, [16] * 4], "unequal": [[4, 12, 16, 16, 16], [8, 8, 16, 16, 16]]}


def _schedules(work: Path) -> None:
    prof = synthetic_profile(2, max_size=16, seed=1, bytes_per_sample=MLP["width"] * 4)
    prof = prof.model_copy(
        update={
            "model": prof.model.model_copy(update={"name": "mlp", "args": MLP}),
            "stages": [
                st.model_copy(update={"layers": [a, b]}) for st, (a, b) in zip(prof.stages, [(0, 3), (3, 6)])
            ],
        }
    )
    save_profile(prof, work / "p.json")
    prof = load_profile(work / "p.json")
    for name, f in SCHEDULES.items():
        ops = Candidate(f, f, "1f1b").ops()
        tl = simulate(CostTables.from_profile(prof), ops, B)
        save_schedule(
            make_schedule(prof, B, False, ops, tl, {"name": name, "status": "feasible", "seconds": 0.0}, {}),
            str(work / f"{name}.json"),
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--baseline", required=True, help="a checkout of the baseline commit, its extensions built"
    )
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    work = Path(tempfile.mkdtemp(prefix="umopt-overhead-"))
    _schedules(work)
    ms: dict[str, list[list[float]]] = {"baseline": [], "this tree": []}
    for rnd in range(args.rounds):
        for tree in ("baseline", "this tree") if rnd % 2 == 0 else ("this tree", "baseline"):
            env = dict(os.environ, PYTHONPATH=args.baseline if tree == "baseline" else here)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "umopt.cli",
                    "run",
                    *(str(work / f"{n}.json") for n in SCHEDULES),
                    "--steps",
                    "15",
                    "--warmup",
                    "3",
                    "--report",
                    str(work / "r_{name}.json"),
                ],
                env=env,
                check=True,
                capture_output=True,
                cwd=str(work),
            )
            ms[tree].append(
                [json.loads((work / f"r_{n}.json").read_text())["measured_iteration_ms"] for n in SCHEDULES]
            )
    table = Table(
        title=f"umopt run, this tree against {args.baseline}: median iteration ms over {args.rounds} rounds in turns"
    )
    for col in ("schedule", "baseline ms", "this tree ms", "this / baseline", "round by round"):
        table.add_column(col, justify="right")
    for k, name in enumerate(SCHEDULES):
        old = statistics.median(r[k] for r in ms["baseline"])
        new = statistics.median(r[k] for r in ms["this tree"])
        rounds = " ".join(f"{b[k] / a[k]:.3f}" for a, b in zip(ms["baseline"], ms["this tree"]))
        table.add_row(name, f"{old:.2f}", f"{new:.2f}", f"{new / old:.3f}", rounds)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
