"""The one step model (ppsim/step/): each group placed on nodes as torchtitan's mesh orders ranks, one price per
collective (measured on that placement, else the cluster's model, else the p2p fit), and the passes putting them in
the step, the pipeline's hand-offs across nodes included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from one_line import one_line_error
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.costs import parse_costs
from ppsim.errors import PPSimError
from ppsim.job.degrees import Degrees
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.step.build import StepJob, build_step
from ppsim.step.cluster import Link, load_cluster
from ppsim.step.collectives import Span, predict
from ppsim.step.kinds import ALL_KINDS, CollectiveKind
from ppsim.step.placement import PlacementError, groups, place, span_of
from ppsim.step.pricing import CollectiveCosts, MeasuredCollective

runner = CliRunner()
AG, RS, A2A, P2P = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL,
                    CollectiveKind.SEND_RECV)


# --- placement ---------------------------------------------------------------------------------------------------
def test_deepseeks_layout_puts_ep_64_across_8_nodes_and_every_pipeline_hand_off_across_nodes() -> None:
    """PP 16 x EP 64 x dp_shard 128 on 2048 GPUs of 8 a node (DeepSeek-V3's): EP innermost spans 8 whole nodes, the
    experts' FSDP (efsdp 2, 64 ranks apart) two nodes, the dense FSDP all 128 ranks over 16 nodes, and PP ranks are
    128 GPUs apart, so each hand-off leaves its node."""
    p = place(Degrees(pp=16, dp_shard=128, ep=64), 8)
    assert p.nodes == 256
    assert (p.span("ep").ranks, p.span("ep").nodes) == (64, 8)
    assert (p.span("efsdp").ranks, p.span("efsdp").nodes) == (2, 2)
    assert (p.span("fsdp").ranks, p.span("fsdp").nodes) == (128, 16)
    assert all(p.pp_crosses) and len(p.pp_crosses) == 15


def test_tp_stays_in_a_node_and_fsdp_strides_over_it() -> None:
    p = place(Degrees(pp=1, tp=8, dp_shard=4), 8)
    assert (p.span("tp").ranks, p.span("tp").nodes) == (8, 1)
    assert (p.span("fsdp").ranks, p.span("fsdp").nodes) == (4, 4)  # one rank a node, 8 apart
    p = place(Degrees(pp=2, dp_shard=2), 2)  # 2 nodes of 2: FSDP within a node, PP across
    assert p.span("fsdp").nodes == 1 and p.pp_crosses == (True,)


def test_ranks_dealt_round_the_nodes_put_fsdp_across_and_pp_within() -> None:
    # one torchrun a rank, --node-rank 0 and 2 on node 0 (or Slurm's --distribution=cyclic): ranks 0, 2 share a node
    p = place(Degrees(pp=2, dp_shard=2), 2, rank_order="cyclic")
    assert p.span("fsdp").nodes == 2 and p.pp_crosses == (False,)
    p = place(Degrees(pp=1, tp=8, dp_shard=4), 8, rank_order="cyclic")  # 4 nodes: TP over all 4, FSDP (8 apart) on one
    assert (p.span("tp").nodes, p.span("fsdp").nodes) == (4, 1)
    one = place(Degrees(pp=2, dp_shard=2), 4, rank_order="cyclic")  # within one node the order changes nothing
    assert one.to_dict() == place(Degrees(pp=2, dp_shard=2), 4).to_dict()


def test_gpus_that_do_not_fill_whole_nodes_are_refused_in_one_line() -> None:
    with pytest.raises(PlacementError, match="12 GPUs .* do not fill whole nodes of 8"):
        place(Degrees(pp=3, dp_shard=4), 8)
    assert place(Degrees(pp=1, dp_shard=4), 8).nodes == 1  # a job within one node


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 4), st.integers(0, 2), st.integers(0, 3))
def test_every_group_spans_whole_nodes_evenly_and_no_more_than_the_job_has(pp: int, tp: int, dp: int, rep: int,
                                                                           node: int) -> None:
    degrees = Degrees(pp=2**pp, tp=2**tp, dp_shard=2**dp, dp_replicate=2**rep)
    per_node = 2**node
    p = place(degrees, per_node)
    for name, group in groups(degrees).items():
        span = p.span(name)
        assert span.ranks == group.size and span.ranks % span.nodes == 0
        assert 1 <= span.nodes <= p.nodes and span.ranks // span.nodes <= per_node
    assert span_of(groups(degrees)["tp"], per_node).nodes == max(1, degrees.tp // per_node)


# --- one price ---------------------------------------------------------------------------------------------------
def _measured(op: str, ranks: int, nodes: int, seconds: float) -> MeasuredCollective:
    return MeasuredCollective(op, ranks, ((1, seconds), (1 << 30, seconds)), 1e30, nodes=nodes)


def test_a_measured_placement_beats_the_model_and_another_placement_does_not() -> None:
    h100 = load_cluster("h100")
    costs = CollectiveCosts(measured=(_measured("all_gather", 16, 2, 0.5),), cluster=h100)
    assert costs.seconds(AG, 1 << 20, group_size=16, nodes=2) == 0.5  # measured on this placement
    model = predict(AG, 1 << 20, Span(16, 4), h100).seconds
    assert costs.seconds(AG, 1 << 20, group_size=16, nodes=4) == pytest.approx(model)  # not measured: the model
    assert "measured on 16 ranks" in costs.source(AG, 16, 2) and "nccl model" in costs.source(AG, 16, 4)


def test_a_profile_measured_on_this_gloo_host_lends_the_model_its_links_and_another_clusters_does_not() -> None:
    host = load_cluster("this-host")
    mine = CollectiveCosts(p2p_alpha_s=1e-3, p2p_bytes_per_s=1e8, cluster=host)  # a profile from before clusters
    assert mine.model_cluster().intra_node == Link(bandwidth_Bps=1e8, latency_s=1e-3)
    theirs = dataclasses.replace(mine, cluster=load_cluster("h100"), measured_on="this-host")
    assert theirs.model_cluster() == load_cluster("h100")
    warning = theirs.mismatch()
    assert warning is not None and "'this-host'" in warning and "'h100'" in warning


def test_without_a_cluster_every_kind_has_a_p2p_price_and_the_rings_rule_holds() -> None:
    costs = CollectiveCosts(p2p_alpha_s=1e-3, p2p_bytes_per_s=1e6)
    n = 4_000_000
    assert costs.seconds(AG, n, group_size=4) == pytest.approx(3 * (1e-3 + n / 4 / 1e6))
    assert costs.seconds(CollectiveKind.ALL_REDUCE, n, group_size=4) == pytest.approx(2 * 3 * (1e-3 + n / 4 / 1e6))
    assert costs.seconds(P2P, n, group_size=2) == pytest.approx(1e-3 + n / 1e6)
    assert all(costs.seconds(k, n, group_size=1) == 0.0 for k in ALL_KINDS)


# --- the passes --------------------------------------------------------------------------------------------------
def _shapes(layers: int = 4) -> JobShapes:
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (1000, 1000)),), saved_bytes=0) for i in range(layers)}
    for name in ("tok_embeddings", "norm", "lm_head"):
        blocks[name] = BlockShapes("head", (("w", (1000,)),), saved_bytes=0)
    return JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=64 << 20, dim=1000)


MODULES = (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "lm_head"))


def _step(per_node: int, *, dp_shard: int = 2) -> tuple[object, float]:
    schedule = get_schedule("1F1B", 2, 4)
    costs = parse_costs("F=0.01,B=0.02")
    degrees = Degrees(pp=2, dp_shard=dp_shard)
    cluster = dataclasses.replace(load_cluster("emulated-1gbit"), gpus_per_node=per_node)
    job = StepJob(shapes=_shapes(), stage_modules=MODULES, degrees=degrees, costs=CollectiveCosts(cluster=cluster),
                  placement=place(degrees, per_node), activation_bytes=_shapes().boundary_bytes)
    step = build_step(schedule, costs, job)
    result = step.simulate(lambda extra: simulate(step.schedule, step.costs or costs, extra_s=extra))
    return result, result.makespan


def test_hand_offs_across_nodes_wait_for_the_network_and_are_counted_with_their_placement() -> None:
    """PP 2 x FSDP 2 on nodes of 2 (PP across the shaped link) against nodes of 4 (all on one host): the same
    collectives, but each microbatch's 64 MiB hand-off crosses the 1 Gbit/s link, about 0.54 s each way: at least
    the first forward's and the last backward's are on the step's critical path."""
    across, t_across = _step(2)
    within, t_within = _step(4)
    assert t_across > t_within + 2 * 0.5
    doc = json.loads(json.dumps(across.to_dict()))["collectives"]
    assert doc["send_recv"]["count"] == 2 * 4 and doc["send_recv"]["placement"][0]["nodes"] == 2
    assert doc["all_gather"]["placement"][0] == {"group": "fsdp", "ranks": 2, "nodes": 1, "ranks_per_node": 2,
                                                 "algorithm": doc["all_gather"]["placement"][0]["algorithm"],
                                                 "count": 6}  # 3 units a stage
    assert "send_recv" not in json.loads(json.dumps(within.to_dict()))["collectives"]


def test_fsdp_across_nodes_costs_more_than_within_one() -> None:
    _, t_in = _step(4, dp_shard=2)  # pp 2 x dp 2 on one node of 4
    schedule = get_schedule("1F1B", 2, 4)
    degrees = Degrees(pp=2, dp_shard=2)
    cluster = dataclasses.replace(load_cluster("emulated-1gbit"), gpus_per_node=1)  # every rank its own node
    job = StepJob(shapes=_shapes(), stage_modules=MODULES, degrees=degrees, costs=CollectiveCosts(cluster=cluster),
                  placement=place(degrees, 1))
    step = build_step(schedule, parse_costs("F=0.01,B=0.02"), job)
    t_out = step.simulate(lambda extra: simulate(step.schedule, step.costs, extra_s=extra)).makespan
    assert job.span("fsdp").nodes == 2 and t_out > t_in


# --- the command line --------------------------------------------------------------------------------------------
def test_simulate_refuses_an_unknown_cluster_and_a_bad_file_in_one_line(tmp_path: Path) -> None:
    line = one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--cluster", "h1000"]))
    assert "h1000" in line and "h100" in line  # names the presets
    bad = tmp_path / "c.toml"
    bad.write_text("gpus_per_node = 0\n")
    line = one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--cluster", str(bad)]))
    assert "gpus_per_node" in line


@pytest.mark.torch
def test_a_job_that_does_not_fill_whole_nodes_is_refused_in_one_line() -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel",
                                 "--parallelism.pipeline_parallel_degree", "3",
                                 "--parallelism.data_parallel_shard_degree", "4", "--cluster", "h100"])
    line = one_line_error(result)
    assert "12 GPUs" in line and "whole nodes of 8" in line


def test_a_bad_cluster_on_run_is_refused_before_anything_starts() -> None:
    line = one_line_error(runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic",
                                              "--cluster", "nowhere"]))
    assert "nowhere" in line


def test_placement_errors_are_user_errors() -> None:
    assert issubclass(PlacementError, PPSimError)
