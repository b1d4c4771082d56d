"""The cost model: how long a schedule takes and how much memory it needs.

This module is the single source of predicted times. :func:`simulate` is the plain reference
simulator of docs/formats.md ("Cost model"): it plays any op lists (GPipe, 1F1B or any other order)
and returns the iteration time, per-stage busy time and peak memory, and the timeline of every op
and message. Solvers that need speed use :mod:`umopt.schedules.population_sim`, which must agree with this to
1e-9 and is tested against it.

Times are milliseconds. Chunk sizes are whole samples, so per-size costs are tabulated once, with
linear interpolation between the profile's measured sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .chunks import virtual_stages
from .errors import UmoptError
from .formats.ops import Chunking, ChunkOp, Op, OpKind, op_stage
from .limits import MAX_MS

if TYPE_CHECKING:  # (the formats import the cost model to check schedules)
    from .formats.profile import AllReduceProfile, Profile

__all__ = [
    "OpKind",
    "Op",
    "ChunkOp",
    "Chunking",
    "CostTables",
    "Span",
    "Message",
    "Timeline",
    "simulate",
    "stage_peak_memory",
    "rank_peak_memory",
    "allreduce_ms",
]


@dataclass(frozen=True)
class CostTables:
    """Per-size costs of one profile, indexed by chunk size ``b`` (index 0 is an empty chunk).

    ``fwd[s, b]`` and ``bwd[s, b]`` are the durations of an F and a B op of ``b`` samples on stage
    ``s``; with ``recompute`` a B op re-runs the forward, so ``bwd`` already includes it.
    ``link[s, b]`` is the time of a ``b``-sample message over link ``s`` (either direction).
    ``allreduce_ms[r]`` is the all-reduce of rank ``r``'s gradients among its data-parallel
    replicas, after its last op (zeros for one pipeline). ``bwd_input`` and ``bwd_weight`` are the
    B and W ops of a stage whose backward is split (None where the profile has no split).
    ``static_bytes[s]`` is what stage s holds through the whole step: parameters, gradients and
    optimizer state, and, where the tables are for one minibatch, the runtime's receive buffers
    and the all-reduce's buckets (see [Note: what a step holds besides its activations]).

    With several chunks per rank (``ranks`` set), every per-stage table is per *virtual* stage,
    ``ranks[j]`` is the rank virtual stage ``j`` runs on, and ``link[j]`` is the message from
    virtual stage ``j`` to ``j + 1`` over their ranks' link (zero on one rank).
    """

    fwd: np.ndarray
    bwd: np.ndarray
    link: np.ndarray
    optimizer_ms: float
    recompute: bool
    static_bytes: np.ndarray
    stash_bytes: np.ndarray
    input_bytes: np.ndarray
    memory_limit: int | None
    allreduce_ms: np.ndarray
    bwd_input: np.ndarray | None = None
    bwd_weight: np.ndarray | None = None  # one B chunk's weight gradient as a W op
    op_overhead: np.ndarray | None = None  # (S,) the runtime's cost per op, inside every entry above
    ranks: tuple[int, ...] | None = None  # the rank of each virtual stage (None: stage s on rank s)
    # one minibatch of sequences of different lengths: every cost by sample range (None: by size)
    ranged: RangeCosts | None = None
    # what an op allocates while it runs, (S,) each: fixed, per sample (by size) or per token
    # (by range), and the optimizer step's (see [Note: what an op allocates while it runs])
    work_bytes: np.ndarray | None = None
    work_per_unit: np.ndarray | None = None
    optimizer_work_bytes: np.ndarray | None = None
    # of static_bytes, the receive buffers of the minibatch (None: not counted; [Note: what a step
    # holds besides its activations]): what the runtime's pool holds instead where it is larger
    buffer_bytes: np.ndarray | None = None

    # --- a chunk's costs: by its size, or by its sample range (see [Note: costs by sample range])
    def op_ms(self, table: str, s, lo, hi):
        """The duration of an op on samples ``[lo, hi)`` of stage ``s`` from ``table`` ("fwd",
        "bwd", "bwd_input", "bwd_weight"); ``lo``, ``hi`` may be arrays."""
        if self.ranged is None:
            return getattr(self, table)[s][hi - lo]
        return getattr(self.ranged, table)[s][lo, hi]

    def link_ms(self, ln: int, lo, hi):
        """A message of samples ``[lo, hi)`` across boundary ``ln``."""
        if self.ranged is None:
            return self.link[ln][hi - lo]
        return self.ranged.link[ln][lo, hi]

    def stash_of(self, s: int, lo, hi):
        """Bytes stage ``s`` keeps for the backward of samples ``[lo, hi)``."""
        if self.ranged is None:
            return (hi - lo) * self.stash_bytes[s]
        return self.ranged.stash[s][lo, hi]

    def input_of(self, s: int, lo, hi):
        """Bytes of stage ``s``'s inputs for samples ``[lo, hi)`` (what recompute keeps)."""
        if self.ranged is None:
            return (hi - lo) * self.input_bytes[s]
        return self.ranged.inputs[s][lo, hi]

    def work_of(self, s: int, lo, hi):
        """Bytes an F or B op on samples ``[lo, hi)`` of stage ``s`` allocates while it runs
        beyond what the stage keeps (0 for an empty range, and where not measured)."""
        if self.work_bytes is None:
            return 0 * (hi - lo)
        units = (hi - lo) if self.ranged is None else self.ranged.range_tokens[lo, hi]
        return np.where(units > 0, self.work_bytes[s] + units * self.work_per_unit[s], 0)

    @property
    def additive(self) -> bool:
        """Whether a range's bytes are the sum of its samples' (by size, or packed sequences; not
        padded ones, whose chunk pads every sequence to its longest)."""
        return self.ranged is None or self.ranged.mode == "packed"

    @property
    def num_stages(self) -> int:
        """Stages of the cost tables: virtual stages where several chunks share a rank."""
        return self.fwd.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.num_stages if self.ranks is None else max(self.ranks) + 1

    def rank_of(self, stage: int) -> int:
        return stage if self.ranks is None else self.ranks[stage]

    def channel(self, boundary: int, direction: str) -> tuple[int, int]:
        """The (sender, receiver) ranks of a message across ``boundary`` (virtual stage
        ``boundary`` to ``boundary + 1``): messages between one pair, one way, queue on it."""
        a, b = self.rank_of(boundary), self.rank_of(boundary + 1)
        return (a, b) if direction == "fwd" else (b, a)

    @property
    def max_size(self) -> int:
        return self.fwd.shape[1] - 1

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        recompute: bool = False,
        dp: AllReduceProfile | None = None,
        chunks: Chunking | None = None,
        minibatch: int | None = None,
    ) -> "CostTables":
        """The tables of ``profile``; with ``dp`` (replicas and their all-reduce speed), each rank's
        gradient all-reduce among them; with ``chunks``, per virtual stage, summed from the
        profile's per-layer entries (:func:`umopt.chunks.virtual_stages`); with ``minibatch``,
        the memory the runtime holds for a minibatch of that size beside the profile's static
        bytes (see [Note: what a step holds besides its activations])."""
        sizes = np.asarray(profile.sizes, dtype=float)
        b = np.arange(profile.max_size + 1, dtype=float)
        if chunks is None:
            stages, links, ranks = profile.stages, profile.links, None
        else:
            stages, links = virtual_stages(profile, chunks)
            ranks = tuple(chunks.ranks)
        # an op costs its compute and the runtime's own cost per op; a message its transfer and
        # the runtime's cost per message (both 0 unless fitted to runs: docs/formats.md)
        over = np.array([[st.op_overhead_ms] for st in stages])
        fwd = np.array([np.interp(b, sizes, st.forward_ms) for st in stages]) + over
        bwd = np.array([np.interp(b, sizes, st.backward_ms) for st in stages]) + over
        split = {}
        if all(st.backward_input_ms is not None for st in stages):
            split["bwd_input"] = np.array([np.interp(b, sizes, st.backward_input_ms) for st in stages]) + over
            split["bwd_weight"] = (
                np.array([np.interp(b, sizes, st.backward_weight_ms) for st in stages]) + over
            )
            split["op_overhead"] = over[:, 0].copy()
        if recompute:  # the recomputed forward runs inside the B op: one op, one overhead
            bwd = bwd + fwd - over
            if split:
                split["bwd_input"] = split["bwd_input"] + fwd - over
        fwd[:, 0] = bwd[:, 0] = 0.0
        for key in ("bwd_input", "bwd_weight"):
            if key in split:
                split[key][:, 0] = 0.0
        link = np.array(
            [
                np.where(
                    b > 0,
                    ln.latency_ms + ln.message_overhead_ms + b * st.output_bytes_per_sample / ln.bytes_per_ms,
                    0.0,
                )
                if ln is not None
                else np.zeros(len(b))  # two virtual stages on one rank: no message
                for ln, st in zip(links, stages)
            ]
        ).reshape(len(links), len(b))
        checked = [
            ("an F op of {b} samples on stage {s}", fwd),
            ("a B op of {b} samples on stage {s}", bwd),
            ("a message of {b} samples over link {s}", link),
        ]
        checked += [
            (f"a {k} op of {{b}} samples on stage {{s}}", split[key])
            for k, key in ((OpKind.B, "bwd_input"), (OpKind.W, "bwd_weight"))
            if key in split
        ]
        for what, arr in checked:
            if arr.size and not arr.max() <= MAX_MS:  # not <=: also NaN
                s, b = np.unravel_index(int(np.argmax(np.where(np.isnan(arr), np.inf, arr))), arr.shape)
                raise UmoptError(
                    f"{what.format(s=s, b=b)} would take {arr[s, b]:.3g} ms, over umopt's limit of {MAX_MS:.0e} ms"
                )
            arr.setflags(write=False)
        buffers = _buffer_bytes(stages, minibatch)
        return cls(
            fwd=fwd,
            bwd=bwd,
            link=link,
            optimizer_ms=max(st.optimizer_ms for st in profile.stages),
            recompute=recompute,
            static_bytes=np.array([st.static_bytes for st in stages], dtype=np.int64)
            + buffers
            + _bucket_bytes(stages, ranks, dp),
            buffer_bytes=buffers if minibatch is not None else None,
            stash_bytes=np.array([st.stash_bytes_per_sample for st in stages], dtype=np.int64),
            input_bytes=np.array([st.input_bytes_per_sample for st in stages], dtype=np.int64),
            memory_limit=profile.memory_limit_bytes,
            allreduce_ms=_allreduce_per_rank(stages, ranks, dp),
            ranks=ranks,
            **split,
            **_work(stages, [st.work_bytes_per_sample for st in stages]),
        )


