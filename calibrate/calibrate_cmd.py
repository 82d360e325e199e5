from __future__ import annotations

from ppsim.errors import PPSimError


def calibrate_command() -> None:
    """Measure per-stage costs on real hardware (being written)."""
    raise PPSimError("ppsim calibrate is being written")
