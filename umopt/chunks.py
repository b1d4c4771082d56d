"""Several model chunks per rank: where each virtual stage runs and which layers it holds.

A pipeline of S ranks with v chunks each has V = v x S virtual stages, contiguous layer ranges in
model order (docs/formats.md, "Several chunks per rank"). *Looped* placement (Megatron's
interleaved 1F1B, torch's ``ScheduleInterleaved1F1B``) puts virtual stage j on rank j mod S;
*V-shaped* placement (torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``) zig-zags, so
rank r holds j = r and j = 2S - 1 - r (and so on for more chunks), and the hand-off at the turn is
local. A virtual stage's costs are the sums of its layers' entries in the profile; its rank's
per-op overhead is added once per op.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .errors import UmoptError
from .formats.ops import Chunking
from .formats.profile import LayerProfile, LinkProfile, Profile, StageProfile, TokenCosts, TokenFit

__all__ = [
    "PLACEMENTS",
    "placement",
    "placement_name",
    "chunking",
    "balanced_cut",
    "stage_cut",
    "user_cuts",
    "check_chunking",
    "virtual_stages",
    "stages_from_layers",
    "min_max_cut",
]


PLACEMENTS = ("looped", "vshape")


def placement(name: str, num_ranks: int, chunks: int) -> tuple[int, ...]:
    """The rank of each of the ``chunks x num_ranks`` virtual stages under ``name``."""
    S, v = num_ranks, chunks
    if name == "looped":
        return tuple(j % S for j in range(v * S))
    if name == "vshape":  # zig-zag: even rounds go down the ranks, odd rounds come back up
        return tuple(j % S if (j // S) % 2 == 0 else S - 1 - j % S for j in range(v * S))
    raise UmoptError(f"unknown placement {name!r} (one of {', '.join(PLACEMENTS)})")


def placement_name(ranks: Sequence[int], num_ranks: int) -> str:
    """Which placement ``ranks`` (each virtual stage's rank) follows: "looped", "vshape" or "custom"."""
    v = len(ranks) // num_ranks
    named = [name for name in PLACEMENTS if tuple(ranks) == placement(name, num_ranks, v)]
    return named[0] if named else "custom"


def _layer_cost(profile: Profile) -> np.ndarray:
    """Each layer's forward and backward at the profile's middle size: what a cut balances."""
    k = len(profile.sizes) // 2
    return np.array([ly.forward_ms[k] + ly.backward_ms[k] for ly in _layers(profile)])


def _layers(profile: Profile):
    if profile.layers is None:
        raise UmoptError(
            "the profile has no per-layer entries, so a rank's layers cannot be cut into chunks "
            "(umopt profile --chunks, or umopt.profile_stages(..., layers=True) for your own stages; or use one chunk per rank)"
        )
    return profile.layers


def min_max_cut(cost: Sequence[float], parts: int, min_len: int = 1) -> list[tuple[int, int]]:
    """Contiguous ranges of ``cost`` in ``parts`` pieces of at least ``min_len`` each, minimising
    the costliest piece."""
    cost = np.asarray(cost, dtype=float)
    L, V, n = len(cost), parts, min_len
    if V * n > L:
        raise UmoptError(f"{V} pieces of at least {n} need {V * n} layers, there are {L}")
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    # best[k][i]: the least costliest piece cutting [0, i) into k pieces; arg[k][i]: the last cut
    best = np.full((V + 1, L + 1), np.inf)
    arg = np.zeros((V + 1, L + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, V + 1):
        for i in range(k * n, L - (V - k) * n + 1):
            lo, hi = (k - 1) * n, i - n + 1  # the previous cut a: lo <= a < hi
            cand = np.maximum(best[k - 1][lo:hi], prefix[i] - prefix[lo:hi])
            a = int(np.argmin(cand))
            best[k][i], arg[k][i] = cand[a], a + lo
    cuts, i = [], L
    for k in range(V, 0, -1):
        cuts.append((int(arg[k][i]), i))
        i = int(arg[k][i])
    return cuts[::-1]


def balanced_cut(profile: Profile, num_virtual: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges for ``num_virtual`` virtual stages that minimise the costliest one
    (forward and backward at the profile's middle size), ignoring the profile's stage split."""
    cost = _layer_cost(profile)
    if num_virtual > len(cost):
        raise UmoptError(
            f"{num_virtual} virtual stages need at least {num_virtual} layers, the profile has {len(cost)}"
        )
    return tuple(min_max_cut(cost, num_virtual))


def stage_cut(
    profile: Profile, chunks: int, cost: Sequence[float] | None = None
) -> tuple[tuple[int, int], ...]:
    """Each of the profile's stages cut into ``chunks`` pieces (balanced within the stage by the
    layers' ``cost``, by default their times): the model split the user already has, in finer
    pieces; one chunk is the stages themselves."""
    cost = _layer_cost(profile) if cost is None else np.asarray(cost, dtype=float)
    out: list[tuple[int, int]] = []
    for s, st in enumerate(profile.stages):
        lo, hi = st.layers
        if hi - lo < chunks:
            raise UmoptError(f"stage {s} has {hi - lo} layers in the profile, too few for {chunks} chunks")
        out += [(lo + a, lo + b) for a, b in min_max_cut(cost[lo:hi], chunks)]
    return tuple(out)


def user_cuts(profile: Profile, chunks: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """The cuts a user of torch's schedules would try for ``chunks`` per rank, by name: each
    stage in pieces balanced by cost or of equal layer counts, all layers in pieces balanced by
    cost or of equal counts (those the layers allow; a cut two names give once, first name)."""
    ones = np.ones(len(_layers(profile)))
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    makers = {
        "each stage by cost": lambda: stage_cut(profile, chunks),
        "each stage by count": lambda: stage_cut(profile, chunks, ones),
        "all layers by cost": lambda: balanced_cut(profile, chunks * profile.num_stages),
        "all layers by count": lambda: tuple(min_max_cut(ones, chunks * profile.num_stages)),
    }
    for name, make in makers.items():
        try:
            cut = make()
        except UmoptError:
            continue
        if cut not in out.values():
            out[name] = cut
    return out


def chunking(
    profile: Profile, chunks: int, place: str = "looped", cut: Sequence[tuple[int, int]] | None = None
) -> Chunking:
    """``chunks`` per rank under ``place``, cut by ``cut`` or else by :func:`stage_cut`."""
    S = profile.num_stages
    ranks = placement(place, S, chunks)
    layers = tuple(tuple(c) for c in cut) if cut is not None else stage_cut(profile, chunks)
    result = Chunking(layers=layers, ranks=ranks)
    check_chunking(profile, result)
    return result


def check_chunking(profile: Profile, chunks: Chunking) -> None:
    """A one-line error unless ``chunks`` covers the profile's layers in order and every rank of
    the profile holds at least one of them."""
    layers = _layers(profile)
    if len(chunks.layers) != len(chunks.ranks):
        raise UmoptError(f"{len(chunks.layers)} layer ranges for {len(chunks.ranks)} virtual stages")
    end = 0
    for j, (lo, hi) in enumerate(chunks.layers):
        if lo != end or hi <= lo:
            raise UmoptError(
                f"virtual stage {j} holds layers {lo}..{hi - 1}; expected a non-empty range from layer {end}"
            )
        end = hi
    if end != len(layers):
        raise UmoptError(f"the virtual stages cover layers 0..{end - 1}, the profile has {len(layers)}")
    S = profile.num_stages
    bad = [r for r in chunks.ranks if not 0 <= r < S]
    if bad:
        raise UmoptError(f"a virtual stage is placed on rank {bad[0]}; the profile has ranks 0..{S - 1}")
    idle = sorted(set(range(S)) - set(chunks.ranks))
    if idle:
        raise UmoptError(f"rank {idle[0]} holds no virtual stage")


def _link(profile: Profile, a: int, b: int) -> LinkProfile | None:
    """The link virtual stages on ranks ``a`` and ``b`` talk over (None: the same rank)."""
    S = profile.num_stages
    if a == b:
        return None
    if abs(a - b) == 1:
        return profile.links[min(a, b)]
    slowest = max(profile.links, key=lambda ln: (1.0 / ln.bytes_per_ms, ln.latency_ms))
    if {a, b} == {0, S - 1} and profile.wrap_link is not None:
        return profile.wrap_link
    return slowest  # not measured: the slowest measured link stands in (docs/formats.md)


def virtual_stages(profile: Profile, chunks: Chunking) -> tuple[list[StageProfile], list[LinkProfile | None]]:
    """The stage entries of the virtual stages (their layers' sums, their rank's overheads) and
    the link each hand-off uses (None where it stays on one rank)."""
    check_chunking(profile, chunks)
    layers = profile.layers
    split = all(ly.backward_input_ms is not None for ly in layers)
    stages = []
    for (lo, hi), r in zip(chunks.layers, chunks.ranks):
        mine = layers[lo:hi]
        rank = profile.stages[r]

        def total(key: str) -> list[float]:
            return [float(x) for x in np.sum([getattr(ly, key) for ly in mine], axis=0)]

        params = [ly.param_bytes for ly in mine]
        stages.append(
            StageProfile.model_construct(
                layers=[lo, hi],
                forward_ms=total("forward_ms"),
                backward_ms=total("backward_ms"),
                backward_input_ms=total("backward_input_ms") if split else None,
                backward_weight_ms=total("backward_weight_ms") if split else None,
                input_bytes_per_sample=mine[0].input_bytes_per_sample,
                output_bytes_per_sample=mine[-1].output_bytes_per_sample,
                stash_bytes_per_sample=sum(ly.stash_bytes_per_sample for ly in mine),
                static_bytes=sum(ly.static_bytes for ly in mine),
                param_bytes=None if None in params else sum(params),
                optimizer_ms=rank.optimizer_ms,
                op_overhead_ms=rank.op_overhead_ms,
                tokens=token_costs_of(mine),
                **_work_of(mine),
            )
        )
    links = [_link(profile, a, b) for a, b in zip(chunks.ranks, chunks.ranks[1:])]
    return stages, links


def token_costs_of(layers) -> Optional[dict[str, TokenCosts]]:
    """Consecutive layers' costs by tokens as one stage's, per mode (None unless every layer has
    them): their fits summed term by term (each term is linear in the chunk's tokens, squares and
    sequences, so the sum is the fit of the layers run one after another), what they keep summed,
    the first layer's input and the last one's output, the largest temporaries (one layer runs at
    a time)."""
    if not layers or any(ly.tokens is None for ly in layers):
        return None
    modes = [m for m in layers[0].tokens if all(m in ly.tokens for ly in layers)]

    def summed(fits) -> Optional[TokenFit]:
        if any(f is None for f in fits):
            return None
        return TokenFit.model_construct(
            **{k: float(sum(getattr(f, k) for f in fits)) for k in ("a_ms", "b_ms", "c_ms", "d_ms")},
            residual=None,
        )

    out = {}
    for m in modes:
        costs = [ly.tokens[m] for ly in layers]
        out[m] = TokenCosts.model_construct(
            forward=summed([c.forward for c in costs]),
            backward=summed([c.backward for c in costs]),
            backward_input=summed([c.backward_input for c in costs]),
            backward_weight=summed([c.backward_weight for c in costs]),
            input_bytes_per_token=costs[0].input_bytes_per_token,
            output_bytes_per_token=costs[-1].output_bytes_per_token,
            stash_bytes_per_token=sum(c.stash_bytes_per_token for c in costs),
            work_bytes_per_token=max(c.work_bytes_per_token for c in costs),
        )
    return out


def stages_from_layers(per_layer: Profile, cuts: Sequence[int]) -> Profile:
    """A profile of ``len(cuts) - 1`` stages (stage s: layers ``cuts[s]..cuts[s+1]-1``) from a
    profile that timed every layer as a stage of its own, keeping those per-layer entries in
    ``layers``, so that a rank's layers can be cut into chunks (``umopt profile --chunks``).

    A stage's entry is its layers' sums (times per size, stash, static and parameter bytes,
    optimizer), its input bytes its first layer's and its output bytes its last layer's; the
    links between stages are the per-layer profile's links at the cuts."""
    L = per_layer.num_stages
    if list(cuts)[0] != 0 or list(cuts)[-1] != L or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise UmoptError(f"stage cuts must rise strictly from 0 to {L}, got {list(cuts)}")
    src = per_layer.stages
    split = all(st.backward_input_ms is not None for st in src)

    def total(mine, key):
        return [round(float(x), 6) for x in np.sum([getattr(st, key) for st in mine], axis=0)]

    stages = []
    for lo, hi in zip(cuts, cuts[1:]):
        mine = src[lo:hi]
        params = [st.param_bytes for st in mine]
        stages.append(
            {
                "layers": [mine[0].layers[0], mine[-1].layers[1]],
                "forward_ms": total(mine, "forward_ms"),
                "backward_ms": total(mine, "backward_ms"),
                **(
                    {
                        "backward_input_ms": total(mine, "backward_input_ms"),
                        "backward_weight_ms": total(mine, "backward_weight_ms"),
                    }
                    if split
                    else {}
                ),
                "input_bytes_per_sample": mine[0].input_bytes_per_sample,
                "output_bytes_per_sample": mine[-1].output_bytes_per_sample,
                "stash_bytes_per_sample": sum(st.stash_bytes_per_sample for st in mine),
                "static_bytes": sum(st.static_bytes for st in mine),
                "param_bytes": None if None in params else sum(params),
                "optimizer_ms": round(sum(st.optimizer_ms for st in mine), 6),
                **({"tokens": token_costs_of(mine)} if mine[0].tokens is not None else {}),
                **_work_of(mine),
            }
        )
    # each layer's entry: what its stage entry says of every field a layer has
    layers = [{key: getattr(st, key) for key in LayerProfile.model_fields} for st in src]
    if any(st.layers[1] - st.layers[0] != 1 for st in src) or src[0].layers[0] != 0:
        raise UmoptError("the per-layer profile must time every model layer as a stage of its own")
    data = per_layer.model_dump(mode="json")
    data.update(
        stages=stages,
        links=[per_layer.links[c - 1].model_dump(mode="json") for c in cuts[1:-1]],
        layers=layers,
    )
    return Profile.model_validate(data)


def _work_of(layers) -> dict[str, int]:
    """What consecutive layers allocate while they run, beyond what they keep: one layer runs at a
    time, so the largest of theirs (fixed part and part per sample each: a bound); the optimizer
    step's temporaries add up over the layers it steps."""
    return {
        "work_bytes": max(ly.work_bytes for ly in layers),
        "work_bytes_per_sample": max(ly.work_bytes_per_sample for ly in layers),
        "optimizer_work_bytes": sum(ly.optimizer_work_bytes for ly in layers),
    }
