"""ppsim: generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.

The core package is plain Python (no torch, no matplotlib at import time).
"""

from __future__ import annotations

from ppsim.costs import CostModel, load_costs, parse_costs
from ppsim.errors import DeadlockError, PPSimError, ScheduleConfigError, ScheduleFormatError
from ppsim.ir import Action, ActionType, Schedule, parse_action
from ppsim.schedules.loading import load_schedule
from ppsim.result import RankStats, SimResult
from ppsim.schedules import all_specs, get_schedule, get_spec
from ppsim.simulate import simulate

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionType",
    "DeadlockError",
    "PPSimError",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleFormatError",
    "all_specs",
    "get_schedule",
    "get_spec",
    "load_schedule",
    "parse_action",
    "__version__",
    "CostModel",
    "RankStats",
    "SimResult",
    "load_costs",
    "parse_costs",
    "simulate",
]