# [Note: what an op allocates while it runs]
# What a stage keeps for backward is not all a step allocates: while an F or B op runs it holds
# temporaries besides (the loss's logits in float32, the gradients flowing back through the
# layers), and the optimizer step holds its own for a moment after the last op. The profiler
# measures both on CUDA (max_memory_allocated over a chunk's forward and backward, less what the
# chunk keeps: a fixed part and a part per sample, fitted on two sizes; over an optimizer step,
# less its state); CPUs keep no such count, and their profiles say 0. The model adds to a rank's
# peak the largest temporaries of any F or B op on it (a bound: the op running at the peak may
# be a smaller one) and takes the optimizer step's peak (static bytes and its temporaries, when
# nothing else is held) if that is larger. The bound keeps every evaluator's peak equal: it
# depends on the chunks' sizes, not on the order they run in.


def _work(stages: Sequence, per_unit: Sequence[int]) -> dict[str, np.ndarray]:
    """CostTables' work fields of ``stages`` (``per_unit``: per sample, or per token); none where
    nothing was measured (the evaluators then skip them)."""
    if not any(per_unit) and not any(st.work_bytes or st.optimizer_work_bytes for st in stages):
        return {}
    return {
        "work_bytes": np.array([st.work_bytes for st in stages], dtype=np.int64),
        "work_per_unit": np.array(per_unit, dtype=np.int64),
        "optimizer_work_bytes": np.array([st.optimizer_work_bytes for st in stages], dtype=np.int64),
    }


