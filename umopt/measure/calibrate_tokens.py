"""Fit a profile's costs by tokens to runs of sequences of different lengths:
``umopt calibrate PROFILE REPORT... -o OUT`` with reports of ``umopt run PLAN --lengths/--data``.

``umopt profile --lengths`` times each stage alone on a grid of chunks of sequences; inside a
running pipeline the same ops take longer or shorter (another rank's ops beside them on the same
cores, caches, the runtime's own work per op: shapes from the plan, masks, buffers). A run of
sequences writes every measured step's ops into its report, each with its plan's prediction and
its measured duration (``lengths.op_pairs``). For each stage, mode (packed or padded) and kind (F,
B, W) this module fits ``measured = r * predicted + delta`` over those ops (least squares; where
the ops' predictions barely differ, as padding's equal rows, the ratio alone): ``r`` scales
every term of the stage's fit (per token, per square, per sequence, per op) and ``delta`` is what
each op costs beyond it. The stage's layers (a profile for several chunks per rank) move with it,
each term scaled alike and ``delta`` shared out, so that they still sum to the stage.

What it leaves: the per-message and per-iteration costs (the probe runs of ``umopt profile`` fit
those), runs with ``--recompute`` (their B ops hold a forward too) and runs with several chunks
per rank (a virtual stage's ops cover part of a stage's layers, and the cut differs between
layouts): both are refused in one line.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import UmoptError
from ..formats.profile import CalibrationMeta, Profile, TokenCosts, TokenFit
from ..formats.report import RunReport, as_report

__all__ = ["TokenRefit", "calibrate_tokens"]

# a fit's field for each op kind; B where the stage's ops were split into B and W: its input part
_FIELD = {"F": "forward", "B": "backward", "W": "backward_weight"}
MIN_OPS = 4  # ops a (stage, mode, kind) needs before it is fitted
SPREAD = 0.15  # the predictions' coefficient of variation below which only the ratio is fitted


@dataclass(frozen=True)
class TokenRefit:
    """One (stage, mode, kind)'s fit: the ratio, each op's own cost beyond it, over how many ops,
    and the relative RMS error of the ops' predictions before and after."""

    stage: int
    mode: str
    kind: str  # the fit's field: forward, backward, backward_input, backward_weight
    ratio: float
    per_op_ms: float
    ops: int
    rms_before: float
    rms_after: float


