"""The device logic of the profiler and the runtime, exercised without a GPU.

Layers on the meta device stand in for a GPU (a CPU tensor pushed through them raises just as on
CUDA), CPU autocast in bfloat16 for mixed precision, and monkeypatched torch.cuda for the checks
that depend on how many GPUs there are.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli, zoo_sim_profile
from test_runtime import MLP, B, write_schedule

from umopt import devices
from umopt.errors import UmoptError
from umopt.measure import ProfileOptions, check_profile_options, link_plan, pingpong_sizes, profile_model
from umopt.run.launch import launch
from umopt.run.options import RunOptions
from umopt.run.rank import build_stage, init_distributed
from umopt.zoo import build_model

GPT = {"layers": 2, "d_model": 32, "heads": 2, "vocab": 64, "seq_len": 8}


def test_stage_set_up_runs_on_the_stage_device(tmp_path):
    """A rank's stage and its edge shapes are worked out on its own device: nothing from the CPU
    is pushed through layers that live elsewhere (meta here, a GPU in a run)."""
    meta = torch.device("meta")
    gpt = zoo_sim_profile(tmp_path / "gpt.json", "gpt", GPT, [0, 2, 4])
    for s in (0, 1):
        setup = build_stage(gpt, s, meta)
        assert all(p.device == meta for p in setup.module.parameters())
        assert setup.input == (
            devices.TensorSpec((8,), torch.int64) if s == 0 else devices.TensorSpec((8, 32), torch.float32)
        )
        assert setup.output == (
            devices.TensorSpec((8, 32), torch.float32)
            if s == 0
            else devices.TensorSpec((8, 64), torch.float32)
        )
    mlp = zoo_sim_profile(tmp_path / "mlp.json", "mlp", MLP, [0, 2, 4, 6])
    setup = build_stage(mlp, 2, meta)
    assert setup.input.shape == (MLP["width"],) and setup.output.shape == (MLP["num_classes"],)
    assert list(dict(setup.module.named_parameters())) == [
        "layers.4.0.weight",
        "layers.4.0.bias",
        "layers.5.weight",
        "layers.5.bias",
    ]


def test_edges_carry_the_dtype_autocast_produces(tmp_path):
    """Under bfloat16 autocast an MLP sends bfloat16, a GPT's residual stream stays float32."""
    cpu = torch.device("cpu")
    mlp = zoo_sim_profile(tmp_path / "mlp.json", "mlp", MLP, [0, 3, 6], dtype="bfloat16")
    assert build_stage(mlp, 0, cpu).output == devices.TensorSpec((MLP["width"],), torch.bfloat16)
    assert build_stage(mlp, 1, cpu).input == devices.TensorSpec((MLP["width"],), torch.bfloat16)
    gpt = zoo_sim_profile(tmp_path / "gpt.json", "gpt", GPT, [0, 2, 4], dtype="bfloat16")
    assert build_stage(gpt, 0, cpu).output == devices.TensorSpec((8, 32), torch.float32)
    assert build_stage(gpt, 1, cpu).output.dtype == torch.bfloat16  # the LM head's logits


def _grads(tmp_path, S):
    got = {}
    for s in range(S):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    return got


def _one_process_grads(cast: bool) -> dict:
    parts = build_model("mlp", MLP, seed=0)
    model = torch.nn.Sequential(*parts.layers)
    x, y = parts.make_batch(B, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
        loss = parts.loss(model(x), y) / B
    loss.backward()
    return {"layers." + n: p.grad for n, p in model.named_parameters()}


def test_a_bfloat16_profile_runs_under_autocast(tmp_path):
    """The runtime runs a bfloat16 profile in bfloat16: its gradients are one process's under
    the same autocast (to bfloat16's precision; chunks round on their own), not float32's."""
    prof = zoo_sim_profile(tmp_path / "p.json", "mlp", MLP, [0, 3, 6], dtype="bfloat16")
    path, _ = write_schedule(tmp_path, prof, "1f1b", False, 3)
    launch(RunOptions(schedules=[path], steps=1, warmup=0, save_grads=str(tmp_path / "g")), quiet=True)
    got = _grads(tmp_path, 2)

    def rel(want: dict) -> float:
        return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)

    in_bf16, in_fp32 = rel(_one_process_grads(True)), rel(_one_process_grads(False))
    assert in_bf16 < 0.02 and in_fp32 > 5 * in_bf16


def test_the_profiler_counts_link_bytes_in_the_dtype_that_crosses():
    quick = dict(
        sizes=[1, 2],
        repeats=1,
        warmup=0,
        link_latency_ms=0.0,
        link_gbps=1.0,
        dtype="bfloat16",
        concurrent=False,
    )
    gpt = profile_model(ProfileOptions(model="gpt", model_args=GPT, split=[0, 2, 4], **quick))
    assert gpt.stages[0].output_bytes_per_sample == 8 * 32 * 4  # the residual stream: float32
    mlp = profile_model(ProfileOptions(model="mlp", model_args=MLP, split=[0, 3, 6], **quick))
    assert mlp.stages[0].output_bytes_per_sample == MLP["width"] * 2  # a Linear+ReLU: bfloat16


def test_nccl_ranks_set_their_gpu_before_joining(monkeypatch):
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id"))),
    )
    assert init_distributed("nccl", 60) == torch.device("cuda", 3)
    assert calls == [("set_device", torch.device("cuda", 3)), ("init", "nccl", torch.device("cuda", 3))]
    calls.clear()
    assert init_distributed("gloo", 60) == torch.device("cpu")
    assert calls == [("init", "gloo", None)]


