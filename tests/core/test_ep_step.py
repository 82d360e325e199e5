"""EP's all-to-alls in the simulated step (ppsim.step.ep): counted per MoE layer, costed from the profile or the stated
default, exposed by eager actions, hidden by DualPipe's overlapped F&B pairs; the step's collectives on the result."""

from __future__ import annotations

import json

import pytest
from step_helpers import ep_step, fsdp_step

from ppsim.compare import compare
from ppsim.costs import parse_costs
from ppsim.ir import Action, ActionType
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.result import COLLECTIVE_KINDS
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.step.ep import (
    DEFAULT_COMM_RATIO,
    StageComm,
    all_to_all_bytes,
    all_to_all_seconds,
    exposed_seconds,
    moe_share,
    stage_comms,
)
from ppsim.step.model import Step as FsdpStep
from ppsim.step.pricing import CollectiveCosts, MeasuredCollective

TOKENS, TOP_K, DIM = 64, 2, 32  # 64 * 2 * 32 * 2 bytes (bfloat16) = 8192 bytes a rank per all-to-all


def _shapes(num_layers: int = 8, *, dense: tuple[int, ...] = (0,), moe: bool = True) -> JobShapes:
    """``num_layers`` layers, those in ``dense`` without experts; 100 fp32 elements a block."""
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (100,)),), saved_bytes=0) for i in range(num_layers)}
    for name in ("tok_embeddings", "norm", "lm_head"):
        blocks[name] = BlockShapes("head", (("w", (100,)),), saved_bytes=0)
    layers = tuple(f"layers.{i}" for i in range(num_layers) if i not in dense) if moe else ()
    return JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=0, moe_layers=layers, moe_top_k=TOP_K,
                     moe_tokens=TOKENS, dim=DIM)


def _modules(num_stages: int, num_layers: int = 8) -> tuple[tuple[str, ...], ...]:
    """Layers split evenly; the embedding on stage 0, norm and head on the last."""
    per = num_layers // num_stages
    out = []
    for s in range(num_stages):
        mods = [f"layers.{i}" for i in range(s * per, (s + 1) * per)]
        out.append(tuple((["tok_embeddings"] if s == 0 else []) + mods + (["norm", "lm_head"]
                                                                            if s == num_stages - 1 else [])))
    return tuple(out)


def _a2a_measured(seconds: float, group_size: int = 2) -> CollectiveCosts:
    """An all-to-all measured flat at ``seconds`` (latency-bound) on ``group_size`` ranks."""
    points = ((1, seconds), (1 << 30, seconds))
    return CollectiveCosts(measured=(MeasuredCollective(op="all_to_all", group_size=group_size, points=points,
                                                        bytes_per_s=1e30),))


def _step(schedule, costs, shapes, *, ep=2, a2a=None, overlap="dualpipe", in_blocks=False):  # type: ignore[no-untyped-def]
    stage_costs = costs.for_schedule(schedule) if hasattr(costs, "for_schedule") else costs
    modules = _modules(len(schedule.pipelines[0]))  # per chain position (DualPipe's two chains share them)
    step = ep_step(FsdpStep(schedule=schedule, extra_s={}), stage_costs, shapes=shapes, stage_modules=modules,
                   ep=ep, costs=a2a, overlap=overlap, in_blocks=in_blocks)
    return step, step.simulate(lambda extra: simulate(schedule, stage_costs, extra_s=extra))


def test_one_all_to_all_moves_tokens_times_top_k_times_dim_in_param_dtype() -> None:
    assert all_to_all_bytes(_shapes()) == TOKENS * TOP_K * DIM * 2


def test_cost_from_measured_all_to_all_then_p2p_then_the_stated_default() -> None:
    n = all_to_all_bytes(_shapes())
    assert all_to_all_seconds(n, ep=2, costs=_a2a_measured(0.5)) == pytest.approx(0.5)
    assert all_to_all_seconds(n, ep=4, costs=_a2a_measured(0.5)) == pytest.approx(3 * 0.5)  # (E-1)/(g-1) steps
    p2p = CollectiveCosts(p2p_alpha_s=1e-3, p2p_bytes_per_s=1e6)
    assert all_to_all_seconds(n, ep=4, costs=p2p) == pytest.approx(3 * 1e-3 + n * 3 / 4 / 1e6)  # what leaves
    # an FSDP-only measurement is no all-to-all: the p2p fallback, else the default (None)
    fsdp_only = CollectiveCosts(measured=(MeasuredCollective("all_gather", 2, ((1, 9.0),), 1.0),))
    assert all_to_all_seconds(n, ep=2, costs=fsdp_only) is None and all_to_all_seconds(n, ep=2, costs=None) is None
    # the default: a MoE layer's two forward all-to-alls take DEFAULT_COMM_RATIO of its forward compute
    schedule = get_schedule("1F1B", 2, 4)
    comms = stage_comms(schedule, parse_costs("F=3,B=6"), shapes=_shapes(), stage_modules=_modules(2), ep=2,
                        costs=None)
    # stage 0: layers 0-3, 3 MoE, share 3/4 of F=3; stage 1: layers 4-7 and the head, 4 MoE of 5
    assert comms[0] == StageComm(3, DEFAULT_COMM_RATIO * 3 * 0.75 / 3 / 2, 0.75)
    assert comms[1] == StageComm(4, DEFAULT_COMM_RATIO * 3 * 0.8 / 4 / 2, 0.8)


