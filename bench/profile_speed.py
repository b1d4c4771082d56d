"""How long profiling takes, and how well two profiles of the same model agree.

    python bench/profile_speed.py

Targets (issue 4): VGG16 (image_size 32, 4 stages, sizes 1..64) profiled on this CPU in under
60 s; two profiles of it agree within 10% per entry (median over the forward and backward
entries of every stage and size). Both profiles are made side by side in this one run; the
second uses the first one's split (--split), so that the same stages are compared.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from umopt.profiler import ProfileOptions, profile_model


def main() -> None:
    opts = ProfileOptions(model="vgg16", model_args={"image_size": 32}, stages=4, max_size=64)
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        prof = profile_model(opts)
        runs.append((time.perf_counter() - t0, prof))
        # the second run keeps the first run's stages, so that every entry has a twin
        opts = ProfileOptions(**{**opts.__dict__, "stages": None, "split": prof.model_extra["split"]})
    (t_a, a), (t_b, b) = runs
    table = Table(title="vgg16, image 32, 4 stages, sizes 1..64, CPU, 1 thread")
    for col in ("run", "seconds (incl. link ping-pong)", "split", "stage-0 F ms @1..64"):
        table.add_column(col, justify="right")
    for i, (t, p) in enumerate(runs):
        table.add_row(str(i + 1), f"{t:.1f}", str(p.model_extra["split"]), " ".join(f"{x:.1f}" for x in p.stages[0].forward_ms))
    console = Console(width=160)
    console.print(table)
    rel = []
    for sa, sb in zip(a.stages, b.stages):
        for key in ("forward_ms", "backward_ms"):
            x, y = np.array(getattr(sa, key)), np.array(getattr(sb, key))
            rel.extend(np.abs(x - y) / ((x + y) / 2))
    rel = np.array(rel)
    console.print(
        f"repeatability over {rel.size} entries: median {100 * np.median(rel):.1f}%, "
        f"90th percentile {100 * np.percentile(rel, 90):.1f}%, max {100 * rel.max():.1f}% "
        f"(target: median under 10%); profiling time target: under 60 s"
    )


if __name__ == "__main__":
    main()
