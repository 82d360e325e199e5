"""`simulate --torchtitan-config` of a MoE job with expert_parallel_degree > 1: EP's all-to-alls in the step and
`--json`'s `collectives` (ppsim.step.ep); a dense job's JSON without them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

pytestmark = pytest.mark.torch
runner = CliRunner()
PROFILE = Path(__file__).resolve().parents[1] / "data" / "llama3_debugmodel_s32_mem.profile.json"  # measured p2p
DEEPSEEK = ["simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel", "--training.disable_cuda_graphs",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2", "--json"]


def _simulate(*args: str) -> tuple[dict[str, Any], str]:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


@pytest.fixture(scope="module")
def deepseek_runs() -> dict[str, tuple[dict[str, Any], str]]:
    return {name: _simulate(*DEEPSEEK, "--parallelism.expert_parallel_degree", "2", "--cost-scope", "rank",
                            "--parallelism.pipeline_parallel_schedule", name) for name in ("1F1B", "DualPipeV")}


def test_the_moe_jobs_json_has_its_all_to_alls_and_dualpipev_hides_a_larger_share(deepseek_runs: Any) -> None:
    ratios = {}
    for name, (doc, err) in deepseek_runs.items():
        a2a = doc["collectives"]["all_to_all"]
        assert list(doc["collectives"]) == ["all_to_all"]  # no profile: FSDP's collectives are not timed
        assert set(a2a) == {"count", "total_s", "exposed_s"} and isinstance(a2a["count"], int)
        # the debug model: 6 layers, the first dense; 8 microbatches; a dispatch and a combine in F and in B
        assert a2a["count"] == 4 * 5 * 8
        ratios[name] = a2a["exposed_s"] / a2a["total_s"]
        ep_lines = [ln for ln in err.splitlines() if ln.startswith("EP (ep 2)")]
        assert len(ep_lines) == 1 and "stated default" in ep_lines[0], err
    assert ratios["1F1B"] == 1.0 and ratios["DualPipeV"] < 0.6


def test_the_moe_jobs_shapes_name_its_moe_layers_top_k_tokens_and_dim() -> None:
    pytest.importorskip("torchtitan")
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes, trainer_config

    value = "deepseek_v3:deepseek_v3_debugmodel"
    overrides = ("--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    shapes, degrees = job_shapes(value, read_job_settings(value, overrides))
    config = trainer_config(value)
    layers = list(config.model_spec.model.layers)
    assert shapes.moe_layers == tuple(f"layers.{i}" for i, c in enumerate(layers) if c.moe is not None)
    assert shapes.moe_layers and len(shapes.moe_layers) < len(layers)  # the debug model's first layer is dense
    assert shapes.moe_top_k == layers[-1].moe.router.top_k and shapes.dim == config.model_spec.model.dim
    assert shapes.moe_tokens == config.training.seq_len * config.parallelism.pipeline_parallel_microbatch_size
    assert degrees.ep == 2


def test_a_dense_job_has_no_all_to_all_and_without_a_profile_no_collectives_key() -> None:
    llama = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel", "--training.disable_cuda_graphs",
             "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2", "--json"]
    doc, _ = _simulate(*llama)
    assert "collectives" not in doc
    timed, err = _simulate(*llama, "--profile", str(PROFILE))
    assert list(timed["collectives"]) == ["all_gather", "reduce_scatter"], err  # FSDP's, timed by the profile
    assert timed["collectives"]["reduce_scatter"]["exposed_s"] == pytest.approx(
        timed["collectives"]["reduce_scatter"]["total_s"])


def test_ep_1_moe_job_has_no_all_to_all() -> None:
    doc, err = _simulate(*DEEPSEEK)
    assert "collectives" not in doc and "EP (ep" not in err


def test_plot_of_the_moe_job_draws_the_communication_lane(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    out = tmp_path / "dpv.svg"
    args = [a for a in DEEPSEEK if a != "--json"]
    result = runner.invoke(app, ["plot", *args[1:], "--parallelism.expert_parallel_degree", "2",
                                 "--parallelism.pipeline_parallel_schedule", "DualPipeV", "-o", str(out)])
    assert result.exit_code == 0, result.output
    svg = out.read_text()
    assert 'id="comm-exposed"' in svg and 'id="comm-hidden"' in svg  # the eager ends expose, the pairs hide
    assert sum(ln.startswith("EP (ep 2)") for ln in result.stderr.splitlines()) == 1


def test_without_the_shapes_the_moe_job_says_its_step_has_no_all_to_alls() -> None:
    doc, err = _simulate("simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel",  # dp_shard -1
                         "--training.disable_cuda_graphs", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.expert_parallel_degree", "2", "--json")
    assert "collectives" not in doc
    line = [ln for ln in err.splitlines() if ln.startswith("memory: not counted")]
    assert len(line) == 1 and "no FSDP or EP collectives" in line[0] and "data_parallel_shard_degree" in line[0]


DUALPIPEV_EP = ["--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel", "--parallelism.pipeline_parallel_degree",
                "4", "--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--training.local_batch_size", "20"]


def _colors(png: Path) -> set[tuple[int, int, int]]:
    from PIL import Image

    with Image.open(png) as im:
        return {rgb for _, rgb in im.convert("RGB").getcolors(maxcolors=1 << 20)}


def test_plot_of_the_dualpipev_ep_job_draws_the_lane_in_png_and_html(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from matplotlib.colors import to_rgb

    from ppsim.viz._data import COMM_COLORS, COMM_LABELS

    lane = {tuple(round(255 * c) for c in to_rgb(COMM_COLORS[part])) for part in ("hidden", "exposed")}
    for name in ("ep.png", "ep.html"):
        result = runner.invoke(app, ["plot", *DUALPIPEV_EP, "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == str(tmp_path / name)
    assert lane <= _colors(tmp_path / "ep.png")  # both parts drawn, at their colours
    html = (tmp_path / "ep.html").read_text()
    for word in ('"comm-lane"', '"comm-hidden"', '"comm-exposed"', COMM_LABELS["hidden"], COMM_LABELS["exposed"],
                 "all-to-all"):
        assert word in html, word
    plain = runner.invoke(app, ["plot", "--schedule", "DualPipeV", "--ranks", "4", "--mb", "10", "-o",
                                str(tmp_path / "plain.png")])
    assert plain.exit_code == 0, plain.output
    assert not lane & _colors(tmp_path / "plain.png")  # no job, no lane
