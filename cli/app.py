"""What every command of ``umopt`` shares: the group and its options, the consoles, logging
and progress, and :func:`main`, which turns an :class:`umopt.errors.UmoptError` into one line on
stderr and exit code 2."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from umopt.errors import UmoptError

__all__ = ["main", "cli", "out", "err", "BYTES", "model_options"]

# emoji off: a user's text (`--data mydata:ok`) is printed as written, not as 🆗
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)


class _Bytes(click.ParamType):
    """A byte count: 17179869184, 16GiB, 16GB, 512MiB, 1.5e9."""

    name = "bytes"
    _UNITS = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        import re

        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
        if not m or m.group(2) not in self._UNITS:
            self.fail(f"{value!r} is not a byte count (e.g. 17179869184, 16GiB, 512MB)", param, ctx)
        try:
            return int(float(m.group(1)) * self._UNITS[m.group(2)])
        except ValueError:
            self.fail(f"{value!r} is not a byte count (e.g. 17179869184, 16GiB, 512MB)", param, ctx)


BYTES = _Bytes()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="umopt")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Say more: what each step does (and every rank's log under umopt run).",
)
@click.option("-q", "--quiet", is_flag=True, help="Say less: no progress, only results, warnings and errors.")
def cli(verbose: bool, quiet: bool) -> None:
    """umopt: unequal per-stage microbatch partitions for pipeline-parallel training.

    \b
    profile -> solve -> run:
      umopt solve gpt-sim --minibatch 64 -o schedule.json --plot schedule.png
      umopt show schedule.json
    """
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    _VERBOSITY["level"] = level
    _log_to(err, level)
    os.environ["UMOPT_LOG_LEVEL"] = logging.getLevelName(level)  # for the ranks umopt run starts


def _log_to(console: Console, level: int) -> None:
    """umopt's library logs (warnings of profile_stages and Pipeline, the solver's steps) as
    'umopt: ...' lines on stderr, plain text."""
    logger = logging.getLogger("umopt")
    logger.setLevel(level)
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(
            _ConsoleHandler(console)
        )  # (and on to the root's handlers, where a host program set some)


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        kind = "warning: " if record.levelno >= logging.WARNING else ""
        self.console.print(
            f"umopt: {kind}{record.getMessage()}", markup=False, highlight=False, soft_wrap=True
        )


_VERBOSITY = {"level": logging.INFO}


class _Lines:
    """Progress as plain lines on stderr, for logs (CI, nohup, torchrun): one when what is being
    done changes, and at most one every ``every`` seconds while it goes on. The same calls as
    rich's Progress, which draws a bar only on a terminal."""

    def __init__(self, label: str, every: float = 10.0):
        self.label, self.every = label, every
        self.last_what, self.last_t, self.start = "", 0.0, time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: Optional[float] = None) -> int:
        self.task = description  # what an update without a description of its own is doing
        return 0

    def update(
        self,
        task: int,
        completed: Optional[float] = None,
        total: Optional[float] = None,
        description: Optional[str] = None,
    ) -> None:
        now = time.monotonic()
        what = description or self.last_what or getattr(self, "task", "")
        if now - self.last_t < (
            self.every if what == self.last_what else 1.0
        ):  # a new phase, unless the last line is under a second old
            return
        share = ""
        if completed is not None and total:  # items as counts (steps 12/42), shares of work as percentages
            whole = float(completed).is_integer() and float(total).is_integer()
            share = f" ({completed:.0f}/{total:.0f})" if whole else f" ({100 * completed / total:.0f}%)"
        err.print(
            f"umopt {self.label}: {what}{share} [{now - self.start:.0f} s]",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        self.last_what, self.last_t = what, now


class _Silent(_Lines):
    def update(self, *args, **kwargs) -> None:
        return None


def model_options(command):
    """The options ``umopt profile`` and ``umopt tune`` share: the model's arguments, the device and
    dtype it runs in, and the links when given rather than measured."""
    options = [
        click.option(
            "--model-arg",
            "model_args",
            multiple=True,
            metavar="KEY=VALUE",
            help="Model argument, repeatable (e.g. layers=8).",
        ),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default="float32",
            show_default=True,
            help="Autocast dtype.",
        ),
        click.option(
            "--link-latency-ms",
            type=float,
            default=None,
            help="Give the link instead of measuring it (needed with one GPU).",
        ),
        click.option(
            "--link-gbps", type=float, default=None, help="Link bandwidth in Gbit/s, with --link-latency-ms."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _progress_bar(label: str):
    """A bar on a terminal, plain lines elsewhere, nothing with -q."""
    if _VERBOSITY["level"] > logging.INFO:
        return _Silent(label)
    if not err.is_terminal:
        return _Lines(label)
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


_STARTED: list[Optional[float]] = [None]  # set by main() for a command run as its own process


def command_start() -> float:
    """Where a ``--time-limit`` counts from: the process's start where the command is the
    process (the interpreter's start and the imports included, as the user's clock sees them),
    else now."""
    return time.perf_counter() if _STARTED[0] is None else _STARTED[0]


def _process_start() -> Optional[float]:
    """The ``time.perf_counter()`` at which this process started, where the system says (Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    return time.perf_counter() - age if 0.0 <= age < 30.0 else None


def warn(line: str) -> None:
    """A warning, one line on stderr, however long."""
    err.print(f"umopt: warning: {line}", markup=False, highlight=False, soft_wrap=True)


def own_model_hint(profile, lengths: bool) -> str:
    """The next step after solving on a profile whose model nothing can run (a bundled synthetic
    one): how to profile a model of one's own."""
    with_lengths = (
        (" --model-arg seq_len=1024 --lengths 1024", " --lengths chat", " --lengths chat")
        if lengths
        else ("", "", "")
    )
    out_file = "plan.json" if lengths else "schedule.json"
    return (
        f"next: {profile.model.name} is a synthetic model (device {profile.device.type}): nothing runs it. To train, "
        f"profile your own: umopt profile --model gpt --stages {profile.num_stages}{with_lengths[0]} -o mine.json "
        "(or --model package.module:factory), then umopt solve mine.json -B 32"
        f"{with_lengths[1]} -o {out_file}, then umopt run {out_file}{with_lengths[2]}"
    )


def legend(meanings: dict[str, str], shown) -> None:
    """What a table's columns (and marks) mean, only those ``shown``, dim, under the table."""
    line = "; ".join(f"{k}: {v}" for k, v in meanings.items() if k in set(shown))
    if line:
        out.print(line, style="dim", markup=False, highlight=False)


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _int_list(value: Optional[str], what: str) -> Optional[list[int]]:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UmoptError(f"{what} must be comma-separated integers, got {value!r}") from None


def load_solve_profile(path: str, memory_limit: Optional[int]):
    """The profile a solve plans on: ``path`` (a file or a bundled name), with ``--memory-limit``
    in place of its own where given."""
    from umopt.formats.profile import load_profile

    profile = load_profile(path)
    if memory_limit is None:
        return profile
    if memory_limit <= 0:
        raise UmoptError(f"--memory-limit must be positive, got {memory_limit}")
    return profile.with_memory_limit(memory_limit)


def _require_torch() -> None:
    """torch is needed to profile and run; say how to get it rather than fail on an import."""
    try:
        import torch
    except ImportError:
        raise UmoptError(
            "torch is not installed: pip install torch==2.13.0 (CPU) or the CUDA build for your driver"
        ) from None
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 2):
        raise UmoptError(
            f"torch {torch.__version__} is too old (umopt needs 2.2 or newer): pip install -U 'torch>=2.2'"
        )


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that it unwinds (children closed, temp files gone)."""


def _on_sigterm(_signum, _frame) -> None:
    raise _Terminated()


def main(argv: Optional[list[str]] = None) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        _STARTED[0] = _process_start() if argv is None else None
        cli.main(args=args, prog_name="umopt", standalone_mode=False, obj={"argv": ["umopt", *args]})
    except UmoptError as exc:
        err.print(f"umopt: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:  # click's name for a KeyboardInterrupt
        err.print("umopt: interrupted", markup=False)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("umopt: interrupted", markup=False)
        sys.exit(130)
    except _Terminated:
        err.print("umopt: terminated", markup=False)
        sys.exit(143)


if __name__ == "__main__":
    main()
