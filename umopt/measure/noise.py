"""Measuring on a machine that is not quiet: robust summaries of repeats, fits that cannot follow
noise where physics forbids it, and a figure that tells the user when a measurement is not to be
trusted.

Another job on the machine, a clock that changes speed, a page fault: any of them can make one
repeat of a timing slow, and a slow repeat at one chunk size makes the solver believe in an
advantage that is not there. So each profile entry is the median of its repeats after Tukey's
fences have dropped the outliers, keeps its interquartile range (its *spread*), and gets more
repeats while that spread is wide; the curve over chunk sizes is then fitted to be
non-decreasing (more samples never take less time), weighted by how tight each entry is. The
noise figure is the median spread over a profile's entries; above :data:`NOISY_SPREAD` the
commands say so in one line instead of trusting the numbers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..formats.report import RunReport

__all__ = [
    "NOISY_SPREAD",
    "OFF_PREDICTION",
    "Summary",
    "summarize",
    "monotone_fit",
    "spread",
    "noise_figure",
    "round_speeds",
    "drift_figure",
    "drift_warning",
    "uneven_devices_warning",
    "noisy_warning",
    "load_warning",
    "run_warnings",
]

# the median relative spread (interquartile range / median) of repeats above which a machine
# counts as too noisy to trust: a 10% spread is as large as the gains being measured
NOISY_SPREAD = 0.10
# how far a run may be from its prediction before the run says the profile does not describe it
OFF_PREDICTION = 0.15
MEMORY_OVER = 0.10  # a rank allocating this much more than its predicted peak is warned of


@dataclass(frozen=True)
class Summary:
    """The median of a set of repeats (outliers dropped) and their interquartile range."""

    median: float
    iqr: float
    kept: int  # repeats within the fences

    @property
    def spread(self) -> float:
        return spread(self.median, self.iqr)


def spread(median: float, iqr: float) -> float:
    """Relative spread: interquartile range over the median (0 where the median is 0)."""
    return iqr / median if median > 0 else 0.0


def summarize(runs: Sequence[float]) -> Summary:
    """Median and interquartile range of ``runs``, after dropping those outside Tukey's fences
    (1.5 interquartile ranges beyond the quartiles)."""
    x = np.asarray(runs, dtype=float)
    q1, q3 = np.percentile(x, [25, 75])
    fence = 1.5 * (q3 - q1)
    kept = x[(x >= q1 - fence) & (x <= q3 + fence)]
    if kept.size == 0:  # (cannot happen: the quartiles lie within the fences)
        kept = x
    k1, k3 = np.percentile(kept, [25, 75])
    return Summary(float(np.median(kept)), float(k3 - k1), int(kept.size))


def monotone_fit(values: Sequence[float], weights: Optional[Sequence[float]] = None) -> list[float]:
    """The non-decreasing sequence nearest to ``values`` in weighted least squares (pool
    adjacent violators). Each fitted value is a weighted mean of a run of measured ones, so the
    fit never leaves the measured range."""
    y = [float(v) for v in values]
    w = [1.0] * len(y) if weights is None else [max(float(v), 1e-12) for v in weights]
    blocks: list[list[float]] = []  # [weighted mean, total weight, count]
    for v, wt in zip(y, w):
        blocks.append([v, wt, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for m, _, c in blocks:
        out += [m] * c
    return out


def round_speeds(times: np.ndarray, groups: Sequence[int]) -> np.ndarray:
    """The machine's speed in each round of a profile, as each series should be corrected for it.

    ``times`` holds one row per series (one size's forward, or its backward) and one column per
    round of timing, NaN where the series was not timed in that round; ``groups`` names each
    row's size. A row's factor in a round is the median, over the *other* sizes' rows timed in
    that round, of their time relative to their own median: an estimate of how fast the machine
    ran then that the row's own noise does not enter. Where fewer than two such rows were timed
    the factor is 1. Dividing ``times`` by the result takes out drift common to all sizes."""
    t = np.asarray(times, dtype=float)
    g = np.asarray(groups)
    rel = t / np.nanmedian(t, axis=1, keepdims=True)
    out = np.ones_like(t)
    for size in np.unique(g):
        others = rel[g != size]
        for r in range(t.shape[1]):
            seen = others[:, r][~np.isnan(others[:, r])]
            if seen.size >= 2:
                out[g == size, r] = np.median(seen)
    return out


def drift_figure(times: np.ndarray) -> float:
    """How much the machine's speed changed over a profile's rounds: the spread between the
    10th and 90th percentile of the rounds' median relative times, over their median."""
    t = np.asarray(times, dtype=float)
    rel = t / np.nanmedian(t, axis=1, keepdims=True)
    per_round = [float(np.median(c[~np.isnan(c)])) for c in rel.T if np.count_nonzero(~np.isnan(c)) >= 2]
    if len(per_round) < 3:
        return 0.0
    p10, p50, p90 = np.percentile(per_round, [10, 50, 90])
    return float((p90 - p10) / p50)


def drift_warning(drift: float, threshold: float = NOISY_SPREAD) -> Optional[str]:
    """One line when the machine's speed drifted by more than ``threshold`` while profiling."""
    if drift <= threshold:
        return None
    return (
        f"the machine's speed changed by {100 * drift:.0f}% between rounds of timing (more than {100 * threshold:.0f}%): "
        "each round was corrected for it, but a profile taken at another moment may differ by as much; "
        "stop other jobs, or let the probe runs and `umopt tune` measure in turns"
    )


def uneven_devices_warning(
    reference_ms: Sequence[float],
    device_type: str,
    when: str = "while profiling",
    threshold: float = NOISY_SPREAD,
) -> Optional[str]:
    """One line when the same fixed work took more than ``threshold`` longer on one stage's
    device than on another's while they were timed. (The stages' times are not scaled by it: on
    a shared CPU the matmul's speed did not follow the models' ops, and scaled profiles agreed
    less, not more.)"""
    if len(reference_ms) < 2 or min(reference_ms) <= 0:
        return None
    slow, fast = max(reference_ms), min(reference_ms)
    if slow / fast - 1 <= threshold:
        return None
    where = "cores" if device_type == "cpu" else "devices"
    return (
        f"the same fixed matmul took {fast:.2f} to {slow:.2f} ms on the stages' {where} ({100 * (slow / fast - 1):.0f}% apart) {when}: "
        f"the {where} were not equally fast (shared or throttled hardware), and the stages' times may differ by as much at another moment"
    )


def noise_figure(medians: Sequence[float], iqrs: Sequence[float]) -> tuple[float, float]:
    """The median and the 90th percentile of the entries' relative spreads, each entry weighted
    by its time: a sub-millisecond entry's jitter says little about the machine, and it matters
    little to any schedule."""
    s = np.array([spread(m, q) for m, q in zip(medians, iqrs)])
    w = np.asarray(medians, dtype=float)
    if s.size == 0 or w.sum() <= 0:
        return 0.0, 0.0
    order = np.argsort(s)
    cum = np.cumsum(w[order]) / w.sum()
    return float(s[order][np.searchsorted(cum, 0.5)]), float(
        s[order][min(np.searchsorted(cum, 0.9), s.size - 1)]
    )


def noisy_warning(what: str, median_spread: float, threshold: float = NOISY_SPREAD) -> Optional[str]:
    """One line when ``median_spread`` is above ``threshold``, else None."""
    if median_spread <= threshold:
        return None
    return (
        f"{what} spread by a median {100 * median_spread:.0f}% between repeats (more than {100 * threshold:.0f}%): "
        "the machine is too noisy to trust small differences; stop other jobs and measure again"
    )


def busy_cores(seconds: float = 0.5) -> Optional[float]:
    """How many cores other work kept busy over the last ``seconds`` (Linux's /proc/stat), or the
    one-minute load average where that cannot be read. The load average lags by a minute: right
    after another measurement it still counts that one."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]  # all time, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
        return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(t1 - t0, 1))
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:  # not on this platform
            return None


def load_warning(cores_used: int) -> Optional[str]:
    """One line when other processes already keep the machine's cores busy, else None."""
    load = busy_cores()
    if load is None:
        return None
    cores = os.cpu_count() or 1
    free = cores - load
    if free >= cores_used - 0.5:
        return None
    return f"{load:.1f} of the machine's {cores} cores were busy before measuring: other jobs will slow and scatter the timings"


def run_warnings(report: RunReport) -> list[str]:
    """What a run's report says the user should know: a run far off its prediction (and what to
    do), and steps too scattered to trust."""
    out = []
    # sequences of different lengths: the method whose plans ran (every method runs one plan file)
    name = (
        f"{report.lengths.method}'s steps"
        if report.lengths is not None
        else report.schedule or "the schedule"
    )
    if report.lengths is not None and report.lengths.cut:
        out.append(report.lengths.cut)
    if report.dp > 1 and not report.allreduce:
        out.append(
            f"{name} ran with {report.dp} data-parallel replicas but its prediction leaves out their all-reduce (no speed known): "
            f"solve with --dp {report.dp} (and --dp-gbps, or a profile made with --dp {report.dp})"
        )
    ratio = report.measured_over_predicted
    ranks, cores = (report.stages or 1) * report.dp, os.cpu_count() or 1
    if ratio is not None and abs(ratio - 1) > OFF_PREDICTION and report.backend == "gloo" and ranks > cores:
        out.append(
            f"{name} measured {ratio:.2f}x its prediction: {ranks} ranks on {cores} cores share them, where the profile timed "
            "each stage on a core of its own; run with a core per rank (or fewer stages) to compare with the prediction"
        )
    elif ratio is not None and abs(ratio - 1) > OFF_PREDICTION:
        out.append(
            f"{name} measured {ratio:.2f}x its prediction: the profile does not describe this run (another job on the machine, "
            "another machine, or a profile without the runtime's costs); profile again here (its probe runs fit the runtime) "
            "or fit it to this run: umopt calibrate PROFILE REPORT -o PROFILE2"
        )
    uneven = uneven_devices_warning(
        report.reference_ms, "cuda" if report.backend == "nccl" else "cpu", f"while {name} ran"
    )
    if uneven:
        out.append(uneven)
    if report.numerics_differ:
        out.append(
            f"{name} ran with other numerics than its profile was timed under ({'; '.join(report.numerics_differ)}): "
            "its prediction may not hold; profile under the settings you train with"
        )
    mem = report.peak_memory_bytes
    if mem is not None and mem.measured and len(mem.measured) == len(mem.predicted):
        over = [
            (s, m / p - 1)
            for s, (m, p) in enumerate(zip(mem.measured, mem.predicted))
            if p and m > p * (1 + MEMORY_OVER)
        ]
        if over:
            s, by = max(over, key=lambda x: x[1])
            out.append(
                f"{name}: rank {s} allocated {mem.measured[s] / 2**20:.1f} MiB at its peak, {100 * by:.0f}% over the "
                f"{mem.predicted[s] / 2**20:.1f} MiB predicted: a memory limit is not safe with this profile's "
                "memory figures (profile again on this device)"
            )
    if len(report.step_ms) >= 4:
        s = summarize(report.step_ms)
        line = noisy_warning(name if report.lengths is not None else f"{name}'s steps", s.spread)
        if line:
            out.append(line)
    return out
