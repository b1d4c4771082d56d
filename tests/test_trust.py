"""Nothing silently wrong with a user's own model of sequences: a layer that looks ahead
(bidirectional attention) gets what it needs to ignore padding, or the plan is refused; every
rank plays the maker's plan; outputs come back in the minibatch's order. Ranks are threads over
tests/lazycomm.py's model of NCCL's transport."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import umopt
from umopt.errors import UmoptError
from umopt.search.method import Request
from umopt.search.peers import PEERS
from umopt.search.solve_lengths import plan_schedule
from umopt.search.solvers.per_step import plan
from umopt.synthetic import synthetic_token_profile
from umopt.zoo import Layers, padded_rows, run_layers

sys.path.insert(0, str(Path(__file__).parent))
from lazycomm import World  # noqa: E402

VOCAB, D, LONGEST = 50, 16, 40
PROFILE = synthetic_token_profile(2, blocks=2, max_length=LONGEST, max_size=16)


class Bidirectional(nn.Module):
    """Self-attention in both directions, each sequence on its own: packed documents by a
    block-diagonal mask, padded rows by a key-padding mask ([Note: packed sequences])."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, lengths=None):
        n, t, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        mask = None
        if lengths is not None and padded_rows(x, lengths):
            mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, :]  # (n, 1, t): the keys
        elif lengths is not None:
            doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            mask = (doc[:, None] == doc[None, :])[None]  # (1, t, t)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class Blind(Bidirectional):
    """The same layer, taking no lengths: it cannot keep sequences or padding apart."""

    def forward(self, x):
        return super().forward(x)


def _layers(kind=Bidirectional, seed=0):
    torch.manual_seed(seed)
    return [nn.Embedding(VOCAB, D), kind(), kind(), nn.Linear(D, VOCAB)]


def _sequences(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        t = torch.randint(0, VOCAB, (int(n) + 1,), generator=g)
        y = t[1:].clone()
        y[torch.rand(int(n), generator=g) < 0.15] = -100  # ignored targets, as a fine-tune's prompt
        out.append((t[:-1], y))
    return out


def _reference(layers, seqs):
    """Gradients of the whole minibatch in one process, each sequence alone, token-mean loss."""
    model = nn.ModuleList(copy.deepcopy(layers))
    valid = sum(int((y != -100).sum()) for _, y in seqs)
    loss = sum(F.cross_entropy(run_layers(model, x[None])[0], y, reduction="sum") for x, y in seqs) / valid
    loss.backward()
    return [p.grad for p in model.parameters()], float(loss.detach())


def _pipeline_grads(layers, sched, seqs, causal=False):
    """The same minibatch through a 2-stage umopt.Pipeline: each parameter's gradient, the loss."""
    layers = copy.deepcopy(layers)
    stages = [Layers(layers[:2]), Layers(layers[2:])]
    losses = {}

    def rank(comm):
        r = comm.rank
        pipe = umopt.Pipeline(
            stages[r],
            sched,
            profile=PROFILE,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            _comm=comm,
            select=False,
            causal=causal,
        )
        kw = {"inputs": [x for x, _ in seqs]} if r == 0 else {"targets": [y for _, y in seqs]}
        losses[r] = pipe.step(plan=sched, **kw)

    World(2).run(rank)
    return [p.grad for m in layers for p in m.parameters()], float(losses[1])


def _plans(lengths):
    L = np.array(lengths)
    return {
        "planner, padded": plan_schedule(plan(PROFILE, L, mode="padded", budget_ms=30), PROFILE),
        "planner, packed": plan_schedule(plan(PROFILE, L, mode="packed", budget_ms=30), PROFILE),
        "pad to the longest": plan_schedule(PEERS["pad"].plan(Request(PROFILE, L)), PROFILE),
        "packed rows": plan_schedule(PEERS["pack"].plan(Request(PROFILE, L)), PROFILE),
    }


def test_a_bidirectional_layer_gets_the_lengths_of_padded_and_packed_chunks_and_trains_as_one_process():
    # skewed lengths, 1-token sequences among them: padding is most of a padded chunk
    lengths = [3, 40, 1, 7, 22, 2, 35, 5, 1, 12]
    seqs = _sequences(lengths, 1)
    layers = _layers()
    want, want_loss = _reference(layers, seqs)
    for name, sched in _plans(lengths).items():
        got, loss = _pipeline_grads(layers, sched, seqs)
        assert loss == pytest.approx(want_loss, rel=1e-5), name
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)


