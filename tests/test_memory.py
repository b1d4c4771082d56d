"""Peak memory measured on CPUs (umopt/measure/memory.py): torch's profiler's running total of a
step's allocations, and what a rank holds counted from its tensors."""

from __future__ import annotations

import pytest
import torch

from umopt.measure.memory import held_bytes, peak_during, state_tensors

MiB = 2**20


def test_a_steps_peak_counts_what_it_allocates_and_frees_beyond_what_was_held():
    held = torch.zeros(MiB // 4)  # 1 MiB, allocated before: not the step's

    def step():
        a = torch.ones(2 * MiB // 4)  # 2 MiB
        b = a * 2  # 4 MiB at once: the peak
        del a
        c = torch.ones(MiB // 4)  # 3 MiB
        return float((b.sum() + c.sum()).item())

    out, peak = peak_during(step, torch.device("cpu"))
    assert out == 5 * MiB // 4
    assert 4 * MiB <= peak <= 4 * MiB + 4096  # a scalar or two beside the tensors
    assert held_bytes([held, held[:10], held.view(2, -1)]) == MiB  # one storage, counted once


def test_what_a_rank_holds_is_its_weights_kept_gradients_and_optimizer_state():
    m = torch.nn.Linear(256, 256)  # 65,792 parameters
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    weights = 65_792 * 4
    assert held_bytes(state_tensors([m], opt)) == weights
    m(torch.randn(4, 256)).sum().backward()
    opt.step()  # momentum buffers made
    assert held_bytes(state_tensors([m], opt)) == 3 * weights  # weights, gradients, momentum


@pytest.mark.slow
def test_a_chunks_output_is_let_go_at_its_backward_not_at_the_steps_end(tmp_path):
    """1F1B on a middle stage holds the outputs of the chunks in flight, not all of the step's:
    with 16 chunks its peak is well under that of 4 (each chunk a quarter the size). While the
    step kept every send until its end, every chunk's output (and input gradient) stayed, and the
    16-chunk step held about as much as the 4-chunk one ([Note: a send let go])."""
    import json

    from umopt.cli import main

    from umopt.costmodel import CostTables, simulate
    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.schedule import make_schedule, save_schedule
    from umopt.search.problem import Candidate
    from umopt.synthetic import synthetic_profile

    W, B = 256, 1024  # activations of a megabyte a minibatch, weights of a quarter of one a layer
    args = dict(layers=6, width=W, in_features=W, num_classes=10)
    prof = synthetic_profile(3, max_size=256, seed=1, bytes_per_sample=W * 4)
    prof = prof.model_copy(
        update={
            "model": prof.model.model_copy(update={"name": "mlp", "args": args}),
            "stages": [
                st.model_copy(update={"layers": [2 * s, 2 * s + 2]}) for s, st in enumerate(prof.stages)
            ],
        }
    )
    save_profile(prof, tmp_path / "p.json")
    prof = load_profile(tmp_path / "p.json")
    tables = CostTables.from_profile(prof, False, minibatch=B)
    for m in (4, 16):
        parts = [[B // m] * m] * 3
        ops = Candidate(parts, parts, "1f1b").ops()
        info = {"name": f"m{m}", "status": "feasible", "seconds": 0.0}
        save_schedule(
            make_schedule(prof, B, False, ops, simulate(tables, ops, B), info, {}),
            str(tmp_path / f"m{m}.json"),
        )
    for m in (4, 16):  # a run each: what one holds is not the other's baseline
        main(["-q", "run", str(tmp_path / f"m{m}.json"), "--steps", "1", "--warmup", "1"]
             + ["--no-select", "--report", str(tmp_path / f"r_m{m}.json")])  # fmt: skip
    peak = {
        m: json.loads((tmp_path / f"r_m{m}.json").read_text())["peak_memory_bytes"]["measured"]
        for m in (4, 16)
    }
    assert peak[16][1] < 0.85 * peak[4][1], peak
