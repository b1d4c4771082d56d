"""Sequences of different lengths in ``umopt.Pipeline`` (umopt/run/tokens.py): each step plays its
minibatch's plan (each stage its own chunks of tokens, packed or padded, no shape exchanged), and
the gradients equal one process's on the whole minibatch, whatever the plan's order and cuts.
Ranks are threads over tests/lazycomm.py's model of NCCL's transport."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import umopt
from umopt.errors import UmoptError
from umopt.predict import schedule_tables
from umopt.search.method import Request
from umopt.search.peers import PEERS
from umopt.search.plan import Layout, score
from umopt.search.problem import Candidate
from umopt.search.solve_lengths import plan_schedule
from umopt.search.solvers.per_step import plan
from umopt.synthetic import synthetic_token_profile
from umopt.zoo import Layers, build_model, run_layers

sys.path.insert(0, str(Path(__file__).parent))
from lazycomm import World  # noqa: E402

ARGS = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 48}


def _model():
    parts = build_model("gpt", ARGS, seed=0)
    return parts, [Layers(parts.layers[:2]), Layers(parts.layers[2:])]


def _minibatches(steps: int, n: int = 10) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [list(rng.integers(1, ARGS["seq_len"] + 1, n)) for _ in range(steps)]


def _profile():
    # costed as a two-stage pipeline of sequences up to the model's length (the plan's cuts and
    # order are what matter here, not the times)
    return synthetic_token_profile(2, blocks=2, max_length=ARGS["seq_len"], max_size=16)


def _reference(batches, seqs_of):
    """One process, the whole minibatch at once: each sequence alone (exact, no padding)."""
    parts, _ = _model()
    model = nn.ModuleList(parts.layers)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, L in enumerate(batches):
        seqs = seqs_of(step, L)
        tokens = sum(len(x) for x, _ in seqs)
        loss = sum(loss_fn(run_layers(model, x[None])[0], y) for x, y in seqs) / tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(plans, batches, seqs_of, ranks: int = 2):
    _, stages = _model()
    sched0 = plans[0]

    def rank(comm):
        r = comm.rank
        pipe = umopt.Pipeline(
            stages[r],
            sched0,
            profile=PROFILE,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            _comm=comm,
            select=False,
        )
        opt = torch.optim.SGD(stages[r].parameters(), lr=0.1)
        for step, L in enumerate(batches):
            seqs = seqs_of(step, L)
            kw = {"inputs": [x for x, _ in seqs]} if r == 0 else {"targets": [y for _, y in seqs]}
            pipe.step(plan=plans[step], **kw)
            opt.step()
            opt.zero_grad()

    World(ranks).run(rank)
    got = {}
    for r, st in enumerate(stages):
        for k, v in st.state_dict().items():  # "layers.i.rest" -> the model's layer index
            i = int(k.split(".")[1]) + 2 * r
            got[f"{i}.{k.split('.', 2)[2]}"] = v.detach().clone()
    return got


PROFILE = _profile()


def _seqs(parts):
    return lambda step, L: parts.sequences.make(L, 100 + step)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_a_plan_per_step_trains_as_one_process(mode):
    parts, _ = _model()
    batches = _minibatches(3)
    plans = []
    previous = None
    for L in batches[:2]:
        previous = plan(PROFILE, np.array(L), mode=mode, previous=previous, budget_ms=50)
        plans.append(plan_schedule(previous, PROFILE))
    assert all(p.lengths.samples != [[i] for i in range(len(p.lengths.lengths))] for p in plans)  # reordered
    # and one where each stage cuts its own way, the samples the other way round, in 1F1B
    order = np.argsort(batches[2])[::-1]
    ops = Candidate([[3, 3, 4], [6, 4]], [[3, 3, 4], [6, 4]], "1f1b").ops()
    plans.append(
        plan_schedule(
            score("hand", PROFILE, np.array(batches[2]), Layout.of_order(order, mode), ops), PROFILE
        )
    )
    got = _train(plans, batches, _seqs(parts))
    want = _reference(batches, _seqs(parts))
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def test_the_peers_plans_play_too_and_bad_steps_are_one_line_errors():
    """Padding to the longest (every chunk one width), packing into rows (each row's padding a
    document of its own, its targets ignored) and sort-and-split, then umopt's, one per step."""
    parts, _ = _model()
    batches = _minibatches(4)
    peers = [PEERS[name].plan(Request(PROFILE, L)) for name, L in zip(("pad", "pack", "sort-split"), batches)]
    assert peers[0].layout.pad_to and peers[1].layout.row
    assert any(len(u) > 1 for u in peers[1].layout.units)  # rows of several sequences
    plans = [plan_schedule(p, PROFILE) for p in peers] + [
        plan_schedule(plan(PROFILE, np.array(batches[3])), PROFILE)
    ]
    got = _train(plans, batches, _seqs(parts))
    want = _reference(batches, _seqs(parts))
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)

    # a sequence of another length than the plan says is refused on the rank that holds it
    def wrong(step, L):
        seqs = parts.sequences.make(L, 0)
        x, y = seqs[0]
        seqs[0] = (x[:-1], y[:-1]) if len(x) > 1 else (torch.cat([x, x]), torch.cat([y, y]))
        return seqs

    with pytest.raises(UmoptError, match="sequence 0 of the"):
        _train(plans[:1], batches[:1], wrong)


