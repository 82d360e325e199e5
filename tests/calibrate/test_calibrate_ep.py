"""Calibration with expert parallelism: EP's all-to-all measured and fitted, `calibrate --ep`, and the refusals of
a job whose EP degree is not the profile's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32_mem.profile.json"  # measured p2p, no all_to_all
MOE = "torchtitan:deepseek_v3/debugmodel"


def _error_line(result: Any) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


# --- the all-to-all ----------------------------------------------------------------------------------------------
@pytest.mark.torch
def test_all_to_all_on_two_gloo_processes_fits_a_positive_latency_and_bandwidth() -> None:
    pytest.importorskip("torch")
    from ppsim.calibrate.measure import comm

    sizes = [4096, 65536, 1 << 20]
    (fit,) = comm.measure_local_collectives(sizes, group_size=2, warmup=1, reps=5, ops=("all_to_all",))
    assert fit.op == "all_to_all" and fit.group_size == 2
    assert [s.bytes for s in fit.samples] == sizes
    assert 0 <= fit.alpha_s < 0.05 and 1e6 < fit.beta_bytes_per_s < 1e12  # loopback gloo: microseconds, GB/s
    assert all(s.median_s > 0 for s in fit.samples)
    assert fit.samples[-1].median_s > fit.samples[0].median_s  # 1 MiB takes longer than 4 KiB


@pytest.mark.torch
def test_a_backend_without_all_to_all_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ppsim.calibrate.measure import comm
    from ppsim.errors import PPSimError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ProcessGroupGloo does not support alltoall")

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_to_all_single", refuse)
        with pytest.raises(PPSimError) as caught:
            comm._collectives(1, 0, sizes=[4096], warmup=0, reps=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    line = str(caught.value)
    assert "\n" not in line and line.startswith(comm.ALL_TO_ALL_REFUSAL)
    assert "gloo backend" in line and "does not support alltoall" in line
