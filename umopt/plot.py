"""Gantt pictures of timelines (matplotlib, PNG).

One row per stage (rank), F, B and W ops in three colours, each box labelled with its chunk's
size in samples where it is wide enough (the picture says so under its axis); with several chunks
per rank, a rank's later chunks lighter (the legend says so). Several timelines share one time
axis, stacked, so a schedule can be read against the best equal GPipe schedule at a glance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .costmodel import OpKind, Timeline
from .fileio import write_atomic

__all__ = ["gantt"]

COLOURS = {OpKind.F: "#4C72B0", OpKind.B: "#DD8452", OpKind.W: "#8172B3"}
ALLREDUCE = "#55A868"


def _count(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(int(n))


def _panel(ax, label: str, tl: Timeline, horizon: float, tokens=None) -> None:
    """One timeline on ``ax``: a lane per stage (or rank), its ops, all-reduces and optimizer step;
    with ``tokens`` (each sample's), a box's number is its chunk's tokens, not its samples."""
    ranks = len(tl.spans)
    ends = None if tokens is None else np.concatenate([[0], np.cumsum(tokens)])
    for s, spans in enumerate(tl.spans):
        for sp in spans:
            width = sp.end - sp.start
            # several chunks per rank: the later chunks of a rank lighter
            lap = max(sp.chunk, 0) // ranks
            ax.barh(
                s,
                width,
                left=sp.start,
                height=0.8,
                color=COLOURS[sp.kind],
                alpha=1.0 / (1 + 0.45 * lap),
                edgecolor="white",
                linewidth=0.4,
            )
            if width > horizon / 150:  # the number fits (smaller in a narrow box)
                ax.text(
                    sp.start + width / 2,
                    s,
                    str(sp.hi - sp.lo) if ends is None else _count(ends[sp.hi] - ends[sp.lo]),
                    ha="center",
                    va="center",
                    fontsize=6 if width > horizon / 60 else 4,
                    color="white",
                )
    # each stage's gradient all-reduce among data-parallel replicas, after its last op
    for s, (f, a) in enumerate(zip(tl.finish_ms, tl.allreduce_ms)):
        if a > 0:
            ax.barh(s, a, left=f, height=0.8, color=ALLREDUCE, edgecolor="white", linewidth=0.4)
    # the optimizer step closes the iteration on every stage
    ax.barh(
        range(len(tl.spans)),
        tl.iteration_ms - tl.makespan_ms,
        left=tl.makespan_ms,
        height=0.8,
        color="#BBBBBB",
    )
    chunked = any(sp.chunk not in (-1, s) for s, spans in enumerate(tl.spans) for sp in spans)
    lane = "rank" if chunked else "stage"
    ax.set_yticks(range(len(tl.spans)), [f"{lane} {s}" for s in range(len(tl.spans))])
    ax.invert_yaxis()
    ax.set_ylim(len(tl.spans) - 0.5, -0.5)
    ax.set_title(
        f"{label}: {tl.iteration_ms:.2f} ms per iteration, bubble {100 * tl.bubble_fraction:.1f}%",
        fontsize=9,
        loc="left",
    )
    ax.set_xlim(0, horizon * 1.01)


def gantt(panels: Sequence[tuple], path: str | Path, *, title: str = "") -> None:
    """Draw each ``(label, timeline)`` as a panel of one figure and write it to ``path`` (PNG);
    ``(label, timeline, tokens)`` for a plan of sequences of different lengths (each sample's
    tokens: the boxes say their chunks' tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    S = max(len(tl.spans) for _, tl, *_ in panels)
    horizon = max(tl.iteration_ms for _, tl, *_ in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 0.9 + 0.45 * S * len(panels) + 0.4), sharex=True, squeeze=False
    )
    for ax, (label, tl, *tokens) in zip(axes[:, 0], panels):
        _panel(ax, label, tl, horizon, tokens[0] if tokens else None)
    what = (
        "its chunk's tokens (k: thousands)"
        if any(len(p) > 2 for p in panels)
        else "the chunk's size in samples"
    )
    axes[-1, 0].set_xlabel(
        f"time (ms); each box is one op, its number {what} (none where the box is too "
        "narrow: umopt show lists every chunk)",
        fontsize=8,
    )
    # above the first panel, right of its title: inside the axes it hid the first stage's ops
    handles = [
        Patch(color=COLOURS[OpKind.F], label="forward"),
        Patch(color=COLOURS[OpKind.B], label="backward"),
        Patch(color="#BBBBBB", label="optimizer"),
    ]
    if any(sp.kind == OpKind.W for _, tl, *_ in panels for spans in tl.spans for sp in spans):
        handles.insert(2, Patch(color=COLOURS[OpKind.W], label="weight gradient"))
    if any(any(a > 0 for a in tl.allreduce_ms) for _, tl, *_ in panels):
        handles.insert(2, Patch(color=ALLREDUCE, label="all-reduce"))
    laps = max(
        (max(sp.chunk, 0) // len(tl.spans) for _, tl, *_ in panels for spans in tl.spans for sp in spans),
        default=0,
    )
    if laps:  # several chunks per rank: shades say which
        handles.insert(
            2, Patch(color=COLOURS[OpKind.F], alpha=1 / 1.45, label="a rank's 2nd chunk (lighter, and so on)")
        )
    axes[0, 0].legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=4,
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
    )
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
