"""Calibration: a profile scaled to what a run measured, per stage, kind and chunk size."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, two_stage_profile
from umopt.calibrate import calibrate
from umopt.costmodel import CostTables, simulate
from umopt.errors import UmoptError


def _report(profile, ops, factor):
    """What `umopt run` would report if every op took `factor[stage][kind]` times its prediction."""
    tables = CostTables.from_profile(profile)
    tl = simulate(tables, ops, 2)
    return {
        "measured_iteration_ms": 1.0,
        "recompute": False,
        "ops": [
            [[sp.kind, sp.lo, sp.hi, factor[s][sp.kind] * (sp.end - sp.start), sp.end - sp.start] for sp in tl.spans[s]]
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
    assert s0.backward_ms == pytest.approx([1.5 * v for v in prof.stages[0].backward_ms])  # size 1 seen, size 2 nearest
    # stage 1 ran only size-2 chunks: their ratio holds for every size
    assert s1.forward_ms == pytest.approx([1.2 * v for v in prof.stages[1].forward_ms])
    assert s1.backward_ms == pytest.approx([0.8 * v for v in prof.stages[1].backward_ms])
    assert cal.meta["calibration"]["ratios"]["stage1.F"] == {"2": 1.2}
    # the calibrated profile predicts the measured op times of the run it was fitted to
    tl = simulate(CostTables.from_profile(cal), OPS, 2)
    for s in range(2):
        assert [sp.end - sp.start for sp in tl.spans[s]] == pytest.approx([op[3] for op in rep["ops"][s]])


def test_what_the_op_times_miss_becomes_a_step_overhead():
    prof = two_stage_profile()
    rep = _report(prof, OPS, [{"F": 1.2, "B": 0.9}] * 2)
    cal0 = calibrate(prof, [rep], ["r.json"])  # op times scaled; its overhead undone below
    op_only = cal0.model_copy(update={"stages": [a.model_copy(update={"optimizer_ms": b.optimizer_ms}) for a, b in zip(cal0.stages, prof.stages)]})
    op_scaled = simulate(CostTables.from_profile(op_only), OPS, 2).iteration_ms
    others = [dict(rep, measured_iteration_ms=op_scaled - 1.0 + extra) for extra in (3.0, 4.0, 9.0)]
    cal = calibrate(prof, others, ["a.json", "b.json", "c.json"])
    assert cal.meta["calibration"]["step_overhead_ms"] == pytest.approx(3.0)  # the median of 2, 3 and 8
    assert [st.optimizer_ms for st in cal.stages] == pytest.approx([st.optimizer_ms + 3.0 for st in prof.stages])
    # so the run in the middle is predicted exactly
    assert simulate(CostTables.from_profile(cal), OPS, 2).iteration_ms == pytest.approx(others[1]["measured_iteration_ms"])


def test_ratios_between_seen_sizes_are_interpolated_in_log_size():
    prof = two_stage_profile(sizes=[1, 2, 4], stages=[
        {**st, "forward_ms": [1.0, 2.0, 4.0], "backward_ms": [1.0, 2.0, 4.0]} for st in two_stage_profile().model_dump()["stages"]
    ])
    ops = [[("F", 0, 1), ("F", 1, 5), ("B", 1, 5), ("B", 0, 1)], [("F", 0, 1), ("F", 1, 5), ("B", 1, 5), ("B", 0, 1)]]
    tables = CostTables.from_profile(prof)
    tl = simulate(tables, ops, 5)
    rep = {"measured_iteration_ms": 1.0, "ops": [
        [[sp.kind, sp.lo, sp.hi, (1.0 if sp.hi - sp.lo == 1 else 2.0) * (sp.end - sp.start), sp.end - sp.start] for sp in tl.spans[s]]
        for s in range(2)
    ]}
    cal = calibrate(prof, [rep], ["r.json"])
    assert cal.stages[0].forward_ms == pytest.approx([1.0, 1.5 * 2.0, 2.0 * 4.0])  # size 2 sits halfway in log size


def test_reports_from_elsewhere_or_malformed_are_refused(profile_file, tmp_path, capsys):
    prof = two_stage_profile()
    rep = _report(prof, OPS, [{"F": 1.0, "B": 1.0}] * 2)
    other = two_stage_profile(stages=[{**st, "forward_ms": [9.0, 9.5]} for st in prof.model_dump()["stages"]])
    with pytest.raises(UmoptError, match="not measured against this profile"):
        calibrate(other, [rep], ["r.json"])
    with pytest.raises(UmoptError, match="no per-op times"):
        calibrate(prof, [{"measured_iteration_ms": 1.0}], ["old.json"])
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
