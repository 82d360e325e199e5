"""Commands that need torch (`ppsim calibrate`, `ppsim run`): defined in ppsim.calibrate, torch imported inside."""

from __future__ import annotations

from ppsim.calibrate.commands import calibrate_command, run_command
from ppsim.cli._app import app
from ppsim.cli.common import user_errors

app.command("calibrate")(user_errors(calibrate_command))
app.command("run")(user_errors(run_command))
