"""``umopt.Pipeline`` in a user's own script (tests/pipeline_user.py: their modules, MSELoss, AdamW,
their loop), one real process per stage: parameters after three steps equal one process training
the whole minibatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from umopt.costmodel import CostTables, Op, simulate
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import pipeline_user  # noqa: E402

B = pipeline_user.B


def _schedule(tmp_path: Path, fsizes, order: str, recompute: bool, warmup=None, bsizes=None) -> str:
    ops = Candidate(fsizes, bsizes or fsizes, order, warmup=warmup).ops()
    return _save(tmp_path, ops, recompute)


def _save(tmp_path: Path, ops, recompute: bool) -> str:
    """A schedule of these op lists on a synthetic profile of as many stages, both written to tmp_path."""
    tmp_path.mkdir(exist_ok=True)
    save_profile(synthetic_profile(len(ops), max_size=8, seed=3), tmp_path / "profile.json")
    prof = load_profile(tmp_path / "profile.json")
    tl = simulate(CostTables.from_profile(prof, recompute), ops, B)
    sched = make_schedule(
        prof, B, recompute, ops, tl, {"name": "test", "status": "feasible", "seconds": 0.0}, {}
    )
    path = tmp_path / "schedule.json"
    save_schedule(sched, str(path))
    return str(path)


def _run(
    tmp_path: Path, case: str, schedule: str, steps: int = 3, extra: tuple = (), ranks: int = 2
) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "pipeline_user.py"),
                case,
                schedule,
                *extra,
                str(tmp_path / "store"),
                str(out),
                str(steps),
            ],
            env=dict(os.environ, RANK=str(r), OMP_NUM_THREADS="1"),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    return [torch.load(out / f"stage{r}.pt", weights_only=True) for r in range(ranks)]


def _threads(case: str, schedule: str, steps: int = 3, ranks: int = 2) -> list[dict]:
    """The same user loop (pipeline_user.train), each rank a thread over tests/lazycomm.py's model
    of NCCL's transport: what the real processes above check, in a fraction of their time."""
    from lazycomm import World

    stages = pipeline_user.model(case)  # (built here: torch's seed is the process's)
    return World(ranks).run(
        lambda comm: pipeline_user.train(case, stages[comm.rank], comm.rank, ranks, schedule, steps, comm)
    )


def test_each_link_has_a_process_group_of_its_own(tmp_path):
    """[Note: one process group per link]: on three stages every message (and the boundary-shape
    exchange) goes through the group of exactly its two ranks, so the middle stage's two links
    are two communicators; and training still equals one process."""
    schedule = _schedule(tmp_path, [[3, 5, 4], [6, 6], [2, 4, 6]], "1f1b", False)
    got = _run(tmp_path, "mlp3", schedule, steps=2, ranks=3)
    for rank, state in enumerate(got):
        used = state.pop("groups_used")
        assert used and all(ranks == sorted([rank, peer]) for peer, ranks in used), used
        assert {peer for peer, _ in used} == {r for r in (rank - 1, rank + 1) if 0 <= r < 3}
    for g, w in zip(got, pipeline_user.reference("mlp3", steps=2)):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "via,case,fsizes,order,recompute,warmup,bsizes",
    [
        ("processes", "mlp", [[3, 5, 4], [6, 6]], "gpipe", False, None, None),
        (
            "threads",
            "mlp",
            [[2, 2, 8], [1, 4, 7]],
            "1f1b",
            False,
            [3, 0],
            None,
        ),  # unequal, per-stage warm-ups
        (
            "threads",
            "mlp",
            [[4, 8], [5, 7]],
            "1f1b",
            True,
            None,
            [[6, 6], [2, 3, 7]],
        ),  # recompute: B chunks of their own
        (
            "processes",
            "tuple",
            [[5, 7], [3, 3, 6]],
            "1f1b",
            False,
            None,
            None,
        ),  # a float and an integer tensor cross
        ("threads", "tuple", [[6, 6], [8, 4]], "gpipe", True, None, [[4, 8], [1, 11 - 3, 3]]),
    ],
)
def test_a_users_loop_trains_as_one_process(tmp_path, via, case, fsizes, order, recompute, warmup, bsizes):
    """A process per stage over gloo, or (the same loop) a thread per stage over the model of NCCL."""
    schedule = _schedule(tmp_path, fsizes, order, recompute, warmup, bsizes)
    got = _run(tmp_path, case, schedule) if via == "processes" else _threads(case, schedule)
    want = pipeline_user.reference(case, steps=3)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


def _with_w(ops, rng, max_size: int = 8):
    """The op lists with each stage's backward split: W ops of one or two consecutive B chunks,
    each at a random place after its B ops."""
    from umopt.costmodel import Op

    out = []
    for st in ops:
        bs = sorted((lo, hi) for kind, lo, hi in st if kind == "B")
        new = list(st)
        i = 0
        while i < len(bs):
            n = 2 if i + 1 < len(bs) and bs[i + 1][1] - bs[i][0] <= max_size and rng.random() < 0.5 else 1
            group = bs[i : i + n]
            after = max(new.index(Op("B", lo, hi)) for lo, hi in group)
            new.insert(int(rng.integers(after + 1, len(new) + 1)), Op("W", group[0][0], group[-1][1]))
            i += n
        out.append(new)
    return out