def test_a_packed_plan_needs_a_module_that_keeps_documents_apart():
    parts, _ = _model()
    L = np.array(_minibatches(1)[0])
    sched = plan_schedule(plan(PROFILE, L, mode="packed"), PROFILE)

    def rank(comm):
        stage = nn.Sequential(*parts.layers[:2]) if comm.rank == 0 else Layers(parts.layers[2:])
        umopt.Pipeline(stage, sched, profile=PROFILE, loss_fn=nn.CrossEntropyLoss(), _comm=comm, select=False)

    with pytest.raises(
        UmoptError, match="stage 0: layer 0 .Embedding. gets no lengths= inside an nn.Sequential"
    ):
        World(2).run(rank)


def test_plans_made_ahead_by_the_first_stage_reach_every_rank():
    """PlanAhead plans in a process of its own; only the rank holding the first stage passes the
    plans, the other reads each step's from the store ([Note: one plan a step, one maker])."""
    from umopt.run.ahead import PlanAhead

    parts, stages = _model()
    batches = _minibatches(3)
    with PlanAhead(PROFILE, budget_ms=20) as ahead:
        for L in batches:
            ahead.submit(L)
        plans = [ahead.next() for _ in batches]
        with pytest.raises(UmoptError, match="nothing submitted"):
            ahead.next()
    assert [p.lengths.lengths for p in plans] == [list(map(int, L)) for L in batches]
    seqs_of = _seqs(parts)

    def rank(comm):
        r = comm.rank
        pipe = umopt.Pipeline(
            stages[r], plans[0], profile=PROFILE, loss_fn=nn.CrossEntropyLoss(), dtype="float32", _comm=comm
        )
        opt = torch.optim.SGD(stages[r].parameters(), lr=0.1)
        for step, L in enumerate(batches):
            seqs = seqs_of(step, L)
            if r == 0:
                pipe.step(inputs=[x for x, _ in seqs], plan=plans[step])
            else:
                pipe.step(targets=[y for _, y in seqs])  # the plan comes from rank 0
            opt.step()
            opt.zero_grad()

    World(2).run(rank)
    want = _reference(batches, seqs_of)
    for r, st in enumerate(stages):
        for k, v in st.state_dict().items():
            i = int(k.split(".")[1]) + 2 * r
            torch.testing.assert_close(v, want[f"{i}.{k.split('.', 2)[2]}"], rtol=1e-5, atol=1e-6)


