"""`ppsim plan` without a profile charges TP and FSDP their communication (unit costs at stated link speeds), and
candidates timed in seconds and in unit costs are never ranked in one list or drawn on one axis (ppsim.plan,
ppsim.cli.plan, ppsim.viz.plan_page)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from job.test_plan import FREE_LINKS, _build, _request, _settings, _shapes_for, _unit_timer
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import PPSimError
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.plan import (
    NVLINK_BYTES_PER_S,
    Judge,
    ModelFacts,
    PlanRequest,
    ProfileCover,
    UnitRates,
    candidates,
    global_batch,
    layer_flops_per_token,
    unit_costs,
)
from ppsim.plan_search import plan

runner = CliRunner()
DIM = 4096
LAYER_PARAMS = 12 * DIM * DIM  # attention 4 x dim^2 and a feed-forward of 8 x dim^2: an 8B-like layer


def _big_shapes(tp: int, mb_size: int, ac: str) -> JobShapes:
    """A 6-layer model with an 8B-like layer (dim 4096), TP-local as torchtitan shards it."""
    layer = BlockShapes("layer", (("w", (LAYER_PARAMS // tp,)),), saved_bytes=10 * mb_size)
    blocks = {f"layers.{i}": layer for i in range(6)}
    blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (1000 * DIM // tp,)),), saved_bytes=mb_size)
    blocks["norm"] = BlockShapes("head", (("w", (DIM,)),), saved_bytes=0)
    blocks["lm_head"] = BlockShapes("head", (("w", (1000 * DIM // tp,)),), saved_bytes=mb_size)
    return JobShapes(source="toy", blocks=blocks, tp=tp, boundary_bytes=2 * DIM * mb_size, dim=DIM)


def _tp_request(**kw: Any) -> PlanRequest:
    """8 GPUs on one node, no data parallelism (dp_shard pinned to 1): pp x tp = 8 (pp 1 x tp 8, pp 2 x tp 4, pp 4 x
    tp 2; 6 layers leave no pp 8)."""
    base: dict[str, Any] = dict(settings=_settings(local_batch=4), user_overrides=(), model=ModelFacts(6, 8, 8, "toy"),
                                num_gpus=8, gpus_per_node=8, cap_bytes=10**15, activation_checkpoints=("none",),
                                pinned={"dp_shard": 1}, top=10**6)
    base.update(kw)
    return PlanRequest(**base)


def _best_by_tp(rates: UnitRates) -> dict[int, float]:
    result = plan(_tp_request(unit_rates=rates), shapes_for=_big_shapes, build=_build, simulate=_unit_timer)
    best: dict[int, float] = {}
    for j in result.ranked:
        tp, step = j.candidate.degrees.tp, j.relative_step
        assert step is not None
        best[tp] = min(best.get(tp, math.inf), step)
    return best


def test_without_a_profile_tp_8_beats_tp_2_only_when_communication_is_free() -> None:
    free, charged = _best_by_tp(FREE_LINKS), _best_by_tp(UnitRates())
    assert free[8] < free[2]  # compute alone: TP 8 has no pipeline bubble, so more TP looks better
    assert charged[2] < charged[8]  # its collectives at H100 link speeds: TP 2 in a pipeline wins
    assert charged[8] > free[8] and charged[2] > free[2]


def test_the_tp_collectives_of_one_layer_equal_the_hand_computed_volume_over_nvlink() -> None:
    """Per layer and direction, 2 all-gathers and 2 reduce-scatters of tokens x dim bf16 activations, (tp-1)/tp of
    each crossing the link, against the layer's forward at 989 TFLOP/s x 40 % MFU."""
    request = _tp_request()
    c = next(c for c in candidates(request, global_batch(request.settings, 8))
             if c.degrees.tp == 8 and c.microbatch_size == 1)
    unit = unit_costs(c, request, _big_shapes(8, 1, "none"))
    tokens = 16  # the toy job's seq_len x microbatch size 1
    seconds = 4 * (8 - 1) / 8 * tokens * DIM * 2 / 450e9
    layer_s = (2 * LAYER_PARAMS + 4 * DIM * 16) / (989e12 * 0.40)  # one layer's forward per token at TP 1
    assert unit.seconds_per_unit == pytest.approx(layer_s)
    one_layer = unit.tp_comm / 6  # pp 1: the one chunk holds the 6 layers
    assert one_layer * unit.seconds_per_unit == pytest.approx(seconds)
    assert one_layer == pytest.approx(seconds / layer_s)
    assert unit.text().startswith(f"F={1 + unit.tp_comm / unit.work!r},B={2 + unit.tp_comm / unit.work!r}")
    assert NVLINK_BYTES_PER_S == 450e9


