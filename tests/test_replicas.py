"""The global minibatch across data-parallel replicas (umopt/search/replicas.py): each assignment
is a partition, the same on every call; umopt's balances the replicas' predicted steps (a replica
with a very long sequence gets fewer others) and beats the contiguous split; no plan beats the
lower bound; outlier delay trains every sequence once; ``umopt solve --dp`` writes a replicas file
whose plans are each a plan; and replicas fed their shares (``Pipeline.share``, ``umopt run
--dp``) train exactly as one process on the whole global minibatch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import umopt
from umopt.errors import UmoptError
from umopt.samplers import minibatches
from umopt.search.replicas import ASSIGNERS, assign, delay_outliers, lower_bound_ms, plan_global, work_of
from umopt.synthetic import synthetic_token_profile
from umopt.zoo import Layers, build_model, run_layers

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_cli  # noqa: E402
from lazycomm import World  # noqa: E402

PROFILE = synthetic_token_profile(4, blocks=8, max_length=8192)


@pytest.mark.parametrize("method", list(ASSIGNERS))
def test_every_assignment_is_a_partition_the_same_every_time(method):
    L = minibatches("chat", 1, 96, seed=3, cap=8192)[0]
    a = assign(PROFILE, L, 6, method)
    assert sorted(i for r in a.replicas for i in r) == list(range(len(L)))
    assert all(r and r == sorted(r) for r in a.replicas)
    assert assign(PROFILE, L, 6, method).replicas == a.replicas  # every rank computes the same


def test_umopt_balances_predicted_steps_not_tokens():
    """A replica holding a very long sequence gets fewer others; umopt's slowest replica is faster
    than every peer's but Hydraulis's (the same bound searched by random restarts, within 2%), and
    each peer is at or above the bound."""
    L = np.array([8000] + [300 + 37 * (i % 29) for i in range(127)])
    a = assign(PROFILE, L, 4, "umopt")
    long_one = next(r for r in a.replicas if 0 in r)
    assert len(long_one) < len(L) / 4 - 10
    # the balance is of time, not of tokens: the others hold far more tokens than it
    tokens = sorted(int(L[r].sum()) for r in a.replicas)
    assert tokens[0] == L[long_one].sum() and tokens[1] > 1.5 * tokens[0]
    steps = {m: plan_global(PROFILE, L, 4, m).step_ms for m in ASSIGNERS}
    bound = lower_bound_ms(PROFILE, L, 4)
    assert all(s >= bound * (1 - 1e-9) for s in steps.values())
    for m in ("contiguous", "round-robin", "tokens", "wlb"):
        assert steps["umopt"] < steps[m], (m, steps)
    assert steps["umopt"] <= steps["hydraulis"] * 1.02


@pytest.mark.parametrize("spec", ["chat", "long-context"])
def test_umopt_beats_the_contiguous_split_and_the_bound_holds(spec):
    """On minibatches of 4 replicas x 32 sequences, umopt's assignment's step is shorter than the
    contiguous split's on the mean (a proxy of each replica's step, not its plan: not on every
    minibatch), and no assignment's step beats the lower bound."""
    ratios = []
    for L in minibatches(spec, 4, 128, seed=1, cap=8192):
        bound = lower_bound_ms(PROFILE, L, 4)
        steps = {m: plan_global(PROFILE, L, 4, m).step_ms for m in ("umopt", "contiguous", "tokens")}
        assert min(steps.values()) >= bound * (1 - 1e-9), (steps, bound)
        ratios.append(steps["contiguous"] / steps["umopt"])
    assert np.mean(ratios) > 1.02, ratios


def test_the_bound_is_one_pipelines_own_on_one_replica():
    """On one replica the bound is at most the planner's step and above the longest sequence's path."""
    from umopt.search.solvers.per_step import plan

    L = np.array([40, 900, 77, 3000, 12, 512, 1024, 64])
    bound = lower_bound_ms(PROFILE, L, 1)
    assert bound <= plan(PROFILE, L).iteration_ms
    _, P = work_of(PROFILE, L)
    assert bound >= P.max() / 1e6


def test_assignment_refuses_what_it_cannot_do_in_one_line():
    with pytest.raises(UmoptError, match="cannot feed 4 replicas"):
        assign(PROFILE, [10, 20, 30], 4)
    with pytest.raises(UmoptError, match="unknown assignment 'sorted'"):
        assign(PROFILE, [10, 20, 30, 40], 2, "sorted")


