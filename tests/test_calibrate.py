"""Calibration: a profile scaled to what a run measured, per stage, kind and chunk size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli, two_stage_profile

from umopt.costmodel import CostTables, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import ProfileMeta
from umopt.measure.calibrate import Overheads, calibrate
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile


def _report(profile, ops, factor):
    """What `umopt run` would report if every op took `factor[stage][kind]` times its prediction."""
    tables = CostTables.from_profile(profile)
    tl = simulate(tables, ops, 2)
    return {
        "measured_iteration_ms": 1.0,
        "recompute": False,
        "ops": [
            [
                [sp.kind, sp.lo, sp.hi, factor[s][sp.kind] * (sp.end - sp.start), sp.end - sp.start]
                for sp in tl.spans[s]
            ]
            for s in range(len(ops))
        ],
    }


OPS = [[("F", 0, 1), ("F", 1, 2), ("B", 1, 2), ("B", 0, 1)], [("F", 0, 2), ("B", 0, 2)]]


def test_each_size_is_scaled_by_its_measured_ratio():
    prof = two_stage_profile()
    rep = _report(prof, OPS, [{"F": 1.0, "B": 1.5}, {"F": 1.2, "B": 0.8}])
    cal = calibrate(prof, [rep], ["r.json"])
    s0, s1 = cal.stages
    assert s0.forward_ms == pytest.approx(prof.stages[0].forward_ms)
    assert s0.backward_ms == pytest.approx(
        [1.5 * v for v in prof.stages[0].backward_ms]
    )  # size 1 seen, size 2 nearest
    # stage 1 ran only size-2 chunks: their ratio holds for every size
    assert s1.forward_ms == pytest.approx([1.2 * v for v in prof.stages[1].forward_ms])
    assert s1.backward_ms == pytest.approx([0.8 * v for v in prof.stages[1].backward_ms])
    assert cal.meta.model_dump()["calibration"]["ratios"]["stage1.F"] == {"2": 1.2}
    # what probe runs measured over the profile's earlier fit does not survive a new one
    probed = prof.model_copy(
        update={
            "meta": ProfileMeta.model_validate(
                {
                    "probes": {
                        "ran": True,
                        "order_ratio": {"gpipe": 0.9, "1f1b": 1.1},
                        "measured_over_fitted": {"probe_gpipe_b2": 0.9},
                    }
                }
            )
        }
    )
    assert calibrate(probed, [rep], ["r.json"]).meta.model_dump()["probes"] == {"ran": True}
    # the calibrated profile predicts the measured op times of the run it was fitted to
    tl = simulate(CostTables.from_profile(cal), OPS, 2)
    for s in range(2):
        assert [sp.end - sp.start for sp in tl.spans[s]] == pytest.approx([op[3] for op in rep["ops"][s]])


def test_split_backwards_move_with_the_backward_and_w_reports_are_read():
    """A profile with the B/W split: its parts scale with the backward's ratio; a run with W ops
    (whose B ops are input gradients) is checked against the split and adds no backward ratio."""
    split = two_stage_profile()
    split = split.model_copy(
        update={
            "stages": [
                st.model_copy(
                    update={
                        "backward_input_ms": [0.6 * v for v in st.backward_ms],
                        "backward_weight_ms": [0.4 * v for v in st.backward_ms],
                    }
                )
                for st in split.stages
            ]
        }
    )
    cal = calibrate(split, [_report(split, OPS, [{"F": 1.0, "B": 1.5}, {"F": 1.0, "B": 1.0}])], ["r.json"])
    assert cal.stages[0].backward_input_ms == pytest.approx(
        [1.5 * 0.6 * v for v in split.stages[0].backward_ms]
    )
    assert cal.stages[0].backward_weight_ms == pytest.approx(
        [1.5 * 0.4 * v for v in split.stages[0].backward_ms]
    )
    with_w = [OPS[0], [("F", 0, 2), ("B", 0, 2), ("W", 0, 2)]]
    cal = calibrate(
        split, [_report(split, with_w, [{"F": 1.0, "B": 1.0}, {"F": 1.0, "B": 2.0, "W": 2.0}])], ["w.json"]
    )
    assert cal.stages[1].backward_ms == pytest.approx(split.stages[1].backward_ms)
    # a stage with W ops whose B was predicted as the whole backward: not this profile's run
    rep = _report(split, with_w, [{"F": 1.0, "B": 1.0, "W": 1.0}] * 2)
    rep["ops"][1][1][4] = split.stages[1].backward_ms[1]
    with pytest.raises(UmoptError, match="was not measured against this profile"):
        calibrate(split, [rep], ["x.json"])


def test_what_the_op_times_miss_becomes_a_step_overhead():
    # three runs of the same op lists cannot tell a cost per op from one per iteration: it all
    # goes to the iteration, the least-squares value of the relative residuals
    prof = two_stage_profile()
    rep = _report(prof, OPS, [{"F": 1.2, "B": 0.9}] * 2)
    cal0 = calibrate(prof, [rep], ["r.json"])  # op times scaled; its overhead undone below
    op_only = cal0.model_copy(
        update={
            "stages": [
                a.model_copy(update={"optimizer_ms": b.optimizer_ms})
                for a, b in zip(cal0.stages, prof.stages)
            ]
        }
    )
    op_scaled = simulate(CostTables.from_profile(op_only), OPS, 2).iteration_ms
    extra = np.array([2.0, 3.0, 8.0])
    others = [dict(rep, measured_iteration_ms=op_scaled + e) for e in extra]
    cal = calibrate(prof, others, ["a.json", "b.json", "c.json"])
    w = 1 / (op_scaled + extra) ** 2
    step = float((w * extra).sum() / w.sum())
    assert cal.meta.model_dump()["calibration"]["step_overhead_ms"] == pytest.approx(step, abs=1e-4)
    assert cal.meta.model_dump()["calibration"]["op_overhead_ms"] == 0.0
    assert [st.optimizer_ms for st in cal.stages] == pytest.approx(
        [st.optimizer_ms + step for st in prof.stages], abs=1e-4
    )


def _runs_measured_as(prof, truth, S: int) -> list[dict]:
    """Reports of equal and unequal schedules with different numbers of ops, each measured as the
    ``truth`` profile predicts it, its op times as ``prof`` does."""
    reports = []
    for sizes in ([8, 8], [4, 4, 4, 4], [2] * 8, [1] * 16, [3, 5, 8]):
        for order in ("gpipe", "1f1b"):
            ops = Candidate.uniform(sizes, S, order).ops()
            tl = simulate(CostTables.from_profile(prof), ops, 16)
            reports.append(
                {
                    "measured_iteration_ms": simulate(CostTables.from_profile(truth), ops, 16).iteration_ms,
                    "minibatch": 16,
                    "recompute": False,
                    "ops": [
                        [[sp.kind, sp.lo, sp.hi, sp.end - sp.start, sp.end - sp.start] for sp in tl.spans[s]]
                        for s in range(S)
                    ],
                }
            )
    return reports


def test_the_runtime_costs_per_op_and_per_iteration_are_fitted_back():
    """Runs measured as if every op cost 0.3 ms beyond the profile and every iteration 2 ms
    more: the fit finds both, and charges the messages nothing the runs did not show."""
    prof = synthetic_profile(3, max_size=8, seed=4)
    reports = _runs_measured_as(prof, Overheads(0.3, 0.0, 2.0, 0.0).apply(prof), 3)
    fit = calibrate(prof, reports, [f"r{k}" for k in range(len(reports))]).meta.model_dump()["calibration"]
    assert fit["op_overhead_ms"] == pytest.approx(0.3, abs=0.02)
    assert fit["message_overhead_ms"] == pytest.approx(0.0, abs=0.02)
    assert fit["step_overhead_ms"] == pytest.approx(2.0, abs=0.15)
    assert fit["residual_rms"] < 0.005


def test_a_cost_per_message_is_fitted_where_the_links_bind():
    prof = synthetic_profile(2, max_size=8, seed=4, latency_ms=0.5, bytes_per_ms=2e5)
    reports = _runs_measured_as(prof, Overheads(0.0, 0.6, 0.0, 0.0).apply(prof), 2)
    cal = calibrate(prof, reports, [f"r{k}" for k in range(len(reports))])
    fit = cal.meta.model_dump()["calibration"]
    assert fit["message_overhead_ms"] > 0.3 and fit["residual_rms"] < 0.01
    assert cal.links[0].message_overhead_ms == pytest.approx(fit["message_overhead_ms"], abs=1e-5)


def test_ratios_between_seen_sizes_are_interpolated_in_log_size():
    prof = two_stage_profile(
        sizes=[1, 2, 4],
        stages=[
            {**st, "forward_ms": [1.0, 2.0, 4.0], "backward_ms": [1.0, 2.0, 4.0]}
            for st in two_stage_profile().model_dump()["stages"]
        ],
    )
    ops = [
        [("F", 0, 1), ("F", 1, 5), ("B", 1, 5), ("B", 0, 1)],
        [("F", 0, 1), ("F", 1, 5), ("B", 1, 5), ("B", 0, 1)],
    ]
    tables = CostTables.from_profile(prof)
    tl = simulate(tables, ops, 5)
    rep = {
        "measured_iteration_ms": 1.0,
        "ops": [
            [
                [
                    sp.kind,
                    sp.lo,
                    sp.hi,
                    (1.0 if sp.hi - sp.lo == 1 else 2.0) * (sp.end - sp.start),
                    sp.end - sp.start,
                ]
                for sp in tl.spans[s]
            ]
            for s in range(2)
        ],
    }
    cal = calibrate(prof, [rep], ["r.json"])
    assert cal.stages[0].forward_ms == pytest.approx(
        [1.0, 1.5 * 2.0, 2.0 * 4.0]
    )  # size 2 sits halfway in log size


def test_reports_from_elsewhere_or_malformed_are_refused(profile_file, tmp_path, capsys):
    prof = two_stage_profile()
    rep = _report(prof, OPS, [{"F": 1.0, "B": 1.0}] * 2)
    other = two_stage_profile(stages=[{**st, "forward_ms": [9.0, 9.5]} for st in prof.model_dump()["stages"]])
    with pytest.raises(UmoptError, match="not measured against this profile"):
        calibrate(other, [rep], ["r.json"])
    with pytest.raises(UmoptError, match="no per-op times"):
        calibrate(prof, [{"measured_iteration_ms": 1.0}], ["old.json"])
    varlen = {
        **rep,
        "lengths": {
            "method": "umopt",
            "data": "x",
            "tokens": [10],
            "predicted_step_ms": [1.0],
            "tokens_per_s": 1.0,
            "predicted_tokens_per_s": 1.0,
        },
    }
    with pytest.raises(UmoptError, match="sequences of different lengths"):
        calibrate(prof, [varlen], ["varlen.json"])
    path = profile_file(prof)
    bad = tmp_path / "bad.json"
    broken = json.loads(json.dumps(rep))
    broken["ops"][0][0] = ["F", 0]
    bad.write_text(json.dumps(broken))
    out = tmp_path / "cal.json"
    code, _, err = run_cli(["calibrate", path, str(bad), "-o", str(out)], capsys)
    assert code == 2 and "malformed op entry" in err and not out.exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(rep))
    code, stdout, err = run_cli(["calibrate", path, str(good), "-o", str(out)], capsys)
    assert code == 0, err
    assert out.exists() and "measured / profiled" in stdout
