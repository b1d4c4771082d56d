"""Peak memory measured on CPUs (umopt/measure/memory.py): torch's profiler's running total of a
step's allocations, and what a rank holds counted from its tensors."""

from __future__ import annotations

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
