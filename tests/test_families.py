"""A schedule family is the seam: one added in one module is searched and reported with no other change.

The toy family here runs every forward, then every backward in sample order (GPipe drains in
reverse). It brings no population evaluator, so it is scored by the simulator, and it is
registered only for the test's length.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from umopt.costmodel import Op, OpKind, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import save_profile
from umopt.schedules.family import FAMILIES, ScheduleFamily, family, parse_order, register, ruled
from umopt.schedules.partition import backwards_in_sample_order, chunks
from umopt.search.problem import pack
from umopt.search.solve import make_problem, solve
from umopt.search.solvers import SOLVERS
from umopt.synthetic import synthetic_profile


class FifoGPipe(ScheduleFamily):
    """Every F in sample order, then every B in sample order."""

    name = "gpipe-fifo"
    backwards_in_sample_order = True

    def __init__(self):
        self.scored = 0  # individuals scored: the GA's search shows here

    def stage_ops(self, fsizes, bsizes, warmup=None):
        return [
            [Op(OpKind.F, lo, hi) for lo, hi in chunks(f)] + [Op(OpKind.B, lo, hi) for lo, hi in chunks(b)]
            for f, b in zip(fsizes, bsizes)
        ]

    def evaluate(self, tables, fsizes, bsizes, warmup, wcap):
        self.scored += fsizes.shape[0]
        return super().evaluate(tables, fsizes, bsizes, warmup, wcap)


@pytest.fixture
def toy():
    fam = register(FifoGPipe())
    yield fam
    del FAMILIES[fam.name]


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile(3, max_size=8, seed=4)


def test_the_simulator_scores_a_family_without_an_evaluator_as_it_plays_its_op_lists(toy, profile):
    problem = make_problem(profile, 8, False, None)
    parts = [[[4, 4]] * 3, [[1, 2, 5]] * 3, [[8], [2, 6], [1, 1, 1, 5]]]
    it, sc = toy.score(problem.tables, pack(parts))
    for k, fs in enumerate(parts):
        tl = simulate(problem.tables, toy.stage_ops(fs, fs), 8)
        assert it[k] == pytest.approx(tl.iteration_ms, abs=1e-9)
        assert list(sc.peak_memory_bytes[k]) == tl.peak_memory_bytes
    assert backwards_in_sample_order(toy.stage_ops(parts[1], parts[1]))


def test_a_registered_family_is_searched_by_the_ga_and_reported_by_the_solve(toy, profile, tmp_path, capsys):
    assert toy in ruled() and parse_order("gpipe-fifo") is toy
    problem = make_problem(profile, 8, False, None)
    # under --order auto it is one of the order gene's values beside GPipe and 1F1B
    SOLVERS["ga"](problem, time_limit=60, seed=0, max_generations=10, polish_kicks=0)
    assert toy.scored > 100
    # asked for alone, it is all the GA returns, and the solve's file and report say so
    report = solve(profile, 8, solver="ga", order="gpipe-fifo", time_limit=1, seed=0)
    block = report.schedule.solver
    assert block.order == "gpipe-fifo"
    found = report.result.candidate
    assert found.order == "gpipe-fifo"
    assert found.ops() == toy.stage_ops(found.fsizes, found.bsizes)
    assert found.iteration_ms <= toy.score(problem.tables, pack([[[8]] * 3]))[0][0] + 1e-9
    # the in-order bound holds for every schedule of a family whose backwards run in sample order
    assert report.schedule.solver.lower_bound_1f1b_ms is not None
    prof = tmp_path / "p.json"
    save_profile(profile, prof)
    out = tmp_path / "s.json"
    argv = ["solve", str(prof), "-B", "8", "--order", "gpipe-fifo", "--solver", "ga", "--time-limit", "1"]
    code, _, err = run_cli([*argv, "-o", str(out)], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["solver"]["order"] == "gpipe-fifo"


def test_orders_are_parsed_once_at_the_edge():
    assert parse_order("auto") is None and parse_order("1f1b") is family("1f1b")
    for bad in ("free", "fifo", ""):
        with pytest.raises(UmoptError, match="--order must be one of auto, gpipe, 1f1b"):
            parse_order(bad)
    with pytest.raises(UmoptError, match="does not model the 1f1b rule"):
        SOLVERS["cpsat"](
            make_problem(synthetic_profile(2, max_size=4), 4, False), time_limit=1, order=family("1f1b")
        )
    assert np.all(family("gpipe").first_wcaps(np.array([2, 3]), 4, 16) == 16)
    assert list(family("1f1b").first_wcaps(np.array([2, 5]), 4, 16)) == [8, 16]
