from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

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
