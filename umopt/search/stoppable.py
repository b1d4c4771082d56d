"""CP-SAT searches that Ctrl-C stops: the search runs in a thread while the main thread waits.

CP-SAT's search holds the thread that calls it for its whole time limit. Called from the main
thread, a SIGINT meanwhile is either caught by CP-SAT itself (which returns as if its time were up,
and the program carries on as if nothing had been asked) or waits until the search ends. Run in a
worker thread with CP-SAT's own SIGINT handling off, the search leaves the main thread free to
take the KeyboardInterrupt (or the exception the CLI raises on SIGTERM); the search is then
stopped and waited for (milliseconds) before the exception goes on, so no C++ search outlives
the Python code that started it.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["solve"]


def solve(solver: Any, model: Any) -> Any:
    """``solver.solve(model)`` (a ``cp_model.CpSolver``), stopped at once by an interrupt."""
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        return solver.solve(model)  # signals reach the main thread only: nothing to wait for here
    outcome: dict[str, Any] = {}

    def search() -> None:
        try:
            outcome["status"] = solver.solve(model)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=search, name="cp-sat", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except BaseException:
        solver.stop_search()
        worker.join()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["status"]
