"""The command line: solve end to end, and every bad-input class gives one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli as run
from conftest import two_stage_profile

from umopt.costmodel import CostTables, simulate
from umopt.formats.profile import load_profile
from umopt.formats.schedule import load_schedule


def test_solve_bundled_profile_by_name_writes_a_consistent_schedule(tmp_path, capsys):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    trace = tmp_path / "t.json"
    code, stdout, _ = run(
        [
            "solve",
            "gpt-sim",
            "-B",
            "16",
            "--time-limit",
            "1",
            "-o",
            str(out),
            "--plot",
            str(png),
            "--trace",
            str(trace),
        ],
        capsys,
    )
    assert code == 0, stdout
    assert "GPipe equal" in stdout and "lower bound" in stdout
    sched = load_schedule(str(out))
    prof = load_profile("gpt-sim")
    assert sched.profile.sha256 == prof.sha256
    tl = simulate(CostTables.from_profile(prof, sched.recompute), sched.op_lists(), 16)
    assert sched.predicted.iteration_ms == tl.iteration_ms
    assert sched.predicted.iteration_ms <= sched.baselines["gpipe_equal"].iteration_ms
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("F(") for e in events)
    # show re-validates and re-simulates it
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "iteration" in stdout


def test_solve_for_data_parallel_replicas_records_and_predicts_their_allreduce(tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run(
        ["solve", "gpt-sim", "-B", "16", "--dp", "2", "--time-limit", "1", "-o", str(out)], capsys
    )
    assert (
        code == 2
        and "no all-reduce speed" in err
        and "--dp-gbps" in err
        and len(err.strip().splitlines()) == 1
    )
    assert not out.exists()
    code, stdout, _ = run(
        [
            "solve",
            "gpt-sim",
            "-B",
            "16",
            "--dp",
            "4",
            "--dp-gbps",
            "8",
            "--time-limit",
            "1",
            "-o",
            str(out),
            "--plot",
            str(tmp_path / "s.png"),
        ],
        capsys,
    )
    assert code == 0 and "x4 data-parallel" in stdout
    # a synthetic profile's model runs nowhere: the next step says how to profile one that does
    nxt = " ".join(stdout.split("next:", 1)[1].split())
    assert nxt.startswith("gpt-sim is a synthetic model") and "umopt profile --model gpt --stages 4" in nxt
    sched = load_schedule(str(out))
    prof = load_profile("gpt-sim")
    assert sched.dp.replicas == 4 and sched.dp.bus_bytes_per_ms == 1e6
    tl = simulate(CostTables.from_profile(prof, False, sched.dp), sched.op_lists(), 16)
    assert (
        sched.predicted.iteration_ms
        == tl.iteration_ms
        > simulate(CostTables.from_profile(prof), sched.op_lists(), 16).iteration_ms
    )
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and f"iteration {tl.iteration_ms:.3f} ms (file says {tl.iteration_ms:.3f})" in stdout


@pytest.mark.parametrize("command", [[shutil.which("umopt") or "umopt"], [sys.executable, "-m", "umopt.cli"]])
def test_console_entry_points_run_and_fail_cleanly(command, tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run(
        command + ["solve", "gpt-sim", "-B", "8", "--solver", "equal", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.exists()
    proc = subprocess.run(
        command + ["solve", str(tmp_path / "none.json"), "-B", "8", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"umopt: error: {tmp_path / 'none.json'}: no such file")
    assert "Traceback" not in proc.stderr


def _bad_profiles():
    good = two_stage_profile().model_dump(mode="json")

    def edit(fn):
        d = json.loads(json.dumps(good))
        fn(d)
        return d

    return {
        "not valid JSON": "{ this is not json",
        "format is 'umopt-profile/0'": edit(lambda d: d.update(format="umopt-profile/0")),
        "sizes: missing field": edit(lambda d: d.pop("sizes")),
        "stages[0].forward_ms[1]": edit(lambda d: d["stages"][0]["forward_ms"].__setitem__(1, "fast")),
        "2 stages need 1 links, got 2": edit(lambda d: d["links"].append(d["links"][0])),
        "sizes must start at 1": edit(lambda d: d.update(sizes=[2, 4])),
        "sizes must be strictly ascending": edit(lambda d: d.update(sizes=[1, 1])),
        "stages[1].backward_ms has 3 values for 2 sizes": edit(
            lambda d: d["stages"][1]["backward_ms"].append(1.0)
        ),
        "stages[0].static_bytes": edit(lambda d: d["stages"][0].update(static_bytes=-5)),
        "a profile must be a JSON object": [1, 2, 3],
    }


@pytest.mark.parametrize("expected", list(_bad_profiles()))
def test_bad_profile_is_one_line_exit_2_and_nothing_written(expected, tmp_path, capsys):
    data = _bad_profiles()[expected]
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    out = tmp_path / "s.json"
    code, _, err = run(
        ["solve", str(path), "-B", "4", "-o", str(out), "--plot", str(tmp_path / "p.png")], capsys
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("umopt: error: ") and str(path) in lines[0], err
    assert expected in lines[0]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [path]


def test_1f1b_with_recompute_gives_each_stage_its_own_backward_chunks(tmp_path, capsys):
    # Megatron-style 1F1B with activation recomputation: the backward partitions are free
    from umopt.costmodel import CostTables, simulate
    from umopt.formats.profile import load_profile
    from umopt.schedules import onef1b_schedule
    from umopt.schedules.partition import partitions_from_ops

    out = tmp_path / "s.json"
    code, _, err = run(
        [
            "solve",
            "gpt-sim",
            "-B",
            "16",
            "--order",
            "1f1b",
            "--recompute",
            "--solver",
            "ga",
            "--time-limit",
            "2",
            "-o",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    sched = load_schedule(str(out))
    ops = sched.op_lists()
    parts = [partitions_from_ops(o) for o in ops]
    assert sched.recompute and ops == onef1b_schedule([f for f, _ in parts], [b for _, b in parts])
    tables = CostTables.from_profile(load_profile("gpt-sim"), recompute=True)
    assert simulate(tables, ops, 16).iteration_ms == pytest.approx(sched.predicted.iteration_ms, abs=1e-9)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["solve", "no-such-profile", "-B", "4"], "no such file and no bundled profile"),
        (["solve", "gpt-sim", "-B", "0"], "--minibatch must be at least 1"),
        (
            ["solve", "gpt-sim", "-B", "8", "--memory-limit", "1000"],
            "memory before any activation (41943040 bytes",
        ),
        (["solve", "gpt-sim", "-B", "8", "--time-limit", "0"], "--time-limit must be a positive number"),
        (["solve", "gpt-sim", "-B", "8", "--time-limit", "nan"], "--time-limit must be a positive number"),
        (["solve", "gpt-sim", "-B", "100000"], "over umopt's limit of 8192 samples"),
        (
            ["solve", "gpt-sim", "-B", "8", "--plot", "/proc/no/such.png"],
            "/proc/no/such.png: cannot write there",
        ),
    ],
)
def test_bad_arguments(args, expected, tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run(args + ["-o", str(out)], capsys)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("lengths", [[], ["--lengths", "chat"]])
def test_a_wrong_profile_path_is_said_before_a_missing_output(lengths, capsys):
    code, _, err = run(["solve", "nosuch.json", "-B", "8", *lengths], capsys)
    assert code == 2 and "nosuch.json: no such file" in err and "-o" not in err


def _schedule(tmp_path, capsys, profile_path):
    out = tmp_path / "good.json"
    code, _, err = run(["solve", profile_path, "-B", "2", "--solver", "equal", "-o", str(out)], capsys)
    assert code == 0, err
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda s: s["stages"][0]["ops"].pop(), "B ops miss sample"),
        (lambda s: s["stages"][1].update(ops=[["F", 0, 1], ["B", 0, 1]]), "F ops cover samples 0..0"),
        (lambda s: s["stages"][0]["ops"].__setitem__(0, ["X", 0, 1]), 'expected ["F"|"B"|"W", lo, hi]'),
        (lambda s: s.update(format="umopt-schedule/9"), "format is 'umopt-schedule/9'"),
        (lambda s: s.pop("predicted"), "predicted: missing field"),
        (lambda s: s["stages"].pop(), "schedule has 1 stages but profile"),
        (lambda s: s["profile"].update(sha256="0" * 64), "made for another profile"),
        (
            lambda s: (
                s["stages"].__setitem__(0, {"ops": [["F", 0, 1], ["B", 0, 1], ["F", 1, 2], ["B", 1, 2]]})
                or s["stages"].__setitem__(1, {"ops": [["F", 0, 2], ["B", 0, 2]]})
            ),
            "deadlocks",
        ),
    ],
)
def test_bad_schedule_is_refused(mutate, expected, tmp_path, capsys, profile_file):
    prof = profile_file(two_stage_profile())
    sched = _schedule(tmp_path, capsys, prof)
    mutate(sched)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(sched))
    code, _, err = run(["show", str(bad), "--plot", str(tmp_path / "x.png")], capsys)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_usage_errors_exit_2(capsys):
    code, _, err = run(["solve", "gpt-sim", "-o", "x.json"], capsys)
    assert code == 2 and "--minibatch" in err
    assert not Path("x.json").exists()


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
def test_order_option_restricts_the_search(order, tmp_path, capsys):
    from umopt.schedules import gpipe_ops, onef1b_schedule
    from umopt.schedules.partition import partitions_from_ops

    out = tmp_path / "s.json"
    code, _, err = run(
        ["solve", "gpt-sim", "-B", "16", "--order", order, "--time-limit", "1", "-o", str(out)], capsys
    )
    assert code == 0, err
    sched = load_schedule(str(out))
    ops = sched.op_lists()
    parts = [partitions_from_ops(o) for o in ops]
    if order == "gpipe":
        assert ops == [gpipe_ops(f, b) for f, b in parts]
    else:
        assert ops == onef1b_schedule([f for f, _ in parts], [b for _, b in parts])
        # the bound is the 1F1B family's, tighter than the any-order one and below the schedule
        from umopt.formats.profile import load_profile
        from umopt.search.bounds import fast_bound_ms
        from umopt.search.solve import make_problem

        assert sched.solver.bound_scope == "1f1b order"
        any_order = fast_bound_ms(make_problem(load_profile("gpt-sim"), 16, recompute=False))
        assert (
            any_order
            < sched.solver.lower_bound_ms
            == sched.solver.lower_bound_1f1b_ms
            <= sched.predicted.iteration_ms
        )
    assert sched.solver.model_extra["order"] == order


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--order", "1f1b", "--solver", "cpsat"], "cpsat does not model the 1f1b rule"),
        (["--order", "zigzag"], "--order must be one of auto, gpipe, 1f1b, got 'zigzag'"),
    ],
)
def test_orders_a_solver_cannot_search_are_refused(args, expected, tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run(["solve", "gpt-sim", "-B", "8", "--time-limit", "1", *args, "-o", str(out)], capsys)
    assert code == 2 and expected in err and not out.exists()


def test_files_written_get_the_users_usual_permissions(tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run(["solve", "gpt-sim", "-B", "8", "--time-limit", "0.3", "-o", str(out)], capsys)
    assert code == 0, err
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_schedule_read_from_another_folder_finds_its_profile_beside_it(tmp_path, capsys, monkeypatch):
    from umopt.formats.profile import save_profile

    (tmp_path / "job").mkdir()
    save_profile(load_profile("gpt-sim"), tmp_path / "job" / "p.json")
    monkeypatch.chdir(tmp_path / "job")
    code, _, err = run(["solve", "p.json", "-B", "8", "--time-limit", "0.3", "-o", "s.json"], capsys)
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run(["show", "job/s.json"], capsys)
    assert code == 0 and "iteration" in stdout, err
    shutil.rmtree(tmp_path / "job")


def test_zero_bubble_schedule_is_written_and_shown(tmp_path, capsys):
    out = tmp_path / "zb.json"
    code, stdout, err = run(
        ["solve", "transformer8-sim", "-B", "16", "--zero-bubble", "--time-limit", "2", "-o", str(out)],
        capsys,
    )
    assert code == 0, err
    assert (
        "ZB-H1 equal" in stdout
        and "ZB-H2 equal" in stdout
        and "against the best equal ZB-H1" in stdout
        and "without W ops" in stdout
    )
    sched = load_schedule(str(out))
    assert any(op[0] == "W" for st in sched.stages for op in st.ops)
    assert set(sched.baselines) == {"gpipe_equal", "1f1b_equal", "zbh1_equal", "zbh2_equal"}
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "W chunks" in stdout


def test_memory_limits_take_units_and_errors_print_text_as_written(tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run(
        ["solve", "gpt-sim", "-B", "8", "--solver", "equal", "--memory-limit", "64GiB", "-o", str(out)],
        capsys,
    )
    assert code == 0, err
    code, _, err = run(
        [
            "solve",
            "gpt-sim",
            "-B",
            "8",
            "--solver",
            "equal",
            "--memory-limit",
            "1KiB",
            "-o",
            str(tmp_path / "t.json"),
        ],
        capsys,
    )
    assert code == 2 and "1024" in err and not (tmp_path / "t.json").exists()
    code, _, err = run(["solve", "gpt-sim", "-B", "8", "--memory-limit", "lots", "-o", str(out)], capsys)
    assert code == 2 and "is not a byte count" in err
    # a user's own text with a colon reaches the terminal as written (rich would make ':ok' an emoji)
    code, _, err = run(["run", str(tmp_path / "missing:ok.json")], capsys)
    assert code == 2 and "missing:ok.json" in err and "🆗" not in err


def test_a_schedule_finds_its_profile_from_any_folder_and_after_a_move(tmp_path, capsys, monkeypatch):
    """[Note: a schedule finds its profile]: stored relative to the schedule (bundled ones by
    name), read from another folder, after the folder moved, and by sha256 after a rename."""
    from umopt.formats.schedule import load_schedule

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(load_profile("gpt-sim").path, work / "prof.json")
    monkeypatch.chdir(work)
    assert run(["solve", "prof.json", "-B", "8", "--solver", "equal", "-o", "out/s.json"], capsys)[0] == 0
    assert run(["solve", "gpt-sim", "-B", "8", "--solver", "equal", "-o", "bundled.json"], capsys)[0] == 0
    assert json.loads((work / "out/s.json").read_text())["profile"]["path"] == "../prof.json"
    assert json.loads((work / "bundled.json").read_text())["profile"]["path"] == "gpt-sim"
    monkeypatch.chdir(tmp_path)
    assert Path(load_schedule("work/out/s.json").profile.path).resolve() == (work / "prof.json").resolve()
    moved = tmp_path / "moved"
    shutil.move(str(work), moved)
    assert (
        Path(load_schedule(str(moved / "out/s.json")).profile.path).resolve()
        == (moved / "prof.json").resolve()
    )
    (moved / "prof.json").rename(moved / "out" / "renamed.json")  # found beside the schedule by its hash
    assert Path(load_schedule(str(moved / "out/s.json")).profile.path).name == "renamed.json"
    assert (
        load_profile(load_schedule(str(moved / "bundled.json")).profile.path).sha256
        == load_profile("gpt-sim").sha256
    )


def test_a_transformers_model_without_the_extra_says_what_to_install(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    code, _, err = run(["profile", "--model", "hf:llama", "--stages", "2", "-o", "x.json"], capsys)
    assert code == 2 and "pip install '.[hf]'" in err and len(err.strip().splitlines()) == 1, err