def test_only_the_first_and_last_stage_load_data(tmp_path, monkeypatch):
    prof = zoo_sim_profile(tmp_path / "p.json", "mlp", MLP, [0, 2, 4, 6])
    path, _ = write_schedule(tmp_path, prof, "gpipe", False, 4)
    monkeypatch.setenv("UMOPT_DATA_LOG", str(tmp_path / "data"))
    monkeypatch.setenv(
        "PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    launch(RunOptions(schedules=[path], steps=1, warmup=0, data="userzoo:mlp_data"), quiet=True)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["rank0", "rank2"]


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees ``n`` GPUs (nothing may run on them)."""

    def pretend(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return pretend


def test_cuda_profiles_that_cannot_finish_are_refused_before_any_timing(gpus):
    gpus(1)
    opts = dict(model="gpt", model_args=GPT, stages=2, device="cuda")
    with pytest.raises(
        UmoptError, match="one GPU: the links between 2 stages cannot be measured; give --link-latency-ms"
    ):
        check_profile_options(ProfileOptions(**opts))
    given = dict(opts, link_latency_ms=0.01, link_gbps=400.0)
    check_profile_options(ProfileOptions(**given))
    check_profile_options(ProfileOptions(**dict(opts, stages=1)))
    with pytest.raises(
        UmoptError, match="--concurrent on CUDA times each stage on its own GPU: 2 stages, 1 GPUs"
    ):
        check_profile_options(ProfileOptions(**given, concurrent=True))
    gpus(2)
    check_profile_options(ProfileOptions(**opts, concurrent=True))


def test_tune_on_cuda_takes_link_options_and_checks_the_gpus_first(gpus, tmp_path, capsys, monkeypatch):
    import umopt.measure.profile

    gpus(1)
    monkeypatch.setattr(
        umopt.measure.profile, "_profile_model", lambda *a, **k: pytest.fail("timing started")
    )
    out = tmp_path / "t"
    code, _, err = run_cli(["tune", "--device", "cuda", "--out", str(out)], capsys)
    assert code == 2 and "one GPU: the links between 2 stages cannot be measured" in err
    code, _, err = run_cli(
        [
            "tune",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--link-latency-ms",
            "0.01",
            "--link-gbps",
            "400",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert (
        code == 2
        and "umopt tune runs each stage on its own GPU: 2 stages, 1 GPU(s) here (use --stages 1)" in err
    )
    assert not out.exists()


def test_links_are_measured_between_the_gpus_their_stages_use():
    assert link_plan(4, "cuda", 4) == [(0, 1), (1, 2), (2, 3)]
    assert link_plan(4, "cuda", 2) == [(0, 1)] * 3
    assert link_plan(3, "cpu", 0) == [(0, 1)] * 2
    nvlink = pingpong_sizes("nccl", 1 << 20)
    assert nvlink[0] == 1 << 10 and nvlink[-1] >= 256 << 20
    assert pingpong_sizes("gloo", 1 << 20)[-1] == 16 << 20
    assert pingpong_sizes("gloo", 100 << 20)[-1] >= 100 << 20


def test_cuda_profiles_default_to_most_of_the_gpu_memory(monkeypatch):
    class Props:
        name, total_memory = "NVIDIA H200", 140 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    limit, why = devices.default_memory_limit(torch.device("cuda", 0))
    assert limit == int(0.9 * 140 * 2**30)
    assert why == "90% of NVIDIA H200's 140.0 GiB (no --memory-limit given)"


def test_autocast_is_off_in_float32_and_on_the_meta_device():
    x = torch.randn(2, 4)
    lin = torch.nn.Linear(4, 4)
    with devices.autocast(torch.device("cpu"), "bfloat16"):
        assert lin(x).dtype == torch.bfloat16
    with devices.autocast(torch.device("cpu"), "float32"):
        assert lin(x).dtype == torch.float32
    with devices.autocast(torch.device("meta"), "bfloat16"):
        pass
    with pytest.raises(UmoptError, match="dtype must be one of"):
        devices.autocast(torch.device("cpu"), "int8")


def test_a_data_module_in_the_current_folder_is_found_and_more_samples_are_refused(tmp_path, monkeypatch):
    """No PYTHONPATH=. needed for the user's own module; a hook returning more samples than the
    minibatch is an error, not silently cut."""
    from umopt.run.launch import RunFailed

    prof = zoo_sim_profile(tmp_path / "p.json", "mlp", MLP, [0, 3, 6])
    path, _ = write_schedule(tmp_path, prof, "gpipe", False, 4)
    (tmp_path / "mydata.py").write_text(
        "import torch\n"
        "def ok(step, n):\n    return torch.randn(n, 12), torch.randint(0, 5, (n,))\n"
        "def more(step, n):\n    return torch.randn(n + 3, 12), torch.randint(0, 5, (n + 3,))\n"
    )
    monkeypatch.chdir(tmp_path)
    launch(RunOptions(schedules=[path], steps=1, warmup=0, data="mydata:ok"), quiet=True)
    with pytest.raises(
        RunFailed,
        match=r"--data mydata:more returned 15 inputs and 15 targets for step 0; the minibatch is 12",
    ):
        launch(RunOptions(schedules=[path], steps=1, warmup=0, data="mydata:more"), quiet=True)
