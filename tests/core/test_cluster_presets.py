"""The cluster description: presets with sources, the file format (TOML and JSON) and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppsim.errors import PPSimError
from ppsim.step.cluster import PRESETS, Cluster, Link, list_presets, load_cluster, parse_cluster, this_host

EXAMPLE = """
gpus_per_node = 8
intra_node = {bandwidth_GBps = 450, latency_us = 3}   # per GPU and direction
inter_node = {bandwidth_GBps = 50, latency_us = 5}    # per NIC and direction
nics_per_node = 8
device = {name = "H100 SXM", peak_tflops = 989, memory_GiB = 80}
"""


def _one_line(exc: pytest.ExceptionInfo[PPSimError]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


@pytest.mark.parametrize("name", [*PRESETS, "HGX-H100", "deepseek-h800", "Local"])
def test_every_preset_loads_by_name_or_alias_in_any_case(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.gpus_per_node >= 1 and cluster.nics_per_node >= 1
    assert len(cluster.source) > 40  # cites where the numbers come from


def test_presets_carry_the_published_numbers() -> None:
    h100 = load_cluster("h100")
    assert h100.intra_node.bandwidth_Bps == pytest.approx(370.8e9)
    assert (h100.nics_per_node, h100.inter_node.bandwidth_Bps, h100.nvls) == (8, 50e9, True)
    assert h100.device.peak_flops == 989e12 and h100.device.memory_bytes == 80 * 2**30
    assert load_cluster("h100-96gb").device.memory_bytes == 96_000_000_000
    assert load_cluster("h800").intra_node.bandwidth_Bps == 160e9
    a100 = load_cluster("a100")
    assert (a100.intra_node.bandwidth_Bps, a100.inter_node.bandwidth_Bps, a100.device.peak_flops) == (240e9, 25e9,
                                                                                                      312e12)
    emulated = load_cluster("emulated-1gbit")
    assert (emulated.backend, emulated.gpus_per_node, emulated.num_nodes) == ("gloo", 2, 2)
    assert emulated.inter_node == Link(0.125e9, 100e-6)
    assert "NCCL" in h100.source and "DeepSeek-V3" in load_cluster("h800").source
    assert [c.name for c in list_presets()] == list(PRESETS)


def test_this_host_takes_the_ranks_given() -> None:
    host = this_host(3)
    assert (host.gpus_per_node, host.backend, host.device.name) == (3, "gloo", "CPU")
    assert load_cluster("this-host").backend == "gloo"


def test_the_documented_example_parses() -> None:
    c = parse_cluster(EXAMPLE)
    assert c.intra_node == Link(450e9, 3e-6) and c.inter_node == Link(50e9, 5e-6)
    assert (c.gpus_per_node, c.nics_per_node, c.nvls, c.backend, c.num_nodes) == (8, 8, False, "nccl", None)
    assert c.device.memory_bytes == 80 * 2**30


def test_rank_order_is_read_round_trips_and_a_bad_one_is_one_line() -> None:
    c = parse_cluster(EXAMPLE + 'rank_order = "cyclic"\n')
    assert c.rank_order == "cyclic" and c.to_dict()["rank_order"] == "cyclic"
    assert parse_cluster(c.to_toml()).rank_order == "cyclic"
    assert parse_cluster(EXAMPLE).rank_order == "block" and "rank_order" not in parse_cluster(EXAMPLE).to_dict()
    with pytest.raises(PPSimError, match="rank_order 'round': must be one of block, cyclic"):
        parse_cluster(EXAMPLE + 'rank_order = "round"\n')


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_file_round_trips(tmp_path: Path, preset: str, suffix: str) -> None:
    cluster = PRESETS[preset]
    path = tmp_path / f"c{suffix}"
    path.write_text(cluster.to_toml() if suffix == ".toml" else json.dumps(cluster.to_dict()), encoding="utf-8")
    again = load_cluster(str(path))
    assert isinstance(again, Cluster)
    assert again.to_dict() == cluster.to_dict()
    assert again.intra_node.bandwidth_Bps == pytest.approx(cluster.intra_node.bandwidth_Bps)


@pytest.mark.parametrize("change, named", [
    ("gpus_per_node = 0", "gpus_per_node"),
    ("gpus_per_node = -8", "gpus_per_node"),
    ("gpus_per_node = 2.5", "gpus_per_node"),
    ("nics_per_node = 0", "nics_per_node"),
    ("intra_node = {bandwidth_GBps = 0, latency_us = 3}", "intra_node.bandwidth_GBps"),
    ("inter_node = {bandwidth_GBps = -1, latency_us = 5}", "inter_node.bandwidth_GBps"),
    ("inter_node = {bandwidth_GBps = 50, latency_us = -5}", "inter_node.latency_us"),
    ("inter_node = {bandwidth_GBps = 50}", "inter_node.latency_us"),
    ("inter_node = {bandwidth_GBps = 50, latency_us = 5, mtu = 4096}", "'inter_node.mtu'"),
    ("inter_node = 50", "inter_node"),
    ('device = {name = "X", peak_tflops = 0, memory_GiB = 80}', "device.peak_tflops"),
    ('device = {name = "X", peak_tflops = 1, memory_GiB = "lots"}', "device.memory_GiB"),
    ("nvls = 1", "nvls"),
    ('backend = "mpi"', "backend"),
    ("nodes = 0", "nodes"),
    ("colour = 3", "'colour'"),
])
def test_each_bad_field_is_one_line_naming_it(change: str, named: str) -> None:
    key = change.split(" =")[0]
    lines = [ln for ln in EXAMPLE.splitlines() if not ln.startswith(key + " ")]
    with pytest.raises(PPSimError) as exc:
        parse_cluster("\n".join([*lines, change]), where="c.toml")
    text = _one_line(exc)
    assert named in text and "c.toml" in text


@pytest.mark.parametrize("missing", ["gpus_per_node", "intra_node", "inter_node", "nics_per_node", "device"])
def test_a_missing_field_is_one_line_naming_it(missing: str) -> None:
    text = "\n".join(ln for ln in EXAMPLE.splitlines() if not ln.startswith(missing + " "))
    with pytest.raises(PPSimError) as exc:
        parse_cluster(text)
    assert missing in _one_line(exc) and "missing" in str(exc.value)


def test_an_unknown_key_names_the_known_ones() -> None:
    with pytest.raises(PPSimError) as exc:
        parse_cluster(EXAMPLE + "gpu_per_node = 8\n")
    assert "'gpu_per_node'" in _one_line(exc) and "gpus_per_node" in str(exc.value)


@pytest.mark.parametrize("suffix, text", [(".toml", "gpus_per_node = = 8\n[x"), (".json", '{"gpus_per_node": 8,'),
                                          (".json", "[1, 2]")])
def test_bad_syntax_is_one_line(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PPSimError) as exc:
        load_cluster(str(path))
    assert str(path) in _one_line(exc)


def test_an_unknown_preset_names_the_presets_and_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(PPSimError) as exc:
        load_cluster("h1000")
    assert "h100" in _one_line(exc) and "emulated-1gbit" in str(exc.value)
    with pytest.raises(PPSimError) as exc:
        load_cluster(str(tmp_path / "nowhere.toml"))
    assert "not found" in _one_line(exc)


def test_nodes_for_whole_nodes_only() -> None:
    h100 = load_cluster("h100")
    assert [h100.nodes_for(g) for g in (1, 4, 8, 16, 2048)] == [1, 1, 1, 2, 256]
    for bad in (0, 12, 20):
        with pytest.raises(PPSimError) as exc:
            h100.nodes_for(bad)
        assert str(bad) in _one_line(exc)
    with pytest.raises(PPSimError) as exc:
        load_cluster("emulated-1gbit").nodes_for(6)
    assert "has 2" in _one_line(exc)