@pytest.mark.parametrize(
    "case,fsizes,order,recompute,warmup,bsizes,seed",
    [
        ("mlp", [[2, 2, 8], [1, 4, 7]], "1f1b", False, [3, 0], None, 0),
        ("mlp", [[3, 5, 4], [6, 6]], "gpipe", False, None, None, 1),
        (
            "mlp",
            [[4, 8], [5, 7]],
            "1f1b",
            True,
            None,
            [[6, 6], [2, 3, 7]],
            2,
        ),  # recompute, then the weights later
        ("tuple", [[5, 7], [3, 3, 6]], "1f1b", False, None, None, 3),
    ],
)
def test_weight_gradients_split_off_into_w_ops_train_as_one_process(
    tmp_path, case, fsizes, order, recompute, warmup, bsizes, seed
):
    """Zero-bubble ops: B computes the input gradient (sent on at once), W the weight gradient
    later, W ops spanning one or two B chunks at random places after them."""
    import numpy as np

    prof = synthetic_profile(2, max_size=8, seed=3)
    tmp_path.mkdir(exist_ok=True)
    save_profile(prof, tmp_path / "profile.json")
    prof = load_profile(tmp_path / "profile.json")
    ops = _with_w(
        Candidate(fsizes, bsizes or fsizes, order, warmup=warmup).ops(), np.random.default_rng(seed)
    )
    tl = simulate(CostTables.from_profile(prof, recompute), ops, B)
    save_schedule(
        make_schedule(
            prof, B, recompute, ops, tl, {"name": "test", "status": "feasible", "seconds": 0.0}, {}
        ),
        str(tmp_path / "schedule.json"),
    )
    path = str(tmp_path / "schedule.json")
    got = (
        _run(tmp_path, case, path) if seed == 0 else _threads(case, path)
    )  # one in processes, the rest in threads
    want = pipeline_user.reference(case, steps=3)
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


def test_a_users_own_stages_profiled_solved_and_trained(tmp_path):
    from torch import nn

    import umopt
    from umopt.formats.schedule import save_schedule as save
    from umopt.search.solve import solve

    x, y = pipeline_user.batch(0)
    prof = umopt.profile_stages(
        pipeline_user.model("mlp"),
        (x, y),
        nn.MSELoss(),
        sizes=[1, 2, 4, 8],
        repeats=2,
        link_latency_ms=0.05,
        link_gbps=10,
    )
    assert prof.num_stages == 2 and prof.model.name == "user" and prof.sizes == [1, 2, 4, 8]
    assert (
        prof.stages[0].output_bytes_per_sample == prof.stages[1].input_bytes_per_sample == pipeline_user.D * 4
    )
    assert all(v > 0 for st in prof.stages for v in st.forward_ms + st.backward_ms)
    assert prof.meta.model_dump()["probes"]["ran"] is False
    save_profile(prof, tmp_path / "profile.json")
    report = solve(load_profile(tmp_path / "profile.json"), B, time_limit=1.0)
    save(report.schedule, str(tmp_path / "schedule.json"))
    got = _run(tmp_path, "mlp", str(tmp_path / "schedule.json"))
    want = pipeline_user.reference("mlp", steps=3)
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_an_exported_schedule_runs_on_torchs_runtime_as_one_process(tmp_path, capsys):
    from conftest import run_cli

    # equal chunks, umopt's own warm-ups (stage 0 runs three forwards first, torch's 1F1B one)
    schedule = _schedule(tmp_path, [[4, 4, 4], [4, 4, 4]], "1f1b", False, warmup=[3, 0])
    plan = tmp_path / "plan.csv"
    code, _, err = run_cli(["export", schedule, "--format", "torch-csv", "-o", str(plan)], capsys)
    assert code == 0, err
    assert plan.read_text().splitlines() == ["0F0,0F1,0F2,0B0,0B1,0B2", "1F0,1B0,1F1,1B1,1F2,1B2"]
    got = _run(tmp_path, "torch", str(plan), extra=("3",))
    want = pipeline_user.reference("mlp", steps=3)
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)
    # zero bubble: B as torch's I, W ops deferred on stage 0, its last two as one W op over two microbatches
    ops = Candidate([[4, 4, 4]] * 2, [[4, 4, 4]] * 2, "1f1b", wcap=[8, 0]).ops()
    ops[0] = [op for op in ops[0] if op.kind != "W" or op.lo == 0] + [Op("W", 4, 12)]
    plan = tmp_path / "zb" / "plan.csv"
    code, _, err = run_cli(
        ["export", _save(tmp_path / "zb", ops, False), "--format", "torch-csv", "-o", str(plan)], capsys
    )
    assert code == 0, err
    assert plan.read_text().splitlines() == [
        "0F0,0F1,0I0,0W0,0F2,0I1,0I2,0W1,0W2",
        "1F0,1I0,1W0,1F1,1I1,1W1,1F2,1I2,1W2",
    ]
    got = _run(tmp_path / "zb", "torch", str(plan), extra=("3",))
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)
    for bad, why in (
        (
            _schedule(tmp_path / "a", [[3, 5, 4], [3, 5, 4]], "gpipe", False),
            "torch splits the minibatch into equal microbatches",
        ),
        (
            _schedule(tmp_path / "b", [[4, 4, 4], [6, 6]], "gpipe", False),
            "stage 1 splits the minibatch as [6, 6]",
        ),
        (_schedule(tmp_path / "c", [[4, 4, 4], [4, 4, 4]], "gpipe", True), "cannot recompute"),
    ):
        code, _, err = run_cli(["export", bad, "-o", str(tmp_path / "x.csv")], capsys)
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("loss", ["ignore", "weight", "smooth"])
@pytest.mark.parametrize(
    "fsizes,order,recompute,bsizes,with_w",
    [
        ([[3, 5, 4], [3, 8, 1]], "gpipe", False, None, False),  # [0, 3): every target ignored
        ([[3, 2, 7], [1, 2, 8, 1]], "1f1b", False, None, False),
        ([[3, 8, 1], [4, 8]], "1f1b", True, [[5, 7], [3, 3, 6]], False),
        ([[3, 5, 4], [3, 4, 5]], "1f1b", False, None, True),
    ],
    ids=["gpipe", "1f1b", "recompute", "w"],
)
def test_token_normalized_losses_train_and_evaluate_as_one_process(
    tmp_path, loss, fsizes, order, recompute, bsizes, with_w
):
    """nn.CrossEntropyLoss with ignored targets (a chunk of them all ignored), class weights and
    label smoothing, passed as it is: parameters after two steps and eval_step's loss equal one
    process's (rtol 1e-5). Weighting each chunk by its share of samples gave 5-210% errors."""
    import numpy as np

    ops = Candidate(fsizes, bsizes or fsizes, order).ops()
    if with_w:
        ops = _with_w(ops, np.random.default_rng(5))
    path = _save(tmp_path, ops, recompute)
    # one case in processes over gloo, the others in threads over the model of NCCL's transport
    real = loss == "ignore" and order == "gpipe"
    got = (
        _run(tmp_path, f"tokens-{loss}", path, steps=2) if real else _threads(f"tokens-{loss}", path, steps=2)
    )
    want = pipeline_user.reference(f"tokens-{loss}", steps=2)
    torch.testing.assert_close(got[1].pop("eval_loss"), want[2]["eval_loss"], rtol=1e-5, atol=1e-7)
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