def test_a_layer_that_takes_no_lengths_is_refused_packed_and_padded_unless_said_causal():
    lengths = [3, 40, 1, 7, 22, 2]
    seqs = _sequences(lengths, 2)
    layers = _layers(Blind)
    for name, sched in _plans(lengths).items():
        mode = "packed" if "pack" in name else "padded"
        with pytest.raises(
            UmoptError,
            match=f"takes no lengths=.*{'see one another' if mode == 'packed' else 'padding'}",
        ):
            _pipeline_grads(layers, sched, seqs)
    # a model whose every layer is causal reads no padding: said so, it plays padded plans
    causal_layers = [nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, VOCAB)]
    want, _ = _reference(causal_layers, seqs)
    got, _ = _pipeline_grads(causal_layers, _plans(lengths)["pad to the longest"], seqs, causal=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_a_bad_sequence_from_data_names_its_step_and_index():
    from umopt.run.feed import sequence_source

    sched = _plans([3, 5, 7, 9])["pad to the longest"]

    def data(step, n):
        xs = [torch.ones(4, dtype=torch.long) for _ in range(n)]
        if step == 1:
            xs[2] = torch.ones(0, dtype=torch.long)
        if step == 2:
            xs[3] = torch.ones(4, 2, dtype=torch.long)
        return xs, [x.clone() for x in xs]

    source = sequence_source(data, None, None, sched, LONGEST, "--data m:f")
    assert len(source(0, 4)[0]) == 4
    with pytest.raises(UmoptError, match="sequence 2 of step 1 is empty"):
        source(1, 4)
    with pytest.raises(UmoptError, match=r"sequence 3 of step 2 has inputs \(4, 2\).*1-d tensor"):
        source(2, 4)


def test_eval_outputs_come_back_per_sequence_in_the_minibatchs_order_without_padding():
    lengths = [3, 40, 1, 7, 22, 2, 35, 5]
    seqs = _sequences(lengths, 3)
    layers = _layers()
    with torch.no_grad():
        want = [run_layers(layers, x[None])[0] for x, _ in seqs]
    for name, sched in _plans(lengths).items():
        stages = [Layers(copy.deepcopy(layers[:2])), Layers(copy.deepcopy(layers[2:]))]
        got = {}

        def rank(comm):
            r = comm.rank
            pipe = umopt.Pipeline(
                stages[r],
                sched,
                profile=PROFILE,
                loss_fn=nn.CrossEntropyLoss(),
                dtype="float32",
                _comm=comm,
                select=False,
            )
            kw = {"inputs": [x for x, _ in seqs]} if r == 0 else {"targets": [y for _, y in seqs]}
            got[r] = pipe.eval_step(plan=sched, outputs=True, **kw)

        World(2).run(rank)
        loss, outputs = got[1]
        assert got[0] is None and len(outputs) == len(lengths), name
        for o, w in zip(outputs, want):
            assert o.shape == w.shape, name  # (length, vocab): no padding, no packed row's padding document
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5, msg=name)


def _each_rank(ranks, body):
    """``body(comm)`` on every rank; what each raised (None: nothing), by rank."""
    raised = {}

    def rank(comm):
        try:
            body(comm)
            raised[comm.rank] = None
        except Exception as exc:  # noqa: BLE001 - what each rank says is the point
            raised[comm.rank] = exc

    World(ranks).run(rank)
    return raised


