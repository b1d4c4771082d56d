"""The profiler on CPU: a complete profile in seconds, memory counted right, balanced stages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_cli as run
from torch import nn

from umopt.devices import numerics
from umopt.errors import UmoptError
from umopt.formats.profile import load_profile
from umopt.measure import (
    ProfiledStage,
    ProfileOptions,
    balanced_split,
    measure_allreduce,
    measure_link,
    profile_model,
    stash_bytes,
)
from umopt.zoo import build_model

FAST_LINK = ["--link-latency-ms", "0.05", "--link-gbps", "10"]


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_small_mlp_profile_is_complete_and_sane(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    code, stdout, err = run(
        [
            "profile",
            "--model",
            "mlp",
            "--model-arg",
            "layers=4",
            "--stages",
            "2",
            "--max-size",
            "8",
            "--split-backward",
            *FAST_LINK,
            "-o",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    prof = load_profile(str(out))
    assert prof.sizes == [1, 2, 4, 8] and prof.num_stages == 2
    assert prof.device.type == "cpu" and prof.model.name == "mlp" and prof.model.args == {"layers": 4}
    assert prof.device.numerics == numerics()  # the TF32 / cuDNN settings it was timed under
    for st in prof.stages:
        assert all(x > 0 for x in st.forward_ms + st.backward_ms)
        assert st.stash_bytes_per_sample > 0 and st.static_bytes > 0 and st.optimizer_ms > 0
    # what stage 0 sends is what stage 1 receives: a 256-wide float32 activation
    assert prof.stages[0].output_bytes_per_sample == prof.stages[1].input_bytes_per_sample == 256 * 4
    assert prof.stages[0].input_bytes_per_sample == 64 * 4
    # the backward split as W ops run it: on stage 0 no input needs a gradient, so the weight
    # part is all of it; on stage 1 both parts do work
    first, second = prof.stages
    assert len(first.backward_input_ms) == len(first.backward_weight_ms) == len(prof.sizes)
    assert all(i < w for i, w in zip(first.backward_input_ms, first.backward_weight_ms))
    assert all(i > 0 and w > 0 for i, w in zip(second.backward_input_ms, second.backward_weight_ms))
    # the gradients data-parallel replicas would all-reduce: the stage's parameters
    mlp = build_model("mlp", {"layers": 4}, seed=0)
    for st in prof.stages:
        assert st.param_bytes == sum(
            p.numel() * 4 for m in mlp.layers[st.layers[0] : st.layers[1]] for p in m.parameters()
        )
    assert prof.links[0].latency_ms == 0.05 and prof.links[0].bytes_per_ms == pytest.approx(10e9 / 8 / 1e3)
    meta = prof.meta.model_dump()
    assert meta["torch"] == torch.__version__ and "umopt profile" in meta["command"] and meta["date"]
    # every entry keeps its spread, the curves never fall with the chunk size, and the profile
    # ends fitted to probe runs of the runtime (a core per stage here)
    for st in prof.stages:
        assert len(st.forward_iqr_ms) == len(prof.sizes) and all(q >= 0 for q in st.backward_iqr_ms)
        assert all(a <= b for a, b in zip(st.forward_ms, st.forward_ms[1:])) and all(
            a <= b for a, b in zip(st.backward_ms, st.backward_ms[1:])
        )
    assert 0 <= meta["noise"]["median_spread"] <= meta["noise"]["p90_spread"]
    assert meta["probes"]["ran"] and meta["probes"]["schedules"] >= 2
    # what the fit leaves, run by run and per order, and what the profile said of the machine
    left = meta["probes"]["measured_over_fitted"]
    assert len(left) == meta["probes"]["schedules"] and all(v > 0 for v in left.values())
    assert set(meta["probes"]["order_ratio"]) == {"gpipe", "1f1b"}
    assert len(meta["noise"]["drift"]) == len(meta["noise"]["reference_ms"]) == prof.num_stages
    assert meta["calibration"]["residual_rms"] >= 0 and prof.stages[0].op_overhead_ms == pytest.approx(
        meta["calibration"]["op_overhead_ms"], abs=1e-5
    )
    assert "fitted to" in stdout and "probe runs of the runtime" in stdout
    # and it is usable straight away
    code, _, err = run(
        ["solve", str(out), "-B", "16", "--time-limit", "1", "-o", str(tmp_path / "s.json")], capsys
    )
    assert code == 0, err


def test_stash_bytes_match_an_analytic_count_for_linear_relu():
    # Linear saves its input, ReLU its output, and the next Linear reuses that very tensor:
    # per sample, the stage input plus one activation per ReLU (float32), no parameters.
    widths = [24, 40, 56, 8]
    layers = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
    stage = ProfiledStage(layers)
    per_sample = 4 * (widths[0] + sum(widths[1:]))
    for n in (1, 3, 7):
        x = torch.randn(n, widths[0], requires_grad=True)
        assert stash_bytes(stage, x) == n * per_sample


def test_balanced_split_minimises_the_slowest_stage():
    times = [1, 1, 1, 1, 10, 1, 1, 1]
    cuts = balanced_split(times, 3)
    assert cuts[0] == 0 and cuts[-1] == 8
    worst = max(sum(times[a:b]) for a, b in zip(cuts, cuts[1:]))
    assert worst == 10
    with pytest.raises(UmoptError, match="3 stages asked for a model of 2 layers"):
        balanced_split([1, 1], 3)


def test_balanced_split_beats_equal_layers_on_an_uneven_user_model():
    prof = profile_model(
        ProfileOptions(
            model="userzoo:uneven", stages=2, max_size=8, link_latency_ms=0.0, link_gbps=1.0, repeats=5
        )
    )
    layer_ms = prof.layer_ms
    assert len(layer_ms) == 5
    assert np.argmax(layer_ms) == 1  # the heavy layer was measured as the heavy one

    def worst(cuts):
        return max(sum(layer_ms[a:b]) for a, b in zip(cuts, cuts[1:]))

    balanced = prof.split
    naive = [0, 3, 5]  # equal layer counts, rounded up front
    assert worst(balanced) < worst(naive)


def test_user_factory_by_import_path():
    parts = build_model("userzoo:uneven", {"width": 8})
    x, y = parts.make_batch(3, 0)
    h = x
    for layer in parts.layers:
        h = layer(h)
    assert h.shape == (3, 4) and parts.loss(h, y).ndim == 0


def test_given_split_is_used(tmp_path):
    prof = profile_model(
        ProfileOptions(model="mlp", split=[0, 1, 4], max_size=2, link_latency_ms=0.1, link_gbps=1.0)
    )
    assert [st.layers for st in prof.stages] == [[0, 1], [1, 4]]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model", "resnet9000", "--stages", "2"], "unknown model 'resnet9000'"),
        (["--model", "mlp", "--stages", "2", "--sizes", "2,4"], "--sizes must start at 1"),
        (["--model", "mlp", "--stages", "2", "--sizes", "1,4,2"], "--sizes must be strictly ascending"),
        (["--model", "mlp", "--stages", "9"], "--stages 9: more stages than the model mlp has layers (4)"),
        (
            ["--model", "mlp", "--stages", "2", "--device", "cuda"],
            "--device cuda asked for, but torch sees no CUDA device",
        ),
        (["--model", "no_such_module:factory", "--stages", "2"], "cannot import it"),
        (
            ["--model", "userzoo:broken", "--stages", "2"],
            "the factory must return (layers, make_batch, loss)",
        ),
        (["--model", "mlp", "--model-arg", "depth", "--stages", "2"], "expected key=value"),
        (["--model", "mlp", "--model-arg", "depth=3", "--stages", "2"], "bad arguments"),
        (["--model", "mlp", "--split", "0,2,9"], "--split must rise strictly from 0 to the model's 4 layers"),
        (["--model", "mlp"], "give --stages S or --split"),
        (["--model", "mlp", "--stages", "2", "--lengths", "64"], "does not say how it takes sequences"),
        (
            ["--model", "gpt", "--stages", "2", "--lengths", "64", "--length-modes", "rows"],
            "'rows' is not one of",
        ),
        (
            ["--model", "mlp", "--stages", "2", "--link-gbps", "10"],
            "give both --link-latency-ms and --link-gbps",
        ),
    ],
)
def test_bad_profile_arguments(args, expected, tmp_path, capsys):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "p.json"
    code, _, err = run(["profile", *args, "-o", str(out)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert expected in line and "Traceback" not in err
    assert not out.exists()


def test_link_ping_pong_over_gloo():
    latency, bytes_per_ms = measure_link("gloo", max_bytes=1 << 20, reps=5)
    assert 0 <= latency < 50
    assert bytes_per_ms > 1e4  # at least 10 MB/s between two local processes


def test_links_sharing_no_device_are_measured_at_once(monkeypatch):
    """Three links of a 4-GPU pipeline: (0,1) and (2,3) share no device and run in one round,
    (1,2) in a second; every pair gets its own fit."""
    import torch.multiprocessing as mp

    import umopt.measure.links as profiler

    rounds, real = [], mp.start_processes

    def start(fn, args, nprocs, start_method, join):
        rounds.append(args[4])
        return real(fn, args=args, nprocs=nprocs, start_method=start_method, join=join)

    monkeypatch.setattr(mp, "start_processes", start)
    got = profiler.measure_links("gloo", [(0, 1), (1, 2), (2, 3)], max_bytes=1 << 16, reps=2)
    assert rounds == [(0, 1), (2, 3), (1, 2)] and set(got) == {(0, 1), (1, 2), (2, 3)}
    assert all(lat >= 0 and bpm > 0 for lat, bpm in got.values())


def test_allreduce_among_gloo_processes():
    latency, bus = measure_allreduce("gloo", 2, max_bytes=1 << 20, reps=3)
    assert 0 <= latency < 50
    assert bus > 1e4  # at least 10 MB/s between two local processes


def test_float16_is_refused_for_training_with_the_way_out(tmp_path, capsys):
    """No loss scaling in the runtime: float16 would flush small gradients to zero, silently."""
    out = tmp_path / "p.json"
    code, _, err = run(
        ["profile", "--model", "mlp", "--stages", "2", "--dtype", "float16", *FAST_LINK, "-o", str(out)],
        capsys,
    )
    (line,) = err.strip().splitlines()
    assert (
        code == 2
        and "float16 training needs loss scaling" in line
        and "bfloat16" in line
        and not out.exists()
    )


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_profile_stages_in_a_script_without_a_main_guard_says_what_to_add(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, umopt\nfrom torch import nn\nfrom umopt.errors import UmoptError\n"
        "try:\n    umopt.profile_stages([nn.Linear(4, 4), nn.Linear(4, 1)], (torch.randn(8, 4), torch.randn(8, 1)), nn.MSELoss(), sizes=[1, 2])\n"
        "except UmoptError as e:\n    print('umopt:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert 'put its code under `if __name__ == "__main__":`' in done.stdout, done.stdout + done.stderr[-2000:]
