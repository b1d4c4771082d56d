"""Sequences of different lengths: the samplers, the peers, umopt's planner, the schedule file and
`umopt solve --lengths` (docs/varlen.md). The cost model's side (costs by sample range, every
evaluator equal to the simulator) is tests/test_conformance.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from umopt.cli import main

from umopt.chunks import chunking
from umopt.costmodel import simulate, tables_for_lengths, tables_for_samples
from umopt.errors import UmoptError
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import load_schedule, validate_ops
from umopt.samplers import SAMPLERS, minibatches
from umopt.search.method import Request
from umopt.search.peers import PEERS
from umopt.search.problem import LayoutProblem
from umopt.search.solvers.per_step import plan
from umopt.synthetic import synthetic_token_profile


@pytest.fixture(scope="module")
def profile4():
    return synthetic_token_profile(4)


def test_samplers_are_seeded_and_near_the_published_statistics():
    a = minibatches("chat", 3, 64, seed=5)
    b = minibatches("chat", 3, 64, seed=5)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (minibatches("chat", 1, 64, seed=6)[0] == a[0]).all()
    big = np.concatenate(minibatches("chat", 200, 100, seed=0))
    assert abs(big.mean() / (161 + 338) - 1) < 0.15  # ShareGPT: input 161 + output 338 tokens
    big = np.concatenate(minibatches("instruction", 200, 100, seed=0))
    assert abs(big.mean() / (19 + 58) - 1) < 0.15  # Alpaca
    docs = np.concatenate(minibatches("long-context", 200, 100, seed=0))
    assert abs(np.median(docs) / np.exp(7.68) - 1) < 0.1  # the lognormal's median, mu 7.68
    for name, s in SAMPLERS.items():
        drawn = np.concatenate(minibatches(name, 20, 64, seed=1))
        assert drawn.min() >= 1 and drawn.max() <= s.cap and drawn.dtype.kind == "i"


def test_lengths_from_a_file_wrap_and_bad_files_are_one_line_errors(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("10\n20\n30\n")
    assert [list(m) for m in minibatches(f"file:{f}", 2, 2)] == [[10, 20], [30, 10]]
    f.write_text("10\nabc\n")
    with pytest.raises(UmoptError, match="line 2: 'abc' is not a length"):
        minibatches(f"file:{f}", 1, 2)
    f.write_text("10\n\n20 0\n")  # the line named, blank lines counted
    with pytest.raises(UmoptError, match="line 3: '0' is not a length"):
        minibatches(f"file:{f}", 1, 2)
    f.write_text("[10, 2.5]")
    with pytest.raises(UmoptError, match="item 1: 2.5 is not a length"):
        minibatches(f"file:{f}", 1, 2)
    with pytest.raises(UmoptError):
        minibatches("no-such-sampler", 1, 2)


def _covers(plan_, L) -> None:
    """The plan's samples hold every sequence (once, unless a long one spans packed rows), its
    ops are a valid schedule of them, and its prediction is the simulator's."""
    units = plan_.layout.units
    held = sorted(i for u in units for i in u)
    if plan_.layout.row is None:
        assert held == list(range(len(L)))
    else:
        assert set(held) == set(range(len(L)))
    B = len(units)
    validate_ops(plan_.ops, B, B, False)
    assert plan_.tokens == int(L.sum())
    assert plan_.iteration_ms == pytest.approx(simulate(plan_.tables, plan_.ops, B).iteration_ms, rel=1e-9)


@pytest.mark.parametrize("spec", ["chat", "long-context"])
def test_every_peer_and_umopt_plan_every_sequence_validly(profile4, spec):
    L = minibatches(spec, 1, 32, seed=3)[0]
    for name, peer in PEERS.items():
        p = peer.plan(Request(profile4, L))
        if p is None:  # does not fit the memory limit: padding and packing, on long documents
            assert name in ("pad", "pack", "pack-split") and spec == "long-context"
            continue
        _covers(p, L)
        parts = [[op[2] - op[1] for op in st if op[0] == "F"] for st in p.ops]
        assert all(x == parts[0] for x in parts), f"{name}: the peers run one partition on every stage"
    mine = plan(profile4, L)
    _covers(mine, L)
    limit = profile4.memory_limit_bytes
    assert max(mine.timeline.peak_memory_bytes) <= limit


