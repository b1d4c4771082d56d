"""The ``umopt`` command line: parse, call the library, print. Installed as ``umopt.cli``.

One module per command (:mod:`.solve`, :mod:`.profile`, :mod:`.run`, :mod:`.tune`,
:mod:`.calibrate`; :mod:`.show` holds the commands that read files and print them), each
registering itself on the group of :mod:`.app`, which also holds what they share: the consoles,
progress, and :func:`main`. Every user-facing problem arrives as
:class:`umopt.errors.UmoptError`; :func:`main` prints it as one line on stderr and exits with
code 2, without a traceback and without writing any file.
"""

from __future__ import annotations

from . import calibrate, profile, run, show, solve, tune  # noqa: F401 (each registers its commands)
from .app import _log_to, cli, err, main, out

__all__ = ["main", "cli", "out", "err", "_log_to"]
