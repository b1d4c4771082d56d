"""Every kind of schedule umopt can play, through a model of NCCL's semantics (tests/lazycomm.py:
lazy connections, in-order matching, rendezvous): none deadlocks, and every one gives one
process's gradients. Each rank is a thread of this process running the real umopt.Pipeline.

Without the connections made at set-up ([Note: lazy connections] in umopt/run/comm.py), the
model finds the deadlock a looped schedule on 3 ranks had on NCCL: the model can fail."""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch
from lazycomm import Deadlock, LazyComm, World
from torch import nn

from umopt.chunks import chunking
from umopt.costmodel import CostTables, simulate
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import make_schedule
from umopt.run.comm import Comm, rounds
from umopt.run.pipeline import Pipeline
from umopt.schedules.multichunk import ChunkGenes, build_ops
from umopt.search.peers.schedules import torch_ops
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile

D = 4
PER_STAGE = 2  # layers per stage of the profile (a chunk of a stage holds one)


def _layer(i: int, layers: int) -> nn.Module:
    torch.manual_seed(100 + i)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh()) if i + 1 < layers else nn.Linear(D, 1)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, D, generator=g), torch.randn(n, 1, generator=g)


def _reference(layers: int, n: int, step: int) -> dict[str, torch.Tensor]:
    """One process, the whole (global) minibatch of ``step``: every layer's gradients."""
    model = nn.Sequential(*[_layer(i, layers) for i in range(layers)])
    x, y = _batch(step, n)
    nn.MSELoss()(model(x), y).backward()
    return {f"{i}.{k}": p.grad for i, m in enumerate(model) for k, p in m.named_parameters()}


def _profile(tmp_path, S: int):
    save_profile(synthetic_profile(S, max_size=16, seed=3, layers_per_stage=PER_STAGE), tmp_path / "p.json")
    return load_profile(tmp_path / "p.json")


def _schedule(prof, B: int, ops, ch=None, recompute=False, candidates=()):
    tables = CostTables.from_profile(prof, recompute, chunks=ch)
    solver = {"name": "test", "status": "feasible", "seconds": 0.0, "recommended": "pick"}
    return make_schedule(
        prof, B, recompute, ops, simulate(tables, ops, B), solver, {}, candidates=candidates, chunks=ch
    )


def _play(sched, S: int, steps: int = 2, dp: int = 1, lazy: bool = True, select_steps: Optional[int] = None):
    """Every rank of ``dp`` replicas plays ``steps`` steps (gradients zeroed before each) in a
    World; returns each rank's gradients of the last step by layer name."""
    layers = S * PER_STAGE
    spans = (
        sched.chunks.layers if sched.chunks else [st.layers for st in load_profile(sched.profile.path).stages]
    )
    ranks_of = list(sched.chunks.ranks) if sched.chunks else list(range(S))
    B = sched.minibatch
    world = World(S * dp, lazy=lazy)
    # built here, not in the ranks' threads: torch's seed is the process's, one for all threads
    models = [[_layer(i, layers) for i in range(layers)] for _ in range(dp)]

    def rank(comm: LazyComm) -> dict[str, torch.Tensor]:
        replica, me = divmod(comm.rank, S)
        dp_groups = [comm.new_group([k * S + s for k in range(dp)]) for s in range(S)] if dp > 1 else None
        mine = [j for j, r in enumerate(ranks_of) if r == me]
        mods = [nn.Sequential(*models[replica][slice(*spans[j])]) for j in mine]
        pipe = Pipeline(
            mods if sched.chunks else mods[0],
            sched,
            loss_fn=nn.MSELoss(),
            group=[replica * S + s for s in range(S)],
            dp_group=dp_groups[me] if dp_groups else None,
            select_steps=select_steps,
            steps=steps,
            _comm=comm,
        )
        for step in range(steps):
            for m in mods:
                m.zero_grad()
            x, y = _batch(step, B * dp)
            x, y = x[replica * B : (replica + 1) * B], y[replica * B : (replica + 1) * B]
            pipe.step(x if 0 in mine else None, target=y if len(ranks_of) - 1 in mine else None)
        out = {}
        for j, m in zip(mine, mods):
            for k, layer in enumerate(m):
                for name, p in layer.named_parameters():
                    out[f"{spans[j][0] + k}.{name}"] = p.grad
        if select_steps is not None:
            out["selected"] = pipe.selected
            # one set of receive buffers: the kept schedule's (shared with the pick's); the others let go
            for t in pipe.turns.turns:
                for j, st in t.pipe.stages.items():
                    if t.pipe is pipe.playing:
                        assert all(a is b for a, b in zip(st.act, pipe.stages[j].act)) or pipe.playing is pipe
                    else:
                        assert st.act == [] and st.grad == []
        return out

    return world.run(rank), _reference(layers, B * dp, steps - 1)


