"""What people run on sequences of different lengths, from the tools' and papers' own descriptions,
each at the knobs that serve it best, scored by the same cost model as umopt's plans: one
:class:`~umopt.search.method.Method` per file (padding, packing, sorting and splitting, DynaPipe,
WLB-LLM), their shared end in :mod:`.equal`. docs/varlen.md says what was chosen where the
descriptions leave room.

Every module of this package is imported here, so a peer's class, once its file is here, is in
:data:`PEERS` (and :data:`umopt.search.methods.METHODS`) with nothing else to change.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..method import Method, registered
from .pack import packed_rows
from .pad import pad

__all__ = ["PEERS", "pad", "packed_rows"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

PEERS: dict[str, Method] = {m.name: m for m in registered() if type(m).__module__.startswith(f"{__name__}.")}
