"""The one collective cost model: NCCL's rules against nccl-tests' published figures and choices worked out by hand
from tuning.cc, gloo's alpha-beta against the two-node emulation measured here, measured points and link fits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim.errors import PPSimError
from ppsim.step.cluster import PRESETS, Link, load_cluster
from ppsim.step.collectives import Measured, Sample, Span, all_choices, bus_factor, fit_links, predict
from ppsim.step.kinds import CollectiveKind

AG, RS, AR, A2A, P2P = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE,
                        CollectiveKind.ALL_TO_ALL, CollectiveKind.SEND_RECV)
GiB = 1 << 30
MiB = 1 << 20
H100 = load_cluster("h100")
CHOICES = json.loads((Path(__file__).parents[1] / "data" / "nccl_choices.json").read_text(encoding="utf-8"))


def _within(value: float, low: float, high: float, tolerance: float) -> bool:
    """``value`` within ``tolerance`` (relative) of the published range [low, high]."""
    return low * (1 - tolerance) <= value <= high * (1 + tolerance)


@pytest.mark.parametrize("kind", [AG, RS])
def test_intra_node_all_gather_and_reduce_scatter_match_nccl_tests(kind: CollectiveKind) -> None:
    # nccl-tests on HGX H100 at 1 GiB, 8 GPUs: 360-370 GB/s bus bandwidth (NVIDIA/nccl-tests issues 326, 212, 290, 267)
    p = predict(kind, GiB, Span(8, 1), H100)
    assert _within(p.busbw_Bps / 1e9, 360, 370, 0.10), p
    assert (p.algorithm, p.protocol) == ("Ring", "Simple")


@pytest.mark.parametrize("nodes", [2, 4, 16])
def test_across_nodes_the_bus_bandwidth_is_the_nics_a_node_uses(nodes: int) -> None:
    # What nccl-tests reports across nodes: each ring crosses each node boundary once per step, so the bus bandwidth
    # is the sum over the NICs the node's ranks use, about 46-49 GB/s per 400 Gb/s NIC: 8 NICs, 368-392 GB/s (bounded
    # by NVLink's 370.8 in NCCL's graph). One rank per node uses one NIC. At 16 GiB, nccl-tests' usual largest size,
    # so that the ring's latency (hundreds of microseconds at 16 nodes) does not hide the bandwidth.
    size = 16 * GiB
    p = predict(AG, size, Span(8 * nodes, nodes), H100)
    assert _within(p.busbw_Bps / 1e9, 46 * 8, 49 * 8, 0.10), p
    one = predict(AG, size, Span(nodes, nodes), H100)
    assert _within(one.busbw_Bps / 1e9, 46, 49, 0.10), one
    half = predict(AG, size, Span(4 * nodes, nodes), H100)
    assert _within(half.busbw_Bps / 1e9, 46 * 4, 49 * 4, 0.10), half


def test_all_to_all_across_nodes_moves_about_one_nic_per_gpu() -> None:
    n, nodes = 128, 16
    p = predict(A2A, GiB, Span(n, nodes), H100)
    cross_per_gpu = GiB * (n - n // nodes) / n / p.seconds
    assert _within(cross_per_gpu / 1e9, 46, 49, 0.10), p
    inside = predict(A2A, GiB, Span(8, 1), H100)
    assert inside.seconds < p.seconds / 5  # NVLink, not the NICs


def test_send_recv_within_and_across_a_node() -> None:
    inside, across = predict(P2P, GiB, Span(2, 1), H100), predict(P2P, GiB, Span(2, 2), H100)
    assert inside.busbw_Bps == pytest.approx(370.8e9, rel=0.02)
    assert across.busbw_Bps == pytest.approx(50e9, rel=0.02)


def test_ring_latency_grows_with_ranks() -> None:
    times = [predict(AG, 8 * 1024, Span(r, max(1, r // 8)), H100).seconds for r in (8, 64, 512, 2048)]
    assert times == sorted(times) and times[0] < 50e-6
    assert times[-1] > 1e-3  # 2048 ranks, 8 KiB: milliseconds by NCCL's constants (2047 steps, 255 across nodes)


@pytest.mark.parametrize("case", CHOICES["cases"], ids=lambda c: f"{c['cluster']}-{c['op']}-{c['bytes']}-{c['ranks']}")
def test_nccl_choice_worked_out_by_hand(case: dict) -> None:
    p = predict(CollectiveKind(case["op"]), case["bytes"], Span(case["ranks"], case["nodes"]),
                load_cluster(case["cluster"]))
    assert (p.algorithm, p.protocol) == (case["algorithm"], case["protocol"]), case["comment"]


def test_nvls_only_where_the_cluster_has_it() -> None:
    algos = {p.algorithm for p in all_choices(AR, GiB, Span(8, 1), H100)}
    assert "NVLS" in algos
    algos = {p.algorithm for p in all_choices(AR, GiB, Span(8, 1), replace(H100, nvls=False))}
    assert "NVLS" not in algos and "NVLSTree" not in algos
    assert {p.algorithm for p in all_choices(AG, GiB, Span(16, 2), H100)} == {"Ring"}
    assert {p.algorithm for p in all_choices(AG, GiB, Span(4, 4), H100)} == {"Ring", "PAT"}


_PLACEMENTS = st.sampled_from([(2, 1), (8, 1), (4, 1), (16, 2), (8, 8), (64, 8), (256, 32), (4, 2), (2, 2)])


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(list(CollectiveKind)), nbytes=st.integers(0, 1 << 34), placement=_PLACEMENTS,
       preset=st.sampled_from(["h100", "a100", "h800", "emulated-1gbit"]))
def test_predict_is_the_fastest_choice_and_grows_with_size(kind: CollectiveKind, nbytes: int,
                                                           placement: tuple[int, int], preset: str) -> None:
    ranks, nodes = placement
    if kind is P2P:
        ranks = 2
        nodes = min(nodes, 2)
    cluster = PRESETS[preset]
    if ranks // nodes > cluster.gpus_per_node or (cluster.num_nodes or nodes) < nodes:
        return
    span = Span(ranks, nodes)
    p = predict(kind, nbytes, span, cluster)
    assert p.seconds == min(c.seconds for c in all_choices(kind, nbytes, span, cluster))
    bigger = predict(kind, 2 * nbytes + 1, span, cluster)
    assert bigger.seconds >= p.seconds
    assert p.busbw_Bps == pytest.approx(p.algbw_Bps * bus_factor(kind, ranks))


def test_sizes_in_a_row_take_longer_and_run_faster() -> None:
    sizes = [2**k for k in range(6, 34)]
    for kind in (AG, RS, AR, A2A):
        preds = [predict(kind, s, Span(16, 2), H100) for s in sizes]
        assert [p.seconds for p in preds] == sorted(p.seconds for p in preds)
        assert preds[-1].busbw_Bps > 100 * preds[0].busbw_Bps


def test_gloo_all_gather_matches_the_two_node_emulation() -> None:
    # Measured here: `scripts/cluster-local.sh start --nodes 2 --link 200mbit`, 2 nodes x 2 gloo ranks: a 16 MiB
    # all_gather took 0.549 s and an all_to_all 0.977 s. The model: 3 ring steps of 4 MiB at 25 MB/s = 0.504 s
    # (-8 %). Its all_to_all: the node's 2 ranks send 2 x 2 x 4 MiB across (0.671 s) plus one 4 MiB exchange within,
    # 0.673 s: 31 % under the measured 0.977 s (gloo's pairwise exchanges do not overlap as the model assumes), so
    # it is reported here, not asserted.
    cluster = replace(load_cluster("emulated-1gbit"), inter_node=Link(200e6 / 8, 100e-6))
    p = predict(AG, 16 * MiB, Span(4, 2), cluster)
    assert (p.algorithm, p.protocol) == ("ring", "tcp")
    assert p.seconds == pytest.approx(0.549, rel=0.15)
    assert predict(A2A, 16 * MiB, Span(4, 2), cluster).algorithm == "pairwise"


def test_gloo_all_reduce_is_two_rings_and_send_recv_is_direct() -> None:
    cluster = load_cluster("emulated-1gbit")
    ag, ar = predict(AG, 64 * MiB, Span(4, 2), cluster), predict(AR, 64 * MiB, Span(4, 2), cluster)
    assert ar.seconds == pytest.approx(2 * ag.seconds)
    p = predict(P2P, 64 * MiB, Span(2, 2), cluster)
    assert (p.algorithm, p.seconds) == ("direct", pytest.approx(100e-6 + 64 * MiB / 0.125e9))


def test_measured_points_replace_the_model_where_measured() -> None:
    samples = [Sample(AG, 4, 2, 1 * MiB, 0.05), Sample(AG, 4, 2, 3 * MiB, 0.15), Sample(AG, 4, 2, 3 * MiB, 0.17),
               Sample(AG, 4, 2, 3 * MiB, 0.13)]
    measured = Measured.from_samples(samples)
    cluster = load_cluster("emulated-1gbit")
    at = predict(AG, 2 * MiB, Span(4, 2), cluster, measured=measured)
    assert (at.algorithm, at.seconds) == ("measured", pytest.approx(0.10))
    assert predict(AG, 1024, Span(4, 2), cluster, measured=measured).seconds == pytest.approx(0.05)
    assert predict(AG, 5 * MiB, Span(4, 2), cluster, measured=measured).seconds == pytest.approx(0.25)
    assert predict(AG, 2 * MiB, Span(2, 1), cluster, measured=measured).algorithm == "ring"  # not measured there


def test_fit_links_recovers_the_links_of_the_gloo_model() -> None:
    truth = replace(load_cluster("emulated-1gbit"), intra_node=Link(3e9, 40e-6), inter_node=Link(0.1e9, 120e-6))
    samples = [Sample(kind, ranks, nodes, size, predict(kind, size, Span(ranks, nodes), truth).seconds)
               for kind in (AG, AR) for ranks, nodes in ((2, 1), (4, 2)) for size in (4096, MiB, 16 * MiB)]
    intra, inter = fit_links(samples)
    assert intra is not None and inter is not None
    assert intra.bandwidth_Bps == pytest.approx(3e9, rel=1e-6) and intra.latency_s == pytest.approx(40e-6, rel=1e-6)
    assert inter.bandwidth_Bps == pytest.approx(0.1e9, rel=1e-6)
    assert inter.latency_s == pytest.approx(120e-6, rel=1e-6)
    assert fit_links(samples[:1]) == (None, None)
    # all_to_all across nodes also spends time within the node, which the inter-node fit folds into its link
    a2a = [Sample(A2A, 4, 2, size, predict(A2A, size, Span(4, 2), truth).seconds) for size in (4096, MiB, 16 * MiB)]
    _, inter = fit_links(a2a)
    assert inter is not None and inter.bandwidth_Bps == pytest.approx(0.1e9, rel=0.02)


@pytest.mark.parametrize("args, named", [
    ((AG, 1024, (0, 1)), "ranks 0"),
    ((AG, 1024, (4, 0)), "nodes 0"),
    ((AG, 1024, (16, 3)), "16 ranks on 3 nodes"),
    ((AG, 1024, (16, 1)), "16 on a node"),
    ((AG, -1, (8, 1)), "size -1"),
    ((P2P, 1024, (4, 1)), "send_recv on 4 ranks"),
])
def test_bad_placements_are_one_line(args: tuple, named: str) -> None:
    kind, nbytes, (ranks, nodes) = args
    with pytest.raises(PPSimError) as exc:
        predict(kind, nbytes, Span(ranks, nodes), H100)
    assert named in str(exc.value) and "\n" not in str(exc.value)
