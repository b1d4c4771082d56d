"""What a model is to umopt: a list of layers run one after the other (:class:`ModelParts`), how
it takes sequences of different lengths (:class:`Sequences`), and what a layer is given of a
chunk's sequences (``lengths=``, [Note: packed sequences]) and must honour.

The zoo (:mod:`umopt.zoo`), transformers' models (:mod:`umopt.hf`) and a user's factory all give
a :class:`ModelParts`; the profiler and the runtime take nothing else of a model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .devices import to_device

__all__ = [
    "IGNORE",
    "ModelParts",
    "Sequences",
    "Layers",
    "TOKENWISE",
    "blind_layer",
    "pack",
    "pad",
    "padded_rows",
    "positions",
    "run_layers",
    "takes_lengths",
]

Batch = tuple[torch.Tensor, torch.Tensor]


IGNORE = -100  # a target the summed cross-entropy skips: padding


@dataclass
class Sequences:
    """How a model takes sequences of different lengths: ``make(lengths, seed)``, each sequence's
    (tokens, targets) as 1-d tensors; ``max_length``, the longest it takes; ``packed``, whether
    its layers take the chunk's sequence ``lengths`` (keyword) and honour them, packed and
    padded ([Note: packed sequences]); ``causal``, whether every layer is causal, so that padding
    after a sequence never reaches its tokens (padded chunks then need no lengths)."""

    make: Callable[[Sequence[int], int], list[Batch]]
    max_length: int
    packed: bool = False
    causal: bool = False

    @property
    def modes(self) -> tuple[str, ...]:
        """The ways its chunks can be laid out: packed where its layers take lengths, padded
        where they take them or the model is causal."""
        return (("packed",) if self.packed else ()) + (("padded",) if self.packed or self.causal else ())


@dataclass
class ModelParts:
    layers: list[nn.Module]
    make_batch: Callable[[int, int], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sequences: Optional[Sequences] = None
    # parameters one object in several layers (tied embeddings): each group's (layer, name)s,
    # whose copies on different ranks the runtime keeps equal ([Note: tied weights])
    tied: list[list[tuple[int, str]]] = field(default_factory=list)

    def tied_in(self, held: Sequence[int], modules: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
        """The tied parameters of the layers ``held`` (model indices, in the order of ``modules``,
        the layers as this rank holds them): each group's key to this rank's parameter."""
        out = {}
        for k, group in enumerate(self.tied):
            for i, name in group:
                if i in held:
                    out[f"tied{k}"] = modules[list(held).index(i)].get_parameter(name)
                    break
        return out


def takes_lengths(layer: nn.Module) -> bool:
    """Whether ``layer`` takes a chunk's sequence lengths (a ``lengths`` keyword; see [Note:
    packed sequences])."""
    return "lengths" in inspect.signature(layer.forward).parameters


# torch's layers that compute each token on its own: they need no lengths in any chunk's shape
TOKENWISE = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Dropout,
    nn.Identity,
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softmax,
)


def blind_layer(module: nn.Module, name: str = "", given: bool = True) -> Optional[str]:
    """What lets a chunk's sequences (or its padding) reach one another in ``module``: its first
    such layer, named, and why; None where there is none (see [Note: packed sequences]). A layer is safe if it
    is given the lengths and takes ``lengths=``, is one of torch's token-wise layers (or says
    ``tokenwise = True``), or holds safe layers: a :class:`Layers` gives its layers the lengths,
    an ``nn.Sequential`` does not (``given``)."""
    if isinstance(module, TOKENWISE) or getattr(module, "tokenwise", False):
        return None
    if isinstance(module, (Layers, nn.Sequential)):
        inner = module.members() if isinstance(module, Layers) else list(module)
        passes = given and isinstance(module, Layers)
        for i, m in enumerate(inner):
            bad = blind_layer(m, f"{name}.{i}" if name else str(i), passes)
            if bad is not None:
                return bad
        return None
    if given and takes_lengths(module):
        return None
    what = f"layer {name} ({type(module).__name__})" if name else type(module).__name__
    if takes_lengths(module):
        return f"{what} gets no lengths= inside an nn.Sequential (umopt.zoo.Layers passes them on)"
    return f"{what} takes no lengths="


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, lengths: Optional[torch.Tensor] = None):
    """``layers`` one after the other on ``x``; a chunk's sequence ``lengths`` go to the layers
    that take them."""
    for layer in layers:
        x = layer(x, lengths=lengths) if lengths is not None and takes_lengths(layer) else layer(x)
    return x


def padded_rows(x: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Whether a chunk ``x`` given ``lengths`` is padded rows, row i sequence i's ``lengths[i]``
    tokens then padding, rather than one packed row of documents (see [Note: packed sequences]):
    one length per row. (A packed row of one document is also one length per row, and the two
    readings of it agree.)"""
    return x.shape[0] == lengths.numel()


class Layers(nn.Module):
    """``layers`` as one module, run one after the other (a stage, or a chunk of one); a chunk's
    sequence ``lengths`` go to the layers that take them."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def members(self) -> list[nn.Module]:
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        return run_layers(self.members(), x, lengths)


def pack(seqs: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences concatenated into one row: (tokens (1, T), targets (1, T), lengths (n,))."""
    lengths = torch.tensor([len(x) for x, _ in seqs], dtype=torch.long)
    return torch.cat([x for x, _ in seqs])[None], torch.cat([y for _, y in seqs])[None], lengths


def pad(seqs: Sequence[Batch], to: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences padded to ``to`` (default: the longest): (tokens (n, to), targets (n, to)), the
    padding's targets ignored by the loss (causal attention keeps padding after a sequence out
    of its tokens' outputs)."""
    to = to or max(len(x) for x, _ in seqs)
    xs = torch.zeros(len(seqs), to, dtype=seqs[0][0].dtype)
    ys = torch.full((len(seqs), to), IGNORE, dtype=seqs[0][1].dtype)
    for i, (x, y) in enumerate(seqs):
        xs[i, : len(x)], ys[i, : len(y)] = x, y
    return xs, ys


# [Note: packed sequences]
# A chunk of sequences of different lengths reaches a layer that takes a ``lengths`` keyword in
# one of two shapes, with the lengths beside it (not sent: every rank knows them from the step's
# plan). Packed: one row (1, T) of documents one after another, ``lengths`` the documents' (they
# sum to T). Each document is its own sequence: positions restart at its first token, and
# attention stays within it, so a document's outputs do not depend on what it is packed with,
# and the attention's work is the sum of the squared lengths, not T^2 (on CUDA in half precision
# one varlen flash-attention kernel; elsewhere scaled-dot-product attention per document).
# Padded: (n, w), row i sequence i's ``lengths[i]`` tokens then zeros: a layer that looks at
# other positions (bidirectional attention, a centred convolution) must mask the padding with
# them; a causal one need not, since padding comes after every token it could reach. A layer
# tells the two apart by the count: one length per row is padded (`padded_rows`), and a packed
# row of one document reads the same either way. A layer that takes no lengths gets neither,
# so a model packs only if its layers take them, and pads only if they do or it is causal
# (`Sequences.modes`; umopt.Pipeline's ``causal=``).


def positions(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each token's position within its document, for documents of ``lengths`` packed in a row."""
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    # built on the host, copied without a wait for the device (a packed forward syncs with it nowhere)
    return to_device(torch.arange(int(lengths.sum())) - starts, device)
