"""`ppsim collective` and `ppsim list --clusters`: the JSON keys, the nccl-tests-like line, one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from tests.one_line import one_line_error

runner = CliRunner()
KEYS = {"op", "ranks", "nodes", "bytes", "seconds", "algorithm", "protocol", "algorithm_bandwidth_GBps",
        "bus_bandwidth_GBps"}


def test_json_has_the_documented_keys() -> None:
    result = runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "16", "--nodes", "2", "--size",
                                 "1GiB", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert KEYS <= set(data)
    assert (data["op"], data["ranks"], data["nodes"], data["bytes"]) == ("all_gather", 16, 2, 1 << 30)
    assert 330 < data["bus_bandwidth_GBps"] < 400


def test_the_line_and_the_default_nodes() -> None:
    result = runner.invoke(app, ["collective", "--op", "all-reduce", "--ranks", "16", "--size", "64MiB"])
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "16 ranks on 2 node(s)" in result.output and "busbw" in result.output and "GB/s" in result.output


def test_gloo_backend_on_the_emulated_cluster() -> None:
    result = runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "4", "--size", "16777216",
                                 "--cluster", "emulated-1gbit", "--backend", "gloo", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["algorithm"] == "ring"


@pytest.mark.parametrize("args, named", [
    (["--op", "allgatherv", "--ranks", "8"], "--op"),
    (["--op", "all_gather", "--ranks", "0"], "--ranks 0"),
    (["--op", "all_gather", "--ranks", "16", "--nodes", "3"], "--nodes 3"),
    (["--op", "all_gather", "--ranks", "12"], "12 GPUs"),
    (["--op", "all_gather", "--ranks", "8", "--cluster", "dgx-z"], "dgx-z"),
    (["--op", "all_gather", "--ranks", "8", "--size", "lots"], "--size"),
])
def test_mistakes_are_one_line(args: list[str], named: str) -> None:
    full = ["collective", *args] + ([] if "--size" in args else ["--size", "1MiB"])
    assert named in one_line_error(runner.invoke(app, full))


def test_a_cluster_file_with_no_gpus_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("gpus_per_node = 0\nintra_node = {bandwidth_GBps = 450, latency_us = 3}\n"
                    "inter_node = {bandwidth_GBps = 50, latency_us = 5}\nnics_per_node = 8\n"
                    "device = {name = \"X\", peak_tflops = 989, memory_GiB = 80}\n", encoding="utf-8")
    line = one_line_error(runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "8", "--size", "1MiB",
                                              "--cluster", str(path)]))
    assert "gpus_per_node" in line


def test_list_clusters_table_and_json() -> None:
    result = runner.invoke(app, ["list", "--clusters"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for name in ("h100", "h800", "a100", "this-host", "emulated-1gbit", "370.8", "8 x 50"):
        assert name in result.output
    data = json.loads(runner.invoke(app, ["list", "--clusters", "--json"]).output)
    assert [d["name"] for d in data][:2] == ["h100", "h100-96gb"] and all(d["source"] for d in data)
