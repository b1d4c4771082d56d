"""Costs by tokens measured (``umopt profile --lengths``, umopt/measure/tokens.py): the built-in
gpt packs and pads sequences exactly, the fit recovers what it is given, and a measured profile
is one ``umopt solve --lengths`` plans with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_cli as run

from umopt.formats.profile import load_profile
from umopt.measure.tokens import TokenPoint, fit, grid
from umopt.search.solvers.per_step import plan
from umopt.synthetic import synthetic_token_profile
from umopt.zoo import build_model, pack, pad, run_layers


def test_gpt_packed_and_padded_give_each_sequence_what_it_gets_alone():
    parts = build_model("gpt", {"seq_len": 32, "layers": 2})
    seqs = parts.sequences.make([5, 17, 3, 32], 1)
    with torch.no_grad():
        alone = [run_layers(parts.layers, x[None]) for x, _ in seqs]
        x, y, lengths = pack(seqs)
        packed = run_layers(parts.layers, x, lengths)
        torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
        xp, yp = pad(seqs)
        padded = run_layers(parts.layers, xp)
        for i, (xi, _) in enumerate(seqs):
            torch.testing.assert_close(padded[i, : len(xi)], alone[i][0], rtol=1e-5, atol=1e-5)
        # the summed loss skips the padding: both modes give the same loss
        torch.testing.assert_close(parts.loss(packed, y), parts.loss(padded, yp))


def test_the_fit_recovers_known_costs_and_counts_padding_at_the_longest():
    points = grid(256)
    assert max(sum(p.lengths) for p in points) <= 4 * 256 and len({p.lengths[0] for p in points}) >= 4
    assert TokenPoint((8, 2)).counted("packed") == (10, 68, 2)
    assert TokenPoint((8, 2)).counted("padded") == (16, 128, 2)
    for mode in ("packed", "padded"):
        # a fixed part, per token, per squared length and per sequence (a packed chunk's
        # attention called once per document)
        truth = np.array([0.3, 0.002, 1e-5, 0.05])
        ms = [truth @ [1, *p.counted(mode)] for p in points]
        got = fit(points, ms, mode)
        assert np.allclose([got["a_ms"], got["b_ms"], got["c_ms"], got["d_ms"]], truth, rtol=1e-6)
        assert got["residual"] < 1e-6
    # coefficients never go below zero, even where the times fall with tokens
    got = fit(points, [5.0 / (1 + sum(p.lengths)) for p in points], "packed")
    assert min(got["a_ms"], got["b_ms"], got["c_ms"]) >= 0 and got["residual"] > 0.1


def test_a_measured_length_profile_plans_minibatches(tmp_path, capsys):
    """Profiled layer by layer (``--chunks 2``): each layer's costs by tokens, the stages' their sums."""
    out = tmp_path / "gpt.json"
    args = [
        "--model",
        "gpt",
        "--model-arg",
        "seq_len=64",
        "--model-arg",
        "layers=2",
        "--stages",
        "2",
        "--chunks",
        "2",
    ]
    code, stdout, err = run(
        ["profile", *args, "--max-size", "2", "--repeats", "3", "--no-probes", "--sequential"]
        + ["--link-latency-ms", "0.05", "--link-gbps", "10", "--lengths", "64", "-o", str(out)],
        capsys,
    )
    assert code == 0, err
    assert "costs by tokens (sequences up to 64)" in stdout and "d us/seq" in stdout and "fit error" in stdout
    prof = load_profile(str(out))
    assert prof.lengths.max_length == 64 and prof.lengths.modes == ["packed", "padded"]
    assert len(prof.layers) == 4 and all(
        ly.tokens["packed"].forward.residual is not None for ly in prof.layers
    )
    for s, st in enumerate(prof.stages):
        for mode, c in st.tokens.items():
            layers = [ly.tokens[mode] for ly in prof.layers[st.layers[0] : st.layers[1]]]
            assert c.forward.b_ms == pytest.approx(sum(ly.forward.b_ms for ly in layers))
            assert c.forward.b_ms > 0 and c.backward.b_ms > 0
            assert c.stash_bytes_per_token > 0
            # a token of the boundary: the first stage takes int64 ids, the second a float32 row of 128
            assert c.input_bytes_per_token == (8 if s == 0 else 128 * 4)
            assert c.output_bytes_per_token == (128 * 4 if s == 0 else 0)
    sched = tmp_path / "plan.json"
    code, stdout, err = run(
        ["solve", str(out), "-B", "16", "--lengths", "chat", "--time-limit", "2", "-o", str(sched)], capsys
    )
    assert code == 0, err
    assert sched.exists()


def test_the_planner_pads_where_padding_is_cheaper_and_never_where_it_cannot_be():
    profile = synthetic_token_profile(4)
    L = np.full(32, 256)  # equal lengths: padding wastes nothing
    assert plan(profile, L).knobs["mode"] == "packed"  # the sim's modes cost alike: packed only
    cheaper = profile.model_copy(deep=True)
    for st in cheaper.stages:
        st.tokens["padded"].forward.b_ms *= 0.5
    got = plan(cheaper, L, budget_ms=100)
    assert got.knobs["mode"] == "padded" and got.layout.mode == "padded"
    assert plan(cheaper, L, mode="packed", budget_ms=100).knobs["mode"] == "packed"


def test_work_bytes_per_token_is_measured_the_same_with_gradients_absent_or_present():
    # the first of the two measured sizes allocated every .grad inside its peak, the second only
    # accumulated: the difference went below zero and was clamped to 0 on every stage
    from umopt.measure.chunk import boundaries
    from umopt.measure.timing import probes_of
    from umopt.measure.tokens import _bytes_per_token

    parts = build_model("gpt", {"seq_len": 64, "layers": 2, "d_model": 64, "vocab": 256})
    device = torch.device("cpu")
    bounds = boundaries(parts, device, "float32")
    cuts = [0, 2, 4]  # the embedding and a block; a block and the head
    probes = probes_of(parts, cuts, bounds, device, "float32")
    for mode in ("packed", "padded"):
        absent = _bytes_per_token(probes[0], bounds, 0, 2, mode, 64)
        assert all(p.grad is None for p in probes[0].stage.parameters())
        x, y = probes[0].inputs(3)
        out = probes[0].forward(x, y)
        out.backward(probes[0].output_grad(out))  # gradients present, as in a step that accumulates
        present = _bytes_per_token(probes[0], bounds, 0, 2, mode, 64)
        assert absent["work_bytes_per_token"] > 0
        assert present["work_bytes_per_token"] == pytest.approx(absent["work_bytes_per_token"], rel=0.05)
