"""calibrate's estimate names every phase it will run, each with its own estimate, and each phase prints a line at
least every 30 s (issue 41 item 8). No torch work: the matmul speed and the host's cores are fixed here, and the
heartbeat runs on a fake clock."""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path

import pytest

from ppsim.calibrate.measure import calibration as cal
from ppsim.calibrate.measure.calibration import HEARTBEAT_S, CalibrationOptions, PhaseProgress
from ppsim.model_config import PRESETS

PHASES = ["units", "p2p", "collectives", "runtime probe (real)", "runtime probe (synthetic)"]


@pytest.fixture
def fixed_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cal, "decide_speed", lambda opts: opts)  # the default FLOP rate, nothing measured
    monkeypatch.setattr("ppsim.step.sharing.host_cores", lambda: 2)


def tiny_opts(tmp_path: Path, **kw: object) -> CalibrationOptions:
    return CalibrationOptions(output=tmp_path / "p.json", config=PRESETS["tiny"], **kw)  # type: ignore


def phase_seconds(lines: list[str]) -> dict[str, float]:
    out = {}
    for line in lines:
        m = re.fullmatch(r"  (.+): about ([\d.]+) (s|min)", line)
        if m:
            out[m.group(1)] = float(m.group(2)) * (60 if m.group(3) == "min" else 1)
    return out


def test_the_estimate_lists_every_phase_with_its_own_estimate_and_their_total(tmp_path: Path,
                                                                             fixed_host: None) -> None:
    lines = cal.estimate_lines(tiny_opts(tmp_path))
    seconds = phase_seconds(lines)
    assert list(seconds) == PHASES, lines
    assert all(s > 0 for s in seconds.values())
    total = sum(s for _, s in cal.phase_estimates(tiny_opts(tmp_path)))
    assert f"about {total / 60:.1f} min" in lines[0] and any(f"every phase, about {total / 60:.1f} min" in ln
                                                             for ln in lines)


def test_phases_left_out_are_not_estimated(tmp_path: Path, fixed_host: None) -> None:
    assert list(phase_seconds(cal.estimate_lines(tiny_opts(tmp_path, probe=False)))) == PHASES[:3]
    assert list(phase_seconds(cal.estimate_lines(tiny_opts(tmp_path, p2p=False, probe=False)))) == ["units"]


def test_a_torchtitan_model_on_a_2_core_host_adds_the_fsdp_probe(tmp_path: Path, fixed_host: None) -> None:
    opts = tiny_opts(tmp_path)
    titan = dataclasses.replace(opts.model_source, scheme="torchtitan")  # its shapes are the tiny model's
    opts = dataclasses.replace(opts, source=titan)
    seconds = dict(cal.phase_estimates(opts))
    assert list(seconds) == [*PHASES, "runtime probe (FSDP)"]
    # 4 processes on 2 cores, each PP rank's work twice over (dp_shard 2): more than the 2-rank probe
    assert seconds["runtime probe (FSDP)"] > seconds["runtime probe (real)"]


def test_several_passes_are_each_a_phase(tmp_path: Path, fixed_host: None) -> None:
    opts = tiny_opts(tmp_path, passes=(cal.CalibrationPass(1, 1), cal.CalibrationPass(1, 2)))
    names = [name for name, _ in cal.phase_estimates(opts)]
    assert names[:2] == ["units, pass 1/2 (tp 1, microbatch size 1)", "units, pass 2/2 (tp 1, microbatch size 2)"]
    assert names[2:] == PHASES[1:]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_phase_prints_a_line_within_30_s_of_its_start_and_of_its_last_line() -> None:
    clock, lines = FakeClock(), []
    progress = PhaseProgress("runtime probe (FSDP)", 80.0, lines.append, clock=clock)
    with progress:
        clock.now += HEARTBEAT_S - 0.1
        assert progress.tick() == pytest.approx(0.1) and lines == []
        clock.now += 0.1
        progress.tick()
        assert lines == ["  runtime probe (FSDP): 30 s so far (estimate 80 s)"]
        assert progress.tick() == pytest.approx(HEARTBEAT_S)  # the next is due 30 s after this one
        clock.now += 10
        progress.log("runtime probe (FSDP): its own line")  # the phase's own lines count
        clock.now += HEARTBEAT_S - 1
        progress.tick()
        assert len(lines) == 2
        clock.now += 1
        progress.tick()
        assert lines[-1] == "  runtime probe (FSDP): 70 s so far (estimate 80 s)"
    assert lines[-1] == "  runtime probe (FSDP) done in 70 s (estimate 80 s)"


def test_the_heartbeat_thread_prints_when_a_line_is_due() -> None:
    clock, lines, seen = FakeClock(), [], threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if "so far" in line:
            seen.set()

    progress = PhaseProgress("collectives", 6.0, log, clock=clock, every=0.0)  # every tick is due
    with progress:
        assert seen.wait(60), "the heartbeat thread never printed"
    assert lines[0].startswith("  collectives: ") and lines[-1].startswith("  collectives done in ")


def test_a_phase_that_fails_prints_no_done_line() -> None:
    lines: list[str] = []
    with pytest.raises(RuntimeError), PhaseProgress("units", 1.0, lines.append, clock=FakeClock()):
        raise RuntimeError("boom")
    assert not any("done in" in ln for ln in lines)


def test_a_rank_that_does_not_write_is_silent() -> None:
    with PhaseProgress("p2p", 1.0, None, clock=FakeClock()) as progress:
        progress.log("never printed")
        assert progress.tick() > 0


def test_a_resumed_calibration_estimates_only_what_is_left(tmp_path: Path, fixed_host: None) -> None:
    names = [name for name, _ in cal.phase_estimates(tiny_opts(tmp_path), done=["units", "p2p", "runtime.real"])]
    assert names == ["collectives", "runtime probe (synthetic)"]
