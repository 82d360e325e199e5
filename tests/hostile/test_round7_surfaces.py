"""Round 7's new surfaces tried as a hostile user would (issue 41 item 7): ``--cluster`` files and presets,
``ppsim collective``, ``ppsim list --clusters``, ``calibrate --collectives --max-size``, ``simulate --allocator`` and
``run --cluster``. Every mistake is one line, exit 2; a huge value never hangs or overflows."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from tests.one_line import one_line_error

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
GOOD: dict[str, Any] = {"gpus_per_node": 8, "intra_node": {"bandwidth_GBps": 450, "latency_us": 3},
                        "inter_node": {"bandwidth_GBps": 50, "latency_us": 5}, "nics_per_node": 8,
                        "device": {"name": "X", "peak_tflops": 989, "memory_GiB": 80}}
COLLECTIVE = ["collective", "--op", "all_gather", "--ranks", "16", "--size", "1MiB", "--json"]


def _file(tmp_path: Path, doc: Any, name: str = "c.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return str(path)


def _with(table: str | None, key: str, value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(GOOD))
    (doc if table is None else doc[table])[key] = value
    return doc


# --- --cluster files --------------------------------------------------------------------------------------------
def test_collective_cluster_empty_string_is_refused_not_the_default() -> None:
    """``--cluster ''`` used to price on h100 silently (``cluster or "h100"``)."""
    assert "--cluster ''" in one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", ""]))


def test_a_cluster_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """A binary file used to end in a UnicodeDecodeError traceback."""
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xff\xfe\x00gpus_per_node = 8")
    assert "not UTF-8" in one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", str(path)]))


@pytest.mark.parametrize("table, key, value", [
    (None, "gpus_per_node", 10**400), (None, "nics_per_node", 10**30), (None, "nodes", 10**7),
    ("intra_node", "bandwidth_GBps", 10**400), ("intra_node", "bandwidth_GBps", 1e-300),
    ("inter_node", "bandwidth_GBps", 1e300), ("inter_node", "latency_us", 1e300), ("intra_node", "latency_us", 10**400),
    ("device", "peak_tflops", 10**400), ("device", "memory_GiB", 1e300), ("device", "memory_GiB", 1e-300),
])
def test_huge_or_tiny_cluster_values_are_one_line(tmp_path: Path, table: str | None, key: str, value: Any) -> None:
    """Values beyond any cluster: an OverflowError traceback (10**400, memory 1e300 GiB) or a time of 1e290 us
    printed without a word (1e-300 GB/s) before; now one line naming the key and the range."""
    line = one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", _file(tmp_path, _with(table, key, value))]))
    assert key in line and "digits" not in line.split(";")[-1]


@pytest.mark.parametrize("table, key, value", [
    (None, "gpus_per_node", 0), (None, "gpus_per_node", True), (None, "gpus_per_node", "8"),
    (None, "nics_per_node", -1), (None, "nodes", 1.5), ("intra_node", "bandwidth_GBps", 0),
    ("inter_node", "bandwidth_GBps", "fast"), ("inter_node", "latency_us", -1), ("device", "peak_tflops", False),
    ("device", "memory_GiB", -80), (None, "backend", "mpi"), (None, "nvls", "yes"), (None, "name", ""),
    (None, "colour", "red"),
])
def test_bad_cluster_values_stay_one_line(tmp_path: Path, table: str | None, key: str, value: Any) -> None:
    line = one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", _file(tmp_path, _with(table, key, value))]))
    assert key in line


@pytest.mark.parametrize("text, named", [("gpus_per_node = = 8", "not valid TOML"), ("", "gpus_per_node"),
                                         ("[device]\nname = 1", "gpus_per_node is missing")])
def test_bad_toml_is_one_line(tmp_path: Path, text: str, named: str) -> None:
    assert named in one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", _file(tmp_path, text, "c.toml")]))


def test_directories_and_missing_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "d.toml").mkdir()
    for value in (str(tmp_path), str(tmp_path / "d.toml"), str(tmp_path / "none.json")):
        assert repr(value) in one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", value]))


def test_a_cluster_of_fewer_nodes_than_the_collective_needs_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(runner.invoke(app, [*COLLECTIVE, "--cluster", _file(tmp_path, _with(None, "nodes", 1))]))
    assert "2 nodes" in line and "has 1" in line


# --- ppsim collective --------------------------------------------------------------------------------------------
def test_ranks_beyond_any_cluster_are_one_line_not_an_overflow() -> None:
    """``--ranks 10**400`` ended in an OverflowError traceback."""
    for backend in ("nccl", "gloo"):
        line = one_line_error(runner.invoke(app, ["collective", "--op", "all_reduce", "--ranks", str(10**400),
                                                  "--size", "1e18", "--backend", backend]))
        assert "401 digits" in line and "1,000,000,000" in line


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_billion_ranks_and_8_eib_are_finite(op: str, backend: str) -> None:
    result = runner.invoke(app, ["collective", "--op", op, "--ranks", str(10**9), "--size", str((1 << 63) - 1),
                                 "--backend", backend, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert all(math.isfinite(data[k]) for k in ("seconds", "algorithm_bandwidth_GBps", "bus_bandwidth_GBps"))
    assert data["seconds"] > 0


def test_gloo_all_to_all_on_a_node_of_many_ranks_does_not_hang(tmp_path: Path) -> None:
    """A gloo all_to_all with a million ranks a node summed a million binomial terms of million-digit integers
    (minutes); now one closed form."""
    doc = {**_with(None, "gpus_per_node", 1_000_000), "backend": "gloo", "nics_per_node": 1}
    started = time.monotonic()
    result = runner.invoke(app, ["collective", "--op", "all_to_all", "--ranks", "2000000", "--nodes", "2", "--size",
                                 "1GiB", "--cluster", _file(tmp_path, doc), "--json"])
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 5 and math.isfinite(json.loads(result.output)["seconds"])


def test_the_serial_pairs_closed_form_equals_the_sum() -> None:
    from ppsim.step.collectives import _serial_pairs_load

    for k in (1, 2, 3, 8, 17, 64, 999, 1000, 1001, 5000):
        exact = 2 * sum(math.comb(k, j) * max(j, k - j) for j in range(k + 1)) / 2**k
        assert _serial_pairs_load(k) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("args, named", [
    (["--op", "ALL_GATHER", "--ranks", "8"], None), (["--op", "AllReduce", "--ranks", "8"], None),
    (["--op", "broadcast", "--ranks", "8"], "--op"), (["--op", "", "--ranks", "8"], "--op"),
    (["--op", "all_gather", "--ranks", "-1"], "--ranks -1"), (["--op", "all_gather", "--ranks", "1"], None),
    (["--op", "all_gather", "--ranks", "2", "--nodes", "4"], "--nodes 4"),
    (["--op", "all_gather", "--ranks", "8", "--nodes", "0"], "--nodes 0"),
    (["--op", "all_gather", "--ranks", "32", "--nodes", "2"], "16 on a node"),
    (["--op", "send_recv", "--ranks", "4"], "send_recv on 4"),
    (["--op", "all_gather", "--ranks", "8", "--size", "0"], "--size '0'"),
    (["--op", "all_gather", "--ranks", "8", "--size", "-1"], "--size '-1'"),
    (["--op", "all_gather", "--ranks", "8", "--size", "1e30"], "8 EiB"),
    (["--op", "all_gather", "--ranks", "8", "--size", "abc"], "--size 'abc'"),
    (["--op", "all_gather", "--ranks", "8", "--size", "1 GiB"], None),
    (["--op", "all_reduce", "--ranks", "8", "--backend", "gloo"], None),
    (["--op", "all_reduce", "--ranks", "2", "--cluster", "this-host", "--backend", "NCCL"], None),
])
def test_collective_edges(args: list[str], named: str | None) -> None:
    full = ["collective", *args] + ([] if "--size" in args else ["--size", "1MiB"])
    result = runner.invoke(app, [*full, "--json"])
    if named is not None:
        assert named in one_line_error(result)
        return
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    keys = {"op", "ranks", "nodes", "bytes", "seconds", "algorithm", "protocol", "algorithm_bandwidth_GBps",
            "bus_bandwidth_GBps"}
    assert set(data) == keys | {"cluster", "backend"}  # the contract's keys plus the documented extras
    assert all(math.isfinite(data[k]) and data[k] >= 0 for k in ("seconds", "bus_bandwidth_GBps"))


def _profile_with_collectives(tmp_path: Path, cluster: str) -> Path:
    from ppsim.profile import CollectiveFit, P2PSample

    doc = json.loads((DATA / "llama3_debugmodel_s32.profile.json").read_text())
    samples = tuple(P2PSample(bytes=b, median_s=t, p10_s=t, p90_s=t) for b, t in ((1 << 20, 1e-3), (1 << 24, 1e-2)))
    fit = CollectiveFit(op="all_gather", group_size=8, nodes=1, alpha_s=1e-4, beta_bytes_per_s=1e9,
                        fit_rel_error=0.0, samples=samples)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**doc, "collectives": [fit.to_dict()], "cluster": cluster}))
    return path


def test_collective_takes_the_contracts_profile(tmp_path: Path) -> None:
    """The contract lists ``ppsim collective ... [--profile P]``; the command had no such option."""
    path = _profile_with_collectives(tmp_path, "h100")
    result = runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "8", "--size", "1MiB", "--profile",
                                 str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["algorithm"], data["seconds"]) == ("measured", pytest.approx(1e-3))
    unmeasured = runner.invoke(app, ["collective", "--op", "all_reduce", "--ranks", "8", "--size", "1MiB",
                                     "--profile", str(path), "--json"])
    assert unmeasured.exit_code == 0 and json.loads(unmeasured.output)["algorithm"] != "measured"


def test_a_profile_of_another_cluster_is_a_warning_naming_both(tmp_path: Path) -> None:
    path = _profile_with_collectives(tmp_path, "a100")
    result = runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "8", "--size", "1MiB", "--profile",
                                 str(path), "--cluster", "h100"])
    assert result.exit_code == 0, result.output
    warning = [ln for ln in result.output.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "'a100'" in warning[0] and "'h100'" in warning[0]


def test_collective_profile_mistakes_are_one_line(tmp_path: Path) -> None:
    for value in (str(tmp_path / "none.json"), str(tmp_path)):
        one_line_error(runner.invoke(app, ["collective", "--op", "all_gather", "--ranks", "8", "--size", "1MiB",
                                           "--profile", value]))


# --- ppsim list --------------------------------------------------------------------------------------------------
def test_list_clusters_and_list_itself() -> None:
    from ppsim.step.cluster import PRESETS

    result = runner.invoke(app, ["list", "--clusters", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == list(PRESETS) and all(len(r["source"]) > 40 for r in rows)
    table = runner.invoke(app, ["list", "--clusters"])
    assert table.exit_code == 0 and "h100" in table.output
    plain = runner.invoke(app, ["list", "--json"])
    assert plain.exit_code == 0 and "1F1B" in {s["name"] for s in json.loads(plain.output)}


# --- --cluster beside a schedule alone, --allocator, run --cluster ------------------------------------------------
@pytest.mark.parametrize("command", ["simulate", "plot", "report"])
def test_cluster_with_a_schedule_alone_says_it_is_not_used(command: str, tmp_path: Path) -> None:
    """Accepted (docs/cli.md), but no longer dropped silently: a stderr note says the placement is not used."""
    out = [] if command == "simulate" else ["-o", str(tmp_path / ("x.html" if command == "report" else "x.png"))]
    result = runner.invoke(app, [command, "-s", "1F1B", "-r", "4", "-m", "8", "--cluster", "h100", *out])
    assert result.exit_code == 0, result.output
    assert "--cluster h100" in result.output and "not used" in result.output


def test_a_bad_cluster_beside_a_schedule_alone_is_still_refused() -> None:
    for value in ("", "nope"):
        one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--cluster", value]))


def test_allocator_without_a_job_is_refused_and_any_case_is_taken() -> None:
    """``--allocator`` beside a schedule alone was dropped silently."""
    line = one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--allocator",
                                              "default"]))
    assert "--allocator default" in line and "--torchtitan-config" in line
    from ppsim.cli.job_memory import check_allocator

    assert check_allocator("EXPANDABLE") == "expandable"
    assert "--allocator foo" in one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8",
                                                                   "--allocator", "foo"]))


@pytest.mark.parametrize("backend, cluster", [("gloo", "h100"), ("nccl", "this-host")])
def test_run_refuses_a_cluster_of_another_backend(backend: str, cluster: str) -> None:
    """The before-run prediction priced the cluster's backend's collectives for a run on the other one."""
    line = one_line_error(runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic",
                                              "--backend", backend, "--cluster", cluster]))
    assert f"--cluster {cluster}" in line and f"--backend is {backend}" in line


# --- calibrate --collectives -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, named", [
    (["--collectives", "--max-size", "0"], "--max-size '0'"), (["--collectives", "--max-size", "1"], "4 bytes"),
    (["--collectives", "--max-size", "1e18"], "more than this host's"),
    (["--collectives", "--max-size", "1e30"], "8 EiB"), (["--max-size", "1MiB"], "only with --collectives"),
])
def test_calibrate_collectives_max_size(tmp_path: Path, args: list[str], named: str) -> None:
    """``--max-size 1e18`` used to start two processes and run for ever towards an allocation of an exabyte."""
    out = tmp_path / "c.json"
    assert named in one_line_error(runner.invoke(app, ["calibrate", *args, "-o", str(out)]))
    assert not out.exists()


def test_calibrate_collectives_output_mistakes_keep_what_was_there(tmp_path: Path) -> None:
    assert "is a directory" in one_line_error(runner.invoke(app, ["calibrate", "--collectives", "-o",
                                                                  str(tmp_path)]))
    other = tmp_path / "other.json"
    other.write_text("{\"not\": \"a profile\"}")
    one_line_error(runner.invoke(app, ["calibrate", "--collectives", "--max-size", "1e18", "-o", str(other)]))
    assert other.read_text() == "{\"not\": \"a profile\"}"


# --- a job on a cluster ------------------------------------------------------------------------------------------
@pytest.mark.torch
def test_a_job_on_a_cluster_of_too_few_nodes_and_without_a_profile(tmp_path: Path) -> None:
    """A file's ``nodes`` was never checked against the job (8 GPUs ran on a 1-node cluster of 4), and a job with
    ``--cluster`` but no ``--profile`` was told "no --cluster was given"."""
    pytest.importorskip("torchtitan.models")
    job = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree",
           "2", "--parallelism.data_parallel_shard_degree", "4"]
    small = _file(tmp_path, {**_with(None, "gpus_per_node", 4), "nodes": 1})
    line = one_line_error(runner.invoke(app, [*job, "--cluster", small]))
    assert "8 GPUs need 2 nodes" in line and "has 1" in line
    result = runner.invoke(app, [*job, "--cluster", "h100"])
    assert result.exit_code == 0, result.output
    assert "no --cluster was given" not in result.output
    assert "--cluster prices them in seconds" in result.output and "--profile" in result.output
