"""A failed step (or set-up) breaks the pipeline, and every rank hears of it at once.

[Note: a failed step breaks the pipeline]
A step that raises on one rank (a bad batch, an out-of-memory error) leaves messages half done:
its neighbours wait for messages that will never come, or have sent ones nobody will read, so the
next step could only hang or exchange the wrong data. So a failed step breaks this process's
links for good (every later step raises a one-line error saying why), and makes the others fail
at once, not after the process group's timeout (30 minutes by default): the rank writes why into
the world's store, then drops every request and destroys its link groups, which closes gloo's
connections, so a neighbour waiting on that link gets an error at once; it then reads the first
failure from the store, reports that, and breaks its own links, and so on along the pipeline.
NCCL does not notice a peer's communicator going away, so under NCCL every process also has a
thread waiting on the store's key (on a store of its own: see TorchComm.watch_for_failures),
which aborts its communicators when it appears: the main thread's wait then fails instead of
hanging. A rank that raises while its Pipeline is being built does the same, and its peers'
set-up waits poll the store, so they end at once too. A process whose pipeline broke needs a new
process group to train on; catching the error and going on is not possible.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import UmoptError, first_line
from .comm import Comm, PipelineBroken, describe

__all__ = ["guarded"]


def guarded(
    comm: Comm, run: Callable[[], Any], who: str, on_failure: Optional[Callable[[BaseException], None]]
) -> Any:
    """Run ``run`` unless this process's pipelines are broken; if it raises, break them and
    raise, with the failure that came first named (``who``: this rank, as "stage 2" or "rank 2")."""
    if comm.failed:
        raise PipelineBroken(f"this pipeline cannot step again: {comm.failed}")
    try:
        return run()
    except BaseException as exc:
        first = comm.failure()
        if first and not isinstance(exc, UmoptError):  # this rank's error is the echo of another's
            exc = PipelineBroken(f"{first} ({who} stopped: {exc.__class__.__name__}: {first_line(exc, 160)})")
        if on_failure is not None:
            on_failure(exc)  # before the links break: the peers fail at once after that
        comm.fail(first or f"{who} failed: {describe(exc)}")
        if isinstance(exc, PipelineBroken):
            raise exc from None
        raise
