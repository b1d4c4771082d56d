"""Sequences of different lengths in the runtime: a minibatch's samples as rows of tokens.

[Note: token rows]
With sequences of different lengths (a plan of ``umopt solve --lengths``), what crosses a
boundary is cut by token, not by sample: a boundary tensor is token-major, ``(tokens, *rest)``,
sample k's tokens its rows ``offsets[k]:offsets[k + 1]`` in the plan's order, so a chunk of
samples [lo, hi) is a range of rows, and a stage's receive buffer and its neighbours' chunks
(each stage cut its own way) meet on rows as they met on samples. Both ends know every row from
the step's plan: no shape is ever exchanged. Only the module sees a chunk otherwise: *packed*,
one row ``(1, T, *rest)`` with its documents' lengths (``lengths=``, see [Note: packed
sequences] in umopt/zoo.py); *padded*, ``(n, longest, *rest)``, padding's rows zero on the way in
and dropped on the way out, with each row's length (``lengths=``) where the module takes them. Both conversions are autograd ops, so a chunk's backward runs on
exactly its forward's graph, and no padding is ever sent. A plan of packed rows (Megatron's
packing, a peer) pads each row that is not full with a document of its own, whose targets the
loss ignores (-100, what ``nn.CrossEntropyLoss`` ignores unless told otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..devices import to_device
from ..errors import UmoptError
from ..parts import blind_layer

__all__ = ["TokenRows"]


@dataclass
class TokenRows:
    """One step's samples as rows of tokens (see [Note: token rows]): ``docs[k]`` the lengths of
    the documents sample k holds, in the plan's order (one sequence; or a packed row's
    sequences and, where the row is not full, a padding document), ``mode`` how the module sees
    a chunk, ``pad_to`` every padded chunk's length where the plan fixes one (pad-to-longest);
    ``samples`` and ``row``, which sequences each sample holds and the rows' length."""

    mode: str
    docs: list[list[int]]
    pad_to: Optional[int] = None
    samples: Optional[list[list[int]]] = None
    row: Optional[int] = None

    def __post_init__(self) -> None:
        self.tokens = np.array([sum(d) for d in self.docs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.tokens)]).astype(np.int64)

    @classmethod
    def of_plan(
        cls,
        lengths: Sequence[int],
        samples: Sequence[Sequence[int]],
        mode: str,
        pad_to: Optional[int] = None,
        row: Optional[int] = None,
    ) -> "TokenRows":
        if row is None:
            if any(len(u) != 1 for u in samples):
                raise UmoptError("a plan's sample holds several sequences only in packed rows (lengths.row)")
            docs = [[int(lengths[u[0]])] for u in samples]
        else:
            if len({i for u in samples for i in u}) != sum(len(u) for u in samples):
                raise UmoptError(
                    "the plan cuts sequences across rows: the runtime trains on whole sequences (plan packing "
                    "without splitting)"
                )
            docs = []
            for u in samples:
                used = sum(int(lengths[i]) for i in u)
                if used > row:
                    raise UmoptError(f"a row of {row} tokens holds {used}")
                docs.append([int(lengths[i]) for i in u] + ([row - used] if used < row else []))
        # every sample padded to one length (pad-to-longest) is a padded chunk of that width,
        # whatever the plan calls it: its costs are those of pad_to tokens a sample
        return cls("padded" if pad_to else mode, docs, pad_to, [list(map(int, u)) for u in samples], row)

    def arrange(self, seqs: Sequence[torch.Tensor], pad: int) -> torch.Tensor:
        """The minibatch's sequences (in its own order) as rows in the plan's: each sample's
        sequences one after another, a row's padding document filled with ``pad``."""
        assert self.samples is not None
        parts = []
        for u, d in zip(self.samples, self.docs):
            parts += [seqs[i] for i in u]
            if len(d) > len(u):  # the row's padding
                parts.append(seqs[u[0]].new_full((d[-1], *seqs[u[0]].shape[1:]), pad))
        return torch.cat(parts)

    def sequences(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """A tensor of the minibatch's rows (in the plan's order, a packed row's padding included)
        as the minibatch's sequences again: one tensor each, in the minibatch's own order, without
        padding (what :meth:`arrange` did, undone)."""
        assert self.samples is not None
        out: dict[int, torch.Tensor] = {}
        for k, (u, d) in enumerate(zip(self.samples, self.docs)):
            at = int(self.offsets[k])
            for i, n in zip(u, d):
                out[i] = rows[at : at + n]
                at += n
        return [out[i] for i in range(len(out))]

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def rows(self, lo: int, hi: int) -> slice:
        return slice(int(self.offsets[lo]), int(self.offsets[hi]))

    def count(self, lo: int, hi: int) -> int:
        return int(self.offsets[hi] - self.offsets[lo])

    def _index(self, lo: int, hi: int, width: int) -> torch.Tensor:
        """Each row of samples [lo, hi) in a padded chunk of ``width`` per sample, flattened."""
        t = self.tokens[lo:hi]
        starts = np.arange(hi - lo) * width
        return torch.from_numpy(np.concatenate([s + np.arange(n) for s, n in zip(starts, t)]))

    def width(self, lo: int, hi: int) -> int:
        return int(self.pad_to or self.tokens[lo:hi].max())

    def to_module(
        self, xs: tuple[torch.Tensor, ...], lo: int, hi: int, lengths: bool = True
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """Chunk [lo, hi)'s rows as the module takes them: (its arguments, its keywords; the
        sequences' ``lengths`` where the module takes them)."""
        if self.mode == "packed":
            docs = torch.tensor([n for d in self.docs[lo:hi] for n in d], dtype=torch.long)
            return tuple(x.unsqueeze(0) for x in xs), {"lengths": docs}
        n, w = hi - lo, self.width(lo, hi)
        index = to_device(self._index(lo, hi, w), xs[0].device)  # no wait for the device
        out = []
        for x in xs:
            padded = x.new_zeros((n * w, *x.shape[1:])).index_copy(0, index, x)
            out.append(padded.view(n, w, *x.shape[1:]))
        return tuple(out), ({"lengths": torch.from_numpy(self.tokens[lo:hi].copy())} if lengths else {})

    def from_module(
        self, out: tuple[torch.Tensor, ...], lo: int, hi: int, what: str
    ) -> tuple[torch.Tensor, ...]:
        """The module's output of chunk [lo, hi) as rows again (padding's dropped)."""
        rows = self.count(lo, hi)
        if self.mode == "packed":
            for t in out:
                if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != rows:
                    raise UmoptError(
                        f"{what} is {tuple(t.shape)} for a packed chunk of {rows} tokens: it must be (1, {rows}, ...)"
                    )
            return tuple(t[0] for t in out)
        n, w = hi - lo, self.width(lo, hi)
        index = to_device(self._index(lo, hi, w), out[0].device)
        flat = []
        for t in out:
            if t.dim() < 2 or tuple(t.shape[:2]) != (n, w):
                raise UmoptError(
                    f"{what} is {tuple(t.shape)} for a padded chunk of {n} sequences of {w}: it must be ({n}, {w}, ...)"
                )
            flat.append(t.reshape(n * w, *t.shape[2:]).index_select(0, index))
        return tuple(flat)

    def check_module(self, module: torch.nn.Module, where: str, causal: bool = False) -> None:
        """A chunk must reach layers that keep its sequences apart (see [Note: packed sequences]
        in umopt/zoo.py): packed, layers that take ``lengths=`` (or compute each token alone);
        padded, those or a causal model (``causal``: its owner says so)."""
        if self.mode == "padded" and self.row is not None:
            raise UmoptError("a plan of padded rows: rows are packed")
        blind = blind_layer(module)
        if blind is None or (self.mode == "padded" and causal):
            return
        if self.mode == "packed":
            raise UmoptError(
                f"{where}: {blind}, so the documents of a packed chunk would see one another: give its "
                "forward a lengths keyword (positions and attention per document, as umopt/zoo.py's gpt), or, if "
                "every layer is causal, plan padded (--length-modes padded) and say so (causal=True)"
            )
        raise UmoptError(
            f"{where}: {blind}, so it would read a padded chunk's padding: give its forward a lengths "
            "keyword (each row's tokens, to mask the rest), or, if every layer is causal (padding after a token "
            "never reaches it), say so (umopt.Pipeline(..., causal=True); a factory's Sequences(causal=True))"
        )
