"""transformers' causal language models as pipeline stages (umopt/hf.py): Llama, Qwen2 and GPT-2
(tied embeddings) train exactly as transformers' own model computes on the whole minibatch, each
sequence alone, packed and padded, by umopt's planner and the peers, one chunk per rank and two;
bad input is one line. Ranks are threads over tests/lazycomm.py's model of NCCL's transport, each
rank its own copy of its layers, as processes have."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("transformers")

import umopt  # noqa: E402
from umopt.errors import UmoptError  # noqa: E402
from umopt.search.method import Request  # noqa: E402
from umopt.search.peers import PEERS  # noqa: E402
from umopt.search.solve_lengths import plan_schedule  # noqa: E402
from umopt.search.solvers.per_step import plan  # noqa: E402
from umopt.search.solvers.per_step_chunks import plan_chunks  # noqa: E402
from umopt.synthetic import synthetic_token_profile  # noqa: E402
from umopt.zoo import Layers, build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from lazycomm import World  # noqa: E402

VOCAB, LONGEST = 128, 64
TINY = {
    "llama": dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=4),
}
for _args in TINY.values():
    _args.update(vocab_size=VOCAB, max_position_embeddings=LONGEST)
TINY["llama"]["intermediate_size"] = TINY["qwen2"]["intermediate_size"] = 64
# 2 ranks: the embedding and three blocks, then two blocks, the norm and the head (4 layers a rank,
# so that two chunks a rank cut them in pairs)
PROFILE = synthetic_token_profile(2, blocks=2, max_length=LONGEST, max_size=16, layers_per_stage=4)
LENGTHS = [3, 40, 1, 7, 22, 2, 35, 5]


def _transformers_model(family: str):
    """transformers' own model with the weights umopt's build gets (the same seed, the same
    config: umopt's small sizes' dropouts off)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import umopt.hf as hf

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{k: 0.0 for k in hf._DROPOUTS}, **TINY[family])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _sequences(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        t = torch.randint(0, VOCAB, (n + 1,), generator=g)
        y = t[1:].clone()
        y[torch.rand(n, generator=g) < 0.15] = -100  # ignored targets, as a fine-tune's prompt
        out.append((t[:-1], y))
    return out


def _unique(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _plans():
    L = np.array(LENGTHS)
    out = {
        "planner, packed": plan(PROFILE, L, mode="packed", budget_ms=30),
        "planner, padded": plan(PROFILE, L, mode="padded", budget_ms=30),
        "pad to the longest": PEERS["pad"].plan(Request(PROFILE, L)),
        "packed rows": PEERS["pack"].plan(Request(PROFILE, L)),
        "two chunks a rank, packed": plan_chunks(PROFILE, L, 2, mode="packed", budget_ms=200),
        "two chunks a rank, padded": plan_chunks(PROFILE, L, 2, mode="padded", budget_ms=200),
    }
    return {name: plan_schedule(p, PROFILE) for name, p in out.items()}


PLANS = _plans()


def _train(parts, sched, seqs):
    """One step of ``sched`` on 2 ranks, each its own copy of its layers (tied weights copied
    apart, as processes hold them): each rank's layers after it, and the loss."""
    layout = sched.layout(PROFILE)
    held = {r: [j for j, rr in enumerate(layout.ranks) if rr == r] for r in (0, 1)}
    copies, losses = {}, {}
    for r in (0, 1):  # deep-copied together: a rank holding both tied layers holds one weight
        chunks = copy.deepcopy([parts.layers[slice(*layout.layers[j])] for j in held[r]])
        copies[r] = chunks

    def rank(comm):
        r = comm.rank
        modules = [Layers(c) for c in copies[r]]
        indices = [i for j in held[r] for i in range(*layout.layers[j])]
        pipe = umopt.Pipeline(
            modules if sched.chunks is not None else modules[0],
            sched,
            profile=PROFILE,
            loss_fn=nn.CrossEntropyLoss(),
            dtype="float32",
            _comm=comm,
            select=False,
            tied=parts.tied_in(indices, [m for c in copies[r] for m in c]),
        )
        kw = {"inputs": [x for x, _ in seqs]} if 0 in held[r] else {}
        kw |= {"targets": [y for _, y in seqs]} if len(layout.ranks) - 1 in held[r] else {}
        losses[r] = pipe.step(plan=sched, **kw)

    World(2).run(rank)
    last = layout.ranks[-1]
    # the model's layers in order again, whichever rank and chunk held each
    by_layer = {}
    for r in (0, 1):
        for j, chunk in zip(held[r], copies[r]):
            for k, layer in enumerate(chunk):
                by_layer[layout.layers[j][0] + k] = layer
    return [by_layer[i] for i in sorted(by_layer)], float(losses[last])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_a_transformers_model_trains_as_transformers_computes_it(family):
    parts = build_model(f"hf:{family}", TINY[family], seed=0)
    assert len(parts.layers) == 8 and PROFILE.stages[-1].layers[1] == 8
    reference = _transformers_model(family)
    theirs = list(reference.parameters())
    ours = _unique(p for layer in parts.layers for p in layer.parameters())
    assert [p.shape for p in ours] == [p.shape for p in theirs] and all(map(torch.equal, ours, theirs))
    assert bool(parts.tied) == (family == "gpt2")  # GPT-2's lm_head is its wte
    seqs = _sequences(1)
    valid = sum(int((y != -100).sum()) for _, y in seqs)
    loss = sum(F.cross_entropy(reference(input_ids=x[None]).logits[0], y, reduction="sum") for x, y in seqs)
    loss = loss / valid
    loss.backward()
    want = [p.grad for p in theirs]
    for name, sched in PLANS.items():
        layers, got_loss = _train(parts, sched, seqs)
        assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5), name
        got = _unique(p for layer in layers for p in layer.parameters())
        if parts.tied:  # the head's copy of the embedding: the same gradient, summed over the ranks
            (i, a), (k, b) = parts.tied[0]
            first, last = layers[i].get_parameter(a), layers[k].get_parameter(b)
            if first is not last:
                torch.testing.assert_close(last.grad, first.grad, rtol=0, atol=0, msg=name)
                got = [p for p in got if p is not last]
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            torch.testing.assert_close(g.grad, w, rtol=1e-5, atol=1e-7, msg=name)


def test_a_stage_after_several_decoder_layers_learns_its_edges_without_their_shared_parts():
    """A rank learns what its stage receives by running the layers before it, freeing each after
    its step: a Llama's decoder layers share one rotary embedding, which the first one's step must
    not free for the others (a stage of only the norm and the head failed to build so)."""
    from umopt.devices import boundary_tensors

    parts = build_model("hf:llama", TINY["llama"], seed=0)
    x = parts.make_batch(1, 0)[0]
    want = boundary_tensors(parts.layers, x, torch.device("cpu"), "float32")
    n = len(parts.layers)  # the embedding, 5 decoder layers, the norm, the head
    got = boundary_tensors(parts.layers[: n - 1], x, torch.device("cpu"), "float32", release_before=n - 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert all(p.device.type != "meta" for layer in parts.layers[n - 2 :] for p in layer.parameters())
    assert any(p.device.type == "meta" for p in parts.layers[1].parameters())  # the layers before: freed


def test_a_saved_model_is_loaded_with_its_weights_and_bad_models_are_one_line(tmp_path):
    reference = _transformers_model("llama")
    reference.save_pretrained(tmp_path / "mine")
    parts = build_model(f"hf:{tmp_path / 'mine'}", {}, seed=123)  # the file's weights, not the seed's
    ours = _unique(p for layer in parts.layers for p in layer.parameters())
    assert all(map(torch.equal, ours, reference.parameters()))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "mine" / "config.json").read_text())
    cases = [
        ("hf:nosuchfamily", {}, "not a transformers model_type"),
        ("hf:t5", {}, "an encoder-decoder model"),
        ("hf:bert", {}, "decoder layers are not a list"),
        (
            "hf:llama",
            dict(hidden_size=30, num_attention_heads=4),
            "4 attention heads do not divide the width 30",
        ),
        (f"hf:{tmp_path / 'empty'}", {}, "has no weights"),
    ]
    for name, args, said in cases:
        with pytest.raises(UmoptError, match=said) as err:
            build_model(name, args)
        assert "\n" not in str(err.value)


