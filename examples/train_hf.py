"""Train a small Llama of transformers on documents of different lengths with umopt, no padding to one length.

examples/train_docs.py's run with a model of transformers instead of umopt's own GPT: the
paragraphs of this repository's documents, characters as tokens, each step a minibatch of whole
documents planned for itself ahead of the step, in turns with padding every document to the
minibatch's longest. The model is ``--model hf:llama`` (umopt/hf.py): transformers' Llama code
(its embeddings, decoder layers, RMS norm and head) with a small config and random weights,
nothing downloaded.

    pip install ".[hf]"
    python examples/train_hf.py prepare --out run-hf/                   # profile over lengths
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py train --out run-hf/ --steps 60
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_docs import main  # noqa: E402


def llama_args(vocab: int, longest: int, args) -> dict:
    """A Llama of ``--layers`` decoder layers of width ``--d`` (4 heads, 2 key-value heads)."""
    return {
        "hidden_size": args.d,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": int(8 * args.d / 3) // 8 * 8,
        "vocab_size": vocab,
        "max_position_embeddings": longest,
    }


if __name__ == "__main__":
    main("hf:llama", llama_args, __doc__)