def _assert_one_process(got, want) -> None:
    seen = {}
    for g in got:
        seen.update({k: v for k, v in g.items() if k != "selected"})
    assert seen.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(seen[k], want[k], rtol=1e-5, atol=1e-6)


def _one_chunk(S, B, fsizes, order, recompute=False, warmup=None, wcap=None):
    ops = Candidate(fsizes, fsizes, order, warmup=warmup, wcap=wcap).ops()
    return ops, None, recompute


ONE_CHUNK = {
    "gpipe S=3": lambda: _one_chunk(3, 12, [[3, 5, 4], [6, 6], [2, 4, 6]], "gpipe"),
    "1f1b S=4, warm-ups": lambda: _one_chunk(
        4, 12, [[2, 2, 8], [1, 4, 7], [4, 4, 4], [6, 6]], "1f1b", warmup=[3, 2, 1, 0]
    ),
    "1f1b S=3, W ops": lambda: _one_chunk(3, 12, [[4, 4, 4], [3, 3, 6], [6, 6]], "1f1b", wcap=[12, 4, 0]),
    "gpipe S=3, recompute": lambda: _one_chunk(3, 12, [[4, 8], [6, 6], [12]], "gpipe", recompute=True),
}


@pytest.mark.parametrize("case", list(ONE_CHUNK))
def test_one_chunk_per_rank(tmp_path, case):
    ops, _, recompute = ONE_CHUNK[case]()
    S = len(ops)
    sched = _schedule(_profile(tmp_path, S), 12, ops, recompute=recompute)
    _assert_one_process(*_play(sched, S))


TORCH = [
    ("ScheduleLoopedBFS", "looped", 3, 6),
    ("ScheduleInterleaved1F1B", "looped", 3, 6),
    ("ScheduleInterleaved1F1B", "looped", 4, 8),
    ("ScheduleInterleavedZeroBubble", "looped", 3, 6),
    ("ScheduleZBVZeroBubble", "vshape", 3, 6),
    ("ScheduleDualPipeV", "vshape", 3, 6),
]


@pytest.mark.parametrize("name,place,S,M", TORCH)
def test_torchs_orders_on_several_chunks_per_rank(tmp_path, name, place, S, M):
    prof = _profile(tmp_path, S)
    B = 2 * M
    ch = chunking(prof, 2, place)
    sched = _schedule(prof, B, torch_ops(name, S, 2, B, M), ch)
    _assert_one_process(*_play(sched, S))


@pytest.mark.parametrize("place,weights,S", [("looped", False, 3), ("looped", True, 4), ("vshape", True, 3)])
def test_umopts_own_unequal_chunked_schedules(tmp_path, place, weights, S):
    prof = _profile(tmp_path, S)
    rng = random.Random(S)
    B = 12
    ch = chunking(prof, 2, place)
    tables = CostTables.from_profile(prof, False, chunks=ch)
    for _ in range(2):
        parts = []
        for _ in ch.ranks:
            sizes, left = [], B
            while left:
                sizes.append(rng.randint(1, min(left, 6)))
                left -= sizes[-1]
            parts.append(sizes)
        genes = ChunkGenes(
            parts, [rng.randint(1, 2 * B) for _ in range(S)], deep=rng.random() < 0.5, weights=weights
        )
        ops, _ = build_ops(tables, B, genes)
        _assert_one_process(*_play(_schedule(prof, B, ops, ch), S))


def test_selection_candidates_and_data_parallel_replicas(tmp_path):
    """A looped schedule with a candidate on its layout, measured in turns and one kept (the same
    on every rank of both replicas: one decision for the job); and 2 replicas x 3 ranks."""
    S, M = 3, 6
    prof = _profile(tmp_path, S)
    B = 2 * M
    ch = chunking(prof, 2, "looped")
    rival = torch_ops("ScheduleLoopedBFS", S, 2, B, M)
    tables = CostTables.from_profile(prof, False, chunks=ch)
    candidate = {
        "name": "ScheduleLoopedBFS",
        "equal": True,
        "stages": [{"ops": [list(op) for op in st]} for st in rival],
        "predicted_iteration_ms": simulate(tables, rival, B).iteration_ms,
        "chunks": {"layers": [list(c) for c in ch.layers], "ranks": list(ch.ranks), "placement": "looped"},
    }
    sched = _schedule(prof, B, torch_ops("ScheduleInterleaved1F1B", S, 2, B, M), ch, candidates=[candidate])
    got, want = _play(sched, S, steps=16, dp=2, select_steps=14)
    assert len({g["selected"] for g in got}) == 1 and got[0]["selected"] in ("pick", "ScheduleLoopedBFS")
    _assert_one_process(got[:S], want)
    _assert_one_process(got[S:], want)


