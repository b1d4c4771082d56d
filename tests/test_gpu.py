"""The CUDA paths on a real GPU (skipped where there is none; bench/gpu_smoke.sh covers more).

On a GPU, gradients are not bit-equal to one process's: kernels are chosen by chunk size, convolutions
may use TF32, reductions atomics. The runtime's gradients match one process's to rtol 1e-3 there.
"""

from __future__ import annotations

import pytest
import torch
from conftest import zoo_sim_profile
from test_runtime import MLP, B, write_schedule

from umopt.measure import ProfileOptions, profile_model
from umopt.run.launch import launch
from umopt.run.options import RunOptions
from umopt.zoo import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

GPU_RTOL = 1e-3


def _reference(device: torch.device) -> dict:
    parts = build_model("mlp", MLP, seed=0)
    model = torch.nn.Sequential(*parts.layers).to(device)
    x, y = parts.make_batch(B, 0)
    (parts.loss(model(x.to(device)), y.to(device)) / B).backward()
    return {"layers." + n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("S", [1, 2])
def test_nccl_run_gradients_match_one_process(tmp_path, S):
    if torch.cuda.device_count() < S:
        pytest.skip(f"needs {S} GPUs")
    prof = zoo_sim_profile(tmp_path / "p.json", "mlp", MLP, [0, 6] if S == 1 else [0, 3, 6])
    path, _ = write_schedule(tmp_path, prof, "1f1b", False, 3)
    launch(
        RunOptions(schedules=[path], backend="nccl", steps=1, warmup=0, save_grads=str(tmp_path / "g")),
        quiet=True,
    )
    got = {}
    for s in range(S):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    want = _reference(torch.device("cuda", 0))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=GPU_RTOL, atol=1e-6)


def test_bfloat16_gpt_profile_counts_the_float32_residual_stream():
    prof = profile_model(
        ProfileOptions(
            model="gpt",
            model_args={"layers": 2, "d_model": 64, "heads": 2, "vocab": 128, "seq_len": 16},
            split=[0, 2, 4],
            sizes=[1, 2],
            device="cuda",
            dtype="bfloat16",
            link_latency_ms=0.01,
            link_gbps=400,
        )
    )
    assert prof.stages[0].output_bytes_per_sample == 16 * 64 * 4
    assert (
        prof.memory_limit_bytes is not None
        and "no --memory-limit given" in prof.meta.model_dump()["memory_limit"]
    )


def test_the_reference_matmul_measures_the_gpu_not_launch_gaps():
    """A few ms of device time, warmed up: two calls on an idle GPU agree within 10%, and the
    first call is not the slowest by lazy loading."""
    from umopt.devices import reference_ms

    device = torch.device("cuda", 0)
    times = [reference_ms(device) for _ in range(5)]
    assert min(times) > 0.2, times  # device work, not a ~2 us launch
    assert max(times) / min(times) < 1.1, times


@pytest.mark.parametrize("S", [2, 3])
def test_a_failing_rank_under_nccl_is_named_with_its_error_at_once(tmp_path, monkeypatch, S):
    """[Note: a failed rank leaves at once]: under NCCL a rank raising in the middle of a step,
    with receives posted, is named with its own error within seconds."""
    import time

    from umopt.run.launch import RunFailed

    if torch.cuda.device_count() < S:
        pytest.skip(f"needs {S} GPUs")
    prof = zoo_sim_profile(tmp_path / "p.json", "mlp", MLP, [0, 3, 6] if S == 2 else [0, 2, 4, 6])
    path, _ = write_schedule(tmp_path, prof, "1f1b", False, 3)
    monkeypatch.setenv("UMOPT_FAULT", "1:1:midstep")  # the last of two, the middle of three
    monkeypatch.setenv("UMOPT_TIMEOUT_S", "300")
    t0 = time.perf_counter()
    with pytest.raises(RunFailed, match="failed: RuntimeError: injected fault in the middle of step 1"):
        launch(RunOptions(schedules=[path], backend="nccl", steps=4, warmup=0), quiet=True)
    assert time.perf_counter() - t0 < 30
