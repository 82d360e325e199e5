"""Hostile inputs, sixth pass: Ctrl-C in any phase of ``ppsim calibrate`` (the units, p2p, the collectives, each
runtime probe) and of ``ppsim run`` ends the command with ppsim's exit 130 and its one line, never by the signal
(exit -2), and a calibration keeps what it had finished in its progress file.

Each test starts the real command, waits for the phase's progress line, sends SIGINT to the command alone (as
``kill -INT``) and to its whole process group (as a terminal's Ctrl-C), and reads the exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import alive, default_signals, descendants

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--vocab", "32", "--seq-len", "8", "--mb-size", "1",
         "--reps", "1", "--warmup", "0"]
"""A model whose units measure in about a second."""


def _session() -> None:
    default_signals()
    os.setsid()  # its own process group: the group signal reaches the command and its workers, not pytest


def interrupt_at(args: list[str], marker: str | Callable[[int], bool], *, cwd: Path, group: bool,
                 delay_s: float = 0.0) -> tuple[int, str]:
    """Start ``ppsim ARGS``, wait for a stderr line holding ``marker`` (or for ``marker(pid)`` to hold), send SIGINT;
    the exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "ppsim.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_session)  # noqa: PLW1509
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        if callable(marker):
            while not marker(proc.pid):
                assert proc.poll() is None, f"ended before the phase: {proc.communicate()}"
                time.sleep(0.01)
        else:
            for line in proc.stderr:
                seen.append(line)
                if marker in line:
                    break
            else:
                pytest.fail(f"never reached {marker!r}: {''.join(seen)}")
        time.sleep(delay_s)
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(seen) + rest


def workers_started(pid: int) -> bool:
    """The run's local ranks exist (the fork server and its two workers)."""
    return len(alive(descendants(pid))) >= 3


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "small.json"
    subprocess.run([sys.executable, "-m", "ppsim.cli", "calibrate", *SMALL, "--layers", "4", "--no-p2p",
                    "--no-probe", "-o", str(out)], check=True, capture_output=True, timeout=300)
    return out


def _progress(out: Path) -> dict:
    from ppsim.io import progress_path

    return json.loads(progress_path(out).read_text())


@pytest.mark.torch
@pytest.mark.parametrize("group", [False, True], ids=["kill", "terminal"])
@pytest.mark.parametrize(("marker", "kept"), [
    ("interleaved repetitions", []),
    ("measuring p2p latency", ["units"]),
    ("measuring FSDP's all-gather", ["units", "p2p"]),
], ids=["units", "p2p", "collectives"])
def test_ctrl_c_in_a_calibration_phase_exits_130_keeping_what_was_measured(
        tmp_path: Path, marker: str, kept: list[str], group: bool) -> None:
    """Right after the phase's line: the p2p phase starts the local ranks' fork server there, where a Ctrl-C was
    lost (SIGINT ignored while it started) and the calibration ran on to exit 0."""
    out = tmp_path / "c.json"
    code, err = interrupt_at(["calibrate", *SMALL, "--layers", "2", "--no-probe", "-o", str(out)], marker,
                             cwd=tmp_path, group=group, delay_s=0.0)
    assert code == 130, err
    assert "interrupted; finished measurements are in" in err.strip().splitlines()[-1], err
    assert "Traceback" not in err and not out.exists()
    assert set(kept) <= set(_progress(out)["done"]), _progress(out)["done"]


@pytest.mark.torch
@pytest.mark.parametrize(("marker", "kept"), [
    # the phase's start line ("runtime probe (real): 1F1B on 2 local ranks, ..."), not the estimate's listing of it
    ("runtime probe (real): 1F1B", ["units", "p2p", "collectives"]),
    ("runtime probe (synthetic): 1F1B", ["units", "p2p", "collectives", "runtime.real"]),
], ids=["real", "synthetic"])
def test_ctrl_c_in_a_runtime_probe_exits_130_keeping_what_was_measured(
        tmp_path: Path, marker: str, kept: list[str]) -> None:
    out = tmp_path / "c.json"
    code, err = interrupt_at(["calibrate", *SMALL, "--layers", "4", "-o", str(out)], marker, cwd=tmp_path,
                             group=True, delay_s=0.0)
    assert code == 130, err
    assert "interrupted; finished measurements are in" in err.strip().splitlines()[-1], err
    assert "Traceback" not in err and not out.exists()
    assert set(kept) <= set(_progress(out)["done"]), _progress(out)["done"]


@pytest.mark.torch
@pytest.mark.parametrize("group", [False, True], ids=["kill", "terminal"])
def test_ctrl_c_during_a_run_exits_130(tmp_path: Path, group: bool, small_profile: Path) -> None:
    out = tmp_path / "r.json"
    code, err = interrupt_at(["run", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(small_profile),
                              "--steps", "200", "--json", "-o", str(out)], workers_started, cwd=tmp_path,
                             group=group)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "Interrupted.", err
    assert "Traceback" not in err and not out.exists()
