"""Do predictions hold with data-parallel replicas? Pipelines x replicas on CPU, measured in turns.

    python bench/dp.py [--dp 2] [--rounds 3] [--steps 6] [--time-limit 5] [--models NAME,...] [--markdown]

For each model (2 stages x 1 thread, minibatch 32 per pipeline): `umopt profile --dp N` (which
measures the all-reduce among N processes; its probe runs need a core per rank and, on a machine
with fewer, are replaced by what the README says to do then: the equal GPipe and 1F1B probe
schedules run with `--dp N`, and `umopt calibrate` on their reports), `umopt solve --dp N`, then
umopt's schedule and the best equal GPipe and 1F1B schedules run with `--dp N` on the same
processes in turns, `--rounds` times. The table shows each schedule's prediction (all-reduce
included), its measurement and their ratio, and each stage's all-reduce predicted and measured.

Target (issue 33): with --dp 2 on CPU, every measured iteration within 15% of its prediction.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.measure import ProfileOptions
from umopt.probes import fit_to_probes, profile_in_pipeline
from umopt.run.launch import launch
from umopt.run.options import RunOptions
from umopt.search.solve import allreduce_for, make_problem, solve

# models no other bench or test here is tuned on; the large vocabularies make the first and last
# stages' all-reduces the largest
MODELS = {
    "gpt-vocab8k": ("gpt", {"layers": 4, "d_model": 128, "heads": 4, "vocab": 8192, "seq_len": 32}),
    "mlp-deep": ("mlp", {"layers": 8, "width": 512, "in_features": 256, "num_classes": 10}),
}
B = 32
COLUMNS = ("model", "schedule", "chunks", "pred ms", "meas ms", "meas / pred", "all-reduce ms pred / meas")


def _save(prof, problem, cand, name: str, out: Path, dp) -> str:
    path = out / f"{name}.json"
    save_schedule(
        make_schedule(
            prof,
            B,
            False,
            cand.ops(),
            cand.simulate(problem),
            {"name": name, "status": "feasible", "seconds": 0.0},
            {},
            dp,
        ),
        str(path),
    )
    return str(path)


def _run(paths: list[str], dp: int, steps: int, warmup: int, rounds: int, out: Path, tag: str) -> list[dict]:
    return launch(
        RunOptions(
            schedules=paths,
            dp=dp,
            steps=steps,
            warmup=warmup,
            rounds=rounds,
            report=str(out / f"{tag}_{{name}}_report.json"),
        ),
        quiet=True,
    ).reports


def one(
    name: str,
    model: str,
    args: dict,
    dp: int,
    out: Path,
    rounds: int,
    steps: int,
    time_limit: float,
    say=print,
) -> list[tuple]:
    prof = profile_in_pipeline(
        ProfileOptions(model=model, model_args=args, stages=2, max_size=B, dp=dp), probe_minibatch=B
    )
    save_profile(prof, out / f"{name}.json")
    prof = load_profile(out / f"{name}.json")
    probes = prof.meta.probes
    if not (probes and probes.ran):
        # what a user does then: run equal schedules of several chunk sizes with the replicas
        # (the probe schedules) and calibrate the profile on their reports
        say(
            f"{name}: no probe runs ({probes.why if probes else 'not recorded'}); calibrating on the probe schedules run with --dp {dp} instead"
        )
        prof = fit_to_probes(prof, B, out / f"{name}_probes", steps=steps, warmup=2, rounds=rounds)
        save_profile(prof, out / f"{name}_calibrated.json")
        prof = load_profile(out / f"{name}_calibrated.json")
    allreduce = allreduce_for(prof, dp)
    report = solve(prof, B, time_limit=time_limit, seed=0, dp=allreduce)
    problem = make_problem(prof, B, False, allreduce)
    plans = {
        "umopt": report.choice.candidate,
        "gpipe_equal": report.gpipe.candidate,
        "1f1b_equal": report.onef1b.candidate,
    }
    paths = [_save(prof, problem, c, n, out, allreduce) for n, c in plans.items()]
    reports = _run(paths, dp, steps, 2, rounds, out, "run")
    rows = []
    for (n, c), r in zip(plans.items(), reports):
        counts = sorted({len(f) for f in c.fsizes})
        ar = r.allreduce_ms
        rows.append(
            (
                name,
                n + (f" ({report.choice.name})" if n == "umopt" else ""),
                "/".join(map(str, counts)),
                f"{r.predicted_iteration_ms:.1f}",
                f"{r.measured_iteration_ms:.1f}",
                f"{r.measured_over_predicted:.3f}",
                " ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(ar.predicted, ar.measured)),
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/results.md)")
    a = ap.parse_args()
    console = Console(stderr=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="umopt-dp-") as tmp:
        for name in a.models.split(","):
            model, args = MODELS[name]
            console.print(f"{name}: profile, solve with --dp {a.dp}, run in turns")
            rows += one(
                name, model, args, a.dp, Path(tmp), a.rounds, a.steps, a.time_limit, say=console.print
            )
    ratios = [float(r[5]) for r in rows]
    verdict = f"measured / predicted {min(ratios):.3f}..{max(ratios):.3f}: " + (
        "within 15% for every schedule"
        if all(abs(x - 1) <= 0.15 for x in ratios)
        else "NOT within 15% for every schedule"
    )
    if a.markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(f"\n{verdict}")
        return
    table = Table(
        title=f"2 stages x --dp {a.dp} replicas on CPU, minibatch {B} per pipeline, {a.rounds} rounds of turns"
    )
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("model", "schedule") else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)
    print(verdict)


if __name__ == "__main__":
    sys.exit(main())
