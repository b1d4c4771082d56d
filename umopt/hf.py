"""Causal language models of Hugging Face ``transformers`` as umopt's lists of layers.

``--model hf:NAME_OR_DIR`` (and :func:`causal_lm` for ``umopt.Pipeline`` users) builds a decoder-only
``*ForCausalLM`` and cuts it into the layers the rest of umopt takes (:class:`umopt.zoo.ModelParts`):
the embeddings, each decoder layer, the final norm and the LM head. NAME is a ``model_type``
(``llama``, ``qwen2``, ``gpt2``, ...), built from its config with random weights (umopt's small
sizes, :data:`SMALL`, unless ``--model-arg`` gives others: ``hidden_size=``,
``num_hidden_layers=``, ...); DIR a directory written by ``save_pretrained``, its weights loaded.
Nothing is downloaded.

[Note: transformers' layers in a pipeline]
A decoder layer needs more than the hidden states that cross a stage boundary: the tokens'
positions, the rotary embedding's cos and sin, and the attention's mask. None of it is sent:
each layer rebuilds it from the chunk's sequence lengths (``lengths=``, see [Note: packed
sequences] in umopt/zoo.py), which every rank knows from the step's plan. Packed, positions
restart at each document and attention stays within it; padded, positions run from 0 on each
row, and causal attention keeps each row's padding (after its tokens) out of them. The
attention is transformers' own layer calling an attention function umopt registers with
transformers (``AttentionInterface``, implementation "umopt"), given the lengths through the
layer's keywords as transformers gives flash attention its packed sequences: scaled-dot-product
attention per document, or on CUDA in half precision one varlen kernel. So a layer's weights,
norms, projections, rotary and MLP are transformers' code, and only the attention's grouping of
tokens is umopt's. Whether the cut computes what the whole model does is checked when the model
is built: a few short sequences through both, packed and padded; a family the cut gets wrong is
refused in one line rather than trained silently otherwise.

Tied embeddings (GPT-2's ``wte`` and ``lm_head``): the one weight is the first layer's and the
last's. Where those sit on two ranks each holds a copy; :attr:`ModelParts.tied` names them, and the
runtime sums their gradients across those ranks after each step (see [Note: tied weights] in
umopt/run/pipeline.py), so training equals one process.
"""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .devices import to_device
from .errors import UmoptError, first_line
from .parts import IGNORE, ModelParts, Sequences, padded_rows, positions, run_layers

__all__ = ["SMALL", "TRANSFORMERS", "causal_lm", "attention"]

TRANSFORMERS = "transformers>=5,<6"  # the range umopt is tested with (pip install '.[hf]')

# a NAME's sizes unless --model-arg says otherwise: a model a CPU trains at a useful pace (the
# family's own defaults are billions of parameters); every dropout off, so that a run's
# gradients can equal one process's (give them back with --model-arg)
SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 8192,
    "max_position_embeddings": 1024,
}
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")
SEQ_LEN = 128  # a fixed-length sample's tokens (umopt profile without --lengths), at most the model's


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UmoptError(
            f"--model hf:... needs transformers: pip install '.[hf]' (or pip install '{TRANSFORMERS}')"
        ) from None
    return transformers


