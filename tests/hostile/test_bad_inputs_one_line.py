"""Hostile inputs (issue 12): every bad input gives exit 0/1/2 and one clear line, never a traceback or a hang.

Table-driven by category: wrong answers, files that are not ppsim's, tracebacks, unbounded work, first contact.
Each case asserts the exit code, that stderr holds one ``Error:`` line (for exit 2) naming the problem, and no
``Traceback``. Refused work is asserted on the refusal's message (it names the estimate and the limit), never on
time. Cases that wait for another branch are ``xfail(strict=False, reason="needs <branch>")``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim import limits
from ppsim.cli import app
from ppsim.costs import parse_costs
from ppsim.errors import PPSimError
from ppsim.formats import to_csv_text
from ppsim.schedules import get_schedule

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


# --- the hostile files -----------------------------------------------------------------------------------------------
def _csv(name: str, num_ranks: int, num_microbatches: int) -> str:
    return to_csv_text(get_schedule(name, num_ranks, num_microbatches))


@functools.lru_cache(maxsize=1)
def _files() -> dict[str, bytes]:
    """Every small hostile file, by name (written into each test's tmp_path)."""
    zbh1 = _csv("ZBH1", 2, 10)
    assert ",2W9" in zbh1 or "0W9" in zbh1
    rng = random.Random(12)
    return {
        "good.csv": b"0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n",
        "six.csv": _csv("1F1B", 2, 6).encode(),
        "eight.csv": _csv("1F1B", 2, 8).encode(),
        "missing_w.csv": zbh1.replace("0W9", "").encode(),
        "style2024.csv": b"0F0,0I0,0B0,0W0\n1F0,1B0\n",
        "forwards.csv": b"0F0,0F1\n1F0,1F1\n",
        "arabic.csv": "٠F٠,٠B٠\n".encode(),
        "latin1.csv": "0F0,0B0\n# café\n".encode("latin-1"),
        "utf16.csv": "0F0,0B0\n1F0,1B0\n".encode("utf-16"),
        "random.csv": bytes(rng.randrange(128, 256) for _ in range(4096)),
        "binary.csv": Path(sys.executable).read_bytes()[:4096],
        "bigstage.csv": b"0F0,0B0\n999999999F0,999999999B0\n",
        "bigmb.csv": b"0F0,0B0,0F999999999,0B999999999\n1F0,1B0,1F999999999,1B999999999\n",
        "hugeid.csv": b"0F0,0B0\n1F0," + b"9" * 5000 + b"B0\n",
        "deadlock.csv": b"0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n",
        "wide.csv": _csv("1F1B", 4, 6_500).encode(),  # 52,000 actions: beyond a figure, fine to simulate
        "ranks3000.csv": b"".join(f"{r}F0,{r}B0\n".encode() for r in range(3000)),
        "dualpipe.csv": _csv("DualPipe", 4, 8).encode(),
        "pair.csv": b"(0F1;1B0;2F0)OVERLAP_F_B\n",
        "excel.csv": b"\xef\xbb\xbf0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n",  # UTF-8 BOM and CRLF, as Excel saves
        "commas.csv": b"0F0,0B0" + b"," * 3_000_000 + b"\n",
    }


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    for name, data in _files().items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


# --- running the CLI -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    code: int
    says: str
    """Text the message must hold (stderr for exit 2, stdout for exit 1 or 0); ``{d}`` is the test folder."""
    needs: str | None = None
    """Branch this case waits for (xfail until it merges)."""
    marks: tuple[pytest.MarkDecorator, ...] = field(default=())


def param(case: Case) -> object:
    marks = list(case.marks)
    if case.needs:
        marks.append(pytest.mark.xfail(strict=False, reason=f"needs {case.needs}"))
    return pytest.param(case, id=case.id, marks=marks)


def invoke(args: list[str], cwd: Path) -> tuple[int, str, str]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = runner.invoke(app, args)
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback the user would have seen
    return result.exit_code, result.stdout, result.stderr


def check(case: Case, folder: Path) -> None:
    args = [a.replace("{d}", str(folder)) for a in case.args]
    code, out, err = invoke(args, folder)
    says = case.says.replace("{d}", str(folder))
    assert "Traceback" not in out + err
    assert code == case.code, f"exit {code}: {err or out}"
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, err
        assert says in errors[0], errors[0]
    else:
        assert says in out + err


# --- wrong answers without an error ----------------------------------------------------------------------------------
WRONG_ANSWERS = [
    Case("simulate -m 8 on a 6-microbatch file", ("simulate", "-s", "six.csv", "-m", "8"), 2, "has 6 microbatches"),
    Case("simulate -m 4 on a 6-microbatch file", ("simulate", "-s", "six.csv", "-m", "4"), 2, "pass -m 6"),
    Case("simulate -m 2 on an 8-microbatch file", ("simulate", "-s", "eight.csv", "-m", "2"), 2, "has 8 microbatches"),
    Case("show -m 2 on an 8-microbatch file", ("show", "-s", "eight.csv", "-m", "2"), 2, "has 8 microbatches"),
    Case("show an invalid file with a warning", ("show", "-s", "missing_w.csv"), 0, "warning: missing_w.csv is not a "
         "valid schedule"),
    Case("plot -m 2 on an 8-microbatch file", ("plot", "-s", "eight.csv", "-m", "2"), 2, "has 8 microbatches"),
    Case("export json -m 8 on a 6-microbatch file",
         ("export", "-s", "six.csv", "-m", "8", "--format", "json", "-o", "x.json"), 2, "has 6 microbatches"),
    Case("simulate -r 3 on a 2-rank file", ("simulate", "-s", "good.csv", "-r", "3"), 2, "has 2 rows"),
    Case("-v 2 on a file with 1 stage per rank", ("simulate", "-s", "good.csv", "-v", "2"), 2, "1 stage(s) per rank"),
    Case("file sizes inferred without -r/-m", ("show", "-s", "six.csv"), 0, "2 ranks, 6 microbatches"),
    Case("simulate refuses a file missing 0W9", ("simulate", "-s", "missing_w.csv"), 2, "missing backward 0W9"),
    Case("validate rejects a file missing 0W9", ("validate", "missing_w.csv"), 1, "missing backward 0W9"),
    Case("export refuses a file missing 0W9", ("export", "-s", "missing_w.csv", "-o", "x.csv"), 2, "missing backward"),
    Case("report names a file missing 0W9",
         ("report", "-s", "missing_w.csv,1F1B", "-r", "2", "-m", "2", "-o", "r.html"), 0, "r.html"),
    Case("2024-style B and W: validate's rule in simulate", ("simulate", "-s", "style2024.csv"), 2,
         "has both B and I/W"),
    Case("forwards-only file refused", ("simulate", "-s", "forwards.csv"), 2, "forward actions only"),
    Case("deadlocking file refused by simulate", ("simulate", "-s", "deadlock.csv"), 2, "deadlock"),
    Case("DualPipe file without --directions 2", ("simulate", "-s", "dualpipe.csv"), 2, "--directions 2"),
    Case("DualPipe file with --directions 2", ("simulate", "-s", "dualpipe.csv", "--directions", "2"), 0, "makespan"),
    Case("Arabic-Indic digits are not an action", ("validate", "arabic.csv"), 2, "non-ASCII"),
    Case("Arabic-Indic digits are not a cost", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=١"), 2,
         "not a number"),
    Case("F=1e308,B=1e308 refused (would be NaN)",
         ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=1e308,B=1e308", "--json"), 2, "limit of 1e+12"),
    Case("comm=1e308 refused (would be inf)",
         ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "comm=1e308", "--json"), 2, "limit of 1e+12"),
    Case("F=1e308 in export json refused",
         ("export", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=1e308", "--format", "json", "-o", "x.json"), 2,
         "limit of 1e+12"),
    Case("costs of nan refused", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=nan"), 2, "finite"),
    Case("negative cost refused", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "B=-1"), 2, ">= 0"),
    Case("unknown cost key refused", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "X=1"), 2,
         "unknown"),
    Case("all-zero costs refused", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=0,B=0"), 2,
         "every op takes 0"),
    Case("--memory-cap 0.5 is not a 0-byte cap",
         ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", "0.5"), 2, "--memory-cap"),
    Case("report with every name bad exits 2",
         ("report", "-s", "Nope,Zilch", "-r", "2", "-m", "2", "-o", "r.html"), 2, "Nope"),
    Case("--directions 2 on a named schedule is not silent",
         ("show", "-s", "1F1B", "-r", "2", "-m", "2", "--directions", "2"), 0, "--directions"),
]


@pytest.mark.parametrize("case", [param(c) for c in WRONG_ANSWERS])
def test_wrong_answers_become_errors(case: Case, files: Path) -> None:
    check(case, files)


def test_repeated_schedule_option_keeps_both(files: Path) -> None:
    code, out, err = invoke(["simulate", "-s", "1F1B", "-s", "ZBH1", "-r", "2", "-m", "2", "--json"], files)
    assert "Traceback" not in out + err
    if code == 0:
        names = {entry["schedule"] for entry in json.loads(out)}
        assert names == {"1F1B", "ZBH1"}
    else:
        assert code == 2 and "-s" in err


def test_simulate_json_is_strict_json_for_extreme_but_allowed_costs(files: Path) -> None:
    code, out, _ = invoke(
        ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=1e12,B=1e12,comm=1e12", "--json"], files
    )
    assert code == 0

    def refuse(token: str) -> None:
        raise AssertionError(f"non-finite {token} in JSON")

    assert json.loads(out, parse_constant=refuse)["makespan"] > 0


def test_simulator_refuses_non_finite_results() -> None:
    from ppsim.costs import StageCosts
    from ppsim.simulator import simulate

    costs = StageCosts(F=(1e308,), B=(1e308,), I=(5e307,), W=(5e307,), FB=(1e308,))
    with pytest.raises(PPSimError):
        simulate(get_schedule("1F1B", 4, 8), costs)


def test_parse_costs_limits_each_op() -> None:
    assert parse_costs("F=1e12,B=1e12").F == (1e12,)
    for text in ("F=1.5e12", "comm=1e308", "W=1e400", "F=inf", "F=1_000"):
        with pytest.raises(PPSimError) as err:
            parse_costs(text)
        assert "\n" not in str(err.value)


# --- files that are not ppsim's (the writer: cli branch's ppsim.io) --------------------------------------------------
def test_symlink_at_output_is_written_through(files: Path) -> None:
    target = files / "target.csv"
    target.write_text("old")
    (files / "link.csv").symlink_to(target)
    code, _, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "link.csv"], files)
    assert code == 0, err
    assert (files / "link.csv").is_symlink()
    assert target.read_text().startswith("0F0")