def test_moe_share_weighs_layers_and_the_head_not_the_embedding_or_norm() -> None:
    assert moe_share(("tok_embeddings", "layers.0", "layers.1"), frozenset({"layers.1"})) == (1, 0.5)
    assert moe_share(("layers.2", "norm", "lm_head"), frozenset({"layers.2"})) == (1, 0.5)
    assert moe_share(("tok_embeddings",), frozenset({"layers.0"})) == (0, 0.0)


def test_an_eager_1f1b_moe_step_exposes_all_its_all_to_alls_on_the_critical_path() -> None:
    schedule = get_schedule("1F1B", 1, 4)  # one rank: the step is every action plus every exposed all-to-all
    step, result = _step(schedule, parse_costs("F=1,B=2"), _shapes(), a2a=_a2a_measured(0.25))
    a2a = result.collectives["all_to_all"]
    assert a2a.count == 4 * 7 * 4  # 7 MoE layers, 4 microbatches, dispatch+combine in F and in B
    assert a2a.total_s == pytest.approx(a2a.count * 0.25) and a2a.exposed_s == a2a.total_s
    assert result.makespan == pytest.approx(4 * (1 + 2) + a2a.total_s)
    assert set(result.collectives) == {"all_to_all"}


@pytest.mark.parametrize("name,ranks,mb", [("1F1B", 4, 8), ("Interleaved1F1B", 2, 4), ("ZBH1", 4, 8),
                                           ("DualPipeV", 4, 8), ("DualPipe", 4, 8), ("GPipe", 2, 3)])
def test_count_is_four_per_moe_layer_per_microbatch_per_stage(name: str, ranks: int, mb: int) -> None:
    schedule = get_schedule(name, ranks, mb)
    step, _ = _step(schedule, parse_costs("F=1,B=2"), _shapes(num_layers=8, dense=()), a2a=_a2a_measured(0.1))
    layers_per_stage = 8 // len(schedule.pipelines[0])
    forwards = sum(c.type is ActionType.F for row in schedule.actions for a in row for c in a.computations)
    assert step.collectives["all_to_all"].count == 4 * layers_per_stage * forwards
    assert forwards == schedule.num_stages * mb or name == "DualPipe"  # DualPipe: each chain half the microbatches


def test_dualpipev_hides_more_of_the_same_jobs_all_to_alls_than_1f1b() -> None:
    """The issue's "done when": exposed / total below 1F1B's for the same job and costs."""
    costs = parse_costs("F=1,B=2,FB=3")
    shapes = _shapes()
    ratios = {}
    for name in ("1F1B", "DualPipeV"):
        _, result = _step(get_schedule(name, 4, 16), costs, shapes)  # the stated default's costs
        a2a = result.collectives["all_to_all"]
        ratios[name] = a2a.exposed_s / a2a.total_s
    assert ratios["1F1B"] == 1.0
    assert 0 < ratios["DualPipeV"] < 0.5  # the warm-up and cool-down's eager actions still expose theirs


def test_a_runtime_that_runs_a_pairs_halves_in_turn_exposes_every_all_to_all_and_a_longer_step() -> None:
    """torch's runtime (``ppsim run`` through torchtitan) runs an OVERLAP_F_B's halves one after the other:
    ``overlap="sequential"`` exposes all of DualPipeV's all-to-alls, the same total as DeepSeek's rule, a longer
    step."""
    costs = parse_costs("F=1,B=2,FB=3")
    schedule = get_schedule("DualPipeV", 4, 16)
    (_, hidden), (_, waited) = (_step(schedule, costs, _shapes(), overlap=o) for o in ("dualpipe", "sequential"))
    a, b = hidden.collectives["all_to_all"], waited.collectives["all_to_all"]
    assert (a.count, a.total_s) == (b.count, b.total_s)
    assert b.exposed_s == b.total_s > a.exposed_s
    assert waited.makespan > hidden.makespan