def test_outlier_delay_trains_every_sequence_once_within_its_wait():
    """Sequences over the threshold wait until there is one for each replica, at most K steps;
    every sequence is trained once."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 100, 20) for _ in range(9)]
    batches[1][:5] = 5000  # a burst of long ones: four go at once (one per replica), one waits
    batches[6][:1] = 7000  # one alone: it waits K = 2 steps, then goes
    out, waited = delay_outliers(batches, 1000, 2, 4)
    assert sorted(np.concatenate(out).tolist()) == sorted(np.concatenate(batches).tolist())
    assert all(len(b) for b in out)
    assert [int((b > 1000).sum()) for b in out] == [0, 4, 0, 1, 0, 0, 0, 0, 1]
    assert waited == 2
    out, _ = delay_outliers(batches, 1000, 2, 1)  # one replica: nothing waits
    assert [b.tolist() for b in out] == [sorted(b.tolist(), key=lambda x: x > 1000) for b in batches]


def test_solve_dp_writes_each_replicas_sequences_and_plan(tmp_path, capsys):
    from umopt.formats.replicas import load_replicas

    out_file = tmp_path / "r.json"
    code, out, err = run_cli(
        [
            "solve",
            "gpt-tokens-sim",
            "-B",
            "64",
            "--lengths",
            "chat",
            "--dp",
            "4",
            "--dp-gbps",
            "100",
            "-o",
            str(out_file),
        ],
        capsys,
    )
    assert code == 0, err
    for name in ASSIGNERS:
        assert name in out
    assert "lower bound" in out and "x contig." in out and "…" not in out  # 80 columns hold it
    data = load_replicas(str(out_file))  # checked: every sequence once, each plan its own sequences'
    assert len(data.replicas) == 4 and data.method == "umopt"
    assert data.predicted.step_ms == pytest.approx(max(data.predicted.replica_ms))
    assert data.predicted.lower_bound_ms <= data.predicted.step_ms
    for r in data.replicas:  # each a plan as umopt solve --lengths writes one
        assert r.plan.lengths.lengths == [data.lengths[i] for i in r.sequences]
        assert r.plan.predicted.iteration_ms == pytest.approx(
            data.predicted.replica_ms[data.replicas.index(r)]
        )
    raw = json.loads(out_file.read_text())
    raw["replicas"][0]["sequences"].append(raw["replicas"][1]["sequences"][0])  # one sequence twice
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(UmoptError, match="exactly once"):
        load_replicas(str(tmp_path / "bad.json"))
    for argv, said in [
        (["-B", "3", "--dp", "4"], "cannot feed 4 replicas"),
        (["-B", "64", "--dp", "4", "--chunks", "2"], "one chunk per rank"),
    ]:
        target = tmp_path / "refused.json"
        argv = ["solve", "gpt-tokens-sim", "--lengths", "chat", "--dp-gbps", "100", "-o", str(target), *argv]
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not target.exists()  # nothing half-written


ARGS = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 48}
SMALL = synthetic_token_profile(2, blocks=2, max_length=ARGS["seq_len"], max_size=16)


@pytest.mark.parametrize("how", ["umopt", "contiguous"])
def test_replicas_fed_their_shares_train_as_one_process_on_the_global_minibatch(how):
    """2 replicas x 2 stages: every rank reads the global minibatch and takes its share
    (``Pipeline.share``), each replica plays its own plan of it; the weights after two SGD steps
    are one process's on the whole global minibatch, the loss a mean over all its tokens."""
    from umopt.search.solve_lengths import plan_schedule
    from umopt.search.solvers.per_step import plan

    S, D = 2, 2
    rng = np.random.default_rng(5)
    globals_ = [[int(x) for x in rng.integers(1, ARGS["seq_len"] + 1, 13)] for _ in range(2)]
    globals_[0][3] = globals_[1][0] = ARGS["seq_len"]  # a long one: the shares differ from contiguous
    shares = [assign(SMALL, L, D, how).replicas for L in globals_]
    if how == "umopt":
        assert shares[0] != assign(SMALL, globals_[0], D, "contiguous").replicas
    plans = [
        [plan_schedule(plan(SMALL, np.array(L)[r]), SMALL) for r in share]
        for L, share in zip(globals_, shares)
    ]
    parts = build_model("gpt", ARGS, seed=0)
    models = [build_model("gpt", ARGS, seed=0).layers for _ in range(D)]
    seen = {}

    def rank(comm):
        replica, s = divmod(comm.rank, S)
        dp_groups = [comm.new_group([k * S + j for k in range(D)]) for j in range(S)]
        stage = Layers(models[replica][2 * s : 2 * s + 2])
        pipe = umopt.Pipeline(
            stage,
            plans[0][replica],
            profile=SMALL,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            group=[replica * S + j for j in range(S)],
            dp_group=dp_groups[s],
            _comm=comm,
            select=False,
        )
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        for step, L in enumerate(globals_):
            pairs = parts.sequences.make(L, 50 + step)
            xs, ys = pipe.share([x for x, _ in pairs], [y for _, y in pairs], assign=how)
            seen[(step, comm.rank)] = [len(x) for x in xs]
            pipe.step(plan=plans[step][replica], **({"inputs": xs} if s == 0 else {"targets": ys}))
            opt.step()
            opt.zero_grad()

    World(S * D).run(rank)
    for step, L in enumerate(globals_):
        for r in range(S * D):
            assert seen[(step, r)] == [L[i] for i in shares[step][r // S]]

    reference = nn.ModuleList(build_model("gpt", ARGS, seed=0).layers)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for step, L in enumerate(globals_):
        pairs = parts.sequences.make(L, 50 + step)
        loss = sum(loss_fn(run_layers(reference, x[None])[0], y) for x, y in pairs) / sum(L)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for replica in range(D):
        got = nn.ModuleList(models[replica]).state_dict()
        for k, w in reference.state_dict().items():
            torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def _gpt_plan(tmp_path, monkeypatch):
    """A 2-stage profile of userzoo.gpt_sequences' GPT (SMALL's costs) and umopt's plan of its
    first minibatch: what ``umopt run --dp 2 --data userzoo:gpt_sequences`` plays."""
    from userzoo import gpt_sequences

    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.schedule import save_schedule
    from umopt.search.solve_lengths import plan_schedule
    from umopt.search.solvers.per_step import plan

    monkeypatch.setenv(
        "PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    small = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 48}  # userzoo.gpt_sequences'
    prof = SMALL.model_copy(
        update={
            "model": SMALL.model.model_copy(update={"name": "gpt", "args": small, "seed": 0}),
            "device": SMALL.device.model_copy(update={"dtype": "float32"}),
            "stages": [
                st.model_copy(update={"layers": [2 * s, 2 * s + 2]}) for s, st in enumerate(SMALL.stages)
            ],
        }
    )
    save_profile(prof, tmp_path / "p.json")
    prof = load_profile(tmp_path / "p.json")
    x0, _ = gpt_sequences(0, 8)
    save_schedule(
        plan_schedule(plan(prof, np.array([len(x) for x in x0])), prof), str(tmp_path / "plan.json")
    )
    return prof, small, len(x0)


def test_umopt_run_dp_gives_each_replica_umopts_share(tmp_path, monkeypatch):
    """``umopt run PLAN --dp 2 --data fn``: 4 gloo processes; each replica trains on its share by
    umopt's assignment (replica 0's plans are of exactly its share's lengths), the report says who
    assigned, and the gradients are one process's on the whole global minibatch."""
    from userzoo import gpt_sequences

    from umopt.formats.report import load_report
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions

    prof, small, B = _gpt_plan(tmp_path, monkeypatch)
    opts = RunOptions(
        schedules=[str(tmp_path / "plan.json")],
        steps=1,
        warmup=0,
        dp=2,
        data="userzoo:gpt_sequences",
        report=str(tmp_path / "r.json"),
        save_grads=str(tmp_path / "g"),
    )
    launch(opts, quiet=True)
    report = load_report(tmp_path / "r.json")
    xs, ys = gpt_sequences(0, 2 * B)
    L = [len(x) for x in xs]
    share = assign(prof, L, 2, "umopt").replicas
    assert report.lengths.assign == "umopt" and report.dp == 2
    assert report.lengths.plans[0].lengths.lengths == [L[i] for i in share[0]]
    assert report.lengths.tokens == [sum(L)]
    got = {}
    for s in range(2):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    model = nn.ModuleList(build_model("gpt", small, seed=0).layers)
    loss = sum(
        nn.functional.cross_entropy(run_layers(model, x[None])[0], y, reduction="sum") for x, y in zip(xs, ys)
    )
    (loss / sum(L)).backward()
    want = {f"layers.{k}": p.grad for k, p in model.named_parameters()}
    assert set(got) == set(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_methods_in_turns_each_train_on_their_own_assignments_shares(tmp_path, monkeypatch):
    """``umopt run PLAN --dp 2 --methods umopt,pack --assign umopt,contiguous`` (what ``umopt tune
    --lengths --dp`` plays): on the same global minibatches, each method's replica 0 plans and
    trains exactly its own assignment's share; the table says who assigned each. One assignment
    per method or one for all, else a one-line error."""
    from userzoo import gpt_sequences

    from umopt.formats.report import load_report
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions, preflight

    prof, _, B = _gpt_plan(tmp_path, monkeypatch)
    opts = RunOptions(
        schedules=[str(tmp_path / "plan.json")],
        steps=1,
        warmup=0,
        dp=2,
        methods=["umopt", "pack"],
        assign="umopt,contiguous",
        data="userzoo:gpt_sequences",
        report=str(tmp_path / "r_{name}.json"),
    )
    launch(opts, quiet=True)
    xs, _ = gpt_sequences(0, 2 * B)
    L = [len(x) for x in xs]
    for method, how in (("umopt", "umopt"), ("pack", "contiguous")):
        report = load_report(tmp_path / f"r_{method}.json")
        share = assign(prof, L, 2, how).replicas[0]
        assert report.lengths.assign == how and report.lengths.tokens == [sum(L)]
        assert sorted(report.lengths.plans[0].lengths.lengths) == sorted(L[i] for i in share), method
    assert assign(prof, L, 2, "umopt").replicas[0] != assign(prof, L, 2, "contiguous").replicas[0]
    for given, msg in (
        ("umopt,contiguous,tokens", "--assign names 3 assignments for 2 methods"),
        ("umopt,sorted", "--assign: unknown 'sorted'"),
    ):
        with pytest.raises(UmoptError, match=msg):
            preflight(opts.model_copy(update={"assign": given, "report": None}))