# [Note: what a step holds besides its activations]
# The runtime receives every boundary tensor into a buffer for the whole minibatch (a stage's
# neighbours may chunk differently; see umopt/run/stage.py), and, with data-parallel replicas,
# averages the gradients through flat buckets, at most two of ALLREDUCE_BUCKET_BYTES at a time. Both live
# through the step whatever the schedule, so they are part of what a stage holds beside its
# static bytes: per virtual stage, a buffer of its inputs (all but the first) and one of the
# gradients of its outputs (all but the last), a minibatch each; per rank, the buckets. The
# output buffer is counted at the stage's output bytes, integer tensors included (they carry no
# gradient): a bound, a few bytes per sample over. Counted where the tables are built for one
# minibatch (every solve, every check of a schedule); the schedules of one file share one set
# of buffers (selection's candidates play one at a time).
ALLREDUCE_BUCKET_BYTES = 25 << 20  # the runtime's bucket (torch DDP's default)


def _buffer_bytes(stages: Sequence, minibatch: int | None) -> np.ndarray:
    """Each (virtual) stage's receive buffers for a minibatch of ``minibatch`` samples (zeros:
    none counted)."""
    V = len(stages)
    out = np.zeros(V, dtype=np.int64)
    if minibatch is None:
        return out
    for j, st in enumerate(stages):
        per_sample = (st.input_bytes_per_sample if j > 0 else 0) + (
            st.output_bytes_per_sample if j < V - 1 else 0
        )
        out[j] = minibatch * per_sample
    return out


def _bucket_bytes(stages: Sequence, ranks: Sequence[int] | None, dp: AllReduceProfile | None) -> np.ndarray:
    """With data-parallel replicas, the all-reduce's buckets, on the first virtual stage of each rank."""
    out = np.zeros(len(stages), dtype=np.int64)
    if dp is not None and dp.replicas > 1:
        ranks = list(ranks) if ranks is not None else list(range(len(stages)))
        for r in sorted(set(ranks)):
            held = sum(st.param_bytes or 0 for st, rr in zip(stages, ranks) if rr == r)
            out[ranks.index(r)] += min(held, 2 * ALLREDUCE_BUCKET_BYTES)
    return out


# [Note: costs by sample range]
# With sequences of different lengths a chunk's cost depends on which samples it holds, not only
# how many. A minibatch's samples (sequences, or rows of packed sequences), in the order the
# planner chose, give each sample range [lo, hi) its tokens T (packed: the sum of its samples'
# tokens; padded: its size times its longest) and its squares Q (the attention's work: the sum
# of its sequences' squared lengths; padded: size times longest squared), and each op of a stage
# costs a + b T + c Q, a message latency + T x bytes per token / bandwidth, a chunk's stash T x
# bytes per token (docs/formats.md, "Sequences of different lengths"). RangeCosts holds every
# range's costs of one minibatch, from prefix sums (packed) or running maxima (padded): dense
# (B+1) x (B+1) per stage, as B is a minibatch's sequences, a few hundred at most, and every
# evaluator then looks a range up as cheaply as a size. A CostTables with `ranged` set answers
# op_ms() and its kin by range; its size-indexed tables then hold a sample of mean tokens'
# costs, for the heuristics that reason by size alone (a first guess, never a predicted time).


