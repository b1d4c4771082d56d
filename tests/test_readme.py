"""Every command README prints runs as printed: its options exist, take the values shown, and the
scripts it names are there. Concrete commands are parsed in full by the command's own click parser
(under torchrun too); synopsis lines (``[--opt X]``, ``a|b``) have their option
names checked."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from umopt.cli import cli

ROOT = Path(__file__).resolve().parent.parent


def _commands(markdown: str) -> list[str]:
    """The shell commands of the ```bash blocks, continuation lines joined, split at && and ;,
    comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            out += [c.strip() for c in re.split(r"&&|;", line) if c.strip() and not c.strip().startswith("#")]
    return out


COMMANDS = _commands((ROOT / "README.md").read_text())


def _synopsis(tokens: list[str]) -> bool:
    return any(t.startswith("[") or t.endswith("]") or "|" in t or t == "..." for t in tokens)


def _option_names(tokens: list[str]) -> list[str]:
    return [re.sub(r"[\[\]]", "", t).split("=")[0] for t in tokens if re.sub(r"^\[", "", t).startswith("-")]


def _check_umopt(tokens: list[str]) -> None:
    name, args = tokens[0], tokens[1:]
    assert name in cli.commands, f"umopt {name}: no such command"
    command = cli.commands[name]
    if _synopsis(args):
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [o for o in _option_names(args) if o not in known]
        assert not unknown, f"umopt {name}: no option {unknown}"
        return
    try:
        command.make_context(name, list(args))
    except click.ClickException as exc:
        raise AssertionError(f"umopt {' '.join(tokens)}: {exc.format_message()}") from None


def test_readme_has_commands_to_check():
    assert sum(c.startswith("umopt ") for c in COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_command_runs_as_printed(command):
    tokens = shlex.split(command)
    if tokens[0] == "umopt":
        _check_umopt(tokens[1:])
    elif tokens[0] == "torchrun":
        assert "-m" in tokens and tokens[tokens.index("-m") + 1] == "umopt.cli"
        _check_umopt(tokens[tokens.index("-m") + 2 :])
    elif tokens[0] in ("python", "bash") and not tokens[1].startswith("-"):
        assert (ROOT / tokens[1]).exists(), f"{tokens[1]}: no such file"
    elif tokens[:3] == ["python", "-m", "pytest"] or tokens[0] in ("pip", "cd", "UMOPT_SMOKE_DEVICE=cpu"):
        pass
    else:
        assert tokens[0] in ("pip", "python"), f"unchecked command: {command}"


def test_the_bench_shell_scripts_parse():
    import subprocess

    for script in sorted((ROOT / "bench").glob("*.sh")):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
