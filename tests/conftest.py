from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# the job cache (ppsim/job/cache.py) is off unless a test turns it on: tests that take torchtitan away, or count what
# a command imports, must see the command read the job afresh
os.environ["PPSIM_CACHE_DIR"] = "off"

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The reference orders recorded from DeepSeek's DualPipe and torch (tests/data, see its README.md)."""
    return DATA


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
