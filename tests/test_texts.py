"""What the commands print agrees with itself: every figure a sentence cites is the one its table
shows, and every count adds up (a new user reads the sentences, then checks them against the table)."""

from __future__ import annotations

import re

from conftest import run_cli


def _rows(text: str) -> dict[str, list[str]]:
    """A rich table's body rows by their first cell."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


def test_solve_cites_what_its_table_shows(tmp_path, capsys):
    out_file = tmp_path / "s.json"
    # gpt-cpu: a model that runs (so no hint about synthetic profiles joins the output)
    code, out, err = run_cli(
        ["solve", "gpt-cpu", "-B", "64", "--time-limit", "2", "--seed", "1", "-o", str(out_file)], capsys
    )
    assert code == 0, err
    rows = _rows(out)
    ms = {name: float(cells[1]) for name, cells in rows.items() if cells[1] not in ("", "-")}
    bound = ms.pop("lower bound")
    pick = next(n for n in ms if n.startswith("umopt"))
    # the gap column is the row's distance to the lower bound row
    gap = float(rows[pick][4].rstrip("%"))
    assert abs(gap - 100 * (ms[pick] - bound) / bound) < 0.06
    # the 1F1B-order bound's sentence: its percentage is this row's distance to the bound it cites
    m = re.search(r"at least ([\d.]+) ms: this one is within ([\d.]+)% of it", " ".join(out.split()))
    if m:
        b, pct = float(m.group(1)), float(m.group(2))
        assert abs(pct - 100 * (ms[pick] - b) / b) < 0.06
    # the next step names the candidates at the times of their rows
    nxt = " ".join(out[out.index("next: ") :].split())
    for name, label in (("gpipe_equal", "GPipe equal"), ("1f1b_equal", "1F1B equal")):
        cited = re.search(rf"{name} \(([\d.]+) ms\)", nxt)
        if cited:
            assert abs(float(cited.group(1)) - ms[label]) < 0.006
    steps = re.search(r"--steps (\d+): its first (\d+) steps", nxt)
    assert steps and int(steps.group(2)) <= (int(steps.group(1)) + 2) / 2
