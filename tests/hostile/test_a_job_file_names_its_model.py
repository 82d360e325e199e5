"""Hostile inputs, sixth pass: a job file that names neither a model nor a pipeline describes nothing; it is refused
in one line (the file, the rule, the fix), never simulated as a one-rank default job."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from tests.one_line import one_line_error

runner = CliRunner()


@pytest.mark.parametrize("text", ["", "\n# nothing here\n", "[training]\nseq_len = 128\n",
                                  "[job]\ndescription = \"x\"\n", "[model]\n", "[parallelism]\n"])
def test_a_job_file_that_names_no_model_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.toml"
    path.write_text(text)
    line = one_line_error(runner.invoke(app, ["simulate", "--torchtitan-config", str(path)]))
    assert str(path) in line.replace("\n", "") and "must name its model" in line and "[model]" in line
    assert "name =" in line and "pipeline_parallel_degree" in line


def test_a_job_file_naming_its_model_or_its_pipeline_is_still_simulated(tmp_path: Path) -> None:
    named = tmp_path / "named.toml"
    named.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[parallelism]\npipeline_parallel_degree = 2\n')
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text("[parallelism]\npipeline_parallel_degree = 2\n[training]\nlocal_batch_size = 4\n")
    for path in (named, pipeline):
        result = runner.invoke(app, ["simulate", "--torchtitan-config", str(path)])
        assert result.exit_code == 0, result.output