def test_fsdp_without_a_profile_charges_its_ring_over_the_node_or_the_network() -> None:
    """dp_shard > 1: the step holds FSDP's all-gather and reduce-scatter; across nodes at the slower link."""
    request = _request(num_gpus=4, gpus_per_node=2, cap_bytes=10**15, model=ModelFacts(6, 4, 2, "toy"),
                       activation_checkpoints=("none",))
    fsdp = [c for c in candidates(request, global_batch(request.settings, 4))
            if c.degrees.dp_shard == 4 and c.microbatch_size == 1]
    judge = Judge(request, _big_shapes, _build, _unit_timer)
    free = Judge(PlanRequest(**{**request.__dict__, "unit_rates": FREE_LINKS}), _big_shapes, _build, _unit_timer)
    for c in fsdp:  # 4 ranks over 2 nodes: the inter-node link
        charged, alone = judge(c)[0].relative_step, free(c)[0].relative_step
        assert charged is not None and alone is not None and charged > alone
    assert UnitRates().fsdp_bytes_per_s(fsdp[0].degrees, 2) == UnitRates().inter_node_bytes_per_s
    assert UnitRates().fsdp_bytes_per_s(fsdp[0].degrees, 8) == UnitRates().intra_node_bytes_per_s


@given(low=st.floats(1.0, 1000.0), factor=st.floats(1.0, 100.0), index=st.integers(0, 10**6))
@settings(max_examples=20, deadline=None)
def test_more_bandwidth_never_makes_a_candidate_slower(low: float, factor: float, index: int) -> None:
    request = _request(num_gpus=8, gpus_per_node=4, cap_bytes=10**15, model=ModelFacts(6, 4, 4, "toy"),
                       activation_checkpoints=("none", "full"))
    space = candidates(request, global_batch(request.settings, 8))
    c = space[index % len(space)]
    judged = []
    for gbs in (low, low * factor):
        rates = UnitRates(intra_node_bytes_per_s=gbs * 1e9, inter_node_bytes_per_s=gbs * 1e8)
        judge = Judge(PlanRequest(**{**request.__dict__, "unit_rates": rates}), _big_shapes, _build, _unit_timer)
        judged.append(judge(c)[0])
    slow, fast = judged
    if slow.relative_step is None:  # a candidate the schedule refuses (e.g. DualPipeV with m < 2 x pp): for any link
        assert fast.relative_step is None and fast.reason == slow.reason and slow.reason
        return
    assert fast.relative_step is not None and fast.relative_step <= slow.relative_step * (1 + 1e-12)


def test_the_bandwidth_property_meets_refused_and_timed_candidates() -> None:
    """The property above draws from both kinds: a refused DualPipeV candidate and timed ones are in its space."""
    request = _request(num_gpus=8, gpus_per_node=4, cap_bytes=10**15, model=ModelFacts(6, 4, 4, "toy"),
                       activation_checkpoints=("none", "full"))
    judge = Judge(request, _big_shapes, _build, _unit_timer)
    steps = [judge(c)[0].relative_step for c in candidates(request, global_batch(request.settings, 8))]
    assert any(s is None for s in steps) and sum(s is not None for s in steps) > len(steps) // 2


def test_a_moe_layers_flops_count_the_experts_a_token_uses() -> None:
    dense = BlockShapes("layer", (("w", (100,)),), saved_bytes=0)
    moe = BlockShapes("moe", (("w", (100,)), ("experts", (8, 50))), saved_bytes=0, sparse=frozenset({"experts"}))
    flops = layer_flops_per_token(JobShapes(source="t", blocks={"layers.0": dense}, tp=1, boundary_bytes=0, dim=4), 10)
    assert flops == 2 * 100 + 4 * 4 * 10
    shapes = JobShapes(source="t", blocks={"layers.0": moe}, tp=1, boundary_bytes=0, dim=4, moe_top_k=2)
    assert layer_flops_per_token(shapes, 10) == 2 * (100 + 2 * 50) + 4 * 4 * 10


def test_under_ep_the_routed_experts_count_once_whatever_the_tp_degree() -> None:
    # torchtitan shards the routed experts on the EP mesh, whole at any TP (a 671B MoE layer at TP 8 counted 4.8x
    # its FLOPs when they were multiplied by TP: bench/bench_layouts.py); without EP they are TP-sharded
    moe = BlockShapes("moe", (("w", (100,)), ("experts", (8, 50))), saved_bytes=0, sparse=frozenset({"experts"}))
    at_tp8 = JobShapes(source="t", blocks={"layers.0": moe}, tp=8, boundary_bytes=0, dim=4, moe_top_k=2)
    assert layer_flops_per_token(at_tp8, 10, ep=4) == 2 * (100 * 8 + 2 * 50) + 4 * 4 * 10
    assert layer_flops_per_token(at_tp8, 10, ep=1) == 2 * (100 + 2 * 50) * 8 + 4 * 4 * 10