def test_without_connecting_first_a_looped_schedule_deadlocks_in_the_model(tmp_path, monkeypatch):
    """The model has teeth: with the links made but not connected before the first step, the
    first step of a looped schedule on 3 ranks waits in a ring, as it did on NCCL."""

    def made_only(self, directions):
        self.links.update(self._make_groups(rounds(sorted(set(directions) - set(self.links)))))

    monkeypatch.setattr(Comm, "link_groups", made_only)
    S, M = 3, 6
    prof = _profile(tmp_path, S)
    sched = _schedule(
        prof, 2 * M, torch_ops("ScheduleInterleaved1F1B", S, 2, 2 * M, M), chunking(prof, 2, "looped")
    )
    with pytest.raises(Deadlock, match="connecting"):
        _play(sched, S)
    _assert_one_process(*_play(sched, S, lazy=False))  # gloo's eager connections: no deadlock


def test_the_rounds_of_disjoint_pairs_make_few_splits():
    """[Note: one process group per link and direction]: S=8 ranks x 4 chunks looped, 8 replicas
    (64 ranks): every direction of every link in 6 rounds of disjoint pairs, not 128 groups made
    one at a time."""
    S, dp = 8, 8
    dirs = set()
    for k in range(dp):
        ring = [k * S + s for s in range(S)]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            dirs |= {(a, b), (b, a)}
    got = rounds(dirs)
    assert len(dirs) == 128 and len(got) <= 6
    for r in got:
        used = [x for p in r for x in p]
        assert len(used) == len(set(used))
    assert sorted(p for r in got for p in r) == sorted(dirs)


# --- what a user's loop meets, played in the same model ------------------------------------------


def _one_chunk_schedule(tmp_path, S=2, B=8):
    fsizes = [[4, 4]] * S
    return _schedule(_profile(tmp_path, S), B, Candidate(fsizes, fsizes, "1f1b").ops())


class _Flagged(nn.Module):
    """Sends on a per-batch value beside the activations: it has no row per sample."""

    def __init__(self, scalar: bool):
        super().__init__()
        self.lin, self.scalar = nn.Linear(D, D), scalar

    def forward(self, x):
        h = self.lin(x)
        flag = h.sum() if self.scalar else h.sum().reshape(1)
        return h, flag


class _Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, h, flag):
        return self.lin(h) + flag


@pytest.mark.parametrize("scalar", [True, False])
@pytest.mark.parametrize("call", ["step", "eval_step"])
def test_a_boundary_tensor_without_a_row_per_sample_is_refused(tmp_path, scalar, call):
    """A 0-d or shape-(1,) tensor at a boundary has no rows to send per chunk: received so, the
    buffer's other rows would be uninitialised memory read as data. It is a one-line error on
    the rank that sends it, and the other rank stops at once, naming it."""
    sched = _one_chunk_schedule(tmp_path)

    def rank(comm):
        mod = _Flagged(scalar) if comm.rank == 0 else _Tail()
        pipe = Pipeline(mod, sched, loss_fn=nn.MSELoss(), _comm=comm)
        x, y = _batch(0, 8)
        return getattr(pipe, call)(x if comm.rank == 0 else None, target=y if comm.rank == 1 else None)

    with pytest.raises(Exception, match="stage 0's output 1 has shape .* split on dim 0 by sample"):
        World(2).run(rank)


