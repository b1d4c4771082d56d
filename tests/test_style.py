"""ruff keeps the style (pyproject.toml's [tool.ruff]): the lint rules pass and the code is formatted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIRS = ["."]  # every Python file of the project (pyproject.toml leaves the Markdown out)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    ran = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *DIRS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-1000:]
