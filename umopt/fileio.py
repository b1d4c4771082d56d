"""Reading JSON and writing files atomically.

Every file umopt writes goes through :func:`write_atomic` (temp file in the same folder, then
rename), so a failed run never leaves a half-written profile, schedule or picture behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import UmoptError

__all__ = ["read_json", "write_atomic", "write_json", "check_writable"]


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file, turning every way it can fail into one-line :class:`UmoptError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UmoptError(f"{p}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UmoptError(f"{p}: cannot read: {exc.__class__.__name__}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UmoptError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def write_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then rename the temp file onto ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(data, indent=1) + "\n"
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def check_writable(path: str | os.PathLike) -> None:
    """Refuse, before any work, an output path that cannot be written (one line)."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    existing = folder
    while not existing.exists():  # write_atomic makes the missing folders
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK) or (p.exists() and (p.is_dir() or not os.access(p, os.W_OK))):
        raise UmoptError(f"{p}: cannot write there")