def test_umopt_beats_padding_twice_on_chat_and_holds_its_own_against_the_peers(profile4):
    """Predicted, one seeded minibatch; the margins are far from the figures (4x and 1.1x in
    bench/varlen.py), so a slower machine's shorter polish cannot flip them."""
    L = minibatches("chat", 1, 64, seed=11)[0]
    mine = plan(profile4, L, budget_ms=200)
    assert mine.tokens_per_s > 2 * PEERS["pad"].plan(Request(profile4, L)).tokens_per_s
    for name in ("pack", "sort-split", "dynapipe", "wlb"):
        assert mine.iteration_ms < PEERS[name].plan(Request(profile4, L)).iteration_ms, name


def test_padding_to_the_longest_is_costed_by_the_padded_fits_and_needs_them(profile4):
    L = np.array([100, 300, 50, 400, 220, 90, 10, 330])
    before = PEERS["pad"].plan(Request(profile4, L)).iteration_ms
    cheaper = profile4.model_copy(deep=True)
    for st in cheaper.stages:
        for fit in (st.tokens["padded"].forward, st.tokens["padded"].backward):
            fit.b_ms *= 0.5
    assert PEERS["pad"].plan(Request(cheaper, L)).iteration_ms < 0.8 * before
    # a model that cannot be padded (its profile has packed costs only) has no padding peer
    packed_only = cheaper.model_copy(deep=True)
    packed_only.lengths.modes = ["packed"]
    assert PEERS["pad"].plan(Request(packed_only, L)) is None
    assert "needs padded chunks" in PEERS["pad"].unavailable(packed_only)
    assert (
        PEERS["pack"].plan(Request(packed_only, L)) is not None
        and PEERS["pack"].unavailable(packed_only) is None
    )


def test_peers_run_1f1b_with_fewer_microbatches_than_stages_as_megatron_does():
    """A long-tailed minibatch packs into a few rows: torch's 1F1B wants one per stage, Megatron's
    runs fewer (each stage warming up min(S - s - 1, M)); the peer is scored at the better."""
    from umopt.search.baselines import gpipe_equal, onef1b_equal
    from umopt.search.problem import Problem

    profile = load_profile("gpt-tokens8-sim")
    gains = []
    for seed in range(6):
        L = minibatches("long-context", 1, 16, seed=seed, cap=profile.lengths.max_length)[0]
        got = PEERS["pack"].plan(Request(profile, L))
        assert got.iteration_ms == pytest.approx(
            simulate(got.tables, got.ops, len(got.layout.units)).iteration_ms
        )
        problem = Problem(got.layout.tables(profile, L), len(got.layout.units))
        torch_only = min(b.iteration_ms for b in (gpipe_equal(problem), onef1b_equal(problem)) if b.candidate)
        assert got.iteration_ms <= torch_only + 1e-9
        gains.append(torch_only / got.iteration_ms)
        if got.knobs["order"] == "1f1b":
            assert got.knobs["microbatches"] < 8  # in these minibatches: fewer rows than stages
    assert max(gains) > 1.03


def test_a_warm_start_that_no_longer_fits_falls_back_to_a_cold_plan(profile4):
    """The last step's knobs (a chunk or two for the whole minibatch) on a minibatch whose long
    sequences cannot share so few chunks within the memory limit."""
    short = np.full(64, 100)
    first = plan(profile4, short)
    first.knobs.update(count=1, ramp="flat", slope=None)
    long = np.full(64, 300)
    long[:8] = 8000
    second = plan(profile4, long, previous=first)
    assert max(second.timeline.peak_memory_bytes) <= profile4.memory_limit_bytes
    assert second.knobs["count"] > 4
    _covers(second, long)


