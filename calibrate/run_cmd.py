from __future__ import annotations

from ppsim.errors import PPSimError


def run_command() -> None:
    """Execute a schedule with torch's pipeline runtime (being written)."""
    raise PPSimError("ppsim run is being written")
