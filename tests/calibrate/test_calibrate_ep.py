"""Calibration with expert parallelism: EP's all-to-all measured and fitted, `calibrate --ep`, and the refusals of
a job whose EP degree is not the profile's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from one_line import one_line_error
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32_mem.profile.json"  # measured p2p, no all_to_all
MOE = "torchtitan:deepseek_v3/debugmodel"


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
    assert all(0 < s.p10_s <= s.median_s <= s.p90_s for s in fit.samples)
    # no timing comparison between sizes: with 5 repetitions on a shared 2-core host one stalled 4 KiB exchange
    # (2.5 ms median, 0.14 ms p10) outlasted the 1 MiB one (CI on torch 2.15, 2026-11-27)


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


# --- refusals: one line, exit 2, nothing started ------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize(("args", "says"), [
    (["--model", "torchtitan:llama3/debugmodel", "--ep", "2"], "a dense model has no routed experts"),
    (["--model", MOE, "--ep", "3"], "--ep 3: does not divide the 8 routed experts"),
    (["--model", MOE, "--ep", "2", "--tp", "2"], "one sharding at a time"),
    (["--model", MOE, "--ep", "0"], "--ep 0: must be at least 1"),
])
def test_calibrate_ep_that_cannot_be_measured_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    pytest.importorskip("torchtitan.models")
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", *args, "--seq-len", "32", "-o", str(out)])
    assert says in one_line_error(result)
    assert not out.exists() and not list(tmp_path.iterdir())


def _profile_at_ep(tmp_path: Path, ep: int) -> Path:
    doc = json.loads(PROFILE.read_text())
    doc["expert_parallel_degree"] = ep
    path = tmp_path / f"ep{ep}.profile.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_profiles_expert_parallel_degree_round_trips_and_is_1_when_absent(tmp_path: Path) -> None:
    from ppsim.profile import load_profile

    assert load_profile(PROFILE).expert_parallel_degree == 1
    profile = load_profile(_profile_at_ep(tmp_path, 2))
    assert profile.expert_parallel_degree == 2 and profile.to_dict()["expert_parallel_degree"] == 2
    assert "expert_parallel_degree" not in load_profile(PROFILE).to_dict()


@pytest.mark.torch
def test_simulate_a_job_at_another_ep_degree_than_the_profiles_names_the_profiles(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["simulate", "--profile", str(_profile_at_ep(tmp_path, 2)), "--torchtitan-config",
                                 "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2"])
    assert "measured at expert_parallel_degree 2, the job runs 1" in one_line_error(result)


@pytest.mark.torch
def test_run_ep_with_a_profile_at_another_degree_names_the_profiles_before_anything_starts() -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--model", MOE, "--seq-len", "32",
                                 "--dp-shard", "2", "--ep", "2", "--profile", str(PROFILE)])
    assert "measured at expert_parallel_degree 1, the job runs 2" in one_line_error(result)


# --- calibrate --ep 2 on the debug flavor, and simulate with its profile ------------------------------------------
@pytest.fixture(scope="module")
def ep_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torchtitan.models")
    out = tmp_path_factory.mktemp("ep") / "ep2.profile.json"
    result = runner.invoke(app, ["calibrate", "--model", MOE, "--seq-len", "32", "--mb-size", "1", "--reps", "2",
                                 "--warmup", "1", "--ep", "2", "--no-probe", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.torch
@pytest.mark.slow
def test_calibrate_ep_2_records_the_degree_and_the_moe_layers_costs(ep_profile: Path) -> None:
    from ppsim.profile import load_profile

    profile = load_profile(ep_profile)
    assert profile.expert_parallel_degree == 2
    assert profile.blocks is not None
    moe = profile.blocks["layer.moe"]
    for op in ("F", "B", "I", "W", "FB"):
        stat = getattr(moe, op)
        assert stat is not None and stat.median > 0
    assert any("expert_parallel_degree 2" in n for n in profile.notes)
    (a2a,) = [c for c in profile.collectives if c.op == "all_to_all"]
    assert a2a.group_size == 2 and a2a.beta_bytes_per_s > 0 and a2a.alpha_s >= 0


@pytest.mark.torch
@pytest.mark.slow
def test_simulate_with_the_ep_profile_costs_its_all_to_alls_from_the_measured_fit(ep_profile: Path) -> None:
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes
    from ppsim.profile import load_profile
    from ppsim.step.ep import all_to_all_bytes, all_to_all_seconds
    from ppsim.step.pricing import CollectiveCosts

    args = ["simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel", "--training.disable_cuda_graphs",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
            "--training.seq_len", "32", "--profile", str(ep_profile), "--json"]
    result = runner.invoke(app, [*args, "--parallelism.expert_parallel_degree", "2"])
    assert result.exit_code == 0, result.output
    a2a = json.loads(result.stdout)["collectives"]["all_to_all"]
    ep_lines = [ln for ln in result.stderr.splitlines() if ln.startswith("EP (ep 2)")]
    assert len(ep_lines) == 1 and "all-to-all measured on 2 ranks" in ep_lines[0], result.stderr
    assert "measured at this degree" in ep_lines[0]
    # each is one all-to-all of one microbatch's buffer over 2 ranks, costed by ppsim.step.ep from the profile's fit
    value = "deepseek_v3:deepseek_v3_debugmodel"
    overrides = ("--training.disable_cuda_graphs", "--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2", "--training.seq_len", "32",
                 "--parallelism.expert_parallel_degree", "2")
    shapes, _ = job_shapes(value, read_job_settings(value, overrides))
    costs = CollectiveCosts.from_profile(load_profile(ep_profile))
    each = all_to_all_seconds(all_to_all_bytes(shapes), ep=2, costs=costs)
    assert each is not None and each > 0
    assert a2a["count"] == 4 * 5 * 8  # 5 MoE layers, 8 microbatches, a dispatch and a combine in F and in B
    assert a2a["total_s"] == pytest.approx(a2a["count"] * each)
    assert a2a["exposed_s"] == pytest.approx(a2a["total_s"])  # 1F1B: eager actions wait for all of them
    refused = runner.invoke(app, args)  # the job at EP 1: the profile's degree named
    assert "measured at expert_parallel_degree 2, the job runs 1" in one_line_error(refused)
