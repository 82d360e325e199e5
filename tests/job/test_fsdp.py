"""FSDP's exposed collectives in the simulated step (ppsim.step.fsdp): costed from the profile's measured all-gather and
reduce-scatter, placed where torch's pipelining runtime issues them, one model for run, simulate and plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from step_helpers import fsdp_step
from typer.testing import CliRunner

from ppsim.compare import build, compare
from ppsim.costs import parse_costs
from ppsim.ir import ActionType
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.step.fsdp import fsdp_units, lower, original_positions
from ppsim.step.pricing import CollectiveCosts, MeasuredCollective, ring_seconds

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32_mem.profile.json"  # measured p2p, no collectives


def _measured(scale: float = 1.0) -> CollectiveCosts:
    """All-gather 1 s + 1 s per 1000 bytes, reduce-scatter twice that, measured on 2 ranks at 1000-4000 bytes."""
    points = tuple((b, scale * (1.0 + b / 1000)) for b in (1000, 2000, 4000))
    double = tuple((b, 2 * t) for b, t in points)
    return CollectiveCosts(measured=(
        MeasuredCollective(op="all_gather", group_size=2, points=points, bytes_per_s=1000 / scale),
        MeasuredCollective(op="reduce_scatter", group_size=2, points=double, bytes_per_s=500 / scale)))


def _shapes(num_layers: int = 4) -> JobShapes:
    """Each layer 250 fp32 elements (1000 bytes), the embedding 500, norm 10, head 490."""
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (250,)),), saved_bytes=0) for i in range(num_layers)}
    blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (500,)),), saved_bytes=0)
    blocks["norm"] = BlockShapes("head", (("w", (10,)),), saved_bytes=0)
    blocks["lm_head"] = BlockShapes("head", (("w", (490,)),), saved_bytes=0)
    return JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=0, param_dtype="float32",
                     reduce_dtype="float32")


MODULES = (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "lm_head"))


def test_measured_costs_interpolate_between_sizes_and_extrapolate_at_the_fit_bandwidth() -> None:
    costs = _measured()
    assert costs.seconds("all_gather", 1500, group_size=2) == pytest.approx(2.5)
    assert costs.seconds("all_gather", 3000, group_size=2) == pytest.approx(4.0)
    assert costs.seconds("all_gather", 10, group_size=2) == pytest.approx(2.0)  # latency-bound below the smallest
    assert costs.seconds("all_gather", 6000, group_size=2) == pytest.approx(5.0 + 2.0)
    assert costs.seconds("reduce_scatter", 2000, group_size=2) == pytest.approx(6.0)
    assert costs.seconds("all_gather", 2000, group_size=1) == 0.0


def test_another_group_size_is_scaled_as_a_ring_from_the_measured_one() -> None:
    costs = _measured()
    # a ring on 4 ranks: 3 steps of n/4 bytes; measured on 2: one step of n/2 bytes
    assert costs.seconds("all_gather", 4000, group_size=4) == pytest.approx(3 * costs.seconds(
        "all_gather", 2000, group_size=2))
    assert "scaled as a ring to 4 ranks" in costs.describe(4)


def test_without_measured_collectives_a_ring_over_p2p_is_used_and_said() -> None:
    from ppsim.profile import load_profile

    costs = CollectiveCosts.from_profile(load_profile(PROFILE))
    assert costs.measured == () and costs.available
    assert costs.seconds("all_gather", 10**6, group_size=2) == pytest.approx(ring_seconds(
        10**6, dp=2, alpha_s=costs.p2p_alpha_s, bytes_per_s=costs.p2p_bytes_per_s))
    assert "measured none, so a ring over its p2p alpha/beta" in costs.describe(2)
    step = fsdp_step(get_schedule("1F1B", 2, 4), shapes=_shapes(), stage_modules=MODULES, dp_shard=2,
                     costs=CollectiveCosts())
    assert step.extra_s == {} and "not in the step" in step.notes[0]


def test_norm_and_head_are_one_fsdp_unit_as_torchtitan_shards_them() -> None:
    assert fsdp_units(MODULES[1]) == [["layers.2"], ["layers.3"], ["norm", "lm_head"]]
    assert fsdp_units(("tok_embeddings", "layers.0")) == [["tok_embeddings"], ["layers.0"]]


def test_1f1b_gathers_inside_the_first_forward_and_reduce_scatters_after_the_last_backward() -> None:
    sched = get_schedule("1F1B", 2, 4)
    step = fsdp_step(sched, shapes=_shapes(), stage_modules=MODULES, dp_shard=2, costs=_measured())
    # stage 0: embedding (2000 B -> 3 s) and two layers (1000 B -> 2 s each); stage 1: 2 + 2 + 500*4 B (3 s)
    gather = [3 + 2 + 2, 2 + 2 + 3]
    for rank, row in enumerate(step.schedule.actions):
        assert not any(a.type is ActionType.UNSHARD for a in row)  # GPipe/1F1B gather inline
        first_f = next(p for p, a in enumerate(row) if a.type is ActionType.F)
        assert step.extra_s[(rank, first_f)] == pytest.approx(gather[rank])
        assert row[-1].type is ActionType.REDUCE_GRAD and row[-2].type is ActionType.B
        assert step.extra_s[(rank, len(row) - 1)] == pytest.approx(2 * gather[rank])
    assert len(step.extra_s) == 4


def test_the_reduce_scatter_delays_the_rank_not_the_gradient_it_sent() -> None:
    sched = get_schedule("1F1B", 2, 4)
    costs = parse_costs("F=1,B=2")
    only_rs = lower(sched, gather_s=[0.0, 0.0], reduce_s=[0.0, 5.0])
    base = simulate(sched, costs)
    with_rs = simulate(only_rs.schedule, costs, extra_s=only_rs.extra_s)
    at = original_positions(only_rs.schedule, sched)
    # rank 0's work is not delayed by rank 1's reduce-scatter; rank 1 ends 5 later
    assert [with_rs.ends[0][at[0][p]] for p in range(len(sched.actions[0]))] == pytest.approx(list(base.ends[0]))
    assert with_rs.ends[1][-1] == pytest.approx(base.ends[1][-1] + 5.0)


def test_runtime_schedules_wait_for_their_first_stage_gathers_before_the_first_forward() -> None:
    sched = get_schedule("Interleaved1F1B", 2, 4, 2)
    step = lower(sched, gather_s=[1.0, 2.0, 3.0, 4.0], reduce_s=[10.0, 20.0, 30.0, 40.0])
    for rank, row in enumerate(step.schedule.actions):
        first = next(a for a in sched.actions[rank] if a.type is ActionType.F).stage
        assert row[0].type is ActionType.UNSHARD and row[0].stage == first
        assert step.extra_s[(rank, 0)] == [1.0, 2.0, 3.0, 4.0][first]
        reduced = [a.stage for a in row if a.type is ActionType.REDUCE_GRAD]
        assert sorted(reduced) == sorted(sched.stages_of(rank))
    assert original_positions(step.schedule, sched)[0][0] == 1


@given(scale=st.floats(0.1, 10.0))
@settings(max_examples=20, deadline=None)
def test_the_step_grows_with_the_measured_collective_cost(scale: float) -> None:
    sched = get_schedule("1F1B", 2, 4)
    costs = parse_costs("F=1,B=2")
    plain = simulate(sched, costs).makespan
    steps = []
    for k in (scale, 2 * scale):
        step = fsdp_step(sched, shapes=_shapes(), stage_modules=MODULES, dp_shard=2, costs=_measured(k))
        steps.append(simulate(step.schedule, costs, extra_s=step.extra_s).makespan)
    assert plain < steps[0] < steps[1]
    # rank 0's gather (7 s x scale) delays everything; the step's end is at least that later
    assert steps[0] >= plain + 7 * scale - 1e-9


def test_at_dp_shard_one_the_step_has_no_collectives() -> None:
    sched = get_schedule("Interleaved1F1B", 2, 4, 2)
    step = fsdp_step(sched, shapes=_shapes(), stage_modules=MODULES * 2, dp_shard=1, costs=_measured())
    assert step.schedule is sched and step.extra_s == {} and step.notes == ()


def test_compare_simulates_the_step_with_its_collectives_and_says_so() -> None:
    sched = get_schedule("1F1B", 2, 4)
    plain = compare(["1F1B"], builder=lambda _: sched, costs=parse_costs("F=1,B=2"))
    fsdp = compare(["1F1B"], builder=lambda _: sched, costs=parse_costs("F=1,B=2"),
                   step=lambda s, _: fsdp_step(s, shapes=_shapes(), stage_modules=MODULES, dp_shard=2,
                                               costs=_measured()))
    assert fsdp.best.makespan > plain.best.makespan
    assert any("FSDP (dp_shard 2)" in n for n in fsdp.notes)


# --- plan ------------------------------------------------------------------------------------------------------
def _plan_timer(schedule: Any, job: Any, profile: str | None, unit: str, *, step: Any = None) -> Any:
    return compare([schedule.name], builder=lambda _: schedule, costs=parse_costs(unit), scope="stage",
                   step=step).best


def _plan_shapes(tp: int, mb_size: int, ac: str) -> JobShapes:
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (64, 32)),), saved_bytes=100) for i in range(6)}
    blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (100, 32)),), saved_bytes=10)
    blocks["norm"] = BlockShapes("head", (("w", (32,)),), saved_bytes=0)
    blocks["lm_head"] = BlockShapes("head", (("w", (100, 32)),), saved_bytes=100)
    return JobShapes(source="toy", blocks=blocks, tp=tp, boundary_bytes=64)


def _planned(collectives: CollectiveCosts | None, shared_cores: int | None = None) -> Any:
    from ppsim.job.settings import JobSettings
    from ppsim.plan import ModelFacts, PlanRequest, ProfileCover
    from ppsim.plan_search import plan

    job = JobSettings(source="toy:job", parallelism={"data_parallel_shard_degree": -1},
                      training={"local_batch_size": 4, "seq_len": 16}, in_file=False, model_source="toy",
                      num_model_layers=6)
    covers = tuple(ProfileCover(path="p.json", tp=1, tokens_per_microbatch=16 * m, collectives=collectives)
                   for m in (1, 2, 4))
    request = PlanRequest(settings=job, user_overrides=(), model=ModelFacts(6, 4, 2, "toy"), num_gpus=4,
                          gpus_per_node=1, cap_bytes=10**9, activation_checkpoints=("none",), profiles=covers,
                          time_limit_s=60, shared_cores=shared_cores)
    return plan(request, shapes_for=_plan_shapes, build=lambda n, r, m, v: build(n, r, m, v)[0], simulate=_plan_timer)


def test_plan_times_a_pp_by_dp_candidate_with_its_collectives() -> None:
    free = {j.candidate: j.step_s for j in _planned(None).ranked}
    costly = {j.candidate: j.step_s for j in _planned(_measured(100.0)).ranked}
    assert any(c.degrees.dp_shard > 1 for c in free) and any(c.degrees.dp_shard == 1 for c in free)
    for c, step in costly.items():
        if c.degrees.dp_shard > 1:
            assert step > free[c] + 100.0  # at least one gather of 100 x 2 s exposed
        else:
            assert step == free[c]
    best_free = min(free, key=free.__getitem__)
    best_costly = min(costly, key=costly.__getitem__)
    assert best_free.degrees.dp_shard > 1 and best_costly.degrees.dp_shard == 1  # the ranking changes


def test_plan_as_run_on_a_small_host_times_pp_by_dp_candidates_with_shared_cores() -> None:
    """`plan --memory-as-run` with a CPU profile: a candidate's local processes (pp x dp_shard x tp) share the
    host's cores, so once they outnumber them its step is longer than on devices of its own (never more than
    processes / cores times); with no more processes than cores it is timed as before."""
    alone = {j.candidate: j.step_s for j in _planned(_measured(0.001)).ranked}
    shared = {j.candidate: j.step_s for j in _planned(_measured(0.001), shared_cores=2).ranked}
    assert any(c.degrees.dp_shard > 1 for c in alone)
    for c, step in shared.items():
        if c.degrees.pp * c.degrees.dp_shard > 2:  # more processes than cores, FSDP or not
            assert alone[c] < step <= alone[c] * c.degrees.pp * c.degrees.dp_shard / 2 + 1e-9
        else:
            assert step == alone[c]


# --- simulate --torchtitan-config ------------------------------------------------------------------------------
@pytest.mark.torch
def test_simulate_of_a_config_job_at_dp_shard_2_holds_the_collectives(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    from ppsim.cli import app

    doc = json.loads(PROFILE.read_text())
    samples = [{"bytes": b, "median_s": 0.01 + b / 1e8, "p10_s": 0.01, "p90_s": 0.02} for b in (4096, 1 << 20)]
    doc["collectives"] = [{"op": op, "group_size": 2, "alpha_s": 0.01, "beta_bytes_per_s": 1e8,
                           "fit_rel_error": 0.0, "samples": samples} for op in ("all_gather", "reduce_scatter")]
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(doc))
    job = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel", "--training.seq_len", "32",
           "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs", "--profile", str(prof),
           "--json"]
    spans = {}
    for dp in (1, 2):
        result = CliRunner().invoke(app, [*job, "--parallelism.data_parallel_shard_degree", str(dp)])
        assert result.exit_code == 0, result.output
        spans[dp] = json.loads(result.stdout)["makespan"]
        assert ("FSDP (dp_shard 2)" in result.stderr) is (dp == 2)
    assert spans[2] > spans[1] + 0.01  # at least one exposed all-gather


def _shared(name: str, ranks: int, mb: int, *, per_rank: int, cores: int) -> tuple[float, float]:
    from ppsim.step.sharing import shared_cores_step

    schedule = get_schedule(name, ranks, mb)
    costs = parse_costs("F=1,B=2")
    alone = simulate(schedule, costs).makespan
    shared, _ = shared_cores_step(schedule, lambda extra: simulate(schedule, costs, extra_s=extra),
                                  per_rank=per_rank, cores=cores)
    return alone, shared.makespan


def test_local_processes_beyond_the_cores_stretch_computations_by_how_many_compute_beside_them() -> None:
    """Processor sharing over the simulated step: no stretch with enough cores or when nothing overlaps (one
    microbatch: the ranks take turns), at most ``processes / cores`` when all compute at once, a rank's bubble lending
    its core to the others (pinned by copy of the pipeline, FSDP/TP peers share the same way)."""
    assert _shared("1F1B", 2, 8, per_rank=2, cores=8) == pytest.approx((_shared("1F1B", 2, 8, per_rank=1,
                                                                                   cores=8)[0],) * 2)
    alone, shared = _shared("GPipe", 4, 1, per_rank=1, cores=2)
    assert shared == pytest.approx(alone)  # one microbatch: one PP rank at a time, on a core of its own
    for name in ("GPipe", "1F1B"):
        alone, shared = _shared(name, 4, 8, per_rank=1, cores=2)
        assert alone < shared < 2 * alone
    for name in ("GPipe", "1F1B"):  # 2 processes per PP rank: pinned by copy of the pipeline, the same sharing
        alone, shared = _shared(name, 2, 8, per_rank=2, cores=2)
        assert alone < shared < 2 * alone


def _toy_shared(scale: float) -> float:
    """GPipe, 2 PP ranks x dp_shard 2 on 2 cores (one core per copy of the pipeline), 1 microbatch, F=1, B=2, no
    gathers, reduce-scatters 0.5 (stage 0) and 2 (stage 1): rank 0's B and rank 1's REDUCE_GRAD start together at 4."""
    from ppsim.step.model import Step as FsdpStep

    sched = get_schedule("GPipe", 2, 1)
    costs = parse_costs("F=1,B=2")
    low = lower(sched, gather_s=[0.0, 0.0], reduce_s=[0.5, 2.0])
    step = FsdpStep(schedule=low.schedule, extra_s=low.extra_s, shared=(2, 2), shared_scale=scale)
    return float(step.simulate(lambda extra: simulate(low.schedule, costs, extra_s=extra)).makespan)


def test_a_collective_across_nodes_waits_on_the_link_and_takes_no_core() -> None:
    """The toy above with rank 1's reduce-scatter crossing nodes (its span says so): rank 0's B has the copy's core
    alone (2), the reduce-scatter takes its own price (2, not stretched), rank 0's local one (0.5) follows: 4 + 2 +
    0.5, at any time-sharing scale."""
    from ppsim.result import CommSpan
    from ppsim.step.model import Step as FsdpStep

    sched = get_schedule("GPipe", 2, 1)
    costs = parse_costs("F=1,B=2")
    low = lower(sched, gather_s=[0.0, 0.0], reduce_s=[0.5, 2.0])
    rs = next(p for p, a in enumerate(low.schedule.actions[1]) if a.type is ActionType.REDUCE_GRAD)
    for scale in (1.0, 1.5):
        step = FsdpStep(schedule=low.schedule, extra_s=low.extra_s, shared=(2, 2), shared_scale=scale,
                        comm_spans={(1, rs): CommSpan(2.0, 2.0, ("reduce_scatter",), True)})
        assert step.simulate(lambda extra: simulate(low.schedule, costs, extra_s=extra)).makespan == \
            pytest.approx(4 + 2 + 0.5)


def test_collectives_of_pp_ranks_on_the_same_nodes_share_their_nics_while_they_run_at_once() -> None:
    """Both PP ranks' gathers start at the step's start and cross nodes, one process of each on each node of one
    NIC: at once they get half the NIC each, so each takes twice its price (rank 0's first forward starts at 4, not
    2); with a NIC per process, or ranks on nodes of their own, their price; rank 1's reduce-scatter, alone on the
    link, its price whatever the NICs."""
    from ppsim.result import CommSpan
    from ppsim.step.model import Step as FsdpStep
    from ppsim.step.sharing import NodeLinks

    sched = get_schedule("GPipe", 2, 1)
    costs = parse_costs("F=1,B=2")
    low = lower(sched, gather_s=[2.0, 2.0], reduce_s=[0.0, 3.0], runtime_order=True)
    spans = {k: CommSpan(t, t, ("all_gather",), True) for k, t in low.extra_s.items()}

    def first_forward_start(links: NodeLinks | None) -> tuple[float, float]:
        step = FsdpStep(schedule=low.schedule, extra_s=low.extra_s, comm_spans=spans, links=links)
        result = step.simulate(lambda extra: simulate(low.schedule, costs, extra_s=extra))
        rs = next(p for p, a in enumerate(low.schedule.actions[1]) if a.type is ActionType.REDUCE_GRAD)
        return result.starts[0][1], result.ends[1][rs] - result.starts[1][rs]

    shared = ((0, 1), (1, 1))
    assert first_forward_start(NodeLinks((shared, shared), nics=1)) == pytest.approx((4.0, 3.0), rel=1e-3)
    assert first_forward_start(NodeLinks((shared, shared), nics=2)) == pytest.approx((2.0, 3.0))
    assert first_forward_start(NodeLinks((((0, 1),), ((1, 1),)), nics=1)) == pytest.approx((2.0, 3.0))
    assert first_forward_start(None) == pytest.approx((2.0, 3.0))


def test_an_order_run_as_an_action_list_gathers_at_the_steps_start_even_for_1f1b() -> None:
    """``ppsim run`` hands torch's ``_PipelineScheduleRuntime`` the order as an action list: its ``UNSHARD`` starts
    every rank's gathers at the step's start (rank 1's overlap rank 0's first forward), where torchtitan's
    ``Schedule1F1B`` gathers inside the first forward."""
    sched = get_schedule("1F1B", 2, 4)
    costs = parse_costs("F=1,B=2")
    inline = lower(sched, gather_s=[3.0, 3.0], reduce_s=[0.0, 0.0])
    at_start = lower(sched, gather_s=[3.0, 3.0], reduce_s=[0.0, 0.0], runtime_order=True)
    assert not any(a.type is ActionType.UNSHARD for row in inline.schedule.actions for a in row)
    assert all(row[0].type is ActionType.UNSHARD for row in at_start.schedule.actions)
    base = simulate(sched, costs).makespan
    assert simulate(inline.schedule, costs, extra_s=inline.extra_s).makespan == pytest.approx(base + 6)
    assert simulate(at_start.schedule, costs, extra_s=at_start.extra_s).makespan == pytest.approx(base + 3)


def test_fsdp_collectives_share_the_cores_and_time_sharing_is_slower_than_the_fair_share() -> None:
    """By hand: rank 0's F [0, 1], rank 1's F [1, 2] and B [2, 4] each run alone; rank 0's B (2) and rank 1's
    REDUCE_GRAD (2, CPU work on gloo) then share the copy's one core from 4: each gets half of it, and each half runs
    ``scale`` slower, so both last 2 x 2 x scale; rank 0's REDUCE_GRAD (0.5) follows alone. The old model (a
    collective takes no core, the fair share alone) ended at 4 + 2 + 0.5 = 6.5."""
    assert _toy_shared(1.0) == pytest.approx(4 + 2 * 2 * 1.0 + 0.5)  # 8.5
    assert _toy_shared(1.5) == pytest.approx(4 + 2 * 2 * 1.5 + 0.5)  # 10.5
    assert _toy_shared(1.5) != pytest.approx(6.5)


@pytest.mark.torch
def test_the_fsdp_probe_gives_the_time_sharing_slowdown_that_reproduces_its_measured_step() -> None:
    """``runtime.shared_scale`` is the scale with which the one step model gives the probe's measured step (bisection);
    a probe no slower than the fair share gives 1, never less."""
    import types

    from ppsim.calibrate.measure.runtime_model import fit_shared_scale
    from ppsim.step.model import Step as FsdpStep

    sched = get_schedule("GPipe", 2, 1)
    low = lower(sched, gather_s=[0.0, 0.0], reduce_s=[0.5, 2.0])
    step = FsdpStep(schedule=low.schedule, extra_s=low.extra_s)
    costs = parse_costs("F=1,B=2")
    for measured, scale in ((10.5, 1.5), (8.5, 1.0), (7.0, 1.0)):
        probe: Any = types.SimpleNamespace(step_spans=(measured, measured + 1, measured - 1))
        fitted = fit_shared_scale(probe, step, costs, per_rank=2, cores=2)
        assert fitted["shared_scale"] == pytest.approx(scale, abs=1e-6)


def test_run_pins_each_copy_of_the_pipeline_to_cores_of_its_own_only_when_processes_outnumber_the_cores() -> None:
    from ppsim.step.sharing import core_plan, sharing

    assert core_plan(4, 1, 2) is None and core_plan(2, 2, 4) is None  # one process per PP rank; enough cores
    assert core_plan(2, 2, 2) == ((0,), (1,))
    assert core_plan(4, 2, 6) == ((0, 1, 2), (3, 4, 5))
    assert core_plan(2, 3, 2) == ((0,), (0,), (1,))
    assert sharing(2, 2, 2) == (1, 1) and sharing(1, 2, 4) == (1, 2)
    assert sharing(3, 2, 2) == (2, 1)  # the crowded core: 2 copies on core 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_a_local_worker_is_pinned_to_its_copys_cores() -> None:
    """The worker of process ``rank`` (PP outermost: FSDP/TP position ``rank % per_rank``) runs on that copy's
    cores."""
    allowed = sorted(os.sched_getaffinity(0))
    pp = len(allowed)  # 2 copies of a pipeline of len(allowed) ranks: pinned, each copy on half the cores
    code = ("import os, sys, types; from ppsim.calibrate.execute.steps import pin_to_rank_cores; "
            f"spec = types.SimpleNamespace(world_size={2 * pp}, schedule=types.SimpleNamespace(num_ranks={pp})); "
            "pin_to_rank_cores(spec, int(sys.argv[1])); print(sorted(os.sched_getaffinity(0)))")
    half = len(allowed) // 2
    for rank, cores in ((0, allowed[:half] or allowed[:1]), (2 * pp - 1, allowed[half:])):
        done = subprocess.run([sys.executable, "-c", code, str(rank)], capture_output=True, text=True, check=True)
        assert json.loads(done.stdout) == cores


@pytest.mark.torch
def test_runs_prediction_on_a_cpu_host_stretches_only_with_more_processes_than_cores() -> None:
    pytest.importorskip("torch")
    from ppsim.calibrate.execute.predict import predict_step
    from ppsim.step.model import Step as FsdpStep

    schedule = get_schedule("1F1B", 2, 8)
    costs = parse_costs("F=1,B=2")
    step = FsdpStep(schedule=schedule, extra_s={})
    alone, same = predict_step(step, costs, 1.0, recompute=None, per_rank=1, shared=True, cores=2)
    assert same is costs  # as many processes as cores: the profile's own scale
    shared, noted = predict_step(step, costs, 1.0, recompute=None, per_rank=2, shared=True, cores=2)
    assert shared.makespan > alone.makespan
    assert "4 local processes (2 PP ranks x 2) share 2 CPU cores, each copy of the pipeline (one FSDP/TP " \
        "position) pinned to cores of its own" in noted.notes[-1]
    enough, _ = predict_step(step, costs, 1.0, recompute=None, per_rank=2, shared=True, cores=8)
    assert enough.makespan == pytest.approx(alone.makespan)


@pytest.mark.torch
def test_the_fsdp_probe_runs_only_where_runs_time_share_and_a_failure_leaves_the_fair_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from ppsim.calibrate.measure import calibration

    def recorder() -> Any:
        return calibration.Recorder({"done": [], "notes": [], "runtime": {"dispatch_s": 0.0}}, tmp_path / "p.json",
                                    writer=True)

    def boom(*_: Any) -> Any:
        raise RuntimeError("gloo went away")

    monkeypatch.setattr(calibration, "probe_shared", boom)
    job = {"device": "cpu", "expert_parallel_degree": 1, "activation_checkpoint": "none"}
    titan: Any = types.SimpleNamespace(**job, model_source=types.SimpleNamespace(scheme="torchtitan"))
    builtin: Any = types.SimpleNamespace(**job, model_source=types.SimpleNamespace(scheme="builtin"))
    rec = recorder()
    calibration.shared_probe(builtin, rec.doc, rec, log=lambda _: None)
    assert rec.done == [] and rec.doc["notes"] == []  # FSDP runs take torchtitan models only
    monkeypatch.setattr("ppsim.step.sharing.host_cores", lambda: 1)
    rec = recorder()
    calibration.shared_probe(titan, rec.doc, rec, log=lambda _: None)
    assert rec.done == ["runtime.shared"] and "shared_scale" not in rec.doc["runtime"]
    assert "FSDP probe failed (RuntimeError: gloo went away)" in rec.doc["notes"][0]
    monkeypatch.setattr("ppsim.step.sharing.host_cores", lambda: 64)
    rec = recorder()
    calibration.shared_probe(titan, rec.doc, rec, log=lambda _: None)
    assert rec.done == ["runtime.shared"] and "have a core each" in rec.doc["notes"][0]


def test_under_ep_a_moe_layers_experts_are_gathered_on_their_own_mesh_and_not_at_all_at_efsdp_1() -> None:
    """torchtitan's ``apply_fsdp_to_decoder`` under EP: a MoE layer's dense parameters on the ``dp_shard`` mesh,
    its routed experts (EP-local) on ``efsdp`` -- one collective each, none for the experts at ``efsdp`` 1 (each
    rank holds its experts whole). Without EP everything is one collective on ``dp_shard``. By hand: 100 dense and
    800 expert elements, a flat cost per collective plus 1 s per MB."""
    from ppsim.job.degrees import Degrees
    from ppsim.job.memory import DTYPE_BYTES, BlockShapes, JobShapes
    from ppsim.step.build import StepJob
    from ppsim.step.fsdp import stage_collective_seconds, unit_groups

    experts = "moe.routed_experts.inner_experts.w1"
    moe = BlockShapes("moe", (("attention.wq", (10, 10)), (experts, (8, 10, 10))), saved_bytes=0,
                      sparse=frozenset({experts}))
    shapes = JobShapes(source="toy", blocks={"layers.0": moe}, tp=1, boundary_bytes=0)
    assert unit_groups(shapes, ["layers.0"], dp_shard=2, efsdp=None) == [(900, "fsdp")]
    assert unit_groups(shapes, ["layers.0"], dp_shard=2, efsdp=1) == [(100, "fsdp")]
    assert unit_groups(shapes, ["layers.0"], dp_shard=4, efsdp=2) == [(100, "fsdp"), (800, "efsdp")]
    assert StepJob(shapes=shapes, stage_modules=[], costs=None, degrees=Degrees(pp=1, dp_shard=4, ep=2)).span(
        "efsdp").ranks == 2
    costs = CollectiveCosts(p2p_alpha_s=0.5, p2p_bytes_per_s=1e6)
    seconds = {ep: stage_collective_seconds(StepJob(shapes=shapes, stage_modules=[["layers.0"]], costs=costs,
                                                    degrees=Degrees(pp=1, dp_shard=2, ep=ep)))[0][0]
               for ep in (1, 2)}
    seconds = {None: seconds[1], 1: seconds[2]}  # efsdp: none without EP, 1 at ep 2
    assert seconds[1] < seconds[None]
    per_element = DTYPE_BYTES[shapes.param_dtype]
    assert seconds[1] == pytest.approx(costs.seconds("all_gather", 100 * per_element, group_size=2))
    assert seconds[None] == pytest.approx(costs.seconds("all_gather", 900 * per_element, group_size=2))