def test_umopt_run_trains_a_transformers_model_with_tied_embeddings_on_two_processes(tmp_path, monkeypatch):
    """``umopt run PLAN --data fn`` on GPT-2 (its wte the LM head's weight) over two gloo
    processes, the tied weight a copy on each: the first step's gradients are transformers' own on
    the whole minibatch, the head's copy the embedding's (summed over the two ranks)."""
    import os

    from userzoo import hf_sequences

    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.schedule import save_schedule
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions

    monkeypatch.setenv(
        "PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    base = synthetic_token_profile(2, blocks=2, max_length=LONGEST, max_size=16)
    prof = base.model_copy(
        update={
            "model": base.model.model_copy(update={"name": "hf:gpt2", "args": dict(TINY["gpt2"]), "seed": 0}),
            "device": base.device.model_copy(update={"dtype": "float32"}),
            "stages": [
                st.model_copy(update={"layers": [4 * s, 4 * s + 4]}) for s, st in enumerate(base.stages)
            ],
        }
    )
    save_profile(prof, tmp_path / "p.json")
    prof = load_profile(tmp_path / "p.json")
    xs, ys = hf_sequences(0, 10)
    save_schedule(
        plan_schedule(plan(prof, np.array([len(x) for x in xs])), prof), str(tmp_path / "plan.json")
    )
    opts = RunOptions(
        schedules=[str(tmp_path / "plan.json")],
        steps=1,
        warmup=0,
        data="userzoo:hf_sequences",
        save_grads=str(tmp_path / "g"),
        report=str(tmp_path / "r.json"),
    )
    launch(opts, quiet=True)
    got = {}
    for s in range(2):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    reference = _transformers_model("gpt2")
    valid = sum(int((y != -100).sum()) for y in ys)
    loss = sum(
        F.cross_entropy(reference(input_ids=x[None]).logits[0], y, reduction="sum") for x, y in zip(xs, ys)
    )
    (loss / valid).backward()
    parts = build_model("hf:gpt2", TINY["gpt2"], seed=0)
    by_id = {
        id(p): r.grad
        for p, r in zip(_unique(p for ly in parts.layers for p in ly.parameters()), reference.parameters())
    }
    named = {
        f"layers.{i}.{n}": by_id[id(p)]
        for i, ly in enumerate(parts.layers)
        for n, p in ly.named_parameters(remove_duplicate=False)
    }
    assert set(got) == set(named) and "layers.7.head.weight" in got  # the head's copy too
    for k, w in named.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-7, msg=k)
