"""Regenerate the results section of README.md (and docs/gantt.png) in one run.

    python bench/results.py [--time-limit 20] [--rounds 5]

Runs bench/solver_quality.py's comparison on the bundled profiles and bench/runtime_vs_predicted.py's
side-by-side runs on this CPU, draws the VGG16 Gantt chart, and rewrites the block of README.md
between the results markers with the tables, the paper's reported gains beside ours, and what
differs. Takes about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runtime_vs_predicted  # noqa: E402
import solver_quality  # noqa: E402

from umopt.plot import gantt  # noqa: E402
from umopt.profile import load_profile  # noqa: E402
from umopt.solve import solve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->", "<!-- results:end -->"
RUN_CAVEAT = """Predicted times come from the profile *calibrated* to short runs of equal schedules (`umopt
calibrate`; the column "profile as measured" shows what the raw profile predicted). This 2-core
machine's speed wanders by +-10% from step to step and drifts between runs (one run's steps
ranged from 151 to 231 ms for the same schedule), as much as the predicted margin itself, so the
benchmark takes medians of 30 steps per run and of 5 rounds run alternately. With these settings
(this session; before, 8 steps per run gave 0.98-1.23 and 8-210%), three runs of
`python bench/runtime_vs_predicted.py --rounds 5` gave: umopt's schedule at 1.035, 1.161 and
1.062 x its prediction; the measured win 102%, 37% and 149% of the predicted one; umopt's
runtime / ScheduleGPipe 0.891, 0.940 and 0.837. The targets held in two of the three. With the
step overhead fitted by `umopt calibrate` (since then), the run above (`python bench/results.py
--rounds 5`, an earlier session) and one more of `bench/runtime_vs_predicted.py` met all three:
1.001 and 0.948 x predicted, 1.010 and 0.964 x ScheduleGPipe, 75% and 90% of the predicted
margin; the run above (the same command, this session) met them too, at 0.915 x predicted (every
schedule ran 8-12% faster than predicted that time), 1.022 x ScheduleGPipe and 87%."""
WHAT_IT_SHOWS = """What the solver table shows, plainly: umopt's schedules beat the best equal GPipe and 1F1B
schedules on every profile, most where stages differ most (VGG16: 13-26% over equal GPipe); a
hill climb from the best equal schedules gains 2-11%, one shared ramped partition (`ramp`, small
chunks first and last) 5-12%, the GA with its iterated local search 5-26%. Almost all the
winners are 1F1B-ordered with per-stage warm-ups: the stage holding the most work alternates
forward and backward from the start while the stages before it forward everything first, an
order neither GPipe nor PipeDream-flush has. `auto` runs the GA as `ga` does (the exact model
only gets time where it proves optimality, about S=4, B=8), started from the dp and ramp
schedules too where they beat the equal ones. On the deep pipeline (transformer8-sim, S=8) that
start is worth 3.4% (B=128: 256.4 against 265.4 ms) and 4.7% (B=256: 420.3 against 440.9): the
GA does not find the ramp by itself in 20 s, and the ramp alone beats it there. At S=4 a run's
random path decides between neighbouring schedules (up to 2% apart, either way round from run to
run; here gpt-sim, B=64: ga 169.5 / auto 170.6 ms; vgg16-cpu, B=128: 1020.5 / 1016.0). The
"gap" is to the best bound umopt proves for every schedule (stage cuts and the untied bound of
docs/formats.md; `auto`'s pair bounds run beside it only up to B=32), "gap in 1F1B" to the one it
proves within the 1F1B family (B ops in sample order) for auto's schedules of that family, so
each says how far from optimal a schedule is at most, not how far it is."""


def md(columns, rows) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def speedup(cell: str) -> float:
    return float(re.search(r"\(([\d.]+)x\)", cell).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=5)  # 3 let this machine's drift decide (171 vs 250 ms rounds)
    args = ap.parse_args()
    quality = solver_quality.run(args.time_limit)
    title, runs, summary = runtime_vs_predicted.run(32, args.rounds, 30, args.time_limit)

    report = solve(load_profile("vgg16-cpu"), 64, time_limit=args.time_limit, seed=0)
    gantt(
        [(f"best equal GPipe (M={report.gpipe.microbatches})", report.gpipe_timeline), ("umopt", report.timeline)],
        ROOT / "docs" / "gantt.png",
        title="vgg16-cpu, 4 stages, minibatch 64 (predicted)",
    )

    vgg = next(r for r in quality if r[0] == "vgg16-cpu" and r[1] == "64")
    gsim = next(r for r in quality if r[0] == "gpt-sim")
    auto, of = solver_quality.COLUMNS.index("auto"), solver_quality.COLUMNS.index("1f1b_equal")
    vs_gpipe = speedup(vgg[auto])
    vs_1f1b = vs_gpipe / speedup(vgg[of])
    g_gpipe = speedup(gsim[auto])
    g_1f1b = g_gpipe / speedup(gsim[of])
    meas = {r[0]: float(r[3]) for r in runs}
    eq = next(k for k in meas if k.startswith("umopt runtime, best equal"))
    um = meas["umopt runtime, umopt schedule"]
    paper = md(
        ("model", "paper: vs GPipe", "paper: vs PipeDream", "umopt: vs best equal GPipe", "umopt: vs best equal 1F1B", "how ours was measured"),
        [
            ("VGG16", "+17.11%", "+7.96%", f"+{100 * (vs_gpipe - 1):.1f}%", f"+{100 * (vs_1f1b - 1):.1f}%", "predicted, vgg16-cpu profile, 4 stages, B=64"),
            ("GPT", "+13.89% (GPT1-14)", "+11.09%", f"+{100 * (g_gpipe - 1):.1f}%", f"+{100 * (g_1f1b - 1):.1f}%", "predicted, gpt-sim profile, 4 stages, B=64"),
            ("GPT (small)", "", "", f"+{100 * (meas[eq] / um - 1):.1f}%", "", "measured, umopt run, 2 CPU stages, B=32"),
        ],
    )
    block = f"""{START}
### Results

_Regenerated by `python bench/results.py` (solvers get {args.time_limit:g} s each)._

**Every solver against the baselines and the bound** (iteration ms, speedup over the best equal GPipe schedule):

{md(solver_quality.COLUMNS, quality)}

{WHAT_IT_SHOWS}

**Measured on this CPU, side by side** ({title}):

{md(runtime_vs_predicted.COLUMNS, runs)}

{summary}

{RUN_CAVEAT}

**Against the paper's reported gains**:

{paper}

Where ours differ, and why: these are predicted gains on profiles from a 2-core CPU (vgg16-cpu,
measured) and a GPU-shaped synthetic one (gpt-sim), not measured GPU runs like the paper's. On a
CPU, cost grows almost linearly with the chunk size, so unequal chunk *sizes* gain little by
themselves; most of our gain comes from the per-stage op order (1F1B warm-ups per stage), which
the paper's GA did not search. Our baselines are also stronger than a fixed M: they try every M.
And the paper's "PipeDream" is compared here with the best equal 1F1B (PipeDream-flush) schedule.

![Gantt chart: best equal GPipe schedule above, umopt's below](docs/gantt.png)
{END}"""
    readme = (ROOT / "README.md").read_text()
    if START in readme:
        readme = readme[: readme.index(START)] + block + readme[readme.index(END) + len(END) :]
    else:
        readme = readme.replace("## Development", block + "\n\n## Development")
    (ROOT / "README.md").write_text(readme)
    print("README.md results block and docs/gantt.png rewritten")


if __name__ == "__main__":
    main()