def test_existing_file_keeps_its_mode(files: Path) -> None:
    out = files / "private.csv"
    out.write_text("old")
    out.chmod(0o600)
    code, _, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(out)], files)
    assert code == 0, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_fifo_at_output_is_written_not_replaced(files: Path) -> None:
    fifo = files / "pipe.csv"
    os.mkfifo(fifo)
    chunks: list[bytes] = []
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader is waiting, so the writer never blocks

    def drain() -> None:
        while True:
            try:
                data = os.read(reader_fd, 65536)
            except BlockingIOError:
                if done.is_set():
                    return
                done.wait(0.01)
                continue
            if not data and done.is_set():
                return
            chunks.append(data)
            if not data:
                done.wait(0.01)

    done = threading.Event()
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        code, _, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(fifo)], files)
    finally:
        done.set()
        thread.join(5)
        os.close(reader_fd)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert b"".join(chunks).startswith(b"0F0")


def test_unwritable_output_names_the_users_path(files: Path) -> None:
    code, _, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "/proc/x.json", "--format", "json"],
                          files)
    assert code == 2 and "Traceback" not in err
    assert "/proc/x.json" in err and ".tmp" not in err


# --- tracebacks: each must become one line --------------------------------------------------------------------------
LONG = "a" * 300 + ".csv"
TRACEBACKS = [
    *(Case(f"{cmd} on a {kind} file", (cmd, *(("-s",) if cmd != "validate" else ()), f"{kind}.csv"), 2, says)
      for cmd in ("validate", "show", "simulate")
      for kind, says in (("latin1", "not UTF-8"), ("utf16", "UTF-16"), ("random", "not UTF-8"),
                         ("binary", "binary"))),
    Case("plot on a Latin-1 file", ("plot", "-s", "latin1.csv"), 2, "not UTF-8"),
    Case("input name longer than the OS allows", ("validate", LONG), 2, "longer than"),
    Case("input name too long in simulate", ("simulate", "-s", LONG), 2, "longer than"),
    Case("output name longer than the OS allows", ("export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", LONG), 2,
         "longer than"),
    Case("--memory-cap 1e400", ("simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", "1e400"), 2,
         "--memory-cap"),
    Case("--memory-cap 1e400 in plot", ("plot", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", "1e400"), 2,
         "--memory-cap"),
    Case("F=1e308 in plot", ("plot", "-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=1e308"), 2, "limit of 1e+12"),
    Case("stage id 999,999,999 (validate)", ("validate", "bigstage.csv"), 1, "stage 999999999"),
    Case("stage id 999,999,999 (simulate)", ("simulate", "-s", "bigstage.csv"), 2, "stage 999999999"),
    Case("microbatch id 999,999,999 (validate)", ("validate", "bigmb.csv"), 1, "microbatch 999999999 out of range"),
    Case("microbatch id 999,999,999 (simulate)", ("simulate", "-s", "bigmb.csv"), 2, "microbatch 999999999"),
    Case("5,000-digit id", ("validate", "hugeid.csv"), 2, "exceeds the limit"),
    Case("a directory as the schedule", ("validate", "{d}"), 2, "directory"),
    Case("a UTF-8 BOM and CRLF lines are fine", ("validate", "excel.csv"), 0, "valid"),
    Case("a malformed overlapped pair", ("validate", "pair.csv"), 2, "overlapped pair"),
    Case("a missing schedule file", ("simulate", "-s", "nope.csv"), 2, "not found"),
]


@pytest.mark.parametrize("case", [param(c) for c in TRACEBACKS])
def test_bad_files_and_values_give_one_line(case: Case, files: Path) -> None:
    check(case, files)


def test_fifo_as_schedule_is_refused_without_blocking(files: Path) -> None:
    os.mkfifo(files / "in.csv")
    code, _, err = invoke(["validate", "in.csv"], files)  # opening a FIFO for reading would block forever
    assert code == 2 and "not a regular file" in err


PROFILES = {
    "digits.json": '{"schema": "ppsim.profile", "stages": [{"stage": ' + "9" * 5000 + "}]}",
    "deep.json": "[" * 10_000 + "]" * 10_000,
    "int64.json": json.dumps({"schema": "ppsim.profile", "num_stages": 1, "stages": [{
        "stage": 0, "F": {"median": 1.0}, "B": {"median": 2.0}, "I": {"median": 1.0}, "W": {"median": 1.0},
        "FB": {"median": 3.0}, "activation_bytes": 2**70, "activation_bytes_freed_by_I": 0, "output_bytes": 1,
        "param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}]}),
    "latin1.json": '{"schema": "café"}',
}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_hostile_profiles_give_one_line(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_bytes(PROFILES[name].encode("latin-1" if name.startswith("latin1") else "utf-8"))
    code, out, err = invoke(["simulate", "-s", "1F1B", "-r", "1", "-m", "2", "--profile", str(path)], tmp_path)
    assert code == 2 and "Traceback" not in out + err
    assert len([line for line in err.splitlines() if line.startswith("Error:")]) == 1


def _cli(args: list[str], cwd: Path, *, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """The real entry point in a child process (its own encoding, its own exit); on a hang the whole process group
    is killed, so nothing it started outlives the test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from ppsim.cli import main; main()", *args],
        cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        encoding="utf-8", errors="replace", start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s: the command did not refuse)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ascii_output_encoding_gives_one_line(files: Path) -> None:
    proc = _cli(["validate", "日本語.csv"], files, PYTHONIOENCODING="ascii")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("Error:") == 1


def test_ascii_output_encoding_prints_a_cjk_schedule_name(files: Path) -> None:
    (files / "日本語.csv").write_bytes(_files()["good.csv"])
    proc = _cli(["show", "-s", "日本語.csv"], files, PYTHONIOENCODING="ascii")
    assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr


@pytest.mark.torch
def test_run_refuses_a_deadlocking_file_before_starting_ranks(files: Path) -> None:
    pytest.importorskip("torch")
    proc = _cli(["run", "-s", "deadlock.csv"], files)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "deadlock" in proc.stderr and proc.stderr.count("Error:") == 1


# --- unbounded work: refused with the estimate, the limit and the override ---------------------------------------
UNBOUNDED = [
    Case("-m 1000000000", ("simulate", "-s", "1F1B", "-r", "4", "-m", "1000000000"), 2, "limit of 2,000,000 actions"),
    Case("-r 100000", ("simulate", "-s", "1F1B", "-r", "100000", "-m", "8"), 2, "limit of 2,048 ranks"),
    Case("DualPipeV -r 8 -m 1000000", ("simulate", "-s", "DualPipeV", "-r", "8", "-m", "1000000"), 2,
         "about 48,000,000 actions"),
    Case("show -m 1000000000", ("show", "-s", "GPipe", "-r", "2", "-m", "1000000000"), 2, "--allow-large"),
    Case("export -r 100000", ("export", "-s", "1F1B", "-r", "100000", "-m", "1", "-o", "x.csv"), 2, "--allow-large"),
    Case("report -m 1000000000", ("report", "-s", "1F1B", "-r", "2", "-m", "1000000000", "-o", "r.html"), 2,
         "--allow-large"),
    Case("plot -r 2000", ("plot", "-s", "1F1B", "-r", "2000", "-m", "4"), 2, "1,000 ranks"),
    Case("plot of 80,000 actions", ("plot", "-s", "1F1B", "-r", "4", "-m", "10000"), 2, "50,000 actions"),
    Case("plot of a 52,000-action file", ("plot", "-s", "wide.csv"), 2, "for a figure"),
    Case("export chrome of 1M actions", ("export", "-s", "Interleaved1F1B", "-r", "128", "-m", "1024", "-v", "4",
                                          "--format", "chrome", "-o", "t.json"), 2, "limit of 200,000 actions"),
    Case("validate -m 1000000000", ("validate", "good.csv", "-m", "1000000000"), 2, "--allow-large"),
    Case("a 3,000-rank file", ("validate", "ranks3000.csv"), 2, "2,048 ranks"),
    Case("a line of 3,000,000 empty cells", ("simulate", "-s", "commas.csv"), 2, "cells"),
    Case("simulate a 52,000-action file (within limits)", ("simulate", "-s", "wide.csv", "--json"), 0, "makespan"),
    Case("--allow-large lifts the rank limit", ("show", "-s", "1F1B", "-r", "2100", "-m", "1", "--allow-large"), 0,
         "2100 ranks"),
]


@pytest.mark.parametrize("case", [param(c) for c in UNBOUNDED])
def test_unbounded_work_is_refused_with_the_estimate(case: Case, files: Path) -> None:
    check(case, files)


def test_a_file_beyond_the_byte_limit_is_refused_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "big.csv"
    with open(big, "wb") as fh:
        fh.truncate(limits.MAX_FILE_BYTES + 1)  # sparse: no disk used, and never read
    code, _, err = invoke(["plot", "-s", "big.csv"], tmp_path)
    assert code == 2 and "16.00 MiB" in err and "--allow-large" in err


def test_the_perf_target_fits_the_limits() -> None:
    estimate = limits.estimate_named("Interleaved1F1B", 128, 1024, 4)
    assert estimate.num_actions == 128 * 4 * 1024 * 2
    limits.check_work(estimate)  # no refusal


def test_every_named_schedule_estimate_bounds_its_real_size() -> None:
    from ppsim.schedules import all_specs, resolve_stages_per_rank

    for spec in all_specs():
        v = resolve_stages_per_rank(spec, None)
        sched = get_schedule(spec.name, 4, 8)
        real = sum(1 for _ in sched.iter_computations())
        assert real <= limits.estimate_named(spec.name, 4, 8, v).num_actions <= 2 * real, spec.name


@pytest.mark.torch
def test_run_refuses_a_billion_microbatches(files: Path) -> None:
    proc = _cli(["run", "-s", "1F1B", "-r", "2", "-m", "1000000000"], files)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--allow-large" in proc.stderr


@pytest.mark.torch
@pytest.mark.slow
def test_calibrate_refuses_an_absurd_sequence_length(tmp_path: Path) -> None:
    # a refusal comes back at once; a calibration that starts is killed (with its children) and fails the test
    proc = _cli(["calibrate", "--seq-len", "10000000", "-o", str(tmp_path / "p.json")], tmp_path, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "seq" in proc.stderr


# === issue 18, third adversarial pass (hostile engineer): one section per class, one defect per test ==============
def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, err
    return lines[0]


def _profile_with(tmp_path: Path, **model: object) -> Path:
    from profile_v2 import make_v2_profile

    doc = make_v2_profile().to_dict()
    doc["model"].update(model)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    return path


# --- 18: unbounded work and hangs ------------------------------------------------------------------------------------
def test_a_profile_with_a_prime_hidden_size_is_refused_at_once(tmp_path: Path) -> None:
    # the "divisible by heads" hint searched every number up to the hidden size: 10**9 steps for a prime
    path = _profile_with(tmp_path, hidden=1_000_000_007, heads=2)
    proc = _cli(["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(path)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "divisible by heads" in _one_error(proc.stderr)


def test_calibrate_refuses_a_prime_hidden_size_with_a_divisor_hint(tmp_path: Path) -> None:
    proc = _cli(["calibrate", "--hidden", "1000000007", "--heads", "2", "-o", str(tmp_path / "p.json")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "e.g. --heads 1" in _one_error(proc.stderr)


def test_the_divisor_hint_is_bounded_and_still_the_nearest() -> None:
    from ppsim.model_config import _divisor_near

    assert _divisor_near(2**61 - 1, 3) == 1  # a Mersenne prime: a linear scan would never end
    assert (_divisor_near(128, 5), _divisor_near(12, 5), _divisor_near(100, 3)) == (4, 4, 2)


@pytest.mark.parametrize(("args", "says"), [
    (["--layers", "100000"], "100,000 layers"),  # the runtime probe builds the whole model: it was not estimated
    (["--hidden", "9" * 23], "2,147,483,647"),  # beyond any tensor size (and the estimate's float range)
    (["--layers", "2147483647", "--check-stages", "--stages", "2147483647"], "layers"),  # split first: hung
    (["--init-timeout", "1e300"], "7 days"),  # overflowed a thread wait after the units were measured
    (["--init-timeout", "nan"], "--init-timeout nan"),
])
def test_calibrate_estimates_or_refuses_absurd_sizes_before_starting(args: list[str], says: str,
                                                                     tmp_path: Path) -> None:
    code, out, err = invoke(["calibrate", *args, "-o", str(tmp_path / "p.json")], tmp_path)
    assert code == 2, out + err
    assert says in _one_error(err)
    assert not (tmp_path / "p.json").exists()


def test_the_calibration_estimate_counts_the_probe_of_the_whole_model() -> None:
    from ppsim.calibrate.measure.calibration import estimate
    from ppsim.model_config import get_preset

    deep = get_preset("tiny").replace(preset="custom", layers=100_000)
    units_only = estimate(deep, device="cpu", reps=20, warmup=3)
    with_probe = estimate(deep, device="cpu", reps=20, warmup=3, probe=True)
    assert with_probe[0] > 1000 * units_only[0] and with_probe[1] > 1000 * units_only[1]


def test_run_steps_are_bounded() -> None:
    limits.check_run_steps("x", num_actions=8, num_steps=limits.MAX_RUN_STEPS)
    with pytest.raises(limits.WorkLimitError, match="--allow-large"):
        limits.check_run_steps("x", num_actions=8, num_steps=1_000_000_000)
    with pytest.raises(limits.WorkLimitError, match="1,000,000 actions"):
        limits.check_run_steps("x", num_actions=10_000, num_steps=200)
    limits.check_run_steps("x", num_actions=8, num_steps=1_000_000_000, allow_large=True)


@pytest.mark.torch
@pytest.mark.parametrize(("args", "says"), [
    (["--steps", "1000000000"], "1,000 steps"),
    (["--warmup", "1000000000", "--synthetic"], "1,000 steps"),
    (["--synthetic", "--costs", "F=1,B=1", "--time-unit", "1", "--timeout", "3"], "beyond --timeout 3 s"),
    (["--timeout", "1e300", "--synthetic"], "7 days"),
])
def test_run_refuses_work_beyond_its_limits_before_any_rank_starts(args: list[str], says: str,
                                                                  tmp_path: Path) -> None:
    import multiprocessing

    code, out, err = invoke(["run", "-s", "1F1B", "-r", "2", "-m", "2", *args], tmp_path)
    assert code == 2, out + err
    assert says in _one_error(err)
    assert multiprocessing.active_children() == []


# --- 18: data loss: nothing a user wrote is replaced without being asked ----------------------------------------------
def test_run_without_a_profile_never_replaces_a_users_file(tmp_path: Path) -> None:
    mine = tmp_path / "r.profile.json"
    mine.write_text("my notes")
    code, out, err = invoke(["run", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "r.json"], tmp_path)
    assert code == 2, out + err
    line = _one_error(err)
    assert "r.profile.json exists" in line and "--profile r.profile.json" in line and "--profile-out" in line
    assert mine.read_text() == "my notes"


def test_the_automatic_calibration_file_is_created_new_or_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.execute import run
    from ppsim.calibrate.measure import calibration
    from ppsim.calibrate.models.builtin import source_for
    from ppsim.errors import OutputPathError
    from ppsim.model_config import get_preset

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibrated over a user's file")

    monkeypatch.setattr(calibration, "calibrate", fail)
    mine = tmp_path / "taken.json"
    mine.write_text("mine")
    with pytest.raises(OutputPathError, match="exists"):  # the name taken after the CLI's check: still refused
        run.calibrate_here(source_for(get_preset("tiny")), "cpu", save_to=mine)
    assert mine.read_text() == "mine"
    monkeypatch.setattr(calibration, "calibrate", lambda opts: None)  # writes nothing
    run.calibrate_here(source_for(get_preset("tiny")), "cpu", save_to=tmp_path / "new.json")
    assert not (tmp_path / "new.json").exists()  # the empty reservation is released


def test_plot_without_o_never_replaces_a_file_of_its_default_name(tmp_path: Path) -> None:
    mine = tmp_path / "1F1B_r2_m2.png"
    mine.write_text("my figure")
    code, out, err = invoke(["plot", "-s", "1F1B", "-r", "2", "-m", "2"], tmp_path)
    assert code == 2, out + err
    assert "-o 1F1B_r2_m2.png to replace it" in _one_error(err)
    assert mine.read_text() == "my figure"
    code, _, err = invoke(["plot", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "1F1B_r2_m2.png"], tmp_path)
    assert code == 0, err  # asked by name: replaced
    assert mine.read_bytes().startswith(b"\x89PNG")


def test_an_unsaved_calibration_leaves_no_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from ppsim.calibrate.execute import run
    from ppsim.calibrate.measure import calibration
    from ppsim.calibrate.models.builtin import source_for
    from ppsim.model_config import get_preset

    def failed(opts: object) -> None:
        raise RuntimeError("the calibration failed")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate", failed)
    with pytest.raises(RuntimeError):
        run.calibrate_here(source_for(get_preset("tiny")), "cpu")
    assert list(tmp_path.iterdir()) == []  # every `run` without -o left a ppsim-run-* folder behind


def test_under_torchrun_only_rank_0_creates_the_calibration_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.execute import run
    from ppsim.calibrate.measure import calibration
    from ppsim.calibrate.models.builtin import source_for
    from ppsim.cli.run import calibration_path
    from ppsim.model_config import get_preset

    shared = tmp_path / "r.profile.json"
    shared.write_text("")  # rank 0 (on a shared file system) reserved it already
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(calibration, "calibrate", lambda opts: None)  # a rank other than 0 writes nothing
    assert calibration_path(tmp_path / "r.json", None, profile=None, synthetic=False) == shared
    assert run.calibrate_here(source_for(get_preset("tiny")), "cpu", save_to=shared)[0] is None
    assert shared.exists()  # not rank 1's to remove


@pytest.mark.parametrize("args", [
    ["export", "-s", "six.csv", "-o", "six.csv", "--format", "json"],
    ["export", "-s", "six.csv", "-o", "./six.csv"],
    ["export", "-s", "1F1B", "-r", "2", "-m", "2", "--format", "json", "--profile", "p.json", "-o", "p.json"],
    ["run", "-s", "six.csv", "--synthetic", "-o", "six.csv"],
    ["run", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "r.json", "--profile-out", "r.json"],
])
def test_an_output_never_replaces_an_input_or_another_output(args: list[str], files: Path) -> None:
    from profile_v2 import make_v2_profile

    (files / "p.json").write_text(json.dumps(make_v2_profile().to_dict()))
    before = {name: (files / name).read_bytes() for name in ("six.csv", "p.json")}
    code, out, err = invoke(args, files)
    assert code == 2, out + err
    assert "the same file as" in _one_error(err)
    assert {name: (files / name).read_bytes() for name in before} == before


# --- 18: silent wrong answers: every option takes effect or is refused -----------------------------------------
@pytest.mark.parametrize(("args", "says"), [
    (["export", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", "nope.json", "-o", "x.csv"], "--profile nope.json"),
    (["export", "-s", "1F1B", "-r", "2", "-m", "4", "--split", "9,9,9,9", "-o", "x.csv"], "--split 9,9,9,9"),
    (["export", "-s", "1F1B", "-r", "2", "-m", "4", "--costs", "F=2", "-o", "x.csv"], "--costs F=2"),
    (["export", "-s", "1F1B", "-r", "2", "-m", "4", "--cost-scope", "rank", "-o", "x.csv"], "--cost-scope rank"),
    (["export", "-s", "1F1B", "-r", "2", "-m", "4", "--layers-per-stage", "3", "-o", "x.csv"], "--layers-per-stage"),
    (["plot", "-s", "1F1B", "-r", "2", "-m", "4", "-o", "x.html", "--dpi", "300"], "--dpi 300"),
    (["report", "-s", "1F1B", "-r", "2", "-m", "4", "-o", "x.html", "--search-time", "5"], "--search"),
    (["plot", "-s", "1F1B", "-r", "2", "-m", "4", "-o", "x.png", "--memory-cap", "1GB"], "add --memory"),
    (["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--costs", ""], "--costs ''"),
    (["run", "-s", "1F1B", "-r", "2", "-m", "2", "--time-unit", "0.5", "-o", "x.json"], "--time-unit 0.5"),
    (["run", "-s", "1F1B", "-r", "2", "-m", "2", "--preset", "8b", "--profile", "p.json"], "--preset 8b"),
    (["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--split", "1,1"], "--split 1,1"),
    (["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--profile-out", "x.json"], "--profile-out"),
    (["run", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", "p.json", "--profile-out", "x.json"], "--profile-out"),
])
def test_an_option_the_command_would_ignore_is_refused(args: list[str], says: str, tmp_path: Path) -> None:
    code, out, err = invoke(args, tmp_path)
    assert code == 2, out + err
    assert says in _one_error(err)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_torch_cannot_take_is_refused(seed: str, tmp_path: Path) -> None:
    code, _, err = invoke(["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--seed", seed], tmp_path)
    assert code == 2 and "--seed" in err  # typer's range check (main() prints it as one line)


def test_calibrate_stages_without_check_stages_is_not_silent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    # the warning comes once every refusal is behind (a refused command prints only its error line, issue 26)
    monkeypatch.setattr(importlib.import_module("ppsim.calibrate.measure.calibration"), "calibrate", lambda opts: None)
    code, _, err = invoke(["calibrate", "--stages", "3", "-o", "p.json"], tmp_path)
    assert code == 0
    assert "warning: --stages 3 is used only with --check-stages" in err


# --- 18: exit codes: 2 and one short line for every user mistake --------------------------------------------------
@pytest.mark.parametrize("cap", ["1e1000000", "9" * 5000, "-1e1000000", "9" * 5000 + "act"])
def test_absurd_memory_caps_exit_2_with_a_short_line(cap: str, tmp_path: Path) -> None:
    code, out, err = invoke(["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", cap], tmp_path)
    assert code == 2, out + err
    assert len(_one_error(err)) < 300


def test_absurd_activation_caps_are_size_errors() -> None:
    from ppsim.errors import SizeError
    from ppsim.io import parse_memory_cap

    with pytest.raises(SizeError, match="10\\*\\*12"):
        parse_memory_cap("9" * 5000 + "act")  # int() of 5,000 digits raised ValueError (exit 1)
    assert str(parse_memory_cap("008act")) == "8act"


NON_ROOT_OUTPUTS = [
    ["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "ro/x.csv"],
    ["export", "-s", "1F1B", "-r", "2", "-m", "2", "--format", "json", "-o", "ro/x.json"],
    ["plot", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "ro/x.png"],
    ["report", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "ro/x.html"],
    ["calibrate", "-o", "ro/x.json"],
    ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "-o", "ro/x.json"],
    ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--plot", "ro/x.png"],
]


@pytest.mark.parametrize("args", NON_ROOT_OUTPUTS, ids=lambda a: " ".join(a[:1] + a[-2:]))
def test_a_read_only_folder_for_a_non_root_user_exits_2_naming_the_fix(args: list[str], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ro").mkdir()
    real_access = os.access
    ro = str(tmp_path / "ro")

    def access(path: object, mode: int, *rest: object, **kw: object) -> bool:  # what a non-root user is told
        if os.path.realpath(str(path)).startswith(ro) and mode & os.W_OK:
            return False
        return real_access(path, mode, *rest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    code, out, err = invoke(args, tmp_path)
    assert code == 2, out + err
    assert "is not writable; choose another path" in _one_error(err)


def test_a_write_refused_despite_access_exits_2_naming_the_fix(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import tempfile

    def denied(*args: object, **kwargs: object) -> None:  # access() said yes (root squash, ACLs); the write says no
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    code, out, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "x.csv"], tmp_path)
    assert code == 2, out + err
    assert "permission denied; choose a path you can write to" in _one_error(err)


CTRL_C = [
    ("list", ["list"], "ppsim.schedules", "all_specs"),
    ("show", ["show", "-s", "1F1B", "-r", "2", "-m", "2"], "ppsim.formats", "to_text_grid"),
    ("validate", ["validate", "six.csv"], "ppsim.validate", "validate"),
    ("export", ["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "x.csv"], "ppsim.formats", "write_csv"),
    ("simulate", ["simulate", "-s", "1F1B", "-r", "2", "-m", "2"], "ppsim.compare", "compare"),
    ("plot", ["plot", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "x.png"], "ppsim.viz", "plot_to_file"),
    ("report", ["report", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "x.html"], "ppsim.viz.report", "write_report"),
    ("calibrate", ["calibrate", "-o", "x.json"], "ppsim.calibrate.measure.calibration", "calibrate"),
    ("run", ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic"], "ppsim.calibrate.execute.run", "execute"),
]


@pytest.mark.parametrize(("cmd", "args", "module", "name"), CTRL_C, ids=[c[0] for c in CTRL_C])
def test_ctrl_c_in_any_command_exits_130(cmd: str, args: list[str], module: str, name: str, files: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    code, _, err = invoke(args, files)
    assert code == 130, err
    assert "Traceback" not in err and ("Interrupted." in err or "interrupted" in err)


def test_ctrl_c_while_workers_start_is_raised_after_the_start() -> None:
    from ppsim.calibrate.execute.launch import _ctrl_c_deferred

    steps = []
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # `nohup pytest &` starts with SIG_IGN
    try:
        with pytest.raises(KeyboardInterrupt):
            with _ctrl_c_deferred():
                os.kill(os.getpid(), signal.SIGINT)  # inside Process.start() it would orphan a worker
                steps.append("the block ran to its end")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert steps == ["the block ran to its end"]


# --- 18: limits that do not fit every schedule of a command ---------------------------------------------------------
def test_a_split_that_fits_one_schedule_skips_the_other_and_names_it(tmp_path: Path) -> None:
    path = _profile_with(tmp_path)
    code, out, err = invoke(["simulate", "-s", "1F1B,Interleaved1F1B", "-r", "2", "-m", "4", "--profile", str(path),
                             "--split", "4,4", "--json"], tmp_path)
    assert code == 0, err
    assert [r["schedule"] for r in json.loads(out)] == ["1F1B"]
    assert "skipped Interleaved1F1B: --split 4,4 gives 2 stages" in err
    code, _, err = invoke(["report", "-s", "Interleaved1F1B,1F1B", "-r", "2", "-m", "4", "--profile", str(path),
                           "--layers-per-stage", "5", "-o", "r.html"], tmp_path)
    assert code == 0 and "skipped Interleaved1F1B" in err and (tmp_path / "r.html").exists()


def test_a_split_that_fits_no_schedule_is_refused_with_every_reason(tmp_path: Path) -> None:
    path = _profile_with(tmp_path)
    code, _, err = invoke(["simulate", "-s", "Interleaved1F1B,DualPipeV", "-r", "2", "-m", "4", "--profile",
                           str(path), "--split", "4,4"], tmp_path)
    assert code == 2
    line = _one_error(err)
    assert "none of these schedules" in line and "Interleaved1F1B:" in line and "DualPipeV:" in line


# --- first contact ---------------------------------------------------------------------------------------------------
def test_version_option(tmp_path: Path) -> None:
    proc = _cli(["--version"], tmp_path)
    assert proc.returncode == 0 and "ppsim" in proc.stdout.lower()


def test_bad_integer_is_rejected_without_importing_torch() -> None:
    code = "import sys; from ppsim.cli import app; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("image", ["docs/img/dualpipev_r4_m10.png", "docs/img/report.png"])
def test_readme_images_are_not_ignored_by_git(image: str) -> None:
    proc = subprocess.run(["git", "check-ignore", "-q", image], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == 1, f"{image} is ignored by .gitignore"


# --- the library entry ---------------------------------------------------------------------------------------------
def test_load_schedule_reads_sizes_from_the_file_and_validates_it(files: Path) -> None:
    from ppsim.schedules.loading import InvalidScheduleError, load, load_schedule

    sched = load_schedule(files / "six.csv")
    assert (sched.num_ranks, sched.num_microbatches, sched.num_stages_per_rank) == (2, 6, 1)
    with pytest.raises(InvalidScheduleError) as err:
        load_schedule(files / "missing_w.csv")
    assert "missing backward 0W9" in str(err.value) and err.value.problems
    loaded = load(files / "missing_w.csv", check=False)
    assert loaded.from_file and loaded.schedule.num_microbatches == 10


def test_load_schedule_limits_lift_with_allow_large(files: Path) -> None:
    from ppsim.schedules.loading import load_schedule

    with pytest.raises(limits.WorkLimitError, match="2,048 ranks"):
        load_schedule("1F1B", num_ranks=2100, num_microbatches=1)
    assert load_schedule("1F1B", num_ranks=2100, num_microbatches=1, allow_large=True).num_ranks == 2100
    with pytest.raises(limits.WorkLimitError, match="2,048 ranks"):
        load_schedule(files / "ranks3000.csv")


# --- found by a second adversarial pass ------------------------------------------------------------------------------
def _v2_profile(tmp_path: Path, **act: int) -> Path:
    from profile_v2 import make_v2_profile

    doc = make_v2_profile().to_dict()
    for block, value in act.items():
        doc["blocks"][block]["activation_bytes"] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_per_block_profile_gives_byte_sizes_to_the_memory_cap(tmp_path: Path) -> None:
    path = _v2_profile(tmp_path)
    code, out, err = invoke(["simulate", "-s", "ZBH1", "-r", "4", "-m", "8", "--profile", str(path),
                             "--memory-cap", "50000"], tmp_path)
    assert code == 0, err
    assert "needs byte sizes" not in err  # the profile has them: no false warning
    assert "> cap" in out


@pytest.mark.parametrize("scope", ["stage", "rank"])
def test_a_cost_scope_with_a_profile_is_refused_not_ignored(scope: str, tmp_path: Path) -> None:
    # a profile's costs are per stage already: `--cost-scope stage` used to be accepted and change nothing
    path = _v2_profile(tmp_path)
    for command in (["simulate", "-s", "ZBH1,1F1B"], ["simulate", "-s", "ZBH1"], ["report", "-s", "ZBH1,1F1B",
                                                                                     "-o", str(tmp_path / "r.html")]):
        code, out, err = invoke([*command, "-r", "4", "-m", "8", "--profile", str(path), "--cost-scope", scope],
                                tmp_path)
        assert code == 2 and "Traceback" not in out + err, (command, err)
        assert f"--cost-scope {scope} applies to --costs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_byte_totals_beyond_int64_are_refused_not_wrapped(tmp_path: Path) -> None:
    path = _v2_profile(tmp_path, embed=3 * 10**18)  # each value within int64, four microbatches' worth are not
    code, out, err = invoke(["simulate", "-s", "ZBH1", "-r", "4", "-m", "8", "--profile", str(path), "--json"],
                            tmp_path)
    assert code == 2 and "Traceback" not in out + err
    assert "bytes" in err and "check the profile" in err


def test_repeated_names_are_compared_once_and_the_total_work_is_bounded(files: Path) -> None:
    code, out, err = invoke(["simulate", "-s", "1F1B,1f1b,ZBH1", "-r", "2", "-m", "4", "--json"], files)
    assert code == 0 and "given more than once is compared once" in err
    assert sorted(r["schedule"] for r in json.loads(out)) == ["1F1B", "ZBH1"]
    many = ",".join(["1F1B", "GPipe", "ZBH1"])
    code, _, err = invoke(["simulate", "-s", many, "-r", "4", "-m", "250000"], files)  # 1M each, 4M in all
    assert code == 2 and f"limit of {limits.MAX_COMPARE_ACTIONS:,} actions for one command" in err


def test_a_report_is_bounded_as_a_whole(files: Path) -> None:
    names = "1F1B,ZBH1,GPipe,ZBH2,LoopedBFS"  # 1,000 rows each: every figure fits, the page does not
    code, _, err = invoke(["report", "-s", names, "-r", "1000", "-m", "1", "-o", "r.html"], files)
    assert code == 2 and f"{limits.MAX_REPORT_RANKS:,} rows" in err
    assert not (files / "r.html").exists()


def test_a_folder_that_takes_no_files_is_named_as_such(files: Path) -> None:
    code, _, err = invoke(["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "/proc/x.json", "--format", "json"],
                          files)
    assert code == 2 and "does not exist" not in err and "does not accept new files" in err


def test_costs_below_the_smallest_op_time_are_refused() -> None:
    with pytest.raises(PPSimError, match="below the limit of 1e-12"):
        parse_costs("F=1e-320,B=1e-320")
    assert parse_costs("F=1e-12,B=0").F[0] == 1e-12  # the limit itself, and 0, stay allowed


@pytest.mark.parametrize(("toml", "says"), [
    ('pipeline_parallel_schedule_csv = "six.csv"\n', "six.csv has 6 microbatches"),
    ('pipeline_parallel_schedule = "DualPipeV"\n', "needs at least as many microbatches"),
])
def test_torchtitan_refusals_name_the_job_configs_keys(toml: str, says: str, files: Path) -> None:
    (files / "job.toml").write_text(
        "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 1\n" + toml
        + "[training]\nlocal_batch_size = 3\nseq_len = 128\n"
    )
    code, _, err = invoke(["simulate", "--torchtitan-config", "job.toml"], files)
    assert code == 2 and says in err, err
    assert "local_batch_size 3" in err and "-m" not in err.replace("--torchtitan-config", "")


def test_a_hangup_while_writing_leaves_no_temporary_file(tmp_path: Path) -> None:
    """SIGHUP (a closed terminal) during the atomic write: the process dies of it and the temporary file is gone."""
    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal leaves it (`nohup pytest &` ignores it)\n"
        "from ppsim.io import write_atomic\n"
        "def content(fh):\n"
        "    fh.write(b'partial')\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "write_atomic(sys.argv[1], content)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.png")], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGHUP, proc.stderr
    assert list(tmp_path.iterdir()) == []


# =====================================================================================================================
# --- search: bounded work, time limits, Ctrl-C (issue 18, the `search` engineer's block; kept apart from the above) --
# =====================================================================================================================
def _search(args: list[str], tmp_path: Path) -> tuple[int, str, str]:
    return invoke(["search", *args], tmp_path)


@pytest.mark.parametrize(("args", "says"), [
    # the issue's examples: each ran 20 s or more; now refused before any work, naming the estimate
    (["-r", "2048", "-m", "16", "--memory-cap", "8act", "--time-limit", "2"], "more than --time-limit 2"),
    (["-r", "1000", "-m", "16", "--memory-cap", "8act", "--placement", "any"], "limit of 100,000 actions"),
    (["-r", "512", "-m", "16", "--memory-cap", "8act", "--time-limit", "1"], "more than --time-limit 1"),
    (["-r", "64", "-m", "1000", "--memory-cap", "8act"], "limit of 100,000 actions"),
])
def test_search_beyond_the_limits_is_refused_with_the_estimate(args: list[str], says: str, tmp_path: Path) -> None:
    code, _, err = _search(args, tmp_path)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "--allow-large" in lines[0] and "actions" in lines[0], err


def test_search_estimate_grows_with_every_size() -> None:
    base = limits.estimate_search(64, 16, (1,), num_named=12)
    for bigger in (limits.estimate_search(128, 16, (1,), num_named=12),
                   limits.estimate_search(64, 32, (1,), num_named=12),
                   limits.estimate_search(64, 16, (2,), num_named=12),
                   limits.estimate_search(64, 16, (1, 2), num_named=12)):
        assert bigger.num_actions > base.num_actions and bigger.setup_seconds > base.setup_seconds
    with pytest.raises(limits.WorkLimitError, match="--time-limit 0.5"):
        limits.check_search(limits.estimate_search(512, 16, (1,), num_named=12), time_limit=0.5)
    limits.check_search(limits.estimate_search(512, 16, (1,), num_named=12), time_limit=0.5, allow_large=True)


def test_library_search_refuses_the_same_work() -> None:
    from ppsim.search import search

    with pytest.raises(limits.WorkLimitError, match="--allow-large"):
        search(2048, 16, None, "8act", time_limit=2)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
def test_search_time_limit_must_be_a_positive_finite_number(value: str, tmp_path: Path) -> None:
    code, _, err = _search(["-r", "4", "-m", "8", "--memory-cap", "8act", "--time-limit", value], tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--time-limit" in lines[0] and "positive number of seconds" in lines[0]


@pytest.mark.parametrize("search_flag", [[], ["--search", "--memory-cap", "8act"]])
def test_report_search_time_nan_is_refused_with_or_without_search(search_flag: list[str], tmp_path: Path) -> None:
    code, _, err = invoke(["report", "-s", "1F1B", "-r", "4", "-m", "8", *search_flag, "--search-time", "nan",
                           "-o", str(tmp_path / "r.html")], tmp_path)
    assert code == 2 and "--search-time nan" in err and not (tmp_path / "r.html").exists()


def test_search_progress_starts_with_the_set_up_line(tmp_path: Path) -> None:
    code, _, err = _search(["-r", "4", "-m", "8", "--memory-cap", "6act", "--placement", "v", "--time-limit", "0.5",
                            "--solver", "none"], tmp_path)
    assert code == 0, err
    first = err.splitlines()[0]
    assert "set-up" in first and "no order yet" in first and "0 orders" in first


def _interrupt_list_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    import ppsim.search.driver as driver

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "list_schedule", interrupted)  # Ctrl-C in the first list-scheduling pass
    monkeypatch.setattr(driver, "_seeds", lambda *_a, **_k: None)  # the authors' schedulers (seeds) close or fit
    # these cases before list scheduling starts


def test_ctrl_c_in_the_first_pass_prints_the_best_so_far_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _interrupt_list_scheduling(monkeypatch)
    out_csv = tmp_path / "best.csv"
    v6 = ["-r", "4", "-m", "8", "--memory-cap", "6act", "--placement", "v", "--solver", "none",
          "--costs", "F=1,B=2,I=1,W=1,comm=0.1"]  # a case no order closes at once
    code, out, err = _search([*v6, "-q", "-o", str(out_csv)], tmp_path)
    assert code == 130, err
    assert "searched" in out and "V-Half" in out  # the table, with the best order so far
    assert "Interrupted: the best order found so far is shown and written." in err
    assert out_csv.exists()
    code, out, err = _search([*v6, "--json"], tmp_path)
    assert code == 130 and json.loads(out)["stopped"] == "interrupted"


def test_ctrl_c_before_any_order_says_no_order_yet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _interrupt_list_scheduling(monkeypatch)
    # 2 activations per rank: no named schedule fits, so nothing is known when list scheduling is interrupted
    code, out, err = _search(["-r", "4", "-m", "8", "--memory-cap", "2act", "-q"], tmp_path)
    assert code == 130, err
    assert out == "" and "Interrupted: no order yet" in err and "Traceback" not in err


def test_with_allow_large_the_time_limit_still_ends_the_search() -> None:
    """A first list-scheduling pass longer than the limit is cut at the deadline, not run to its end."""
    from ppsim.search import MemoryCapError, search

    try:  # 8 activations on 256 ranks: no named schedule fits, so only list scheduling can find an order
        result = search(256, 16, None, "8act", time_limit=0.5, solver="none", allow_large=True)
    except MemoryCapError as exc:
        assert "no order found within the time limit" in str(exc)
    else:
        assert result.stopped == "time limit"
