"""examples/train_text.py, small: profile the user's own stages, solve, train with umopt.Pipeline
under torchrun on text from disk; the loss falls and both schedules are timed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_text.py"


@pytest.mark.slow
def test_the_text_example_profiles_solves_and_trains(tmp_path):
    small = [
        "--stages",
        "2",
        "--minibatch",
        "8",
        "--layers",
        "2",
        "--d",
        "32",
        "--seq",
        "16",
        "--time-limit",
        "1",
        "--out",
        str(tmp_path),
    ]
    small += ["--link-latency-ms", "0.05", "--link-gbps", "10"]  # given: measuring them is tested elsewhere
    prep = subprocess.run(
        [sys.executable, str(EXAMPLE), "prepare", *small], capture_output=True, text=True, timeout=300
    )
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert all((tmp_path / f).exists() for f in ("profile.json", "umopt.json", "equal.json"))
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLE),
            "train",
            "--out",
            str(tmp_path),
            "--steps",
            "12",
            "--turn",
            "3",
            "--every",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", train.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, train.stdout
    # a mean over tokens, as one process prints it (a character vocabulary of ~100: about ln 100 = 4.6 at first), not a sum
    assert 2 < losses[0] < 6, train.stdout
    assert "umopt / equal = " in train.stdout


DOCS = EXAMPLE.parent / "train_docs.py"


@pytest.mark.slow
def test_the_documents_example_profiles_over_lengths_and_trains_without_padding(tmp_path):
    small = [
        "--layers",
        "1",
        "--d",
        "32",
        "--longest",
        "48",
        "--no-probes",
        "--sequential",
        "--out",
        str(tmp_path),
    ]
    small += ["--link-latency-ms", "0.05", "--link-gbps", "10"]
    prep = subprocess.run(
        [sys.executable, str(DOCS), "prepare", *small], capture_output=True, text=True, timeout=300
    )
    assert prep.returncode == 0, prep.stderr[-2000:]
    train = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DOCS)]
        + [
            "train",
            "--out",
            str(tmp_path),
            "--steps",
            "8",
            "--turn",
            "2",
            "--every",
            "1",
            "--minibatch",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", train.stdout)]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert "(umopt)" in train.stdout and "(pad  )" in train.stdout  # the two took turns
    assert re.search(r"umopt / pad = [0-9.]+x", train.stdout), train.stdout
