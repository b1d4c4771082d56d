"""Chrome-trace JSON of timelines (opens in Perfetto or chrome://tracing).

Each timeline becomes one process; each stage is a thread with its ops, and each link direction
a thread with its messages. Times are microseconds, as the trace format wants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .costmodel import Timeline
from .fileio import write_json

__all__ = ["chrome_trace", "write_trace"]


def chrome_trace(panels: Sequence[tuple[str, Timeline]]) -> dict:
    events: list[dict] = []
    for pid, (label, tl) in enumerate(panels):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        S = len(tl.spans)
        for s, spans in enumerate(tl.spans):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": s, "args": {"name": f"stage {s}"}}
            )
            for sp in spans:
                events.append(
                    {
                        "name": f"{sp.kind}({sp.lo},{sp.hi})"
                        + (f" stage {sp.chunk}" if sp.chunk not in (-1, s) else ""),
                        "cat": sp.kind,
                        "ph": "X",
                        "pid": pid,
                        "tid": s,
                        "ts": sp.start * 1000.0,
                        "dur": (sp.end - sp.start) * 1000.0,
                        "args": {"samples": sp.hi - sp.lo},
                    }
                )
        for s, (f, a) in enumerate(zip(tl.finish_ms, tl.allreduce_ms)):
            if a > 0:  # the stage's gradient all-reduce among data-parallel replicas
                events.append(
                    {
                        "name": "all-reduce",
                        "cat": "comm",
                        "ph": "X",
                        "pid": pid,
                        "tid": s,
                        "ts": f * 1000.0,
                        "dur": a * 1000.0,
                    }
                )
        for m in tl.messages:
            tid = S + 2 * m.link + (m.direction == "bwd")
            events.append(
                {
                    "name": f"{'act' if m.direction == 'fwd' else 'grad'}({m.lo},{m.hi})",
                    "cat": "comm",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": m.start * 1000.0,
                    "dur": (m.end - m.start) * 1000.0,
                    "args": {"sent_ms": m.sent},
                }
            )
        for ln in range(S - 1):
            for d, name in ((0, "activations"), (1, "gradients")):
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": S + 2 * ln + d,
                        "args": {"name": f"link {ln} {name}"},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(panels: Sequence[tuple[str, Timeline]], path: str | Path) -> None:
    write_json(path, chrome_trace(panels))
