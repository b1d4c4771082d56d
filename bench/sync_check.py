"""A chunk of sequences through a stage without the host waiting for the GPU (bench/gpu_smoke.sh).

A packed or padded chunk's forward builds what its layers need from the chunk's lengths
(positions, the varlen kernel's cumulative lengths, the padded rows' index): built on the host and
copied pinned, without a wait, so the host runs ahead of the GPU and keeps its queue full. Under
``torch.cuda.set_sync_debug_mode("error")`` any operation that would make the host wait raises:
this plays a packed and a padded chunk's forward and backward through the built-in GPT, and through
a small Llama of transformers where it is installed, in bfloat16, and says which one waited.

    python bench/sync_check.py          # on a machine with a GPU: prints PASS lines, exits 1 on a wait
"""

from __future__ import annotations

import sys

import torch

from umopt.devices import autocast
from umopt.run.tokens import TokenRows
from umopt.zoo import build_model, run_layers

MODELS = {
    "gpt": ("gpt", {"layers": 2, "d_model": 256, "heads": 4, "vocab": 1024, "seq_len": 512}),
    "llama": ("hf:llama", {"hidden_size": 256, "num_hidden_layers": 2, "max_position_embeddings": 512}),
}


def check(name: str, model: str, args: dict, device: torch.device) -> None:
    parts = build_model(model, args, seed=0)
    layers = [m.to(device) for m in parts.layers]
    lengths = [300, 17, 5, 120, 64]
    for mode in ("packed", "padded"):
        rows = TokenRows.of_plan(lengths, [[i] for i in range(len(lengths))], mode)
        tokens = torch.randint(0, 256, (rows.total,)).pin_memory().to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with autocast(device, "bfloat16"):
                args_, kw = rows.to_module((tokens,), 0, len(lengths))
                out = run_layers(layers, args_[0], kw.get("lengths"))
                back = rows.from_module((out,), 0, len(lengths), "the output")[0]
                back.float().sum().backward()
        except RuntimeError as exc:
            raise SystemExit(f"FAIL {name}, {mode}: the host waited for the GPU: {str(exc).splitlines()[0]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
        print(f"PASS {name}, {mode}: forward and backward of {len(lengths)} sequences, no wait for the GPU")


def main() -> None:
    if not torch.cuda.is_available():
        print("SKIP: no GPU (the check is of the host waiting for one)")
        return
    device = torch.device("cuda", 0)
    for name, (model, args) in MODELS.items():
        if model.startswith("hf:"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"SKIP {name}: transformers is not installed (pip install '.[hf]')")
                continue
        check(name, model, args, device)


if __name__ == "__main__":
    sys.exit(main())