def test_three_stages_with_w_ops_recompute_and_replicas_each_planning_its_own_minibatch():
    """Two data-parallel replicas of a 3-stage pipeline, each with its own minibatch of sequences
    and so its own plan (one with the weight gradients split off into W ops, one recomputing
    the forward in the backward): the gradients are one process's on both minibatches at once,
    the loss a mean over every token of both."""
    from umopt.schedules import with_weight_ops

    S, dp = 3, 2
    profile = synthetic_token_profile(S, blocks=2, max_length=ARGS["seq_len"], max_size=16)
    spans = [(0, 2), (2, 3), (3, 4)]
    rng = np.random.default_rng(7)
    batches = [[list(rng.integers(1, ARGS["seq_len"] + 1, 7 + 2 * k)) for k in range(dp)] for _ in range(2)]

    def w_ops(L):  # every B's weight gradient deferred (ZB-H1 without a cap), then scored
        p = plan(profile, np.array(L), mode="packed", budget_ms=50)
        ops = [with_weight_ops(st, None) for st in p.ops]
        return plan_schedule(score("w", profile, np.array(L), p.layout, ops), profile)

    def recompute(L):
        return plan_schedule(
            plan(profile, np.array(L), mode="padded", budget_ms=50, recompute=True), profile, recompute=True
        )

    plans = [[w_ops(L) for L in batches[0]], [recompute(L) for L in batches[1]]]
    assert any(op[0] == "W" for st in plans[0][0].stages for op in st.ops) and plans[1][0].recompute
    parts, _ = _model()
    seqs_of = _seqs(parts)
    models = [build_model("gpt", ARGS, seed=0).layers for _ in range(dp)]

    def rank(comm):
        replica, me = divmod(comm.rank, S)
        dp_groups = [comm.new_group([k * S + s for k in range(dp)]) for s in range(S)]
        stage = Layers(models[replica][slice(*spans[me])])
        pipe = umopt.Pipeline(
            stage,
            plans[0][replica],
            profile=profile,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            group=[replica * S + s for s in range(S)],
            dp_group=dp_groups[me],
            _comm=comm,
            select=False,
        )
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        for step, per_replica in enumerate(batches):
            seqs = seqs_of(10 * step + replica, per_replica[replica])
            kw = {"inputs": [x for x, _ in seqs]} if me == 0 else {}
            kw |= {"targets": [y for _, y in seqs]} if me == S - 1 else {}
            # the replica's first stage says the plan; its other ranks read it (each replica its own)
            pipe.step(plan=plans[step][replica] if me == 0 else None, **kw)
            opt.step()
            opt.zero_grad()

    World(S * dp).run(rank)

    def both(step, _):  # one process: both replicas' sequences as one minibatch
        return [s for k in range(dp) for s in seqs_of(10 * step + k, batches[step][k])]

    want = _reference(batches, both)
    for replica in range(dp):
        got = {}
        for me, (lo, hi) in enumerate(spans):
            for k, v in Layers(models[replica][lo:hi]).state_dict().items():
                got[f"{lo + int(k.split('.')[1])}.{k.split('.', 2)[2]}"] = v
        for k, w in want.items():
            torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def _run_profile(tmp_path, layers: bool = False):
    """PROFILE as a profile of the zoo's gpt of ARGS (costs by tokens, device "sim"); with
    ``layers``, each of its 4 layers with its costs (for several chunks per rank)."""
    from umopt.formats.profile import load_profile, save_profile

    base = (
        synthetic_token_profile(2, blocks=2, max_length=ARGS["seq_len"], max_size=16, layers_per_stage=2)
        if layers
        else PROFILE
    )
    prof = base.model_copy(
        update={
            "model": base.model.model_copy(update={"name": "gpt", "args": dict(ARGS), "seed": 0}),
            "device": base.device.model_copy(update={"dtype": "float32"}),
            "stages": [
                st.model_copy(update={"layers": [2 * s, 2 * s + 2]}) for s, st in enumerate(base.stages)
            ],
        }
    )
    save_profile(prof, tmp_path / "p.json")
    return load_profile(tmp_path / "p.json")