def test_a_cp_rank_is_charged_its_share_of_the_tokens() -> None:
    from ppsim.job.degrees import Degrees
    from ppsim.plan import Candidate, unit_costs

    request = _request(num_gpus=8, gpus_per_node=8)
    base = dict(schedule="1F1B", microbatch_size=1, local_batch_size=4, layers_per_stage=None,
                activation_checkpoint="none", num_stages_per_rank=1)
    one, four = (unit_costs(Candidate(degrees=Degrees(pp=2, cp=cp, dp_shard=4 // cp), **base), request)
                 for cp in (1, 4))
    assert four.work == pytest.approx(one.work / 4)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan", "450,50,10", "", "450,", "1_000"])
def test_a_bad_link_bandwidth_is_one_line_exit_2_before_any_work(value: str) -> None:
    result = runner.invoke(app, ["plan", "--torchtitan-config", "llama3:llama3_debugmodel", "--gpus", "2",
                                 "--memory-cap", "1GiB", "--link-bandwidth", value])
    assert result.exit_code == 2, result.output
    assert f"--link-bandwidth {value!r}: give GB/s per GPU and direction" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_link_bandwidth_reads_gb_per_s_within_and_across_nodes() -> None:
    from ppsim.plan import link_rates

    assert link_rates("900,100") == UnitRates(intra_node_bytes_per_s=900e9, inter_node_bytes_per_s=100e9)
    assert link_rates("200") == UnitRates(intra_node_bytes_per_s=200e9, inter_node_bytes_per_s=200e9)


# --- seconds and unit costs, never one list or one axis ----------------------------------------------------------
def _mixed_timer(schedule: Any, job: Any, profile: str | None, unit: str, step: Any = None) -> Any:
    """Seconds where a profile covers the candidate (a step of a few seconds), unit costs elsewhere."""
    import dataclasses

    sim = _unit_timer(schedule, job, profile, unit, step)
    return dataclasses.replace(sim, makespan=sim.makespan * 1e-2) if profile else sim


def _mixed_request() -> PlanRequest:
    cover = ProfileCover(path="p.json", tp=1, tokens_per_microbatch=16)  # tp 1, microbatch size 1, AC none
    return _request(num_gpus=4, cap_bytes=10**7, profiles=(cover,), top=50)


def _mixed_plan() -> Any:
    return plan(_mixed_request(), shapes_for=_shapes_for(2000), build=_build, simulate=_mixed_timer)


def test_a_plan_with_both_units_ranks_them_apart_and_its_frontiers_never_mix_them() -> None:
    result = _mixed_plan()
    assert result.units == ("s", "unit")
    seconds, units = result.ranked_in("s"), result.ranked_in("unit")
    assert seconds and units and len(seconds) + len(units) == len(result.ranked)
    assert result.ranked[:len(seconds)] == seconds  # the seconds first, then the unit costs
    assert all(j.step_unit == "s" for j in result.frontier("s")) and result.frontier() == result.frontier("s")
    assert all(j.step_unit == "unit" for j in result.frontier("unit"))


def test_the_plan_pages_frontier_draws_seconds_and_unit_costs_on_separate_axes(tmp_path: Any) -> None:
    from ppsim.viz.plan_page import frontier_figures, render_plan_page

    result = _mixed_plan()
    panels = dict(frontier_figures(result))
    assert set(panels) == {"s", "unit"}
    for unit, fig in panels.items():
        data = fig.to_dict()
        steps = {j.step_s if unit == "s" else j.relative_step for j in result.ranked_in(unit)}
        drawn = {y for trace in data["data"] for y in trace["y"]}
        assert drawn <= steps and drawn  # only this unit's candidates on this axis
        assert data["layout"]["yaxis"]["title"]["text"] == ("step (s)" if unit == "s" else
                                                           "relative step (unit costs, not seconds)")
    page = render_plan_page(result, job="toy:job")
    assert 'id="frontier"' in page and 'id="frontier-unit"' in page
    assert "% slower" in page and "not timed in seconds: no profile covers it" in page


def _cli(monkeypatch: pytest.MonkeyPatch, *extra: str) -> Any:
    """`ppsim plan` through the command line on the toy job (no torchtitan): the request, the shapes and the
    simulations replaced by the toy's, half the candidates covered by a profile."""
    import ppsim.cli.plan as cli_plan
    from ppsim.plan_search import Simulations

    monkeypatch.setattr(cli_plan, "_request", lambda *a, **kw: _mixed_request())
    monkeypatch.setattr(cli_plan, "_shapes", lambda *a, **kw: _shapes_for(2000))
    monkeypatch.setattr(Simulations, "simulate", lambda self, *a, **kw: _mixed_timer(*a, **kw))
    return runner.invoke(app, ["plan", "--torchtitan-config", "toy:job", "--gpus", "4", "--memory-cap", "1GiB",
                               "--allocator", "none", *extra], env={"COLUMNS": "200"})  # the toy's 10 MB cap


def test_plan_prints_seconds_and_unit_costs_in_separate_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _cli(monkeypatch)
    assert result.exit_code == 0, result.output
    out = result.stdout
    timed, ranked = out.index("timed in seconds (--profile)"), out.index("ranked by unit costs (no profile")
    assert timed < ranked
    assert "step s" in out[timed:ranked] and "rel. step" not in out[timed:ranked]
    assert "rel. step" in out[ranked:] and "tok/s/GPU" not in out[ranked:]
    assert "not comparable with the seconds above" in out
    assert "unit costs: TP and FSDP collectives charged at 450 GB/s within a node and 50 GB/s" in result.stderr


def test_plan_json_says_each_candidates_step_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _cli(monkeypatch, "--json", "--link-bandwidth", "900,100")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["candidates"]
    units = [r["step_unit"] for r in rows]
    assert {"s", "unit"} <= set(units)
    for r in rows:
        assert r["step_unit"] == ("s" if r["step_s"] is not None else "unit" if r["relative_step"] is not None
                                  else None)
    ranked = [u for u in units if u is not None]
    assert ranked == sorted(ranked)  # "s" then "unit": two groups, never interleaved
    assert "900 GB/s within a node and 100 GB/s across nodes" in result.stderr


def test_a_split_backward_under_activation_checkpointing_cannot_run_as_run_refuses_it() -> None:
    """Torch's checkpointing reruns a checkpointed region once per backward half, so a plan judges the zero-bubble
    and DualPipeV orders under selective or full checkpointing "cannot run" (the rule `ppsim run` refuses by), and
    the same orders without checkpointing, and whole-backward orders under it, are judged as usual."""
    request = _request(num_gpus=8, gpus_per_node=4, cap_bytes=10**15, model=ModelFacts(6, 4, 4, "toy"),
                       activation_checkpoints=("selective", "full", "none"))
    judge = Judge(request, _big_shapes, _build, _unit_timer)
    seen = set()
    for c in candidates(request, global_batch(request.settings, 8)):
        if c.degrees.pp == 1:
            continue
        judged = judge(c)[0]
        try:
            splits = _build(c.order_name, c.degrees.pp, c.num_microbatches, c.num_stages_per_rank).splits_backward
        except PPSimError:  # a count the schedule itself refuses (said in the reason)
            assert judged.reason and judged.reason.startswith("cannot run")
            continue
        refused = "splits its backward into I and W" in (judged.reason or "")
        assert refused == (splits and c.activation_checkpoint != "none"), (c, judged.reason)
        seen.add((splits, c.activation_checkpoint, refused))
    assert (True, "selective", True) in seen and (True, "none", False) in seen and (False, "full", False) in seen


def test_run_takes_a_torchtitan_jobs_own_checkpoint_mode_and_refuses_it_with_a_split_backward() -> None:
    """llama3's debug job checkpoints selectively: `run --torchtitan-config` runs that mode unless told otherwise,
    so ZBVZeroBubble is refused in one line before anything starts, naming the way out."""
    args = ["run", "--torchtitan-config", "llama3:llama3_debugmodel", "--training.seq_len", "32",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
            "--training.local_batch_size", "8", "--training.disable_cuda_graphs"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = [x for x in result.stderr.strip().splitlines() if x.startswith("Error")]
    assert line and "--activation-checkpoint selective with ZBVZeroBubble" in line[0]
    assert "--activation-checkpoint none" in line[0] and "Traceback" not in result.output


def test_a_job_without_a_pipeline_and_fsdp_is_refused_by_run_in_one_line() -> None:
    """A plan's pp-1 candidate (FSDP alone) cannot be executed by ppsim run, which runs pipelines through
    torchtitan's pipeline helpers (they need pp >= 2): one line before anything starts, not a traceback."""
    overrides = ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "4",
                 "--training.local_batch_size", "2", "--training.global_batch_size", "32", "--training.seq_len", "128"]
    result = runner.invoke(app, ["run", "--torchtitan-config", "llama3:llama3_debugmodel", *overrides,
                                 "--training.disable_cuda_graphs", "--dp-shard", "4"])
    assert result.exit_code == 2, result.output
    errors = [x for x in result.stderr.strip().splitlines() if x.startswith("Error")]
    assert errors and "-r 1 with --dp-shard 4" in errors[0] and "Traceback" not in result.output
