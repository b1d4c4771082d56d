"""Starting the runtime's processes on this machine (what ``umopt run`` does).

Checks everything it can before a process starts (:func:`umopt.runtime.preflight`), then runs
``python -m torch.distributed.run --standalone --nproc-per-node S -m umopt.runtime ...``: one rank
per stage, a free port, no restarts. If a rank raises or dies, torchrun stops the others; each
rank leaves a one-line status, so the failing rank's message is what the user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import UmoptError
from .runtime import preflight

__all__ = ["RunFailed", "RunResult", "launch"]


class RunFailed(UmoptError):
    """The run started but a rank failed (exit code 1, unlike bad input)."""

    exit_code = 1


@dataclass
class RunResult:
    reports: list[dict]  # one per schedule, in the order given
    report_paths: list[str]  # where they were written ("" where --report was not given)

    @property
    def report(self) -> dict:
        return self.reports[0]


def launch(argv: list[str], *, timeout_s: Optional[float] = None, quiet: bool = False) -> RunResult:
    cfg = preflight(argv)
    S = cfg.num_stages
    with tempfile.TemporaryDirectory(prefix="umopt-run-") as tmp:
        argv = list(argv)
        template = cfg.args.report
        if not template:
            template = str(Path(tmp) / ("report_{name}.json" if len(cfg.schedules) > 1 else "report.json"))
            argv += ["--report", template]
        paths = [cfg.output(template, k) for k in range(len(cfg.schedules))]
        env = dict(os.environ)
        env["UMOPT_STATUS_DIR"] = tmp
        threads = cfg.args.threads or int(cfg.profile.device.model_extra.get("threads", 1))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={S}", "--max-restarts=0", "--monitor-interval=0.5",
            "-m", "umopt.runtime", *argv,
        ]
        log = Path(tmp) / "torchrun.log"
        with open(log, "w") as out:
            try:
                proc = subprocess.run(cmd, env=env, stdout=None if not quiet else out, stderr=out, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RunFailed(f"the run did not finish within {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise RunFailed(_root_cause(Path(tmp), S, proc.returncode, log))
        reports = [json.loads(Path(p).read_text()) for p in paths]
        return RunResult(reports, paths if cfg.args.report else [""] * len(paths))


def _root_cause(status_dir: Path, S: int, returncode: int, log: Path) -> str:
    """The rank that failed first, with its message.

    Each rank's status file says how it ended: "failed" (it raised; the first by time is the
    cause, later ones are its echo), "terminated" (torchrun or the user stopped it with a signal:
    never the cause), or still "started" (it died without a word: killed, crashed in C++). The
    torchrun log is kept and named when the ranks' own words do not explain the failure.
    """
    statuses = {}
    for r in range(S):
        f = status_dir / f"rank{r}"
        try:
            statuses[r] = json.loads(f.read_text()) if f.exists() else {"state": "never started", "time": 0.0, "message": ""}
        except ValueError:  # written as the rank died
            statuses[r] = {"state": "started", "time": 0.0, "message": ""}
    failed = sorted((st["time"], r, st["message"]) for r, st in statuses.items() if st["state"] == "failed")
    silent = [r for r, st in statuses.items() if st["state"] == "started"]
    if failed and not silent:
        _, r, message = failed[0]
        return f"rank {r} (stage {r}) failed: {message}"
    lines = log.read_text().strip().splitlines()
    kept = Path(tempfile.gettempdir()) / f"umopt-torchrun-{os.getpid()}-{int(time.time())}.log"
    kept.write_text("\n".join(lines) + "\n")
    if silent:  # killed: the others' failures are only its echo
        codes = [ln.strip() for ln in lines if "exitcode" in ln][:2]
        return (
            f"rank {silent[0]} (stage {silent[0]}) ended without a word (killed by a signal?); "
            f"torchrun exit code {returncode}{'; ' + ', '.join(codes) if codes else ''} (log: {kept})"
        )
    stopped = sorted((st["time"], r, st["message"]) for r, st in statuses.items() if st["state"] == "terminated")
    if stopped:
        _, r, why = stopped[0]
        return f"the run was stopped from outside: rank {r} (stage {r}) first ({why}); torchrun exit code {returncode} (log: {kept})"
    # torchrun itself failed (rendezvous, spawning): its most telling line
    errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln] or lines[-1:] or [""]
    never = [r for r, st in statuses.items() if st["state"] == "never started"]
    who = f"rank {never[0]} never started; " if never else ""
    return f"torchrun failed with exit code {returncode}: {who}{errors[-1][:200]} (log: {kept})"