def causal_lm(spec: str, seq_len: Optional[int] = None, **overrides: Any) -> ModelParts:
    """``spec``: a ``model_type`` or a ``save_pretrained`` directory (see the module docstring);
    ``overrides``: config fields (a NAME's over :data:`SMALL`); ``seq_len``: a fixed-length
    sample's tokens (default :data:`SEQ_LEN`, at most the model's positions)."""
    model = _load(spec, overrides)
    layers, embed_of = _cut(model, spec)
    _register()
    reference = _reference_outputs(model)  # transformers' own attention, before umopt's is set
    model.set_attn_implementation("umopt")
    _check_cut(layers, reference, spec)
    config = model.config
    longest = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 20
    vocab = int(config.vocab_size)
    n = min(seq_len or SEQ_LEN, longest)

    def make_batch(count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (count, n + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def make_sequences(lengths: Sequence[int], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        out = []
        for k in lengths:
            tokens = torch.randint(0, vocab, (int(k) + 1,), generator=g)
            out.append((tokens[:-1], tokens[1:]))
        return out

    parts = ModelParts(
        layers, make_batch, _sum_cross_entropy, Sequences(make_sequences, longest, packed=True, causal=True)
    )
    parts.tied = _tied(layers)
    return parts


def _load(spec: str, overrides: dict) -> nn.Module:
    tf = _transformers()
    quiet = tf.utils.logging.get_verbosity()
    tf.utils.logging.set_verbosity_error()  # a small vocabulary's token ids it warns of are no use to umopt
    try:
        return _build(tf, spec, overrides)
    finally:
        tf.utils.logging.set_verbosity(quiet)


def _build(tf, spec: str, overrides: dict) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if os.path.isdir(spec):
        if not (glob.glob(os.path.join(spec, "*.safetensors")) or glob.glob(os.path.join(spec, "*.bin"))):
            raise UmoptError(
                f"--model hf:{spec}: the directory has no weights (*.safetensors; save_pretrained writes them)"
            )
        try:
            config = AutoConfig.from_pretrained(spec, **overrides)
        except Exception as exc:  # noqa: BLE001 - a broken config.json is the user's input
            raise UmoptError(f"--model hf:{spec}: cannot read its config ({first_line(exc)})") from None
        _check_config(config, spec)
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, config=config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001
            raise UmoptError(
                f"--model hf:{spec}: cannot load it ({exc.__class__.__name__}: {first_line(exc)})"
            ) from None
    else:
        if spec not in tf.CONFIG_MAPPING:
            raise UmoptError(
                f"--model hf:{spec}: no such directory, and not a transformers model_type (e.g. llama, qwen2, gpt2)"
            )
        cls = tf.CONFIG_MAPPING[spec]
        given = {k: v for k, v in SMALL.items() if k not in overrides}
        given.update({k: 0.0 for k in _DROPOUTS if k not in overrides})
        asked = {**given, **overrides}  # the families' own checks say less than this
        _check_config(SimpleNamespace(**asked), spec)
        try:
            config = cls(**given, **overrides)
        except Exception as exc:  # noqa: BLE001 - a config the family refuses is the user's input
            raise UmoptError(
                f"--model hf:{spec}: its config refuses {overrides} ({first_line(exc)})"
            ) from None
        _check_config(config, spec)
        if type(config).__name__ not in _config_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, spec):
            raise UmoptError(f"--model hf:{spec}: transformers has no causal language model of this type")
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001
            raise UmoptError(
                f"--model hf:{spec}: cannot build it ({exc.__class__.__name__}: {first_line(exc)})"
            ) from None
    return model


def _config_names(mapping, spec: str) -> set[str]:
    """The config class names that have a causal LM (their model_type's)."""
    from transformers import CONFIG_MAPPING

    return {CONFIG_MAPPING[t].__name__ for t in mapping if t in CONFIG_MAPPING}


def _check_config(config, spec: str) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise UmoptError(
            f"--model hf:{spec}: an encoder-decoder model ({config.model_type}); umopt cuts decoder-only ones"
        )
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if width and heads and not getattr(config, "head_dim", None) and width % heads:
        raise UmoptError(
            f"--model hf:{spec}: {heads} attention heads do not divide the width {width} (hidden_size)"
        )


def _find(obj, names: Sequence[str]):
    return next((getattr(obj, n) for n in names if isinstance(getattr(obj, n, None), nn.Module)), None)


def _cut(model: nn.Module, spec: str) -> tuple[list[nn.Module], nn.Module]:
    """The model's layers: the embeddings, each decoder layer, the final norm, the LM head."""
    base = model.base_model
    n = int(model.config.num_hidden_layers)
    blocks = next((m for _, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == n), None)
    norm = _find(base, ("norm", "ln_f", "final_layer_norm", "norm_f"))
    head = model.get_output_embeddings()
    if blocks is None or norm is None or head is None:
        raise UmoptError(
            f"--model hf:{spec}: {type(model).__name__}'s decoder layers are not a list umopt can cut "
            "(a ModuleList of num_hidden_layers beside a final norm and an LM head)"
        )
    embed = Embed(
        model.get_input_embeddings(),  # (Gemma's scales itself)
        _find(base, ("wpe",)),  # learned absolute positions (GPT-2)
        _find(base, ("drop", "embed_dropout")),
    )
    rotary = _find(base, ("rotary_emb",))
    return [embed, *(Decoder(b, rotary) for b in blocks), Norm(norm), Head(head)], embed


def _positions(x: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """Each token's position, (rows, tokens): from 0 on each row (padded), or on each document of
    a packed row."""
    if lengths is None or padded_rows(x, lengths):
        return torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return positions(lengths, x.device)[None]


class Embed(nn.Module):
    """Token embeddings (with learned positions and dropout, where the family has them)."""

    def __init__(self, tokens: nn.Module, positions: Optional[nn.Module], drop: Optional[nn.Module]):
        super().__init__()
        self.tokens, self.positions, self.drop = tokens, positions, drop

    def forward(self, ids: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(_positions(ids, lengths))
        return self.drop(h) if self.drop is not None else h


class Decoder(nn.Module):
    """One of transformers' decoder layers, its positions, rotary and attention's grouping of
    tokens rebuilt from the chunk's lengths (see [Note: transformers' layers in a pipeline])."""

    def __init__(self, layer: nn.Module, rotary: Optional[nn.Module]):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # the model's one rotary embedding (buffers only), a child of each layer

    def forward(self, h: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = _positions(h, lengths)
        kw: dict[str, Any] = {"position_ids": pos, "umopt_lengths": lengths}
        if self.rotary is not None:
            kw["position_embeddings"] = self.rotary(h, pos)
        out = self.layer(h, attention_mask=None, use_cache=False, **kw)
        return out[0] if isinstance(out, tuple) else out


class Norm(nn.Module):
    tokenwise = True  # each token's state alone

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class Head(nn.Module):
    tokenwise = True

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def _sum_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        out.reshape(-1, out.shape[-1]).float(), target.reshape(-1), reduction="sum", ignore_index=IGNORE
    )


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    umopt_lengths: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention as transformers' layers call it (q, k, v: (rows, heads, tokens, dim);
    returns (rows, tokens, heads, dim)): a padded or whole row at once, a packed row per document
    (see [Note: transformers' layers in a pipeline]). What it does not compute is refused: a
    capping of the scores (Gemma 2) or attention sinks would pass the check of a cut on small
    random weights, and train otherwise."""
    if softcap is not None or s_aux is not None:
        raise UmoptError(
            f"{type(module).__name__}: its attention caps its scores or has sinks, which umopt's attention does not "
            "compute: its family is not supported yet"
        )
    if attention_mask is not None:
        raise UmoptError("umopt's attention builds its own masks from the lengths: none is given to it")
    if key.shape[1] != query.shape[1]:  # grouped queries: each key head serves several
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    drop = dropout if module.training else 0.0

    def causal(q, k, v):
        t = q.shape[2]
        if sliding_window is not None and t > sliding_window:
            i = torch.arange(t, device=q.device)
            keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=drop, scale=scaling)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop, scale=scaling)

    if umopt_lengths is None or padded_rows(query, umopt_lengths):
        out = causal(query, key, value)
    elif (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and sliding_window is None
        and not drop
    ):
        out = _varlen(query, key, value, umopt_lengths, scaling)
    else:
        ends = torch.cumsum(umopt_lengths, 0).tolist()
        starts = [0] + ends[:-1]
        out = torch.cat(
            [causal(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]) for a, b in zip(starts, ends)], 2
        )
    return out.transpose(1, 2).contiguous(), None


def _varlen(q, k, v, lengths, scaling) -> torch.Tensor:
    """A packed row's documents in one varlen flash-attention call (CUDA, half precision)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = to_device(F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32), q.device)
    m = int(lengths.max())
    q1, k1, v1 = (z[0].transpose(0, 1) for z in (q, k, v))  # (tokens, heads, dim)
    out = varlen_attn(q1, k1, v1, cu, cu, m, m, window_size=(-1, 0), scale=scaling)
    return out.transpose(0, 1)[None]


_REGISTERED = [False]


def _register() -> None:
    if not _REGISTERED[0]:
        from transformers import AttentionInterface

        AttentionInterface.register("umopt", attention)
        _REGISTERED[0] = True


# a packed row of two documents and padded rows of them: what the check of a cut runs
_CHECK = (5, 3)


def _reference_outputs(model: nn.Module) -> list[torch.Tensor]:
    """transformers' logits of each check sequence alone, in eval mode."""
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in _CHECK]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [(s, model(input_ids=s[None]).logits[0]) for s in seqs]
    finally:
        model.train(was)


def _check_cut(layers: list[nn.Module], reference, spec: str) -> None:
    """The cut's logits, packed and padded, against transformers' own (see the module docstring)."""
    seqs = [s for s, _ in reference]
    lengths = torch.tensor([len(s) for s in seqs])
    training = [m.training for m in layers]
    for m in layers:
        m.eval()
    try:
        with torch.no_grad():
            try:
                packed = run_layers(layers, torch.cat(seqs)[None], lengths)[0].split(lengths.tolist())
            except UmoptError as exc:
                raise UmoptError(f"--model hf:{spec}: {exc}") from None
            width = int(lengths.max())
            rows = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                rows[i, : len(s)] = s
            padded = run_layers(layers, rows, lengths)
    finally:
        for m, t in zip(layers, training):
            m.train(t)
    worst = 0.0
    for i, (_, want) in enumerate(reference):
        scale = 1.0 + float(want.abs().max())
        for got in (packed[i], padded[i, : len(want)]):
            worst = max(worst, float((got - want).abs().max()) / scale)
    if not worst <= 1e-4:
        raise UmoptError(
            f"--model hf:{spec}: umopt's cut of this model does not compute what transformers' does (logits "
            f"{worst:.2g} apart, relative): its family is not supported yet"
        )


def _tied(layers: list[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters one object in several layers (tied embeddings): each group's (layer, name)s."""
    where: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            if (i, name) not in where.get(id(p), []):
                where.setdefault(id(p), []).append((i, name))
    return [sorted(v) for v in where.values() if len({i for i, _ in v}) > 1]