def test_a_pair_under_enough_compute_exposes_nothing_so_dualpipev_exposes_exactly_its_eager_actions() -> None:
    schedule = get_schedule("DualPipeV", 4, 16)
    costs = parse_costs("F=1,B=2,FB=3")
    shapes = _shapes(dense=())  # a dense stage's forward could hide none of a pair's backward all-to-alls
    step, result = _step(schedule, costs, shapes, a2a=_a2a_measured(0.01))
    comms = stage_comms(schedule, costs, shapes=shapes, stage_modules=_modules(schedule.num_stages), ep=2,
                        costs=_a2a_measured(0.01))
    eager = sum(comms[a.stage].per_direction for row in schedule.actions for a in row
                if a.type in (ActionType.F, ActionType.B, ActionType.I))
    pairs = sum(a.type is ActionType.OVERLAP_F_B for row in schedule.actions for a in row)
    a2a = result.collectives["all_to_all"]
    assert pairs > 0 and a2a.exposed_s == pytest.approx(eager) and a2a.total_s > a2a.exposed_s
    assert sum(step.extra_s.values()) == pytest.approx(a2a.exposed_s)
    # the first stage dense: a pair with a half on stage 0 hides none of its other half's all-to-alls
    dense = _shapes(dense=(0,))
    _, dense_first = _step(schedule, costs, dense, a2a=_a2a_measured(0.01))
    comms = stage_comms(schedule, costs, shapes=dense, stage_modules=_modules(schedule.num_stages), ep=2,
                        costs=_a2a_measured(0.01))
    eager = sum(comms[a.stage].per_direction for row in schedule.actions for a in row
                if a.type in (ActionType.F, ActionType.B, ActionType.I))
    pairs_of_0 = [a.sub_actions for row in schedule.actions for a in row
                  if a.type is ActionType.OVERLAP_F_B and 0 in (a.sub_actions[0].stage, a.sub_actions[1].stage)]
    # the other half's all-to-alls, which only stage 0's (dense) compute could have hidden
    unhidden = [comms[f.stage if b.stage == 0 else b.stage].per_direction for f, b in pairs_of_0]
    assert unhidden and dense_first.collectives["all_to_all"].exposed_s == pytest.approx(eager + sum(unhidden))


def test_the_pair_rule_one_direction_hides_only_under_the_other_directions_moe_compute() -> None:
    schedule = get_schedule("DualPipeV", 2, 4)
    costs = parse_costs("F=1,B=2,FB=3")  # pair 3: forward half 1, backward half 2
    pair = Action(0, ActionType.OVERLAP_F_B, sub_actions=(Action(0, ActionType.F, 5), Action(3, ActionType.B, 1)))
    # stage 0 (F half): comm 1.5, half its compute in MoE layers; stage 3 (B half): comm 0.5, all MoE
    comms = [StageComm(1, 0.75, 0.5), StageComm(0, 0, 0), StageComm(0, 0, 0), StageComm(1, 0.25, 1.0)]
    count, total, exposed = exposed_seconds(schedule, costs, pair, comms)
    # F's 1.5 under B's 2 x 1.0 = 2: hidden; B's 0.5 under F's 1 x 0.5 = 0.5: hidden
    assert (count, total, exposed) == (4, 2.0, 0.0)
    comms[0] = StageComm(1, 1.25, 0.5)  # F's 2.5 under 2: 0.5 out; B's borrows nothing from F's compute slack
    assert exposed_seconds(schedule, costs, pair, comms)[2] == pytest.approx(0.5)
    comms[3] = StageComm(1, 0.5, 1.0)  # and B's 1.0 under F's 0.5: 0.5 out too
    assert exposed_seconds(schedule, costs, pair, comms)[2] == pytest.approx(1.0)
    w = Action(3, ActionType.W, 1)
    assert exposed_seconds(schedule, costs, w, comms) == (0, 0.0, 0.0)  # a weight gradient issues none