@dataclass(frozen=True)
class RangeCosts:
    """Every sample range's costs of one minibatch of sequences (see [Note: costs by sample
    range]): ``fwd[s][lo, hi]`` and its kin, arrays of shape (B+1, B+1) per stage."""

    tokens: np.ndarray  # each sample's tokens, in the planned order (padded: its own length)
    mode: str  # "packed" or "padded"
    range_tokens: np.ndarray  # (B+1, B+1): every range's tokens (padded: at its longest)
    fwd: np.ndarray
    bwd: np.ndarray
    link: np.ndarray
    stash: np.ndarray
    inputs: np.ndarray
    bwd_input: np.ndarray | None = None
    bwd_weight: np.ndarray | None = None


def range_tokens(
    tokens: np.ndarray, mode: str, squares: np.ndarray | None = None, docs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, Q, N): every range's tokens, squares and sequences, (B+1, B+1) arrays, zero where
    ``lo >= hi``. ``tokens[i]``: sample i's tokens (a sequence's length, or a packed row's);
    ``squares[i]``: the sum of its sequences' squared lengths (default: it is one sequence,
    ``tokens[i]**2``); ``docs[i]``: its sequences (default 1)."""
    L = np.asarray(tokens, dtype=float)
    B = len(L)
    lo = np.arange(B + 1)[:, None]
    hi = np.arange(B + 1)[None, :]
    valid = hi > lo
    p3 = np.concatenate([[0.0], np.cumsum(np.ones(B) if docs is None else np.asarray(docs, dtype=float))])
    N = p3[None, :] - p3[:, None]
    if mode == "packed":
        sq = L * L if squares is None else np.asarray(squares, dtype=float)
        p1 = np.concatenate([[0.0], np.cumsum(L)])
        p2 = np.concatenate([[0.0], np.cumsum(sq)])
        T = p1[None, :] - p1[:, None]
        Q = p2[None, :] - p2[:, None]
    elif mode == "padded":
        longest = np.zeros((B + 1, B + 1))
        for a in range(B):  # the longest of [a, hi) for every hi, as a running maximum
            longest[a, a + 1 :] = np.maximum.accumulate(L[a:])
        n = (hi - lo).astype(float)
        T, Q = n * longest, n * longest * longest
    else:
        raise UmoptError(f"mode must be packed or padded, got {mode!r}")
    return np.where(valid, T, 0.0), np.where(valid, Q, 0.0), np.where(valid, N, 0.0)


def sample_tokens(
    lengths,
    samples: Sequence[Sequence[int]],
    mode: str = "packed",
    row: int | None = None,
    pad_to: int | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, str, np.ndarray]:
    """Each sample's tokens, and where a sample is a row of packed sequences (``row``) the sum of
    its squared lengths (the attention's work) and its sequences (None: a sample is one sequence,
    its square, one each), the mode its chunks cost in, and the rows the runtime holds of it: a
    row is packed (its padding held); samples padded to one length for all (``pad_to``) are padded
    chunks of that width, costed by the padded fits as the runtime plays them (their padding not
    held: [Note: token rows] in umopt/run/tokens.py). ``samples[k]``: the sequences (indices into
    ``lengths``) sample k holds."""
    L = np.asarray(lengths, dtype=np.int64)
    if pad_to is not None:
        own = np.array([sum(int(L[i]) for i in u) for u in samples])
        return np.full(len(samples), pad_to), None, None, "padded", own
    if row is not None:
        squares = np.array([sum(int(L[i]) ** 2 for i in u) for u in samples])
        rows = np.full(len(samples), row)
        return rows, squares, np.array([len(u) for u in samples]), "packed", rows
    if any(len(u) != 1 for u in samples):
        raise UmoptError("a sample of several sequences needs a row length")
    own = L[[u[0] for u in samples]]
    return own, None, None, mode, own


def tables_for_samples(
    profile: Profile,
    lengths,
    samples: Sequence[Sequence[int]],
    mode: str = "packed",
    row: int | None = None,
    pad_to: int | None = None,
    recompute: bool = False,
    dp: AllReduceProfile | None = None,
    chunks: Chunking | None = None,
) -> "CostTables":
    """The cost tables of a minibatch's sequences laid out as ``samples`` (see
    :func:`sample_tokens`): rows cost as packed, samples padded to one length as padded."""
    tokens, squares, docs, mode, rows = sample_tokens(lengths, samples, mode, row, pad_to)
    return tables_for_lengths(profile, tokens, mode, recompute, dp, squares, docs, chunks, rows)


def tables_for_lengths(
    profile: Profile,
    lengths,
    mode: str = "packed",
    recompute: bool = False,
    dp: AllReduceProfile | None = None,
    squares=None,
    docs=None,
    chunks: Chunking | None = None,
    rows=None,
) -> "CostTables":
    """The cost tables of one minibatch of samples of ``lengths`` tokens (in that order: the
    order the chunks cut), from the profile's costs by tokens in ``mode`` (see [Note: costs by
    sample range]); a sample that is a row of packed sequences gives the sum of their squared
    lengths in ``squares`` and their count in ``docs`` (default: one each). With ``chunks``, per
    virtual stage, from the layers' costs by tokens (:func:`umopt.chunks.virtual_stages`).
    ``rows``: each sample's rows the runtime holds in its receive buffers (default: its tokens;
    a padded sample holds its own tokens, not the chunk's padding)."""
    info = profile.lengths
    if info is None:
        raise UmoptError(
            "the profile has no costs by tokens (profile with --lengths, or a variable-length sim profile)"
        )
    if mode not in info.modes:
        raise UmoptError(f"the profile was timed in {' and '.join(info.modes)} mode, not {mode}")
    L = np.asarray(lengths, dtype=np.int64)
    if L.ndim != 1 or len(L) == 0 or L.min() < 1:
        raise UmoptError("lengths must be one or more positive integers")
    if L.max() > info.max_length:
        raise UmoptError(
            f"a sequence of {int(L.max())} tokens is longer than the profile timed ({info.max_length}): "
            "profile with longer sequences, or cap them"
        )
    if chunks is None:
        stages, links, ranks = profile.stages, profile.links, None
    else:
        stages, links = virtual_stages(profile, chunks)
        ranks = tuple(chunks.ranks)
        if any(st.tokens is None or mode not in st.tokens for st in stages):
            raise UmoptError(
                f"the profile's layers have no costs by tokens in {mode} mode, so a rank's layers cannot be cut "
                "into chunks for sequences of different lengths (umopt profile --lengths --chunks)"
            )
    B = len(L)
    if squares is not None and mode != "packed":
        raise UmoptError("rows of packed sequences are in packed mode")
    T, Q, N = range_tokens(L, mode, squares, docs)
    valid = T > 0
    costs = [st.tokens[mode] for st in stages]
    over = np.array([st.op_overhead_ms for st in stages])

    def ms(fit, ov):
        return np.where(valid, fit.a_ms + fit.b_ms * T + fit.c_ms * Q + fit.d_ms * N + ov, 0.0)

    fwd = np.stack([ms(c.forward, o) for c, o in zip(costs, over)])
    bwd = np.stack([ms(c.backward, o) for c, o in zip(costs, over)])
    split = {}
    if all(c.backward_input is not None and c.backward_weight is not None for c in costs):
        split["bwd_input"] = np.stack([ms(c.backward_input, o) for c, o in zip(costs, over)])
        split["bwd_weight"] = np.stack([ms(c.backward_weight, o) for c, o in zip(costs, over)])
    if recompute:  # the recomputed forward runs inside the B op: one op, one overhead
        bwd = np.where(valid, bwd + fwd - over[:, None, None], 0.0)
        if split:
            split["bwd_input"] = np.where(valid, split["bwd_input"] + fwd - over[:, None, None], 0.0)
    link = np.array(
        [
            np.where(
                valid,
                ln.latency_ms + ln.message_overhead_ms + T * c.output_bytes_per_token / ln.bytes_per_ms,
                0.0,
            )
            if ln is not None
            else np.zeros_like(T)  # two virtual stages on one rank: no message
            for ln, c in zip(links, costs)
        ],
        dtype=float,
    ).reshape(len(links), B + 1, B + 1)  # (one stage: no link at all)
    stash = np.stack([(T * c.stash_bytes_per_token).astype(np.int64) for c in costs])
    inputs = np.stack([(T * c.input_bytes_per_token).astype(np.int64) for c in costs])
    for what, arr in (("an F op", fwd), ("a B op", bwd), ("a message", link)):
        if arr.size and not arr.max() <= MAX_MS:
            raise UmoptError(
                f"{what} on these lengths would take {arr.max():.3g} ms, over umopt's limit of {MAX_MS:.0e} ms"
            )
    for arr in (fwd, bwd, link, stash, inputs, *split.values()):
        arr.setflags(write=False)
    T.setflags(write=False)
    ranged = RangeCosts(
        L, mode, T, fwd, bwd, link, stash, inputs, split.get("bwd_input"), split.get("bwd_weight")
    )
    mean = np.full(B, float(L.mean()))  # by size: sequences of the mean length (heuristics only)
    Tm = np.arange(B + 1) * float(L.mean())
    # the receive buffers hold the minibatch's rows: its tokens, no chunk's padding ([Note: token rows])
    every = float(np.sum(L if rows is None else rows))
    buffers = np.array(
        [
            every
            * (
                (c.input_bytes_per_token if j > 0 else 0)
                + (c.output_bytes_per_token if j < len(costs) - 1 else 0)
            )
            for j, c in enumerate(costs)
        ],
        dtype=np.int64,
    )
    return CostTables(
        fwd=_by_size(costs, over, mean, "forward", recompute=False),
        bwd=_by_size(costs, over, mean, "backward", recompute=recompute),
        link=np.array(
            [
                np.where(
                    np.arange(B + 1) > 0,
                    ln.latency_ms + ln.message_overhead_ms + Tm * c.output_bytes_per_token / ln.bytes_per_ms,
                    0.0,
                )
                if ln is not None
                else np.zeros(B + 1)
                for ln, c in zip(links, costs)
            ],
            dtype=float,
        ).reshape(len(links), B + 1),
        optimizer_ms=max(st.optimizer_ms for st in profile.stages),
        recompute=recompute,
        static_bytes=np.array([st.static_bytes for st in stages], dtype=np.int64)
        + buffers
        + _bucket_bytes(stages, ranks, dp),
        buffer_bytes=buffers,
        stash_bytes=np.array([int(round(c.stash_bytes_per_token * mean[0])) for c in costs], dtype=np.int64),
        input_bytes=np.array([int(round(c.input_bytes_per_token * mean[0])) for c in costs], dtype=np.int64),
        memory_limit=profile.memory_limit_bytes,
        allreduce_ms=_allreduce_per_rank(stages, ranks, dp),
        ranks=ranks,
        bwd_input=_by_size(costs, over, mean, "backward_input", recompute) if split else None,
        bwd_weight=_by_size(costs, over, mean, "backward_weight", False) if split else None,
        op_overhead=over.copy() if split else None,
        ranged=ranged,
        **_work(stages, [c.work_bytes_per_token for c in costs]),
    )


