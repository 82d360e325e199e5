"""User-facing errors.

Every error a user can cause derives from :class:`PPSimError` (a ``ValueError``). Its message is one line that
names the bad value, the rule it breaks and a fix. The CLI turns these into exit code 2 without a traceback;
anything else escaping is a bug.
"""

from __future__ import annotations


class PPSimError(ValueError):
    """A mistake in what the user asked for or supplied (one-line message: value, rule, fix)."""


class ScheduleConfigError(PPSimError):
    """A schedule cannot be built for the requested ranks / microbatches / stages per rank."""


class ScheduleFormatError(PPSimError):
    """A schedule file or action string cannot be parsed."""


class CostError(PPSimError):
    """A cost string or profile is malformed or inconsistent."""


class DeadlockError(PPSimError):
    """An in-order execution of a schedule cannot make progress.

    ``blocked`` maps each blocked rank to ``(head action, the action it waits for)`` as strings.
    """

    def __init__(self, message: str, blocked: dict[int, tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.blocked: dict[int, tuple[str, str]] = dict(blocked or {})


class TorchtitanConfigError(PPSimError):
    """A torchtitan job config that cannot be read, or that contradicts the command line."""


class JobMemoryError(PPSimError):
    """A job whose degrees or shapes ppsim cannot count (one line)."""


class OutputPathError(PPSimError):
    """An output path cannot be written (a directory, a missing or read-only folder, a name too long)."""


class SizeError(PPSimError):
    """A size such as ``--memory-cap`` is malformed, not positive, or beyond what can be represented."""


class RankLostError(RuntimeError):
    """A worker rank died without reporting (killed, out of memory, crashed in native code): not the user's
    mistake, so not a :class:`PPSimError`, but one line naming the rank (exit 1), not a traceback."""
