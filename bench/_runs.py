"""What the benches that start real `ppsim` processes share: run a command (echoed), calibrate a profile once."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def sh(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (printed first, as a shell line), its output captured."""
    print("$ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def calibrated(path: Path, model: str, *options: str) -> Path:
    """``path``, calibrated once before any run (``ppsim calibrate --model MODEL OPTIONS -o PATH``; kept)."""
    if not path.exists():
        done = sh(["ppsim", "calibrate", "--model", model, *options, "-o", str(path)])
        if done.returncode != 0:
            sys.exit(f"calibration of {model} failed: {done.stderr.strip().splitlines()[-1:]}")
    return path