def test_rows_and_padding_cost_as_the_sequences_they_hold(profile4):
    L = np.array([100, 300, 50, 400])
    rows = tables_for_samples(profile4, L, [(0, 1), (2, 3)], row=512)
    alone = tables_for_samples(profile4, L, [(0,), (1,), (2,), (3,)])
    padded = tables_for_samples(profile4, L, [(0,), (1,), (2,), (3,)], pad_to=400)
    # a row of 512 tokens costs more than its sequences alone (its padding), less than 2 x 400 padded
    assert alone.ranged.fwd[1][0, 2] < rows.ranged.fwd[1][0, 1] < padded.ranged.fwd[1][0, 2]
    with pytest.raises(UmoptError):
        tables_for_samples(profile4, L, [(0, 1), (2, 3)])  # several sequences need a row


def _run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code or 0
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_solve_lengths_writes_a_plan_that_show_reads_and_run_needs_a_model_for(tmp_path, capsys):
    sched, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code, out, err = _run(
        [
            "solve",
            "gpt-tokens-sim",
            "-B",
            "32",
            "--lengths",
            "chat",
            "--time-limit",
            "3",
            "-o",
            str(sched),
            "--plot",
            str(png),
        ],
        capsys,
    )
    assert code == 0, err
    for name in ("umopt", "pad", "pack", "sort-split", "dynapipe", "wlb"):
        assert name in out
    # the next step it prints works: a synthetic model runs nowhere, so it says how to profile one
    nxt = " ".join(out.split("next:", 1)[1].split())
    assert "synthetic" in nxt and "umopt profile --model gpt" in nxt and "--lengths 1024" in nxt
    assert png.stat().st_size > 10_000
    s = load_schedule(str(sched))
    assert s.lengths is not None and len(s.lengths.lengths) == 32 and s.minibatch == len(s.lengths.samples)
    assert set(s.baselines) == set(PEERS)
    data = json.loads(sched.read_text())
    assert data["lengths"]["mode"] in ("packed", "padded")
    code, out, err = _run(["show", str(sched)], capsys)
    assert code == 0, err
    # a synthetic profile names no model to build: umopt run says so in one line (the runtime's
    # plays of such plans are tests/test_varlen_run.py's)
    code, out, err = _run(["run", str(sched), "--steps", "1"], capsys)
    assert (
        code == 2
        and "unknown model 'gpt-tokens-sim'" in err
        and "synthetic" in err
        and "Traceback" not in err
    )


def test_solve_lengths_stream_and_its_errors(tmp_path, capsys):
    code, out, err = _run(
        [
            "solve",
            "gpt-tokens-sim",
            "-B",
            "16",
            "--lengths",
            "instruction",
            "--minibatches",
            "3",
            "--time-limit",
            "20",
        ],
        capsys,
    )
    assert code == 0, err
    assert "3/3" in out and "wlb" in out and "plan ms p50" in out and "p95" in out
    bad = [
        (
            ["solve", "gpt-tokens-sim", "-B", "16", "--lengths", "nope", "-o", str(tmp_path / "x.json")],
            "unknown lengths",
        ),
        (
            ["solve", "gpt-sim", "-B", "16", "--lengths", "chat", "-o", str(tmp_path / "x.json")],
            "no costs by tokens",
        ),
        (
            [
                "solve",
                "gpt-tokens-sim",
                "-B",
                "16",
                "--lengths",
                "chat",
                "--minibatches",
                "2",
                "-o",
                str(tmp_path / "x.json"),
            ],
            "writes no files",
        ),
        (
            [
                "solve",
                "gpt-tokens-sim",
                "-B",
                "16",
                "--lengths",
                "chat",
                "--order",
                "gpipe",
                "-o",
                str(tmp_path / "x.json"),
            ],
            "--order",
        ),
        (["solve", "gpt-sim", "-B", "16", "--minibatches", "2", "-o", str(tmp_path / "x.json")], "--lengths"),
    ]
    for argv, words in bad:
        code, out, err = _run(argv, capsys)
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_a_schedule_whose_samples_miss_a_sequence_is_refused(tmp_path, capsys):
    sched = tmp_path / "plan.json"
    _run(
        ["solve", "gpt-tokens-sim", "-B", "8", "--lengths", "chat", "--time-limit", "2", "-o", str(sched)],
        capsys,
    )
    data = json.loads(sched.read_text())
    data["lengths"]["samples"][0] = data["lengths"]["samples"][1]
    sched.write_text(json.dumps(data))
    code, out, err = _run(["show", str(sched)], capsys)
    assert code == 2 and "every sequence" in err


