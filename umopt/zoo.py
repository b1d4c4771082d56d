"""The model zoo: models as flat lists of layers that stages can slice, and how a model is built
from its name (``build_model``).

A model is a :class:`~umopt.parts.ModelParts` (umopt/parts.py): ``layers``, a list of
``nn.Module`` run one after the other; ``make_batch(n, seed)``, a deterministic ``(inputs,
targets)`` batch of ``n`` samples; and ``loss(outputs, targets)``, the loss *summed* over the
samples (the runtime divides by the minibatch, so gradients do not depend on how the minibatch
is chunked); and, for a model of token sequences, how it takes sequences of different lengths.

Built in: ``vgg16`` (13 conv + 3 FC), ``gpt`` (embedding, decoder blocks, LM head) and ``mlp``.
``hf:NAME_OR_DIR`` is a transformers causal language model (umopt/hf.py). Users bring their own
with ``package.module:factory``: a callable taking the model args as keyword arguments and
returning a :class:`~umopt.parts.ModelParts` or a ``(layers, make_batch, loss)`` tuple. Models
are built under ``torch.manual_seed(seed)`` so every process gets the same weights.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sys
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .devices import to_device
from .errors import UmoptError, first_line
from .parts import (  # noqa: F401 - what a model is, re-exported for those who build one from here
    IGNORE,
    TOKENWISE,
    Batch,
    Layers,
    ModelParts,
    Sequences,
    blind_layer,
    pack,
    pad,
    padded_rows,
    positions,
    run_layers,
    takes_lengths,
)

__all__ = [
    "import_object",
    "model_name",
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


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Causal attention within each document of a packed row: q, k, v (1, heads, T, hd)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_attn() is not None:
        cu = to_device(torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32), q.device)
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
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
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


def model_name(name: str) -> str:
    """``name`` as a profile records it: a transformers model's directory absolute (the ranks may
    start elsewhere), anything else as given."""
    if name.startswith("hf:") and os.path.isdir(name[3:]):
        return "hf:" + os.path.abspath(name[3:])
    return name


def runnable(name: str) -> bool:
    """Whether a model of this name can be built to run: one of the zoo's, a factory, or a
    transformers model (hf:NAME_OR_DIR); a bundled synthetic profile's model is none of them."""
    return name in MODELS or ":" in name


def build_model(name: str, args: dict[str, Any] | None = None, seed: int = 0) -> ModelParts:
    """Build a zoo model by name, or a user model by ``package.module:factory``."""
    args = dict(args or {})
    if name.startswith("hf:"):
        from . import hf  # transformers is imported only for its models

        factory = functools.partial(hf.causal_lm, name[3:])
    elif ":" in name:
        factory = import_object(name, "--model")
    elif name in MODELS:
        factory = MODELS[name]
    else:
        raise UmoptError(
            f"unknown model {name!r} (built in: {', '.join(MODELS)}; or hf:NAME_OR_DIR, a transformers causal "
            "language model; or package.module:factory)"
        )
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
    except UmoptError:  # said already, in one line
        raise
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
