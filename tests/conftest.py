"""Shared fixtures: small hand-made and synthetic profiles."""

from __future__ import annotations

import json

import pytest

from umopt.formats.profile import PROFILE_FORMAT, Profile


def two_stage_profile(comm: bool = True, **over) -> Profile:
    """The S=2 profile whose timelines tests/test_costmodel.py computes by hand."""
    data = {
        "format": PROFILE_FORMAT,
        "model": {"name": "hand", "args": {}},
        "device": {"type": "sim", "name": "hand", "dtype": "float32"},
        "sizes": [1, 2],
        "stages": [
            {
                "layers": [0, 1],
                "forward_ms": [1.0, 1.5],
                "backward_ms": [2.0, 3.0],
                "input_bytes_per_sample": 10,
                "output_bytes_per_sample": 1000 if comm else 0,
                "stash_bytes_per_sample": 100,
                "static_bytes": 1000,
                "optimizer_ms": 0.5,
            },
            {
                "layers": [1, 2],
                "forward_ms": [1.0, 2.0],
                "backward_ms": [2.0, 3.5],
                "input_bytes_per_sample": 1000 if comm else 0,
                "output_bytes_per_sample": 0,
                "stash_bytes_per_sample": 200,
                "static_bytes": 2000,
                "optimizer_ms": 0.25,
            },
        ],
        "links": [{"latency_ms": 0.1 if comm else 0.0, "bytes_per_ms": 10000.0}],
        "memory_limit_bytes": None,
    }
    data.update(over)
    return Profile.model_validate(data)


@pytest.fixture
def profile_file(tmp_path):
    """Write a profile dict to a file and return its path."""

    def write(profile: Profile | dict, name: str = "profile.json") -> str:
        path = tmp_path / name
        data = profile.model_dump(mode="json") if isinstance(profile, Profile) else profile
        path.write_text(json.dumps(data))
        return str(path)

    return write


def run_cli(argv, capsys):
    """Run the umopt command in-process: (exit code, stdout, stderr)."""
    from umopt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
        raise SystemExit(0)
    cap = capsys.readouterr()
    return exc.value.code, cap.out, cap.err


def zoo_sim_profile(
    path, model: str, args: dict, cuts: list[int], *, dtype: str = "float32", max_size: int = 8, seed: int = 0
):
    """A profile of a zoo model cut at ``cuts``, with synthetic costs (device "sim"), written to
    ``path`` and loaded back: what the runtime needs to run the model, without measuring it."""
    from umopt.formats.profile import load_profile, save_profile
    from umopt.synthetic import synthetic_profile

    S = len(cuts) - 1
    prof = synthetic_profile(S, max_size=max_size, seed=seed, bytes_per_sample=256)
    prof = prof.model_copy(
        update={
            "model": prof.model.model_copy(update={"name": model, "args": dict(args)}),
            "device": prof.device.model_copy(update={"dtype": dtype}),
            "stages": [
                st.model_copy(update={"layers": [cuts[s], cuts[s + 1]]}) for s, st in enumerate(prof.stages)
            ],
        }
    )
    save_profile(prof, path)
    return load_profile(path)
