"""The one check every refusal test makes: exit 2, exactly one ``Error:`` line, the last thing printed, no
traceback (progress lines before it are fine)."""

from __future__ import annotations

from typing import Any


def one_line_error(result: Any) -> str:
    """``result`` (a CliRunner result) refused in one line; returns the line."""
    output = result.output
    assert result.exit_code == 2, output
    errors = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert output.rstrip().endswith(errors[0]), output
    return errors[0]