def _by_size(costs, over, mean, kind: str, recompute: bool) -> np.ndarray:
    """A cost by chunk size for sequences of the mean length (the heuristics' first guess)."""
    m = float(mean[0])
    b = np.arange(len(mean) + 1, dtype=float)
    rows = []
    for c, o in zip(costs, over):
        fit = getattr(c, kind)
        row = fit.a_ms + fit.b_ms * b * m + fit.c_ms * b * m * m + fit.d_ms * b + o
        if recompute and kind in ("backward", "backward_input"):
            f = c.forward
            row = row + f.a_ms + f.b_ms * b * m + f.c_ms * b * m * m + f.d_ms * b
        row[0] = 0.0
        rows.append(row)
    return np.array(rows)


def allreduce_ms(dp: AllReduceProfile, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` among ``dp.replicas`` replicas (a ring: every byte crosses
    2 (N - 1) / N times the bus bandwidth); 0 for one replica."""
    n = dp.replicas
    return 0.0 if n <= 1 else dp.latency_ms + 2 * (n - 1) / n * nbytes / dp.bus_bytes_per_ms


def _allreduce_per_rank(
    stages: Sequence, ranks: Sequence[int] | None, dp: AllReduceProfile | None
) -> np.ndarray:
    """Each rank's gradient all-reduce: one, over the gradients of every chunk it holds."""
    ranks = list(ranks) if ranks is not None else list(range(len(stages)))
    R = max(ranks) + 1
    if dp is None or dp.replicas <= 1:
        out = np.zeros(R)
    else:
        missing = [s for s, st in enumerate(stages) if st.param_bytes is None]
        if missing:
            raise UmoptError(
                f"stage {missing[0]} of the profile has no param_bytes: its gradient all-reduce cannot be predicted (profile again)"
            )
        held = np.zeros(R)
        for st, r in zip(stages, ranks):
            held[r] += st.param_bytes
        out = np.array([allreduce_ms(dp, float(x)) for x in held])
        if not out.max() <= MAX_MS:
            raise UmoptError(
                f"an all-reduce would take {out.max():.3g} ms, over umopt's limit of {MAX_MS:.0e} ms"
            )
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class Span:
    """One op as it runs on a rank (``stage``; ``chunk``: its virtual stage, the rank's own
    index on a one-chunk pipeline)."""

    stage: int
    kind: str
    lo: int
    hi: int
    start: float
    end: float
    chunk: int = -1


@dataclass(frozen=True)
class Message:
    """One message across a stage boundary (``link``: virtual stage ``link`` to ``link + 1``):
    ``direction`` is "fwd" (activations) or "bwd" (gradients)."""

    link: int
    direction: str
    lo: int
    hi: int
    sent: float
    start: float
    end: float


@dataclass
class Timeline:
    iteration_ms: float
    busy_ms: list[float]
    peak_memory_bytes: list[int]
    spans: list[list[Span]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    finish_ms: list[float] = field(default_factory=list)  # end of each stage's last op
    allreduce_ms: list[float] = field(default_factory=list)  # each stage's gradient all-reduce after it

    @property
    def makespan_ms(self) -> float:
        """End of the last op or all-reduce, without the optimizer step."""
        return max(f + a for f, a in zip(self.finish_ms, self.allreduce_ms or [0.0] * len(self.finish_ms)))

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time idle between 0 and the makespan, averaged over stages."""
        m = self.makespan_ms
        return 0.0 if m <= 0 else 1.0 - sum(self.busy_ms) / (m * len(self.busy_ms))


def stage_peak_memory(tables: CostTables, stage: int, ops: Sequence[Op]) -> int:
    """Peak bytes of one stage of a one-chunk pipeline over its op list (see :func:`rank_peak_memory`)."""
    return rank_peak_memory(tables, stage, ops)


def rank_peak_memory(tables: CostTables, rank: int, ops: Sequence[Op | ChunkOp]) -> int:
    """Peak bytes of one rank over its op list (the spec's memory model; it does not depend on time).

    A rank holds the static bytes of every chunk on it and what each chunk keeps for backward.
    On a chunk with W ops, what a sample keeps for backward is released by its W, not its B
    (the weight gradient needs the layers' inputs and output gradients); with recompute, the
    activations its B recomputed are kept until its W too. Bytes are counted by sample range
    (``stash_of``, ``input_of``): by size, or by the sequences a range holds."""
    F, B, W = OpKind.F, OpKind.B, OpKind.W  # locals: an enum member's lookup costs more than a comparison
    rc = tables.recompute
    chunks = sorted({op_stage(op, rank) for op in ops}) or [rank]
    release = {j: B for j in chunks}
    for op in ops:
        if op[0] == W:
            release[op_stage(op, rank)] = W
    stashed = dict.fromkeys(chunks, 0)  # bytes of samples forwarded and not yet released
    awaiting = dict.fromkeys(chunks, 0)  # with recompute and W ops: what B recomputed for its W
    live: dict[tuple, dict[tuple[int, int], int]] = {}  # padded chunks: each chunk's own bytes
    static = sum(int(tables.static_bytes[j]) for j in chunks)
    held = dict.fromkeys(chunks, 0)  # each chunk's bytes beyond its static ones
    peak = static

    def kept(j: int, lo: int, hi: int) -> int:
        return int(tables.input_of(j, lo, hi) if rc else tables.stash_of(j, lo, hi))

    def freed(what: str, j: int, lo: int, hi: int, of) -> int:
        """Bytes a release of [lo, hi) frees: the range's own where bytes add up over samples,
        else those of the chunks it covers, whole (padded chunks pad to their own longest)."""
        if tables.additive:
            return int(of(j, lo, hi))
        mine = live.setdefault((what, j), {})
        inside = [c for c in mine if lo <= c[0] and c[1] <= hi]
        if sum(c1 - c0 for c0, c1 in inside) != hi - lo:
            raise UmoptError(
                f"stage {j}: padded chunks: a B or W op must cover whole chunks before it, not [{lo},{hi})"
            )
        return sum(mine.pop(c) for c in inside)

    for op in ops:
        kind, lo, hi = op[0], op[1], op[2]
        j = op_stage(op, rank)
        if kind == F:
            stashed[j] += kept(j, lo, hi)
            if not tables.additive:
                live.setdefault(("kept", j), {})[(lo, hi)] = kept(j, lo, hi)
        if rc:
            running = int(tables.stash_of(j, lo, hi)) if kind != W else 0  # a W runs on what its B kept
            mine = stashed[j] + awaiting[j] + running
        else:
            mine = stashed[j]
        peak = max(peak, int(static + sum(held.values()) - held[j] + mine))
        if kind == release[j]:
            stashed[j] -= freed("kept", j, lo, hi, lambda j, lo, hi: kept(j, lo, hi))
            if kind == W and rc:
                awaiting[j] -= freed("awaiting", j, lo, hi, tables.stash_of)
        elif kind == B and release[j] == W and rc:
            awaiting[j] += int(tables.stash_of(j, lo, hi))
            if not tables.additive:
                live.setdefault(("awaiting", j), {})[(lo, hi)] = int(tables.stash_of(j, lo, hi))
        held[j] = stashed[j] + awaiting[j] if rc else stashed[j]
    return _with_work(tables, chunks, peak, [op for op in ops if op[0] != W], rank)


def _with_work(tables: CostTables, chunks: Sequence[int], peak: int, ops, rank: int) -> int:
    """A rank's peak with what its ops and its optimizer step allocate while they run: the
    largest of its F and B ops' on top (see [Note: what an op allocates while it runs])."""
    if tables.work_bytes is None:
        return peak
    work = max((int(tables.work_of(op_stage(op, rank), op[1], op[2])) for op in ops), default=0)
    step = sum(int(tables.static_bytes[j]) + int(tables.optimizer_work_bytes[j]) for j in chunks)
    return max(peak + work, step)


def weight_ms(tables: CostTables, stage: int, b_chunks: Sequence[tuple[int, int]]) -> float:
    """A W op over whole B chunks: each chunk's weight gradient as measured (the runtime resumes
    each chunk's own saved backward; their graphs cannot be batched), one op's overhead."""
    over = float(tables.op_overhead[stage])
    return sum(float(tables.op_ms("bwd_weight", stage, lo, hi)) - over for lo, hi in b_chunks) + over


def _split_stages(
    tables: CostTables, ops: Sequence[Sequence[Op | ChunkOp]]
) -> tuple[list[bool], list[list[tuple[int, int]]]]:
    """Which stages have W ops (their B computes the input gradient only), and the sample ranges
    of each such stage's B ops, in sample order (a W's duration depends on the Bs it covers)."""
    split = [False] * tables.num_stages
    for r, rank_ops in enumerate(ops):
        for op in rank_ops:
            if op[0] == OpKind.W:
                split[op_stage(op, r)] = True
    if any(split) and tables.bwd_input is None:
        raise UmoptError(
            "the schedule has W ops but the profile has no backward_input_ms / backward_weight_ms (profile with --split-backward)"
        )
    b_chunks: list[list[tuple[int, int]]] = [[] for _ in range(tables.num_stages)]
    for r, rank_ops in enumerate(ops):
        for op in rank_ops:
            if op[0] == OpKind.B and split[op_stage(op, r)]:
                b_chunks[op_stage(op, r)].append((op[1], op[2]))
    for c in b_chunks:
        c.sort()
    return split, b_chunks


def _check_finished(ops: Sequence[Sequence[Op | ChunkOp]], ptr: list[int]) -> None:
    """Every rank played its last op, or the schedule deadlocks where the first one stopped."""
    stuck = [r for r in range(len(ops)) if ptr[r] < len(ops[r])]
    if stuck:
        r = stuck[0]
        op = ops[r][ptr[r]]
        where = f"stage {r}" if len(op) == 3 else f"rank {r}"
        chunk = "" if len(op) == 3 else f" of stage {op[3]}"
        raise UmoptError(f"schedule deadlocks: {where} waits forever at {op[0]}({op[1]},{op[2]}){chunk}")


def simulate(
    tables: CostTables, ops: Sequence[Sequence[Op | ChunkOp]], minibatch: int, *, record: bool = True
) -> Timeline:
    """Play the op lists of all ranks under the cost model.

    ``ops[r]`` is rank ``r``'s ops in the order it runs them: :class:`Op` on a one-chunk pipeline,
    :class:`ChunkOp` (naming the virtual stage) where ``tables`` place several chunks per rank.
    With ``record=False`` the timeline keeps no spans or messages and peak memory is not computed
    (searches that only need times run faster); every time is the same either way.

    Raises :class:`UmoptError` if the schedule deadlocks (some rank waits forever), a B op
    comes before the F of its samples on its stage, or a W op before their B.
    """
    # one piece: the cost model of docs/formats.md as one loop over the ranks' op lists, read top
    # to bottom beside the spec; every other evaluator is tested against it
    F, B = OpKind.F, OpKind.B  # locals: an enum member's lookup costs more than a comparison
    S, R = tables.num_stages, tables.num_ranks
    if len(ops) != R:
        raise UmoptError(f"schedule has {len(ops)} stages, the profile {R}")
    split, b_chunks = _split_stages(tables, ops)
    never = float("inf")  # not sent yet; max() over a chunk then says "not ready" by itself
    # act_at[j][i]: when sample i's activation is ready on stage j (stage 0: at time 0).
    # grad_at[j][i]: when sample i's gradient is ready on stage j (last stage: its F's end there).
    act_at = [[0.0] * minibatch] + [[never] * minibatch for _ in range(S - 1)]
    grad_at = [[never] * minibatch for _ in range(S)]
    fwd_done = [[False] * minibatch for _ in range(S)]
    bwd_done = [[False] * minibatch for _ in range(S)]
    link_free: dict[tuple[int, int], float] = {}
    clock = [0.0] * R
    busy = [0.0] * R
    ptr = [0] * R
    spans: list[list[Span]] = [[] for _ in range(R)]
    messages: list[Message] = []
    by_range = tables.ranged  # costs by sample range, or by size (see [Note: costs by sample range])
    fwd, bwd, bwd_input, link = (
        (tables.fwd, tables.bwd, tables.bwd_input, tables.link)
        if by_range is None
        else (by_range.fwd, by_range.bwd, by_range.bwd_input, by_range.link)
    )
    at = (
        (lambda s, lo, hi: (s, hi - lo)) if by_range is None else (lambda s, lo, hi: (s, lo, hi))
    )  # a chunk's entry

    def send(direction: str, ln: int, lo: int, hi: int, sent: float, dest: list[float]) -> None:
        ch = tables.channel(ln, direction)
        start = max(sent, link_free.get(ch, 0.0))
        end = start + float(link[at(ln, lo, hi)])
        link_free[ch] = end
        dest[lo:hi] = [end] * (hi - lo)
        if record:
            messages.append(Message(ln, direction, lo, hi, sent, start, end))

    progress = True
    while progress:
        progress = False
        for r in range(R):
            todo = ops[r]
            while ptr[r] < len(todo):
                op = todo[ptr[r]]
                kind, lo, hi = op[0], op[1], op[2]
                s = op_stage(op, r)
                if not 0 <= s < S or tables.rank_of(s) != r:
                    raise UmoptError(f"rank {r}: {kind}({lo},{hi}) names stage {s}, which is not on rank {r}")
                if kind == F:
                    ready = max(act_at[s][lo:hi])
                    dur = float(fwd[at(s, lo, hi)])
                elif kind == B:
                    if not all(fwd_done[s][lo:hi]):
                        raise UmoptError(f"stage {s}: B({lo},{hi}) comes before the F of its samples")
                    ready = max(grad_at[s][lo:hi])
                    dur = float((bwd_input if split[s] else bwd)[at(s, lo, hi)])
                else:  # W: local, after the B of its samples on this stage, which ran before it
                    if not all(bwd_done[s][lo:hi]):
                        raise UmoptError(f"stage {s}: W({lo},{hi}) comes before the B of its samples")
                    ready = 0.0
                    dur = weight_ms(tables, s, [c for c in b_chunks[s] if lo <= c[0] and c[1] <= hi])
                if ready == never:  # an input has not been sent yet
                    break
                start = max(clock[r], ready)
                end = start + dur
                clock[r] = end
                busy[r] += dur
                if record:
                    spans[r].append(Span(r, kind, lo, hi, start, end, s))
                if kind == F:
                    fwd_done[s][lo:hi] = [True] * (hi - lo)
                    if s + 1 < S:
                        send("fwd", s, lo, hi, end, act_at[s + 1])
                    else:
                        grad_at[s][lo:hi] = [end] * (hi - lo)
                elif kind == B:
                    bwd_done[s][lo:hi] = [True] * (hi - lo)
                    if s > 0:
                        send("bwd", s - 1, lo, hi, end, grad_at[s - 1])
                ptr[r] += 1
                progress = True
    _check_finished(ops, ptr)
    ar = [float(a) for a in tables.allreduce_ms]
    return Timeline(
        iteration_ms=max(c + a for c, a in zip(clock, ar)) + tables.optimizer_ms,
        busy_ms=busy,
        peak_memory_bytes=[rank_peak_memory(tables, r, ops[r]) for r in range(R)] if record else [],
        spans=spans,
        messages=messages,
        finish_ms=clock,
        allreduce_ms=ar,
    )