def test_bundled_token_profiles_load():
    for name, S in (("gpt-tokens-sim", 4), ("gpt-tokens8-sim", 8)):
        p = load_profile(name)
        assert p.num_stages == S and p.lengths is not None and p.device.type == "sim"


def test_a_virtual_stage_costs_what_its_layers_do_and_shares_no_link_with_its_rank():
    """Layers carry costs by tokens; a virtual stage sums its layers' (terms add up), a rank's
    chunks together cost what its one-chunk stage does (each op its own fixed part), and two
    virtual stages on one rank (V-shaped) hand off without a message."""
    prof = synthetic_token_profile(2, blocks=4, max_length=4096, layers_per_stage=2)
    L = np.random.default_rng(3).integers(16, 4096, 12)
    one = tables_for_lengths(prof, L, "packed")
    looped = tables_for_lengths(prof, L, "packed", chunks=chunking(prof, 2, "looped"))
    assert looped.ranks == (0, 1, 0, 1) and looped.num_ranks == 2
    lo, hi = np.triu_indices(len(L) + 1, 1)
    for j in range(4):
        for table in ("fwd", "bwd", "bwd_input", "bwd_weight"):
            np.testing.assert_allclose(looped.op_ms(table, j, lo, hi), one.op_ms(table, j // 2, lo, hi) / 2)
    np.testing.assert_allclose(looped.link_ms(1, lo, hi), one.link_ms(0, lo, hi))  # the same activations
    vshape = tables_for_lengths(prof, L, "padded", chunks=chunking(prof, 2, "vshape"))
    assert vshape.ranks == (0, 1, 1, 0) and not vshape.link_ms(1, lo, hi).any()
    layered = prof.model_copy(
        update={"layers": [ly.model_copy(update={"tokens": None}) for ly in prof.layers]}
    )
    with pytest.raises(UmoptError, match="no costs by tokens in packed mode"):
        tables_for_lengths(layered, L, "packed", chunks=chunking(prof, 2, "looped"))


def test_solve_lengths_with_chunks_plans_per_virtual_stage_against_torchs_multi_chunk_schedules(
    tmp_path, capsys
):
    path, sched = tmp_path / "p.json", tmp_path / "plan.json"
    save_profile(synthetic_token_profile(4, blocks=8, max_length=4096, layers_per_stage=2), path)
    argv = ["solve", str(path), "-B", "12", "--lengths", "chat", "--chunks", "2", "--time-limit", "1.5"]
    code, out, err = _run([*argv, "-o", str(sched)], capsys)
    assert code == 0, err
    for row in ("umopt, chunked", "pad, chunked", "pack, chunked", "dynapipe"):
        assert row in out
    s = load_schedule(str(sched))
    assert s.lengths is not None and set(s.baselines) >= set(PEERS) | {"pack, chunked"}
    if s.chunks is not None:  # umopt's multi-chunk plan won: each virtual stage its own chunks
        assert len(s.chunks.ranks) == 8 and all(len(op) == 4 for st in s.stages for op in st.ops)
    # a stream, every count of chunks its layers allow (2 here: 2 layers a stage), each multi-chunk
    # method keeping its first plan's layout: every minibatch planned by every method
    argv = [*argv[:-4], "--chunks", "auto", "--minibatches", "3", "--time-limit", "20"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    rows = {line.split("│")[1].strip().rstrip(" *"): line for line in out.splitlines() if line.count("│") > 3}
    for row in ("umopt", "umopt, chunked", "pad, chunked", "pack, chunked", "pack"):
        assert " 3/3 " in rows[row], out


def _varlen_report(pairs, **kw) -> dict:
    from umopt.formats.report import LengthsRun, RunReport

    lengths = LengthsRun(
        method="umopt", data="test", tokens=[1], predicted_step_ms=[1.0], tokens_per_s=1.0,
        predicted_tokens_per_s=1.0, op_pairs=pairs,
    )  # fmt: skip
    base = dict(stages=2, measured_iteration_ms=10.0, predicted_iteration_ms=10.0, lengths=lengths)
    return RunReport(**(base | kw)).model_dump(mode="json")


def test_calibrate_fits_costs_by_tokens_to_runs_of_sequences(tmp_path, capsys):
    """Ops measured 1.3x their predictions plus 0.4 ms each: the fit finds both, and the calibrated
    profile predicts them (its stages' layers moved alike), with one chunk per rank or several;
    runs it cannot fit from are refused."""
    from umopt.formats.profile import TokenFit

    prof = synthetic_token_profile(2, blocks=2, max_length=48, max_size=16, layers_per_stage=2)
    path = tmp_path / "p.json"
    save_profile(prof, path)
    prof = load_profile(path)
    T = np.array([30, 60, 120, 240, 480])  # a chunk's tokens (one sequence each: squares T**2)

    def op_ms(fit: TokenFit, s: int) -> np.ndarray:
        return fit.a_ms + fit.b_ms * T + fit.c_ms * T**2 + fit.d_ms + prof.stages[s].op_overhead_ms

    pairs = [
        ("packed", s, kind, float(p), float(1.3 * p + 0.4))
        for s in (0, 1)
        for kind, field in (("F", "forward"), ("B", "backward"))
        for p in op_ms(getattr(prof.stages[s].tokens["packed"], field), s)
    ]
    rep = tmp_path / "r.json"
    rep.write_text(json.dumps(_varlen_report(pairs)))
    code, out, err = _run(["calibrate", str(path), str(rep), "-o", str(tmp_path / "c.json")], capsys)
    assert code == 0, err
    cal = load_profile(tmp_path / "c.json")
    # the runs held packed ops only: padded costs, left as profiled, would win the planner's choice
    # by their error alone; they are dropped
    assert cal.lengths.modes == ["packed"] and all(set(st.tokens) == {"packed"} for st in cal.stages)
    assert "dropped the padded costs" in out
    fits = cal.meta.calibration.tokens
    assert set(fits) == {f"stage{s}.packed.{f}" for s in (0, 1) for f in ("forward", "backward")}
    for f in fits.values():
        assert f["ratio"] == pytest.approx(1.3, rel=1e-3) and f["per_op_ms"] == pytest.approx(0.4, abs=1e-3)
        assert f["rms_after"] < 1e-3 < f["rms_before"]
    for s in (0, 1):
        new, old = cal.stages[s].tokens["packed"].forward, prof.stages[s].tokens["packed"].forward
        np.testing.assert_allclose(op_ms(new, s), 1.3 * op_ms(old, s) + 0.4, rtol=1e-6)
        lo, hi = cal.stages[s].layers
        layers = [cal.layers[i].tokens["packed"].forward for i in range(lo, hi)]
        assert sum(ly.a_ms for ly in layers) == pytest.approx(new.a_ms)
        assert sum(ly.b_ms for ly in layers) == pytest.approx(new.b_ms)
    # several chunks per rank (looped: virtual stage j holds layer j): each layer moves with its
    # virtual stage's fit, and each stage's own fits become its layers' sums
    looped = {"layers": [[j, j + 1] for j in range(4)], "ranks": [0, 1, 0, 1], "placement": "looped"}
    fwd = [prof.layers[j].tokens["packed"].forward for j in range(4)]
    ov = [prof.stages[r].op_overhead_ms for r in looped["ranks"]]
    chunked = [
        ("packed", j, "F", float(p), float(1.3 * p + 0.4))
        for j in range(4)
        for p in op_ms(fwd[j], 0) - prof.stages[0].op_overhead_ms + ov[j]
    ]
    rep.write_text(json.dumps(_varlen_report(chunked, chunks=looped)))
    code, out, err = _run(["calibrate", str(path), str(rep), "-o", str(tmp_path / "c2.json")], capsys)
    assert code == 0, err
    cal = load_profile(tmp_path / "c2.json")
    for j in range(4):
        new = cal.layers[j].tokens["packed"].forward
        np.testing.assert_allclose(
            op_ms(new, 0) - prof.stages[0].op_overhead_ms + ov[j],
            1.3 * (op_ms(fwd[j], 0) - prof.stages[0].op_overhead_ms + ov[j]) + 0.4,
            rtol=1e-6,
        )
    for st in cal.stages:
        lo, hi = st.layers
        assert st.tokens["packed"].forward.b_ms == pytest.approx(
            sum(cal.layers[i].tokens["packed"].forward.b_ms for i in range(lo, hi))
        )
    one_length = tmp_path / "one.json"  # beside a run of sequences: refused, not fitted half
    one_length.write_text(json.dumps(_varlen_report([], lengths=None, ops=[[["F", 0, 1, 1.0, 1.0]]] * 2)))
    other = tmp_path / "other.json"  # ...and so is a run on another layout
    other.write_text(json.dumps(_varlen_report(chunked, chunks=looped)))
    for kw, more, said in (
        ({}, [str(other)], "different layouts"),
        ({"recompute": True}, [], "--recompute"),
        ({}, [str(one_length)], "a run of one length"),
    ):
        rep.write_text(json.dumps(_varlen_report(pairs, **kw)))
        argv = ["calibrate", str(path), str(rep), *more, "-o", str(tmp_path / "x.json")]
        code, _, err = _run(argv, capsys)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.json").exists()


def test_lengths_longer_than_the_profile_costs_are_cut_and_the_cut_is_said(tmp_path, capsys):
    from umopt.samplers import cut_note

    lengths = tmp_path / "L.txt"
    lengths.write_text("500\n40000\n90\n1000\n")
    code, out, err = _run(
        ["solve", "gpt-tokens-sim", "-B", "8", "--lengths", str(lengths), "--recompute", "--time-limit", "2"]
        + ["-o", str(tmp_path / "p.json")],
        capsys,
    )
    assert "2 of 8 of the lengths drawn from file" in err and "up to 40000): each is cut to 32768" in err
    assert "1 of 4 of the lengths in file" in cut_note(f"file:{lengths}", 1000)
    assert "of chat's lengths" in cut_note("chat", 128) and cut_note("chat/16", 1024) is None


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_the_multi_chunk_planner_is_never_slower_than_its_modes_peer_and_its_search_counts(mode, monkeypatch):
    """umopt's multi-chunk plan starts from the peer of its mode on torch's multi-chunk schedules
    (packing's rows, padding's microbatches each padded to their own longest): a search that
    finds only worse keeps that plan, and a search that finds better is the plan. Deterministic:
    the search is bounded by schedules evaluated, not by the clock."""
    import dataclasses

    import umopt.search.solvers.per_step_chunks as chunked
    from umopt.schedules.multichunk import build_ops, equal_genes

    profile = synthetic_token_profile(4, layers_per_stage=2)
    L = minibatches("chat", 1, 12, seed=3, cap=profile.lengths.max_length)[0]
    peer = PEERS["pack" if mode == "packed" else "pad"].plan(Request(profile, L, chunks=(2,)))
    real = chunked.solve_chunks

    def worse(problem, **kw):  # one microbatch per virtual stage: a search that found little
        sol = real(problem, **{**kw, "seconds": 0})
        genes = equal_genes(sol.tables, problem.minibatch, 1)
        ops, ms = build_ops(sol.tables, problem.minibatch, genes)
        return dataclasses.replace(sol, genes=genes, ops=ops, iteration_ms=ms)

    monkeypatch.setattr(chunked, "solve_chunks", worse)
    kept = chunked.plan_chunks(profile, L, 2, mode=mode, budget_ms=1e6, orders=("ends",))
    assert (
        worse(LayoutProblem(profile, len(L), tokens=L, mode=mode), chunk_counts=(2,)).iteration_ms
        > peer.iteration_ms
    )
    assert kept.layout.mode == mode and kept.iteration_ms <= peer.iteration_ms + 1e-9
    monkeypatch.setattr(chunked, "solve_chunks", real)
    searched = chunked.plan_chunks(profile, L, 2, mode=mode, budget_ms=1e6, evaluations=20, orders=("ends",))
    assert searched.layout.mode == mode and searched.iteration_ms < 0.95 * peer.iteration_ms
    assert searched.knobs["placement"] in ("looped", "vshape")  # the search's, not the peer's seed


def test_one_stage_plans_sequences_too():
    """A one-stage profile has no link: its tables were stacked from none (a one-GPU profile
    over lengths could not be planned)."""
    profile = synthetic_token_profile(1)
    L = minibatches("chat", 1, 16, seed=2)[0]
    got = plan(profile, L)
    _covers(got, L)
    assert all(PEERS[name].plan(Request(profile, L)) is not None for name in ("pad", "pack", "dynapipe"))


NEW_PEER = """
from umopt.search.method import Method, Request
from umopt.search.peers.equal import best_shared
from umopt.search.plan import Layout


class Halves(Method):
    name, position = "halves", 7

    def _plan(self, r: Request):
        order = r.lengths.argsort()
        half = len(order) // 2
        return best_shared(self.name, r.profile, r.lengths,
                           [(Layout.of_order(order, "packed"), [[half, len(order) - half]], {})],
                           r.stages, r.recompute, r.dp)
"""


def test_a_new_peer_is_one_class_in_one_file(tmp_path):
    """docs/varlen.md's example: a copy of umopt with one file added to umopt/search/peers/ plans
    with the new peer in ``umopt solve --lengths``'s table and takes it by name, nothing else
    changed."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pkg = tmp_path / "umopt"
    shutil.copytree(root / "umopt", pkg, ignore=shutil.ignore_patterns("__pycache__", "profiles", "cli"))
    shutil.copytree(root / "cli", pkg / "cli", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "profiles", pkg / "profiles", ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "search" / "peers" / "halves.py").write_text(NEW_PEER)
    code = (
        "from umopt.cli import main; from umopt.search.methods import named; "
        "from umopt.formats.profile import load_profile; from umopt.search.method import Request; "
        "p = named('halves').plan(Request(load_profile('gpt-tokens-sim'), [30, 500, 90, 200, 60, 410]));"
        "print('halves plan', p.method, len(p.ops[0]) // 2); "
        f"main(['solve', 'gpt-tokens-sim', '-B', '8', '--lengths', 'chat', '--time-limit', '2', '-o', r'{tmp_path / 's.json'}'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "100"},
        timeout=120,
    )
    assert "halves plan halves 2" in out.stdout, out.stdout + out.stderr
    assert "│ halves " in out.stdout, out.stdout
    assert json.loads((tmp_path / "s.json").read_text())["baselines"]["halves"]["microbatches"] == 2
