"""How long profiling takes, and how well two profiles of the same model agree.

    python bench/profile_speed.py

Targets (issue 4): VGG16 (image_size 32, 4 stages, sizes 1..64) profiled on this CPU in under
60 s; two profiles of it agree within 10% per entry (median over the forward and backward
entries of every stage and size). Both profiles are made side by side in this one run; the
second uses the first one's split (--split), so that the same stages are compared. The
agreement is also given with the profile's level taken out (the median ratio of all entries:
what a machine uniformly faster or slower explains) and with each stage's level taken out: what
is left is how well the balance between stages, and the curves' shapes, repeat.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from umopt.measure import ProfileOptions, profile_model


def main() -> None:
    opts = ProfileOptions(model="vgg16", model_args={"image_size": 32}, stages=4, max_size=64)
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        prof = profile_model(opts)
        runs.append((time.perf_counter() - t0, prof))
        # the second run keeps the first run's stages, so that every entry has a twin
        opts = ProfileOptions(**{**opts.__dict__, "stages": None, "split": prof.split})
    (t_a, a), (t_b, b) = runs
    table = Table(title="vgg16, image 32, 4 stages, sizes 1..64, CPU, 1 thread")
    for col in ("run", "seconds (incl. link ping-pong)", "split", "stage-0 F ms @1..64"):
        table.add_column(col, justify="right")
    for i, (t, p) in enumerate(runs):
        table.add_row(
            str(i + 1),
            f"{t:.1f}",
            str(p.split),
            " ".join(f"{x:.1f}" for x in p.stages[0].forward_ms),
        )
    console = Console(width=160)
    console.print(table)
    rel, shape = [], []
    for sa, sb in zip(a.stages, b.stages):
        x, y = np.array(sa.forward_ms + sa.backward_ms), np.array(sb.forward_ms + sb.backward_ms)
        rel.extend(np.abs(x - y) / ((x + y) / 2))
        y = y / np.median(y / x)  # the stage's level taken out: what is left is the curves' shape
        shape.extend(np.abs(x - y) / ((x + y) / 2))
    rel, shape = np.array(rel), np.array(shape)
    # one level for the whole profile taken out: the balance between stages is what is left
    x = np.concatenate([st.forward_ms + st.backward_ms for st in a.stages])
    y = np.concatenate([st.forward_ms + st.backward_ms for st in b.stages])
    y = y / np.median(y / x)
    balance = np.abs(x - y) / ((x + y) / 2)
    console.print(
        f"repeatability over {rel.size} entries: median {100 * np.median(rel):.1f}%, "
        f"90th percentile {100 * np.percentile(rel, 90):.1f}%, max {100 * rel.max():.1f}% "
        f"(target: median under 10%); profiling time target: under 60 s"
    )
    console.print(
        f"with the profile's level taken out: median {100 * np.median(balance):.1f}%, 90th percentile {100 * np.percentile(balance, 90):.1f}%; "
        f"with each stage's level taken out: median {100 * np.median(shape):.1f}%, 90th percentile {100 * np.percentile(shape, 90):.1f}%; "
        f"what each profile said of the machine: drift per stage {a.meta.noise.drift} and {b.meta.noise.drift}, "
        f"matmul ms per stage {a.meta.noise.reference_ms} and {b.meta.noise.reference_ms}"
    )


if __name__ == "__main__":
    main()
