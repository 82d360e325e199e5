"""The search at plan sizes (issue 24): the zero-bubble authors' greedy as a seed, the lower bound's validity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim import parse_costs, simulate
from ppsim.search import MemoryCap, Placement, search
from ppsim.search.common import problem_for
from ppsim.search.driver import _templates
from ppsim.search.zbgreedy import zb_greedy_orders
from ppsim.validate import validate

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "zb_peer_r16_r32.json").read_text())["cases"]


def _case(case_id: str) -> dict:
    return next(c for c in REFERENCE if c["id"] == case_id)


def _costs(case: dict):  # type: ignore[no-untyped-def]
    return parse_costs(f"F={case['F']},I={case['I']},W={case['W']},comm={case['comm']}")


def _greedy_makespans(ranks: int, mb: int, costs, cap: float) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    (tpl,) = _templates(ranks, mb, Placement.loop, None)
    out = []
    for orders in zb_greedy_orders(problem_for(tpl, costs, MemoryCap(cap, "act"))):
        schedule = tpl.with_actions(orders)
        assert validate(schedule) == []
        sim = simulate(schedule, costs)
        out.append((sim.makespan, max(p.peak_activations for p in sim.per_rank)))
    return out


@pytest.mark.parametrize("case_id", ["PL01", "PL04", "PL06"])
def test_zb_greedy_returns_the_authors_loop_order_among_its_variants(case_id: str) -> None:
    # their greedy auto-scheduler's pick (tests/data/zb_peer_r16_r32.json, their code run unmodified) is one of the
    # eight variants rebuilt here, at the same peak
    case = _case(case_id)
    runs = _greedy_makespans(case["R"], case["M"], _costs(case), case["cap_act"])
    assert len(runs) == 8
    assert any(m == pytest.approx(case["peer_makespan"]) for m, _ in runs)
    assert all(peak <= case["cap_act"] for _, peak in runs)


@settings(max_examples=25, deadline=None)
@given(ranks=st.integers(1, 6), mb=st.integers(1, 12), cap=st.integers(1, 14), i_cost=st.sampled_from([0.5, 1, 1.5]),
       comm=st.sampled_from([0, 0.05, 0.3]))
def test_zb_greedy_orders_are_valid_and_every_one_that_completes_fits_the_cap(
    ranks: int, mb: int, cap: int, i_cost: float, comm: float
) -> None:
    costs = parse_costs(f"F=1,I={i_cost},W=0.7,comm={comm}")
    for _, peak in _greedy_makespans(ranks, mb, costs, cap):
        assert peak <= cap


def test_search_seeded_with_the_zb_greedy_is_no_slower_than_the_authors_on_pl01() -> None:
    # 16 ranks x 32, F=I=W=1, comm 0.05, 24act: the list scheduling and local search alone ended at 112.25 (theirs 111.8)
    case = _case("PL01")
    result = search(case["R"], case["M"], _costs(case), f"{case['cap_act']}act", time_limit=600.0, max_orders=2,
                    solver="none")
    assert result.makespan <= case["peer_makespan"] + 1e-9
    assert result.peak <= case["cap_act"]


# --- the authors' automatic V schedule (a seed family) ---------------------------------------------------------------
def _v_auto_best(ranks: int, mb: int, costs, cap: int, *, uniform_only: bool = False):  # type: ignore[no-untyped-def]
    from ppsim.search.vauto import block_orders, blocks, family

    (tpl,) = _templates(ranks, mb, Placement.v, None)
    best = None
    for fam in family(ranks):
        if uniform_only and fam[3] != fam[4]:
            continue
        for block in blocks(ranks, *fam):
            orders, peak = block_orders(block, mb, cap)
            if peak > cap:
                break
            if orders is None:
                continue
            schedule = tpl.with_actions(orders)
            assert validate(schedule) == []
            sim = simulate(schedule, costs)
            assert max(p.peak_activations for p in sim.per_rank) <= cap
            best = sim.makespan if best is None else min(best, sim.makespan)
    return best


def test_v_auto_matches_the_authors_published_v_auto_schedule_on_4_ranks() -> None:
    # their v_auto_schedule on 4 ranks x 8, F=I=W=1, comm 0.1, at V-Half's 6 chunk activations: 54.8
    assert _v_auto_best(4, 8, parse_costs("F=1,I=1,W=1,comm=0.1"), 6) == pytest.approx(54.8)


def test_v_auto_uniform_blocks_reach_the_authors_order_at_32_ranks_and_v_half_memory() -> None:
    # PV06 of the reference grid: 32 ranks x 64, F=I=W=1, comm 0.05, 34act; their v_auto_schedule: 483.3
    case = _case("PV06")
    best = _v_auto_best(case["R"], case["M"], _costs(case), 34, uniform_only=True)
    assert best == pytest.approx(case["peer_makespan"])


@settings(max_examples=15, deadline=None)
@given(ranks=st.integers(2, 5), extra=st.integers(0, 6), cap=st.integers(4, 10), comm=st.sampled_from([0, 0.1]))
def test_v_auto_orders_are_valid_and_fit_the_cap(ranks: int, extra: int, cap: int, comm: float) -> None:
    _v_auto_best(ranks, 2 * ranks + extra, parse_costs(f"F=1,I=1.5,W=0.5,comm={comm}"), min(cap, 2 * ranks))


# --- the lower bound -------------------------------------------------------------------------------------------------
def test_the_bound_is_below_every_order_of_the_authors_on_the_reference_grid() -> None:
    from ppsim.search.bounds import lower_bound

    for case in REFERENCE:
        (tpl,) = _templates(case["R"], case["M"], Placement(case["placement"]), None)
        for cand in case["candidates"]:
            if "makespan" not in cand:
                continue
            cap = MemoryCap(cand["peak_act"], "act")
            assert lower_bound(problem_for(tpl, _costs(case), cap)) <= cand["makespan"] + 1e-9, (case["id"], cand)


def test_the_last_forward_term_raises_the_bound_at_v_half_memory_to_within_a_percent_of_the_authors() -> None:
    from ppsim.search.bounds import lower_bound

    case = _case("PV06")  # the other terms gave 449.65 (7.5 % below the authors' 483.3)
    (tpl,) = _templates(case["R"], case["M"], Placement.v, None)
    bound = lower_bound(problem_for(tpl, _costs(case), MemoryCap(34, "act")))
    assert 0.99 * case["peer_makespan"] <= bound <= case["peer_makespan"]


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 5), mb=st.integers(1, 12), cap=st.integers(1, 12), i_cost=st.sampled_from([0.5, 1, 1.5, 2]),
       w_cost=st.sampled_from([0.3, 1]), comm=st.sampled_from([0, 0.05, 0.5]), v=st.booleans())
def test_the_bound_never_exceeds_a_feasible_makespan(
    ranks: int, mb: int, cap: int, i_cost: float, w_cost: float, comm: float, v: bool
) -> None:
    """Every order that fits the cap (named schedules, the seed families, a search's answer) takes at least the
    bound."""
    import time

    from ppsim.errors import PPSimError
    from ppsim.schedules import all_specs, get_schedule
    from ppsim.search.bounds import lower_bound
    from ppsim.search.seeds import loop_greedy_seeds, v_auto_seeds, v_block_seeds

    costs = parse_costs(f"F=1,I={i_cost},W={w_cost},comm={comm}")
    placement = Placement.v if v else Placement.loop
    (tpl,) = _templates(ranks, mb, placement, None)
    mcap = MemoryCap(cap, "act")
    prob = problem_for(tpl, costs, mcap)
    bound = lower_bound(prob)
    makespans = []
    for spec in all_specs():
        try:
            sched = get_schedule(spec.name, ranks, mb, tpl.num_stages_per_rank)
        except PPSimError:
            continue
        if sched.stage_to_rank != tpl.stage_to_rank or len(sched.pipelines) != 1:  # as the search's named ones
            continue
        sim = simulate(sched, costs)
        if max(p.peak_activations for p in sim.per_rank) <= cap:
            makespans.append(sim.makespan)
    deadline = time.perf_counter() + 30
    for family in (loop_greedy_seeds, v_auto_seeds):
        makespans += [sim.makespan for _, sim in family(tpl, costs, prob, mcap, deadline=deadline)]
    makespans += [sim.makespan for _, sim in v_block_seeds(tpl, costs, prob, mcap, deadline=deadline, max_count=5)]
    for makespan in makespans:
        assert bound <= makespan + 1e-9


@pytest.mark.parametrize(
    "ranks, mb, cap, optimum",
    [(3, 4, 4, 30.2),  # proven optimal by CP-SAT (tests/core/test_search.py): the analytic bound was below it
     (4, 8, 6, 54.8)],  # the authors' v_auto_schedule (V-Half's memory), now proven optimal
)
def test_the_last_forward_term_meets_known_optima_at_v_placement(ranks: int, mb: int, cap: int, optimum: float) -> None:
    from ppsim.search.bounds import lower_bound

    (tpl,) = _templates(ranks, mb, Placement.v, None)
    costs = parse_costs("F=1,B=2,I=1,W=1,comm=0.1")
    assert lower_bound(problem_for(tpl, costs, MemoryCap(cap, "act"))) == pytest.approx(optimum)
    result = search(ranks, mb, costs, f"{cap}act", placement="v", time_limit=600.0, max_orders=500, solver="none")
    assert result.optimal and result.makespan == pytest.approx(optimum)


@settings(max_examples=25, deadline=None)
@given(ranks=st.integers(2, 4), mb=st.integers(2, 8), held=st.integers(1, 8), freed=st.sampled_from([0.0, 0.25, 0.6]),
       v=st.booleans())
def test_with_a_byte_cap_and_i_freeing_bytes_the_bound_never_exceeds_a_feasible_makespan(
    ranks: int, mb: int, held: int, freed: float, v: bool
) -> None:
    import time

    from ppsim.costs import StageCosts
    from ppsim.errors import PPSimError
    from ppsim.schedules import all_specs, get_schedule
    from ppsim.search.bounds import lower_bound
    from ppsim.search.common import fits
    from ppsim.search.seeds import loop_greedy_seeds, v_auto_seeds

    (tpl,) = _templates(ranks, mb, Placement.v if v else Placement.loop, None)
    S, act, static = tpl.num_stages, 100 * 2**20, 2**30
    costs = StageCosts(
        F=(1.0,) * S, B=(2.0,) * S, I=(1.5,) * S, W=(0.5,) * S, FB=(3.0,) * S, comm=0.1,
        activation_bytes=(act,) * S, activation_bytes_freed_by_I=(int(freed * act),) * S,
        static_bytes=(static,) * S, unit="s", source="test",
    )
    cap = MemoryCap(float(tpl.num_stages_per_rank * static + held * act), "bytes")
    bound = lower_bound(problem_for(tpl, costs, cap))
    makespans = []
    for spec in all_specs():
        try:
            sched = get_schedule(spec.name, ranks, mb, tpl.num_stages_per_rank)
        except PPSimError:
            continue
        if sched.stage_to_rank == tpl.stage_to_rank and len(sched.pipelines) == 1:
            sim = simulate(sched, costs)
            if fits(sim, cap):
                makespans.append(sim.makespan)
    prob = problem_for(tpl, costs, cap)
    for family in (loop_greedy_seeds, v_auto_seeds):
        makespans += [sim.makespan for _, sim in family(tpl, costs, prob, cap, deadline=time.perf_counter() + 30)]
    for makespan in makespans:
        assert bound <= makespan + 1e-9