def test_torchtitans_chunked_overlap_exposes_the_first_dispatch_and_last_combine_halves() -> None:
    schedule = get_schedule("1F1B", 1, 1)
    costs = parse_costs("F=1,B=2")
    f = Action(0, ActionType.F, 0)
    small = [StageComm(2, 0.2, 1.0)]  # experts: half of one layer's F = 0.25; each half-exchange 0.1 < 0.125
    assert exposed_seconds(schedule, costs, f, small, "chunked") == pytest.approx((4, 0.8, 2 * 0.2))
    big = [StageComm(2, 0.5, 1.0)]  # 0.25 > 0.125: t + 2 (t/2 - e/2) per layer = 0.5 + 0.25
    assert exposed_seconds(schedule, costs, f, big, "chunked")[2] == pytest.approx(2 * 0.75)
    assert exposed_seconds(schedule, costs, f, big)[2] == pytest.approx(2.0)  # eager, not chunked: all


def test_a_dense_job_or_ep_1_leaves_the_step_and_its_json_unchanged() -> None:
    schedule = get_schedule("1F1B", 2, 4)
    plain = simulate(schedule, parse_costs(None))
    for shapes, ep in ((_shapes(moe=False), 2), (_shapes(), 1)):
        step, result = _step(schedule, parse_costs(None), shapes, ep=ep, a2a=_a2a_measured(1.0))
        assert step.extra_s == {} and not step.collectives and result.collectives is None
        assert result.to_dict() == plain.to_dict() and "collectives" not in result.to_dict()


def test_fsdp_and_ep_combine_and_the_json_carries_every_kind_the_step_placed() -> None:
    schedule = get_schedule("DualPipeV", 2, 4)
    shapes = _shapes(num_layers=4)
    fsdp_costs = CollectiveCosts(measured=(
        MeasuredCollective("all_gather", 2, ((1, 0.1), (1 << 30, 0.1)), 1e30),
        MeasuredCollective("reduce_scatter", 2, ((1, 0.2), (1 << 30, 0.2)), 1e30),
        *_a2a_measured(0.05).measured))
    modules = _modules(schedule.num_stages, 4)

    def run(ep: int):  # type: ignore[no-untyped-def]
        return compare(["DualPipeV"], builder=lambda _: schedule, costs=parse_costs("F=1,B=2,FB=3"),
                       step=lambda s, c: ep_step(fsdp_step(s, shapes=shapes, stage_modules=modules, dp_shard=2,
                                                           costs=fsdp_costs),
                                                 c, shapes=shapes, stage_modules=modules, ep=ep,
                                                 costs=fsdp_costs)).results[0]

    fsdp_only, both = run(1), run(2)
    doc = json.loads(json.dumps(both.to_dict()))["collectives"]
    assert list(doc) == [k for k in COLLECTIVE_KINDS if k in ("all_to_all", "all_gather", "reduce_scatter")]
    for totals in doc.values():
        assert set(totals) == {"count", "total_s", "exposed_s"} and isinstance(totals["count"], int)
        assert 0 <= totals["exposed_s"] <= totals["total_s"] + 1e-12
    assert "all_to_all" not in fsdp_only.to_dict()["collectives"]
    # every unit gathered once (4 layers + embedding + norm/head: 6), the other stage's gathers hidden
    assert doc["all_gather"]["count"] == 6 and doc["all_gather"]["exposed_s"] < doc["all_gather"]["total_s"]
    assert doc["reduce_scatter"]["exposed_s"] == pytest.approx(doc["reduce_scatter"]["total_s"])
    assert doc["all_to_all"]["count"] == 4 * 3 * 4  # layers 1-3 MoE, 4 microbatches
    assert both.makespan > fsdp_only.makespan


def test_all_to_alls_already_in_the_measured_blocks_add_nothing_eager_and_give_back_what_a_pair_hides() -> None:
    """A profile measured at the job's EP degree has each MoE layer's all-to-alls inside its F and B
    (``in_blocks``): the same count and total are reported, an eager step is the step without EP, and an
    overlapped pair is shorter by what it hides (never counted twice)."""
    costs = parse_costs("F=1,B=2,FB=3")
    a2a = _a2a_measured(0.05)
    for name, eager in (("1F1B", True), ("DualPipeV", False)):
        schedule = get_schedule(name, 4, 16)
        base = simulate(schedule, costs.for_schedule(schedule) if hasattr(costs, "for_schedule") else costs)
        (_, added), (step, inside) = (_step(schedule, costs, _shapes(), a2a=a2a, in_blocks=b) for b in (False, True))
        a, b = added.collectives["all_to_all"], inside.collectives["all_to_all"]
        assert (a.count, a.total_s, a.exposed_s) == (b.count, b.total_s, b.exposed_s)
        if eager:
            assert inside.makespan == pytest.approx(base.makespan) and added.makespan > base.makespan
        else:
            assert b.exposed_s < b.total_s and inside.makespan < base.makespan
