"""The one exception type a user is meant to see.

Anything wrong with what the user gave us (a malformed file, a schedule that does not fit its
profile, an impossible request) raises :class:`UmoptError` with a single line that names the
problem. The CLI prints that line and exits with code 2; every other exception is a bug.
"""

__all__ = ["UmoptError", "NoFit", "first_line"]


class UmoptError(Exception):
    """A problem with the user's input, described in one line."""

    exit_code = 2


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), or ""."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""


class NoFit(UmoptError):
    """No plan of the minibatch fits the memory limit (a method's answer, which its caller may
    take as "none" and compare the others)."""

    def __init__(self, what: str = "no plan"):
        super().__init__(
            f"{what} fits the memory limit: fewer or shorter sequences per minibatch, or --recompute"
        )
