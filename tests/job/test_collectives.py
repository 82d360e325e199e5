"""FSDP's collectives measured beside p2p, and the tensor-parallel degree a profile was measured at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.profile import CollectiveFit, P2PSample, Profile, load_profile

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32.profile.json"


def test_tensor_parallel_degree_and_collectives_round_trip(tmp_path: Path) -> None:
    doc = json.loads(PROFILE.read_text())
    assert load_profile(PROFILE).tensor_parallel_degree == 1 and load_profile(PROFILE).collectives == ()
    fit = CollectiveFit(op="all_gather", group_size=2, alpha_s=1e-4, beta_bytes_per_s=1e9, fit_rel_error=0.1,
                        samples=(P2PSample(bytes=4096, median_s=1e-4, p10_s=1e-4, p90_s=2e-4),))
    doc.update(tensor_parallel_degree=2, collectives=[fit.to_dict()])
    profile = Profile.from_dict(doc)
    assert profile.tensor_parallel_degree == 2 and profile.collectives == (fit,)
    assert Profile.from_dict(profile.to_dict()) == profile
    assert fit.time(10**9) == pytest.approx(1.0001)


def test_a_bad_collective_entry_is_one_line() -> None:
    from ppsim.errors import CostError

    doc = json.loads(PROFILE.read_text())
    doc["collectives"] = [{"op": "broadcast", "group_size": 2, "alpha_s": 0, "beta_bytes_per_s": 1,
                           "fit_rel_error": 0}]
    with pytest.raises(CostError, match=r"collectives\[0\].op must be one of .*all_gather.*reduce_scatter"):
        Profile.from_dict(doc)


@pytest.mark.torch
def test_a_job_at_another_tensor_parallel_degree_is_refused_with_the_profile() -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["simulate", "--profile", str(PROFILE), "--torchtitan-config",
                                 "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2",
                                 "--parallelism.tensor_parallel_degree", "2"])
    assert result.exit_code == 2, result.output
    line = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(line) == 1 and "measured at tensor_parallel_degree 1, the job runs 2" in line[0], result.output


@pytest.mark.torch
@pytest.mark.slow
def test_fsdp_all_gather_and_reduce_scatter_are_fitted_per_op() -> None:
    pytest.importorskip("torch")
    from ppsim.calibrate.measure import comm

    fits = comm.measure_local_collectives([4096, 65536, 1 << 20], group_size=2, warmup=1, reps=3)
    assert sorted(f.op for f in fits) == ["all_gather", "all_to_all", "reduce_scatter"]
    for fit in fits:
        assert fit.group_size == 2 and fit.beta_bytes_per_s > 0 and fit.alpha_s >= 0
        assert [s.bytes for s in fit.samples] == [4096, 65536, 1 << 20]
