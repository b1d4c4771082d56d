"""Mutated profile, schedule and report files fed to solve, show and calibrate in-process: each
ends with success or exit code 2 and one line, never a traceback, never beyond a memory budget."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from conftest import run_cli, two_stage_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umopt.costmodel import CostTables, simulate
from umopt.formats.profile import load_profile
from umopt.formats.schedule import make_schedule, save_schedule

# what one command may allocate (tracemalloc counts numpy's arrays too)
MEMORY_BUDGET = 256 << 20

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30), 10**400]),
    st.sampled_from([0.0, -0.0, 1e-308, 5e-324, 1e308, -1e308, 1e16, 0.5, -2.5]),
    st.text(max_size=5),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(1, 600).map(lambda depth: json.loads("[" * depth + "]" * depth)),
)


def _paths(node, here=()):
    """Every place in a JSON tree: (path, value)."""
    yield here, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, here + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, here + (i,))


@st.composite
def mutated(draw, doc):
    """``doc`` with one to three places replaced by an odd value, deleted, or lists cut/grown."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        places = [p for p, _ in _paths(doc) if p]
        path = draw(st.sampled_from(places))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "replace", "delete", "grow"]))
        if action == "replace" or (action == "delete" and isinstance(parent, list) and len(parent) <= 1):
            parent[key] = draw(ODD_VALUES)
        elif action == "delete":
            del parent[key]
        elif isinstance(parent[key], list):
            parent[key] = parent[key] + parent[key][:1] * draw(st.integers(1, 3))
        else:
            parent[key] = [parent[key]]
    return doc


def _within_budget(argv, capsys):
    tracemalloc.start()
    try:
        code, _, err = run_cli(argv, capsys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BUDGET, f"{argv[0]} took {peak / 2**20:.0f} MiB"
    assert code in (0, 2), err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("umopt: error: "), err
        assert "Traceback" not in err
    return code


def _bundled(name):
    return load_profile(name).model_dump(mode="json")


FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(doc=mutated(_bundled("gpt-sim")), minibatch=st.sampled_from([1, 8, 100, 10**6]))
def test_solve_never_crashes_on_a_mutated_profile(tmp_path, capsys, doc, minibatch):
    path, out = tmp_path / "p.json", tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    out.unlink(missing_ok=True)
    code = _within_budget(
        ["solve", str(path), "-B", str(minibatch), "--solver", "ga", "--time-limit", "0.2", "-o", str(out)],
        capsys,
    )
    assert out.exists() == (code == 0)  # nothing half-written


def _schedule_doc(tmp_path):
    prof = load_profile("gpt-sim")
    from umopt.search.baselines import gpipe_equal
    from umopt.search.solve import make_problem

    problem = make_problem(prof, 8, False)
    cand = gpipe_equal(problem).candidate
    sched = make_schedule(
        prof,
        8,
        False,
        cand.ops(),
        cand.simulate(problem),
        {"name": "equal", "status": "feasible", "seconds": 0.0},
        {},
    )
    save_schedule(sched, tmp_path / "seed.json")
    return json.loads((tmp_path / "seed.json").read_text())


@pytest.fixture(scope="module")
def schedule_doc(tmp_path_factory):
    return _schedule_doc(tmp_path_factory.mktemp("schedule"))


@FUZZ
@given(data=st.data())
def test_show_never_crashes_on_a_mutated_schedule(tmp_path, capsys, schedule_doc, data):
    doc = data.draw(mutated(schedule_doc))
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    _within_budget(["show", str(path), "--profile", "gpt-sim"], capsys)


def _report_doc():
    prof = two_stage_profile()
    ops = [[("F", 0, 1), ("F", 1, 2), ("B", 1, 2), ("B", 0, 1)], [("F", 0, 2), ("B", 0, 2)]]
    tl = simulate(CostTables.from_profile(prof), ops, 2)
    return prof, {
        "measured_iteration_ms": tl.iteration_ms * 1.1,
        "recompute": False,
        "minibatch": 2,
        "ops": [
            [[sp.kind, sp.lo, sp.hi, 1.1 * (sp.end - sp.start), sp.end - sp.start] for sp in tl.spans[s]]
            for s in range(2)
        ],
    }


@FUZZ
@given(data=st.data())
def test_calibrate_never_crashes_on_a_mutated_report(tmp_path, capsys, profile_file, data):
    prof, report = _report_doc()
    doc = data.draw(st.one_of(mutated(report), st.just(report), ODD_VALUES))
    rpath, out = tmp_path / "r.json", tmp_path / "cal.json"
    rpath.write_text(json.dumps(doc))
    out.unlink(missing_ok=True)
    code = _within_budget(["calibrate", profile_file(prof), str(rpath), "-o", str(out)], capsys)
    assert out.exists() == (code == 0)
