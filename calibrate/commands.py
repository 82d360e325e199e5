"""CLI commands that need torch (`ppsim calibrate`, `ppsim run`); torch is imported inside them, never here."""

from __future__ import annotations

from ppsim.calibrate.calibrate_cmd import calibrate_command
from ppsim.calibrate.run_cmd import run_command

__all__ = ["calibrate_command", "run_command"]
