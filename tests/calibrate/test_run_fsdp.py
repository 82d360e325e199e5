"""`ppsim run --dp-shard/--tp`: PP x FSDP (and PP x TP) on real gloo ranks through torchtitan's own parallelize
function, each rank's allocator-level peak measured beside :func:`ppsim.job.memory.job_memory`'s before-run prediction,
and FSDP's collectives in the predicted step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="needs the torchtitan extra")

from typer.testing import CliRunner  # noqa: E402

from ppsim.cli import app  # noqa: E402

pytestmark = pytest.mark.torch

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA_PROFILE = DATA / "llama3_debugmodel_s32_mem.profile.json"  # activation bytes as run measures them
FAST = ["--steps", "1", "--warmup", "1", "--probes", "0", "--timeout", "300"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


@pytest.mark.parametrize(("extra", "says"), [
    (["--tp", "3"], "does not divide the model's 16 heads"),
    (["--dp-shard", "0"], "must be at least 1"),
])
def test_degrees_that_cannot_run_are_one_line_before_anything_starts(extra: list[str], says: str) -> None:
    result = invoke("-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(LLAMA_PROFILE), *FAST, *extra)
    assert result.exit_code == 2
    assert says in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_fsdp_degree_with_a_builtin_model_is_refused_in_one_line() -> None:
    result = invoke("-s", "1F1B", "-r", "2", "-m", "2", "--model", "builtin:tiny", "--dp-shard", "2", *FAST)
    assert result.exit_code == 2
    assert "torchtitan model" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_pp_by_fsdp_on_four_ranks_matches_the_unsplit_model_and_its_predicted_peak(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = invoke("-s", "1F1B", "-r", "2", "-m", "2", "--dp-shard", "2", "--profile", str(LLAMA_PROFILE),
                    *FAST, "-o", str(out))
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["grad_ok"] and data["loss_match"]
    assert any("dp_shard 2" in n for n in data["notes"])
    assert any("FSDP" in n for n in data["prediction_inputs"]["notes"])  # in the step, or why not
    assert [m["rank"] for m in data["memory"]] == [0, 1]
    for m in data["memory"]:
        measured, predicted = m["peak_allocated_bytes_measured"], m["peak_allocated_bytes_predicted"]
        assert measured > m["param_bytes_measured"] + m["grad_bytes_measured"]
        assert abs(predicted - measured) <= 0.1 * measured, m
