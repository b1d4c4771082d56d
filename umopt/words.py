"""How counts read in what umopt prints: "1 round", "2 rounds", never "1 rounds"."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, singular for one: ``count(1, "round")`` is "1 round"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