def test_a_list_of_chunk_modules_is_a_pipeline_too(tmp_path, caplog):
    """Everything a one-module Pipeline has: eval_step (one process's loss and output), given
    boundary shapes (a list per module), the BatchNorm warning and strict=, the shape-learning
    forward in eval mode (BatchNorm's statistics untouched)."""
    import logging

    from umopt.devices import TensorSpec
    from umopt.errors import UmoptError

    S, M = 2, 4
    prof = _profile(tmp_path, S)
    B = 8
    ch = chunking(prof, 2, "looped")
    sched = _schedule(prof, B, torch_ops("ScheduleInterleaved1F1B", S, 2, B, M), ch)
    layers = S * PER_STAGE
    models = [_layer(i, layers) for i in range(layers)]
    x, y = _batch(0, B)
    with torch.no_grad():
        full = nn.Sequential(*models)(x)
    want_loss = nn.MSELoss()(full, y)

    def rank(comm):
        mine = [j for j, r in enumerate(ch.ranks) if r == comm.rank]
        mods = [nn.Sequential(*models[slice(*ch.layers[j])]) for j in mine]
        specs = [[TensorSpec((D,), torch.float32)] for _ in mine]
        pipe = Pipeline(mods, sched, loss_fn=nn.MSELoss(), input_specs=specs, _comm=comm)
        return pipe.eval_step(x if 0 in mine else None, target=y if 3 in mine else None, outputs=True)

    got = World(S).run(rank)
    loss, out = got[ch.ranks[-1]]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)

    norm = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D))

    def with_batch_norm(comm, strict):
        mine = [j for j, r in enumerate(ch.ranks) if r == comm.rank]
        mods = [norm if j == 1 else nn.Sequential(*models[slice(*ch.layers[j])]) for j in mine]
        pipe = Pipeline(mods, sched, loss_fn=nn.MSELoss(), strict=strict, _comm=comm)
        if comm.rank == 1:
            pipe.prepare()
        else:
            pipe.prepare(x)
        return norm[1].num_batches_tracked.item() if comm.rank == 1 else None

    with pytest.raises(UmoptError, match="virtual stage 1 has BatchNorm layers"):
        World(S).run(lambda comm: with_batch_norm(comm, True))
    with caplog.at_level(logging.WARNING, logger="umopt"):
        tracked = World(S).run(lambda comm: with_batch_norm(comm, False))
    assert "virtual stage 1 has BatchNorm layers" in caplog.text and tracked[1] == 0


def test_a_rank_that_fails_building_its_pipeline_stops_the_others_at_once(tmp_path):
    """Stage 1 forgets its loss: it says so, and stage 0, waiting for it in the set-up, stops at
    once with stage 1's words (not after a timeout)."""
    sched = _one_chunk_schedule(tmp_path)
    errors = {}

    def rank(comm):
        mod = nn.Linear(D, D) if comm.rank == 0 else nn.Linear(D, 1)
        try:
            Pipeline(mod, sched, loss_fn=nn.MSELoss() if comm.rank == 0 else None, _comm=comm)
        except Exception as exc:  # noqa: BLE001 - what each rank said
            errors[comm.rank] = str(exc)

    World(2).run(rank)
    assert errors[1] == "the last stage needs loss_fn"
    assert errors[0].startswith(
        "stage 1 failed: UmoptError: the last stage needs loss_fn (rank 0 was waiting for"
    )


def test_a_loss_that_is_not_one_number_is_refused_in_one_line(tmp_path):
    sched = _one_chunk_schedule(tmp_path)

    def rank(comm):
        mod = nn.Linear(D, D) if comm.rank == 0 else nn.Linear(D, 1)
        per_sample = lambda out, y: ((out - y) ** 2).mean(dim=1)  # noqa: E731
        pipe = Pipeline(mod, sched, loss_fn=per_sample, _comm=comm)
        x, y = _batch(0, 8)
        pipe.step(x if comm.rank == 0 else None, target=y if comm.rank == 1 else None)

    with pytest.raises(Exception, match=r"loss_fn returned \(4,\) for a chunk: it must return one number"):
        World(2).run(rank)


def test_clip_grad_norm_clips_by_the_whole_models_norm(tmp_path):
    """A rank's own gradient norm is a part of the model's: pipe.clip_grad_norm_ sums it over the
    pipeline, as torch.nn.utils.clip_grad_norm_ on the whole model in one process."""
    S = 3
    sched = _schedule(_profile(tmp_path, S), 12, Candidate([[4, 8]] * S, [[4, 8]] * S, "gpipe").ops())
    layers = S * PER_STAGE
    models = [_layer(i, layers) for i in range(layers)]
    x, y = _batch(0, 12)
    ref = nn.Sequential(*[_layer(i, layers) for i in range(layers)])
    nn.MSELoss()(ref(x), y).backward()
    want_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.05)

    def rank(comm):
        mod = nn.Sequential(*models[comm.rank * PER_STAGE : (comm.rank + 1) * PER_STAGE])
        pipe = Pipeline(mod, sched, loss_fn=nn.MSELoss(), _comm=comm)
        pipe.step(x if comm.rank == 0 else None, target=y if comm.rank == S - 1 else None)
        return pipe.clip_grad_norm_(0.05)

    norms = World(S).run(rank)
    for n in norms:
        torch.testing.assert_close(n, want_norm, rtol=1e-5, atol=1e-7)
    for mine, theirs in zip(nn.Sequential(*models).parameters(), ref.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
