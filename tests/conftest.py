from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The team's shared folder (../shared beside the checkout), as CI lays it out."""
    path = Path(os.environ.get("PPSIM_SHARED", REPO.parent / "shared"))
    if not (path / "reference").is_dir():
        pytest.skip(f"shared reference folder not found at {path}")
    return path


@pytest.fixture(scope="session")
def reference_dir(shared_dir: Path) -> Path:
    return shared_dir / "reference"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import sys

    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
