"""What a rank of ``umopt run`` trains on when its schedule is a plan for sequences of different
lengths: each step's minibatch of sequences, and on the ranks that make plans, each step's plan,
made ahead while the step before trains.

The sequences come from ``--data package.module:fn`` (``fn(step, n)`` returns the global
minibatch's inputs and targets, two lists of 1-d tensors, ``n`` the number of sequences the
schedule file was planned for times the replicas: a hint, any count is taken), else from the
model's own sequences (``umopt.zoo``) of lengths drawn from ``--lengths SAMPLER`` (seeded by the
step), else of the schedule file's own lengths every step. Every rank that holds sequences reads
the whole global minibatch and takes its replica's share: by default the sequences that make the
replicas' pipelines finish together (:func:`umopt.search.replicas.assign`, the same on every rank
without a word exchanged), or by ``--assign`` a peer's (``contiguous``: the r-th of ``dp``
contiguous parts, as torch's DistributedSampler); methods that take turns may each have their own
(``umopt tune --lengths --dp``: umopt's against the peers' as their frameworks split).

The first stage of each replica makes that replica's plans (one maker a step, see [Note: one plan
a step, one maker] in umopt/run/pipeline.py): a :class:`umopt.run.ahead.PlanAhead` process per
planning method is sent step k + 1's lengths as step k starts, so a plan costs a step no time
unless it is late, and then the wait is in the step's time (a late plan is the method's cost).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..costmodel import Chunking
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.schedule import Schedule
from ..samplers import minibatch_of_step
from ..search.replicas import assign
from .ahead import PlanAhead

__all__ = ["SequenceFeed", "sequence_source"]

Sequences = tuple[list[torch.Tensor], list[torch.Tensor]]
_KEPT = 3  # steps whose sequences are kept (this one, the next one planned ahead, one spare)


def sequence_source(
    data_fn: Optional[Callable[[int, int], Sequences]],
    make: Optional[Callable[..., list]],
    lengths: Optional[str],
    schedule: Schedule,
    cap: Optional[int],
    what: str,
) -> Callable[[int, int], Sequences]:
    """``fn(step, n)``: the global minibatch of step ``step`` (see the module docstring), checked."""
    assert schedule.lengths is not None
    own = list(schedule.lengths.lengths)
    if data_fn is None and make is None:
        raise UmoptError(
            "the model takes no sequences of different lengths: give --data package.module:fn for this plan"
        )

    def model_sequences(step: int, n: int) -> Sequences:
        assert make is not None
        L = own * (n // len(own)) if lengths is None else minibatch_of_step(lengths, step, n, cap)
        pairs = make([int(x) for x in L], step)
        return [x for x, _ in pairs], [y for _, y in pairs]

    def checked(step: int, n: int) -> Sequences:
        got = data_fn(step, n) if data_fn is not None else model_sequences(step, n)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise UmoptError(
                f"{what} returned {type(got).__name__} for step {step}: return (inputs, targets)"
            )
        xs, ys = got
        if not all(isinstance(v, (list, tuple)) for v in (xs, ys)):
            raise UmoptError(
                f"{what}: a plan for sequences of different lengths takes lists of 1-d tensors, one per "
                f"sequence, as inputs and targets (step {step} returned {type(xs).__name__})"
            )
        if len(xs) != len(ys) or not xs:
            raise UmoptError(f"{what} returned {len(xs)} inputs and {len(ys)} targets for step {step}")
        for i, (x, y) in enumerate(zip(xs, ys)):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                raise UmoptError(f"{what}: sequence {i} of step {step} is not a tensor of tokens")
            if x.dim() != 1 or y.dim() != 1:
                raise UmoptError(
                    f"{what}: sequence {i} of step {step} has inputs {tuple(x.shape)} and targets {tuple(y.shape)}: "
                    "each is a 1-d tensor of tokens"
                )
            if x.shape[0] == 0:
                raise UmoptError(
                    f"{what}: sequence {i} of step {step} is empty (a sequence has a token or more)"
                )
            if x.shape[0] != y.shape[0]:
                raise UmoptError(
                    f"{what}: sequence {i} of step {step} has {x.shape[0]} inputs and {y.shape[0]} targets"
                )
            if cap is not None and x.shape[0] > cap:
                raise UmoptError(
                    f"{what}: sequence {i} of step {step} has {x.shape[0]} tokens, more than the profile "
                    f"costs ({cap}; profile with a larger --lengths)"
                )
        return list(xs), list(ys)

    return checked


class SequenceFeed:
    """One rank's sequences and (where it makes them) plans, step by step (the module docstring).

    ``layouts``: the planning methods whose plans this rank makes (empty: it makes none), each
    with its pipeline's layout where its ranks hold several chunks (every plan of it keeps it);
    ``assigns``: each method's assignment of the global minibatch to the replicas (default umopt's)."""

    def __init__(
        self,
        source: Callable[[int, int], Sequences],
        asked: int,
        dp: int,
        replica: int,
        profile: Profile,
        recompute: bool,
        allreduce: Optional[AllReduceProfile],
        layouts: Optional[dict[str, Optional[Chunking]]] = None,
        assigns: Optional[dict[str, str]] = None,
    ):
        self.source, self.asked, self.dp, self.replica = source, asked, dp, replica
        self.assigns = assigns or {}
        self.profile, self.recompute, self.allreduce = profile, recompute, allreduce
        self.layouts = layouts or {}
        self.methods = tuple(self.layouts)
        self._steps: dict[int, Sequences] = {}  # each step's global minibatch
        self._shares: dict[tuple[int, str], list[int]] = {}  # (step, assignment): this replica's
        self._ahead: dict[str, PlanAhead] = {}
        self._queued: dict[str, list[int]] = {m: [] for m in self.methods}  # steps submitted, not taken
        self._early: dict[tuple[int, str], Schedule] = {}  # plans taken as soon as they were made
        self.tokens: dict[int, int] = {}  # each step's real tokens, all replicas together

    def batch(self, step: int, method: str) -> Sequences:
        """This replica's sequences of ``step`` as ``method``'s assignment gives them."""
        if step not in self._steps:
            xs, ys = self.source(step, self.asked)
            if len(xs) < self.dp:
                raise UmoptError(f"step {step}'s minibatch has {len(xs)} sequences for {self.dp} replicas")
            self.tokens[step] = sum(int(x.shape[0]) for x in xs)
            self._steps[step] = (xs, ys)
            for old in [k for k in self._steps if k <= step - _KEPT]:
                del self._steps[old]
                for key in [key for key in self._shares if key[0] == old]:
                    del self._shares[key]
        xs, ys = self._steps[step]
        how = self.assigns.get(method, "umopt")
        if (step, how) not in self._shares:
            lengths = [int(x.shape[0]) for x in xs]
            self._shares[(step, how)] = (
                assign(self.profile, lengths, self.dp, how).replicas[self.replica]
                if self.dp > 1
                else list(range(len(xs)))
            )
        mine = self._shares[(step, how)]
        return [xs[i] for i in mine], [ys[i] for i in mine]

    def lengths(self, step: int, method: str) -> list[int]:
        return [int(x.shape[0]) for x in self.batch(step, method)[0]]

    def plan(self, step: int, method: str, following: Optional[tuple[int, str]]) -> Schedule:
        """``method``'s plan of ``step``, after sending ``following`` (the step after it, and who
        plans it) to be planned meanwhile."""
        if (step, method) in self._early:
            if following is not None:
                self._submit(*following)
            return self._early.pop((step, method))
        self._submit(step, method)
        if following is not None:
            self._submit(*following)
        self._drop_before(step, method)
        self._queued[method].pop(0)
        return self._ahead[method].next()

    def ready(self, step: int, method: str) -> Optional[Schedule]:
        """``method``'s plan of ``step`` if it is made already (submitted earlier, by :meth:`plan`'s
        ``following``), else None: a plan to share with the other ranks before the step starts."""
        if (step, method) in self._early:
            return self._early[(step, method)]
        if step not in self._queued.get(method, []):
            return None
        self._drop_before(step, method)
        got = self._ahead[method].ready()
        if got is not None:
            self._queued[method].pop(0)
            self._early[(step, method)] = got
        return got

    def _drop_before(self, step: int, method: str) -> None:
        queued = self._queued[method]
        while queued[0] != step:  # planned ahead for a step this method did not play: dropped
            self._ahead[method].next()
            queued.pop(0)

    def _submit(self, step: int, method: str) -> None:
        if step in self._queued[method]:
            return
        if method not in self._ahead:
            self._ahead[method] = PlanAhead(
                self.profile,
                recompute=self.recompute,
                dp=self.allreduce,
                method=method,
                on=self.layouts[method],
            )
        self._ahead[method].submit(self.lengths(step, method))
        self._queued[method].append(step)

    def close(self) -> None:
        for ahead in self._ahead.values():
            ahead.close()