def test_ranks_handed_plans_that_play_otherwise_stop_before_the_first_op_on_every_rank():
    """Two equal-length sequences swapped: nothing in the shapes differs, so only the plans'
    comparison can tell (the loss was silently wrong, 4.256108 against 4.247291)."""
    lengths = [5, 9, 5, 12]
    seqs = _sequences(lengths, 4)
    a = _plans(lengths)["pad to the longest"]
    samples = [list(u) for u in a.lengths.samples]
    i, j = [k for k, u in enumerate(samples) if lengths[u[0]] == 5]
    samples[i], samples[j] = samples[j], samples[i]
    b = a.model_copy(update={"lengths": a.lengths.model_copy(update={"samples": samples})})
    layers = _layers()
    stages = [Layers(copy.deepcopy(layers[:2])), Layers(copy.deepcopy(layers[2:]))]

    raised = _each_rank(2, _one_step(stages, a, seqs, (a, b)))
    assert all(isinstance(e, UmoptError) for e in raised.values()), raised
    assert all("stage 1 was handed another plan for step 0 than rank 0" in str(e) for e in raised.values())
    assert all(p.grad is None for st in stages for p in st.parameters())  # no op ran
    # the same plan given to every rank, or given to the maker alone, plays
    for given in ((a, a), (a, None)):
        stages = [Layers(copy.deepcopy(layers[:2])), Layers(copy.deepcopy(layers[2:]))]
        assert _each_rank(2, _one_step(stages, a, seqs, given)) == {0: None, 1: None}


def _one_step(stages, schedule, seqs, plans):
    """A rank's body: a Pipeline of its stage on ``schedule``, one step with its own of ``plans``."""

    def body(comm):
        r = comm.rank
        pipe = umopt.Pipeline(
            stages[r],
            schedule,
            profile=PROFILE,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            _comm=comm,
            select=False,
        )
        kw = {"inputs": [x for x, _ in seqs]} if r == 0 else {"targets": [y for _, y in seqs]}
        pipe.step(plan=plans[r], **kw)

    return body


def test_a_plan_waited_for_inside_the_step_counts_there_and_one_that_fails_ends_every_rank():
    """``step(plan=fn)``: the maker calls ``fn`` inside the step (a late plan is the step's time,
    and the other ranks wait on the store, not in a collective under a watchdog); a plan that
    never comes fails the step on every rank in one line."""
    import time

    lengths = [5, 9, 5, 12]
    seqs = _sequences(lengths, 5)
    sched = _plans(lengths)["planner, packed"]
    layers = _layers()
    took = {}

    def late():
        time.sleep(0.5)
        return sched

    def body(comm, plan_fn):
        r = comm.rank
        stage = Layers(copy.deepcopy(layers[:2] if r == 0 else layers[2:]))
        pipe = umopt.Pipeline(
            stage,
            sched,
            profile=PROFILE,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            _comm=comm,
            select=False,
        )
        kw = {"inputs": [x for x, _ in seqs]} if r == 0 else {"targets": [y for _, y in seqs]}
        t0 = time.perf_counter()
        pipe.step(plan=plan_fn if r == 0 else None, **kw)
        took[r] = time.perf_counter() - t0

    assert _each_rank(2, lambda comm: body(comm, late)) == {0: None, 1: None}
    assert took[0] >= 0.5 and took[1] >= 0.45  # the wait is in the step, on both

    def never():
        raise UmoptError(
            "no plan within 120 s: the planning process of umopt's plans is alive but has not answered"
        )

    raised = _each_rank(2, lambda comm: body(comm, never))
    assert all("no plan within 120 s" in str(e) and "\n" not in str(e) for e in raised.values()), raised


def test_a_planning_process_that_dies_is_said_within_seconds():
    import os
    import signal
    import time

    from umopt.run.ahead import PlanAhead

    with PlanAhead(PROFILE, budget_ms=10) as ahead:
        ahead.submit([3, 5, 7])
        assert ahead.next().lengths.lengths == [3, 5, 7]
        os.kill(ahead._process.pid, signal.SIGKILL)
        ahead.submit([4, 6])
        t0 = time.perf_counter()
        with pytest.raises(UmoptError, match=r"planning process of umopt's plans .* was killed by signal 9"):
            ahead.next()
        assert time.perf_counter() - t0 < 5