def test_a_step_that_fails_on_one_rank_fails_every_rank_at_once(tmp_path):
    """[Note: a failed step breaks the pipeline]: the user catches the last stage's error and
    steps on; stage 0, waiting for gradients, is told within seconds which stage failed and why,
    and every later step on both ranks raises a one-line error instead of hanging."""
    got = _run(tmp_path, "catch", _schedule(tmp_path, [[4, 4, 4], [6, 6]], "1f1b", False), steps=3)
    first, last = got[0]["said"], got[1]["said"]
    assert last[0] == "ValueError: a bad batch" and "stage 1 failed: ValueError: a bad batch" in first[0]
    for said in (first, last):
        assert len(said) == 2 and said[1].startswith(
            "PipelineBroken: this pipeline cannot step again: stage 1 failed: ValueError"
        )
    assert max(g["seconds"] for g in got) < 30  # (seconds; waiting for a lost peer: never)


def test_batchnorm_is_warned_of_and_shape_learning_leaves_its_statistics_alone(tmp_path, caplog):
    """One rank, one stage: the sample forward that learns the output shape runs in eval mode
    with the buffers put back (a batch of one through BatchNorm1d in training would fail), the
    module is warned of (strict= refuses it), and a step moves the statistics once per chunk."""
    import logging

    import torch.distributed as dist

    import umopt
    from umopt.errors import UmoptError

    path = _save(tmp_path, Candidate([[4, 8]], [[4, 8]], "gpipe").ops(), False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
        with pytest.raises(UmoptError, match="stage 0 has BatchNorm layers .* will not equal one process's"):
            umopt.Pipeline(module, path, loss_fn=torch.nn.MSELoss(), strict=True)
        with caplog.at_level(logging.WARNING, logger="umopt"):
            pipe = umopt.Pipeline(module, path, loss_fn=torch.nn.MSELoss())
        assert "BatchNorm layers (1)" in caplog.text
        pipe.stages[0].sample_forward((torch.randn(2, 6),))
        assert module[1].num_batches_tracked.item() == 0 and module.training
        pipe.step(torch.randn(B, 6), target=torch.randn(B, 1))
        assert module[1].num_batches_tracked.item() == 2  # two chunks
    finally:
        dist.destroy_process_group()
