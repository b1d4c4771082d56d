"""Regenerate the bundled synthetic profiles (device type "sim").

    python bench/make_sim_profiles.py

They let ``umopt solve`` work without a profiler run and keep the examples and tests
reproducible. Each stage is twelve equal layers (``layers``), so a rank's share can be cut into
2, 3 or 4 chunks of several chunks per rank. Their shapes are chosen to look like real pipelines: a GPT whose last stage carries
the LM head, and an 8-stage transformer with per-call overheads that differ between stages; and
a GPT costed by tokens on 4 and 8 stages, for sequences of different lengths (docs/varlen.md).
"""

from pathlib import Path

from umopt.formats.profile import save_profile
from umopt.synthetic import synthetic_profile, synthetic_token_profile

ROOT = Path(__file__).resolve().parent.parent / "profiles"

PROFILES = {
    # 4 stages; stage 3 holds the LM head (heavy per sample), stage 0 the embedding (cheap).
    "gpt-sim": dict(
        num_stages=4,
        max_size=64,
        overhead_ms=[0.6, 1.2, 1.2, 0.9],
        per_sample_ms=[0.35, 0.55, 0.55, 0.8],
        exponent=0.9,
        latency_ms=0.08,
        bytes_per_sample=512 * 768 * 4,
        bytes_per_ms=5e6,
        name="gpt-sim",
        layers_per_stage=12,
    ),
    # 8 stages, mixed overheads: some stages want big chunks, some small.
    "transformer8-sim": dict(
        num_stages=8,
        max_size=64,
        overhead_ms=[0.3, 2.0, 0.4, 1.6, 0.5, 2.4, 0.3, 1.0],
        per_sample_ms=[0.5, 0.3, 0.6, 0.35, 0.55, 0.25, 0.6, 0.45],
        exponent=0.85,
        latency_ms=0.05,
        bytes_per_sample=256 * 1024 * 2,
        bytes_per_ms=1e7,
        name="transformer8-sim",
        layers_per_stage=12,
    ),
}

# costed by tokens (umopt solve --lengths): a GPT of 30 blocks of d=2048, on 4 and 8 stages
TOKEN_PROFILES = {"gpt-tokens-sim": 4, "gpt-tokens8-sim": 8}

if __name__ == "__main__":
    for name, kw in PROFILES.items():
        save_profile(synthetic_profile(**kw), ROOT / f"{name}.json")
        print(f"wrote {ROOT / f'{name}.json'}")
    for name, S in TOKEN_PROFILES.items():
        save_profile(synthetic_token_profile(S, name=name), ROOT / f"{name}.json")
        print(f"wrote {ROOT / f'{name}.json'}")