def test_umopt_run_plans_each_step_ahead_and_methods_take_turns_on_the_same_minibatches(
    tmp_path, monkeypatch
):
    """``umopt run PLAN --data fn --methods umopt,pad``: each step's sequences from the user's
    function (not always as many as the plan's), each planned ahead by its method; both methods
    train on steps 0-3's minibatches, and the last step's gradients equal one process's after the
    seven updates before it (SGD with momentum, as the runtime's). A report's predictions are its
    measured steps' plans': each step its own, the busy time their median."""
    from userzoo import gpt_sequences

    from umopt.formats.report import load_report
    from umopt.formats.schedule import save_schedule
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions

    monkeypatch.setenv(
        "PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    profile = _run_profile(tmp_path)
    x0, _ = gpt_sequences(0, 10)
    first = plan_schedule(plan(profile, np.array([len(x) for x in x0])), profile)
    save_schedule(first, str(tmp_path / "plan.json"))
    opts = RunOptions(
        schedules=[str(tmp_path / "plan.json")],
        steps=4,  # an even count: the median of the steps' plans is none of them, the last included
        warmup=0,
        data="userzoo:gpt_sequences",
        methods=["umopt", "pad"],
        report=str(tmp_path / "r-{name}.json"),
        save_grads=str(tmp_path / "g"),
    )
    launch(opts, quiet=True)
    reports = {m: load_report(tmp_path / f"r-{m}.json") for m in ("umopt", "pad")}
    data = [gpt_sequences(k, 10) for k in range(4)]
    tokens = [sum(len(x) for x in xs) for xs, _ in data]
    from umopt.costmodel import simulate

    for m, r in reports.items():
        assert r.lengths.method == m and r.lengths.tokens == tokens  # the same minibatches, steps 0-3's
        assert r.lengths.tokens_per_s == pytest.approx(sum(tokens) / (sum(r.step_ms) / 1e3))
        # every op of the measured steps, both ranks, with its plan's prediction: what calibrate fits
        assert len(r.lengths.op_pairs) == sum(len(st.ops) for p in r.lengths.plans for st in p.stages) and {
            p[1] for p in r.lengths.op_pairs
        } == {0, 1}
        assert all(p[3] > 0 and p[4] > 0 for p in r.lengths.op_pairs)
        assert len(r.lengths.plans) == len(r.step_ms) == 4 and r.lengths.plans[0].lengths is not None
        assert [p.lengths.lengths for p in r.lengths.plans] == [[len(x) for x in xs] for xs, _ in data]
        # each step's prediction is its own plan's; the run's is their mean, its busy time their median
        timelines = [
            simulate(schedule_tables(p, profile), p.op_lists(), p.minibatch) for p in r.lengths.plans
        ]
        assert r.lengths.predicted_step_ms == pytest.approx([tl.iteration_ms for tl in timelines])
        assert len(set(r.lengths.predicted_step_ms)) == 4  # four plans, four predictions
        assert r.predicted_iteration_ms == pytest.approx(np.mean(r.lengths.predicted_step_ms))
        for s, busy in enumerate(r.busy_ms.predicted):
            assert busy == pytest.approx(np.median([tl.busy_ms[s] for tl in timelines]))
    got = {}
    for s in range(2):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))

    parts, _ = _model()
    model = nn.ModuleList(parts.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for k in (0, 1, 2, 3, 0, 1, 2, 3):  # umopt's steps, then pad's, on the same minibatches
        xs, ys = data[k]
        opt.zero_grad()
        loss = sum(F.cross_entropy(run_layers(model, x[None])[0], y, reduction="sum") for x, y in zip(xs, ys))
        (loss / tokens[k]).backward()
        want = {f"layers.{k}": p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    assert set(got) == set(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def test_umopt_run_refuses_what_a_plan_of_sequences_cannot_do_in_one_line(tmp_path, capsys):
    from conftest import run_cli

    from umopt.formats.schedule import save_schedule

    profile = _run_profile(tmp_path)
    save_schedule(
        plan_schedule(plan(profile, np.array([5, 9, 40, 12])), profile), str(tmp_path / "plan.json")
    )
    plan_file = str(tmp_path / "plan.json")
    cases = [
        ([plan_file, plan_file], "one per --methods entry"),
        ([plan_file, "--methods", "umopt,fifo"], "unknown 'fifo'"),
        ([plan_file, "--lengths", "tweets"], "unknown lengths 'tweets'"),
        ([plan_file, "--lengths", "chat", "--data", "userzoo:gpt_sequences"], "not both"),
        ([plan_file, "--methods", "umopt,pad", "--report", str(tmp_path / "r.json")], "{name}"),
        ([plan_file, "--methods", "pad,pack", "--decide", "0.9"], "compares umopt's plans"),
    ]
    for argv, said in cases:
        code, out, err = run_cli(["run", *argv], capsys)
        assert code == 2 and said in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "mode,recompute,dp", [("packed", False, 1), ("padded", True, 1), ("packed", False, 2)]
)
def test_plans_with_several_chunks_per_rank_train_as_one_process(mode, recompute, dp):
    """Each rank holds two chunks (looped: the embedding and the second block on rank 0, the
    first block and the head on rank 1), planned on the layers' costs by tokens; then torch's best
    multi-chunk schedule on rows packed equally (the peer), then each virtual stage cut its own
    way: with W ops, or recomputing its forwards in backward chunks cut otherwise. With ``dp``
    2, two replicas of the pipeline, each with minibatches and plans of its own: the gradients
    are one process's on both minibatches at once."""
    from umopt.chunks import chunking
    from umopt.schedules.multichunk import ChunkGenes, build_ops
    from umopt.search.solvers.per_step_chunks import plan_chunks

    profile = synthetic_token_profile(
        2, blocks=2, max_length=ARGS["seq_len"], max_size=16, layers_per_stage=2
    )
    parts, _ = _model()
    on = chunking(profile, 2, "looped")  # the pipeline's layout: every step's plan keeps it

    def plans_of(batches):
        planned = [
            plan_chunks(profile, np.array(L), 2, mode=mode, recompute=recompute, budget_ms=150, seed=k, on=on)
            for k, L in enumerate(batches[:2])
        ]
        planned.append(PEERS["pack"].plan(Request(profile, batches[2], recompute, on=on)))
        # and each virtual stage cut its own way by hand, W ops deferred, the samples longest first
        L = np.array(batches[3])
        layout = Layout.of_order(np.argsort(L)[::-1], mode)
        tables = layout.tables(profile, L, recompute, chunks=on)
        genes = ChunkGenes([[3, 7], [5, 5], [2, 3, 5], [10]], [10, 10], weights=not recompute)
        if recompute:
            genes.bwd = [[10], [10], [5, 5], [10]]  # padded: whole forward chunks merged
        ops, _ = build_ops(tables, len(L), genes)
        planned.append(score("hand", profile, L, layout, ops, recompute, tables=tables, chunking=on))
        for p in planned:
            assert p.chunking is not None and len(p.chunking.ranks) == 4
        # padded means padded: umopt's plans are in the mode asked, whatever seeded them (the
        # seed once returned packing's rows for padded plans, so no padded plan trained)
        assert all(p.layout.mode == mode for p in planned[:2])
        return [plan_schedule(p, profile, recompute) for p in planned]

    # each replica its minibatches (the second's lengths mirror the first's)
    batches = [_minibatches(4)]
    batches += [[[ARGS["seq_len"] + 1 - n for n in L] for L in batches[0]]] * (dp - 1)
    plans = [plans_of(b) for b in batches]
    assert all(p.recompute == recompute for sched in plans for p in sched)
    assert {len(op) for sched in plans[0] for st in sched.stages for op in st.ops} == {
        4
    }  # virtual stages named
    seqs_of = _seqs(parts)

    def seqs(step, replica):
        return seqs_of(10 * step + replica, batches[replica][step])

    owns = [build_model("gpt", ARGS, seed=0).layers for _ in range(dp)]
    layout = plans[0][0].layout(profile)
    modules = {
        (k, r): [Layers(owns[k][lo:hi]) for (lo, hi), rr in zip(layout.layers, layout.ranks) if rr == r]
        for k in range(dp)
        for r in (0, 1)
    }

    def rank(comm):
        replica, r = divmod(comm.rank, 2)
        dp_groups = [comm.new_group([k * 2 + s for k in range(dp)]) for s in range(2)] if dp > 1 else None
        pipe = umopt.Pipeline(
            modules[replica, r],
            plans[replica][0],
            profile=profile,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            group=[replica * 2, replica * 2 + 1],
            dp_group=dp_groups[r] if dp_groups else None,
            _comm=comm,
            select=False,
        )
        opt = torch.optim.SGD([p for m in modules[replica, r] for p in m.parameters()], lr=0.1)
        for step in range(len(batches[0])):
            xy = seqs(step, replica)
            kw = {"inputs": [x for x, _ in xy]} if r == 0 else {"targets": [y for _, y in xy]}
            pipe.step(plan=plans[replica][step], **kw)
            opt.step()
            opt.zero_grad()

    World(2 * dp).run(rank)
    # one process: every replica's sequences of a step as one minibatch
    want = _reference(range(len(batches[0])), lambda step, _: [x for k in range(dp) for x in seqs(step, k)])
    for own in owns:
        for i, layer in enumerate(own):
            for k, v in layer.state_dict().items():
                torch.testing.assert_close(v, want[f"{i}.{k}"], rtol=1e-5, atol=1e-6)


def test_a_plan_made_ahead_takes_at_most_half_the_last_steps_predicted_time():
    """A plan has one step to be made in: the budget is cut to half the last plan's predicted step
    (at least a millisecond), so short steps do not wait for plans made in the whole budget."""
    from types import SimpleNamespace

    from umopt.run.ahead import plan_budget

    assert plan_budget(15.0, None) == 15.0  # the first plan: the whole budget
    assert plan_budget(15.0, SimpleNamespace(iteration_ms=4.8)) == pytest.approx(2.4)
    assert plan_budget(15.0, SimpleNamespace(iteration_ms=0.5)) == 1.0
    assert plan_budget(15.0, SimpleNamespace(iteration_ms=400.0)) == 15.0
