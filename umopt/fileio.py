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

__all__ = ["MAX_JSON_BYTES", "read_json", "write_atomic", "write_json", "check_writable"]

# the largest profile umopt writes is a few MB; a file far beyond is a mistake, not a profile
MAX_JSON_BYTES = 256 << 20


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file, turning every way it can fail into one-line :class:`UmoptError`."""
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size > MAX_JSON_BYTES:
            raise UmoptError(
                f"{p}: {p.stat().st_size} bytes, over umopt's limit of {MAX_JSON_BYTES} for a JSON file"
            )
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UmoptError(f"{p}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UmoptError(f"{p}: cannot read: {exc.__class__.__name__}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UmoptError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise UmoptError(f"{p}: JSON nested too deeply") from None


def write_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then rename the temp file onto ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes files only their owner may read: give the user's usual permissions
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; read once, before any thread
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(data, indent=1) + "\n"
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def check_writable(path: str | os.PathLike) -> None:
    """Refuse, before any work, an output path that cannot be written (one line).

    Permissions alone do not say (root may write anywhere the permissions say, yet not in /proc,
    on a read-only mount or a full disk): a file is created and removed in the nearest folder that
    exists, where :func:`write_atomic` will create the rest."""
    p = Path(path)
    existing = p.parent if str(p.parent) else Path(".")
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or (p.exists() and (p.is_dir() or not os.access(p, os.W_OK))):
        raise UmoptError(f"{p}: cannot write there")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError:
        raise UmoptError(f"{p}: cannot write there") from None