def _check(rep: RunReport, name: str, profile: Profile) -> None:
    if rep.lengths is None:
        raise UmoptError(
            f"{name}: a run of one length; give runs of sequences of different lengths alone (their costs by "
            "tokens are fitted), or of one length alone (their costs by sample count)"
        )
    if not rep.lengths.op_pairs:
        raise UmoptError(
            f"{name}: no ops with their predictions (written by an older umopt run; run it again)"
        )
    if rep.chunks:
        raise UmoptError(
            f"{name}: a run with several chunks per rank; calibrate costs by tokens from runs of one chunk per rank"
        )
    if rep.recompute:
        raise UmoptError(
            f"{name}: a run with --recompute (its B ops hold a forward too); calibrate from runs without"
        )
    if rep.stages != profile.num_stages:
        raise UmoptError(f"{name}: has {rep.stages} stages, the profile {profile.num_stages}")
    for mode, s, *_ in rep.lengths.op_pairs:
        costs = profile.stages[s].tokens
        if costs is None or mode not in costs:
            raise UmoptError(
                f"{name}: ran {mode} sequences on stage {s}, which the profile has no costs by tokens for"
            )


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``y ~ r * x + delta`` in least squares of the relative error (so the fit is never further
    off than the predictions were) where the predictions spread, else the ratio alone."""
    q = x / y  # the relative error of r * x is r * q - 1
    ratio_only = (float(q.sum() / (q * q).sum()), 0.0)
    if x.std() < SPREAD * x.mean():
        return ratio_only
    r, delta = np.linalg.lstsq(np.stack([q, 1.0 / y], axis=1), np.ones_like(y), rcond=None)[0]
    # a per-op cost that would take back most of the smallest op, or a ratio far from one: the
    # ops do not tell the two apart; the ratio alone is the safer fit
    if not 0.2 <= r <= 5.0 or delta < -0.5 * x.min():
        return ratio_only
    return float(r), float(delta)


def _scaled(fit: TokenFit, r: float, extra: float) -> TokenFit:
    return fit.model_copy(
        update={
            "a_ms": max(0.0, r * fit.a_ms + extra),
            "b_ms": r * fit.b_ms,
            "c_ms": r * fit.c_ms,
            "d_ms": r * fit.d_ms,
        }
    )


def calibrate_tokens(
    profile: Profile, reports: Sequence[RunReport | dict], names: list[str]
) -> tuple[Profile, list[TokenRefit]]:
    """A copy of ``profile`` with its costs by tokens fitted to the reports' ops (see the module
    docstring), and each fit."""
    reports = [as_report(rep, name) for rep, name in zip(reports, names)]
    for rep, name in zip(reports, names):
        _check(rep, name, profile)
    pairs: dict[tuple[int, str, str], list[tuple[float, float]]] = defaultdict(list)
    for rep in reports:
        ops = rep.lengths.op_pairs  # type: ignore[union-attr]
        split = {s for _, s, kind, *_ in ops if kind == "W"}  # stages whose B ops left W ops behind
        for mode, s, kind, predicted, measured in ops:
            field = "backward_input" if kind == "B" and s in split else _FIELD[kind]
            if predicted > 0 and measured > 0:
                pairs[(s, mode, field)].append((predicted, measured))
    stages = list(profile.stages)
    layers = list(profile.layers) if profile.layers is not None else None
    refits = []
    for (s, mode, field), seen in sorted(pairs.items()):
        if len(seen) < MIN_OPS:
            continue
        x, y = (np.array(v) for v in zip(*seen))
        r, delta = _fit(x, y)
        st = stages[s]
        costs: TokenCosts = st.tokens[mode]  # type: ignore[index]
        if getattr(costs, field) is None:
            continue
        # an op predicted fit + o (the runtime's per-op cost) measures r (fit + o) + delta
        extra = (r - 1.0) * st.op_overhead_ms + delta
        new = costs.model_copy(update={field: _scaled(getattr(costs, field), r, extra)})
        stages[s] = st.model_copy(update={"tokens": {**st.tokens, mode: new}})  # type: ignore[dict-item]
        if layers is not None:
            lo, hi = st.layers
            for i in range(lo, hi):
                ly = layers[i]
                if ly.tokens is None or mode not in ly.tokens or getattr(ly.tokens[mode], field) is None:
                    continue
                mine = ly.tokens[mode].model_copy(
                    update={field: _scaled(getattr(ly.tokens[mode], field), r, extra / (hi - lo))}
                )
                layers[i] = ly.model_copy(update={"tokens": {**ly.tokens, mode: mine}})
        rms = lambda p: float(np.sqrt(np.mean(((y - p) / y) ** 2)))  # noqa: E731
        refits.append(TokenRefit(s, mode, field, r, delta, len(seen), rms(x), rms(r * x + delta)))
    if not refits:
        raise UmoptError(
            f"the reports hold fewer than {MIN_OPS} ops of any stage, mode and kind: nothing to fit"
        )
    old = profile.meta.calibration or CalibrationMeta()
    calibration = old.model_copy(
        update={
            "reports": [*old.reports, *names],
            "tokens": {
                f"stage{f.stage}.{f.mode}.{f.kind}": {
                    "ratio": round(f.ratio, 4),
                    "per_op_ms": round(f.per_op_ms, 5),
                    "ops": f.ops,
                    "rms_before": round(f.rms_before, 4),
                    "rms_after": round(f.rms_after, 4),
                }
                for f in refits
            },
        }
    )
    fitted = profile.model_copy(
        update={
            "stages": stages,
            **({"layers": layers} if layers is not None else {}),
            "meta": profile.meta.model_copy(update={"calibration": calibration}),
        }
    )
    return fitted, refits
