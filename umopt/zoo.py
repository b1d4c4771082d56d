"""The model zoo: models as flat lists of layers that stages can slice.

A model is three things (:class:`ModelParts`): ``layers``, a list of ``nn.Module`` run one after
the other; ``make_batch(n, seed)``, a deterministic ``(inputs, targets)`` batch of ``n`` samples;
and ``loss(outputs, targets)``, the loss *summed* over the samples (the runtime divides by the
minibatch, so gradients do not depend on how the minibatch is chunked).

Built in: ``vgg16`` (13 conv + 3 FC), ``gpt`` (embedding, decoder blocks, LM head) and ``mlp``.

A model of token sequences may also say how it takes sequences of different lengths
(:class:`Sequences`): ``make(lengths, seed)`` gives each sequence's tokens and targets, and, where
its layers accept a ``lengths`` keyword (the lengths of the sequences in a chunk, see [Note:
packed sequences]), chunks can be packed, one row of documents, or padded, one row a sequence
(each chunk to its own longest, padding targets ignored by the loss); a model whose layers take
no lengths can be padded only if it is causal (a token never sees a later one, so the padding
after a sequence never reaches it), which it says (``causal=True``).
Users bring their own with ``package.module:factory``: a callable taking the model args as
keyword arguments and returning a :class:`ModelParts` or a ``(layers, make_batch, loss)`` tuple.
Models are built under ``torch.manual_seed(seed)`` so every process gets the same weights.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .errors import UmoptError, first_line

__all__ = [
    "import_object",
    "ModelParts",
    "Sequences",
    "Layers",
    "MODELS",
    "build_model",
    "blind_layer",
    "parse_model_args",
    "pack",
    "pad",
    "padded_rows",
    "run_layers",
    "runnable",
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


def _sum_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1), reduction="sum")


# --- vgg16 -------------------------------------------------------------------------------------

_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16(image_size: int = 32, num_classes: int = 10, fc_width: int = 512) -> ModelParts:
    """VGG16: 13 conv layers (each with its ReLU, and the max-pool that follows it) and 3 FC layers."""
    if image_size < 32 or image_size % 32:
        raise UmoptError(f"vgg16: image_size must be a multiple of 32, got {image_size}")
    layers: list[nn.Module] = []
    cin = 3
    for i, v in enumerate(_VGG16):
        if v == "M":
            continue
        block = [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=False)]
        if i + 1 < len(_VGG16) and _VGG16[i + 1] == "M":
            block.append(nn.MaxPool2d(2))
        layers.append(nn.Sequential(*block))
        cin = v
    side = image_size // 32
    layers.append(nn.Sequential(nn.Flatten(), nn.Linear(512 * side * side, fc_width), nn.ReLU()))
    layers.append(nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU()))
    layers.append(nn.Linear(fc_width, num_classes))

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, image_size, image_size, generator=g), torch.randint(
            0, num_classes, (n,), generator=g
        )

    return ModelParts(layers, make_batch, _sum_cross_entropy)


# --- gpt ---------------------------------------------------------------------------------------


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
    return torch.arange(int(lengths.sum()), device=device) - starts.to(device)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Causal attention within each document of a packed row: q, k, v (1, heads, T, hd)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_attn() is not None:
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(q.device, torch.int32)
        m = int(lengths.max())
        q1, k1, v1 = (z[0].transpose(0, 1) for z in (q, k, v))  # (T, heads, hd)
        out = _varlen_attn()(q1, k1, v1, cu, cu, m, m, window_size=(-1, 0))
        return out.transpose(0, 1)[None]
    ends = torch.cumsum(lengths, 0).tolist()
    starts = [0] + ends[:-1]
    return torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
            for a, b in zip(starts, ends)
        ],
        dim=2,
    )


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # older torch
        return None
    return varlen_attn


class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = (
            torch.arange(idx.shape[1], device=idx.device)
            if lengths is None or padded_rows(idx, lengths)
            else positions(lengths, idx.device)
        )
        return self.tok(idx) + self.pos(pos)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if lengths is None or padded_rows(x, lengths):  # causal: a row's padding comes after its tokens
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a packed row (see [Note: packed sequences])
            y = packed_attention(q, k, v, lengths)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    tokenwise = True  # each token's logits from its own state: no lengths needed

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(
    layers: int = 4, d_model: int = 128, heads: int = 4, vocab: int = 1024, seq_len: int = 64
) -> ModelParts:
    """A GPT-style decoder: the embedding is the first layer, the LM head the last."""
    if d_model % heads:
        raise UmoptError(f"gpt: d_model {d_model} is not divisible by heads {heads}")
    mods: list[nn.Module] = [Embedding(vocab, d_model, seq_len)]
    mods += [Block(d_model, heads) for _ in range(layers)]
    mods.append(Head(d_model, vocab))
    for m in mods:
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(
                    p,
                    std=0.02 / (math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 1),
                )

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def make_sequences(lengths: Sequence[int], seed: int = 0) -> list[Batch]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for n in lengths:
            tokens = torch.randint(0, vocab, (int(n) + 1,), generator=g)
            out.append((tokens[:-1], tokens[1:]))
        return out

    return ModelParts(
        mods, make_batch, _sum_cross_entropy, Sequences(make_sequences, seq_len, packed=True, causal=True)
    )


# --- mlp ---------------------------------------------------------------------------------------


def mlp(layers: int = 4, width: int = 256, in_features: int = 64, num_classes: int = 10) -> ModelParts:
    """Linear+ReLU layers, then a Linear classifier: the smallest thing that pipelines."""
    mods: list[nn.Module] = []
    cin = in_features
    for _ in range(layers - 1):
        mods.append(nn.Sequential(nn.Linear(cin, width), nn.ReLU()))
        cin = width
    mods.append(nn.Linear(cin, num_classes))

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, in_features, generator=g), torch.randint(0, num_classes, (n,), generator=g)

    return ModelParts(mods, make_batch, _sum_cross_entropy)


MODELS: dict[str, Callable[..., ModelParts]] = {"vgg16": vgg16, "gpt": gpt, "mlp": mlp}


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """``["layers=4", "width=128"]`` -> ``{"layers": 4, "width": 128}`` (ints, floats, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UmoptError(f"--model-arg {pair!r}: expected key=value")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def import_object(spec: str, what: str) -> Any:
    """The object ``package.module:name`` names; one-line errors, whatever importing it raises."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UmoptError(f"{what} {spec}: expected package.module:name")
    # a module in the current folder is found as `python -m` would find it, without PYTHONPATH=.
    # (the ranks of `umopt run` start in the same folder)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything while importing
        raise UmoptError(
            f"{what} {spec}: cannot import it ({exc.__class__.__name__}: {first_line(exc)})"
        ) from None


def runnable(name: str) -> bool:
    """Whether a model of this name can be built to run: one of the zoo's, or a factory (a bundled
    synthetic profile's model is neither)."""
    return name in MODELS or ":" in name


def build_model(name: str, args: dict[str, Any] | None = None, seed: int = 0) -> ModelParts:
    """Build a zoo model by name, or a user model by ``package.module:factory``."""
    args = dict(args or {})
    if ":" in name:
        factory = import_object(name, "--model")
    elif name in MODELS:
        factory = MODELS[name]
    else:
        raise UmoptError(f"unknown model {name!r} (built in: {', '.join(MODELS)}; or package.module:factory)")
    if not callable(factory):
        raise UmoptError(f"--model {name}: not a function")
    if type(seed) is not int or not 0 <= seed < 2**63:
        raise UmoptError(f"model seed must be an integer in [0, 2^63), got {seed!r}")
    try:  # arguments the factory does not take are the user's mistake; what it raises inside is its own
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise UmoptError(f"model {name}: bad arguments {args} ({exc})") from None
    except ValueError:  # no signature to check (a builtin): let the call say
        pass
    torch.manual_seed(seed)
    try:
        parts = factory(**args)
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        raise UmoptError(
            f"model {name}{args or ''}: the factory raised {exc.__class__.__name__}: {first_line(exc)}"
        ) from None
    if isinstance(parts, tuple) and len(parts) == 3:
        parts = ModelParts(list(parts[0]), parts[1], parts[2])
    if (
        not isinstance(parts, ModelParts)
        or not parts.layers
        or not all(isinstance(m, nn.Module) for m in parts.layers)
    ):
        raise UmoptError(
            f"model {name}: the factory must return (layers, make_batch, loss) with a non-empty list of nn.Module"
        )
    if not callable(parts.make_batch) or not callable(parts.loss):
        raise UmoptError(f"model {name}: make_batch and loss must be callables")
    return parts
