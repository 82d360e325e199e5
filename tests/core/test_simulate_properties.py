"""Properties of the simulator on random schedules and costs (hypothesis).

The fast engine is checked against the test suite's one naive reference replay (:mod:`replay`, written from the
same two sources of truth: ``ppsim.deps`` for inputs, ``StageCosts`` for durations and delays), including the
runtime-overhead fields (``compute_scale``, ``dispatch_s``, ``recv_posting``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from replay import replay
from test_costs import make_profile

from ppsim import DeadlockError, deps, get_schedule, simulate
from ppsim.costs import CostSpec, StageCosts
from ppsim.errors import ScheduleConfigError
from ppsim.ir import Action, ActionType, Schedule

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NAMES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
         "ZBH1", "ZBH2", "DualPipe"]


def critical_path(schedule: Schedule, costs: StageCosts) -> float:
    """Longest chain of durations and delays through the data dependencies alone (no rank order)."""
    producer: dict[deps.Key, Action] = {}
    for row in schedule.actions:
        for action in row:
            for comp in action.computations:
                for key in deps.provides(comp):
                    producer[key] = action
    memo: dict[int, float] = {}

    def finish(action: Action) -> float:
        if id(action) not in memo:
            start = 0.0
            for comp in action.computations:
                for key in deps.requires(schedule, comp):
                    p = producer[key]
                    if p is not action:
                        start = max(start, finish(p) + costs.comm_delay(schedule, key[0], comp.stage))
            memo[id(action)] = start + costs.duration(schedule, action)
        return memo[id(action)]

    return max((finish(a) for row in schedule.actions for a in row), default=0.0)


# -- strategies ----------------------------------------------------------------------------------------------------

cost_value = st.one_of(st.integers(0, 24).map(lambda x: x / 8), st.floats(0.01, 10.0))


@st.composite
def uniform_costs(draw: Any) -> StageCosts:
    f, i, w = draw(cost_value), draw(cost_value), draw(cost_value)
    b = i + w if draw(st.booleans()) else draw(cost_value)
    fb = draw(st.floats(0.5, 1.0)) * (f + b)
    return StageCosts(F=(f,), B=(b,), I=(i,), W=(w,), FB=(fb,), comm=draw(cost_value), source="random")


@st.composite
def runtime_costs(draw: Any, chain_len: int) -> StageCosts:
    """Uniform or profile costs with runtime overheads: scaled computations, a dispatch gap, either posting."""
    if draw(st.booleans()):
        base = draw(uniform_costs())
    else:
        base = CostSpec.from_profile(make_profile(chain_len, scale=draw(st.floats(0.1, 10.0)))).tables
    return dataclasses.replace(
        base,
        compute_scale=draw(st.one_of(st.just(1.0), st.floats(0.25, 4.0))),
        dispatch_s=draw(st.one_of(st.just(0.0), cost_value)),
        recv_posting=draw(st.sampled_from(["early", "consumer"])),
    )


@st.composite
def library_schedules(draw: Any) -> Schedule:
    name = draw(st.sampled_from(NAMES))
    ranks = draw(st.integers(1, 5))
    mbs = draw(st.integers(1, 10))
    v = draw(st.sampled_from([None, 2, 3]))
    try:
        return get_schedule(name, ranks, mbs, v)
    except ScheduleConfigError:
        assume(False)
        raise


@st.composite
def pair_schedules(draw: Any) -> Schedule:
    """DualPipeV / DualPipe, whose overlapped pairs wait on two ranks at once."""
    if draw(st.booleans()):
        ranks = draw(st.integers(1, 4))
        return get_schedule("DualPipeV", ranks, 2 * ranks + draw(st.integers(0, 6)))
    ranks = 2 * draw(st.integers(1, 3))
    return get_schedule("DualPipe", ranks, 2 * ranks + 2 * draw(st.integers(0, 3)))


@st.composite
def random_orders(draw: Any, *, valid: bool = True) -> Schedule:
    """A random placement and order: a random topological order of the dependency graph split by rank
    (always runnable), or with ``valid=False`` an arbitrary shuffle per rank (may deadlock)."""
    num_stages = draw(st.integers(1, 5))
    num_ranks = draw(st.integers(1, num_stages))
    stage_to_rank = tuple(draw(st.integers(0, num_ranks - 1)) for _ in range(num_stages))
    mbs = draw(st.integers(1, 4))
    schedule = Schedule("random", tuple(() for _ in range(num_ranks)), stage_to_rank, mbs)
    comps: list[Action] = []
    for s in range(num_stages):
        for mb in range(mbs):
            comps.append(Action(s, ActionType.F, mb))
            if draw(st.booleans()):
                comps += [Action(s, ActionType.I, mb), Action(s, ActionType.W, mb)]
            else:
                comps.append(Action(s, ActionType.B, mb))
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    if valid:
        done: set[deps.Key] = set()
        pending = list(comps)
        while pending:
            ready = [c for c in pending if all(k in done for k in deps.requires(schedule, c))]
            pick = ready[draw(st.integers(0, len(ready) - 1))]
            pending.remove(pick)
            done.update(deps.provides(pick))
            rows[stage_to_rank[pick.stage]].append(pick)
    else:
        for c in comps:
            rows[stage_to_rank[c.stage]].append(c)
        rows = [draw(st.permutations(row)) for row in rows]
    return schedule.with_actions(rows)


def times(result: Any) -> tuple[list[list[float]], list[list[float]]]:
    return [list(r) for r in result.starts], [list(r) for r in result.ends]


# -- properties ----------------------------------------------------------------------------------------------------


@SETTINGS
@given(schedule=st.one_of(library_schedules(), pair_schedules(), random_orders()), costs=uniform_costs())
def test_engine_matches_the_naive_reference_exactly(schedule: Schedule, costs: StageCosts) -> None:
    result = simulate(schedule, costs)
    ref = replay(schedule, costs)
    assert not ref.stuck
    assert times(result) == (ref.starts, ref.ends)


@SETTINGS
@given(schedule=st.one_of(library_schedules(), pair_schedules(), random_orders()), data=st.data())
def test_engine_matches_the_reference_with_runtime_overheads(schedule: Schedule, data: Any) -> None:
    costs = data.draw(runtime_costs(len(schedule.pipelines[0])))
    result = simulate(schedule, costs)
    ref = replay(schedule, costs)
    assert not ref.stuck
    assert times(result) == (ref.starts, ref.ends)
    assert [s.busy for s in result.per_rank] == pytest.approx(ref.busy)
    sends = result.transfers()
    if len(sends):
        # a hand-off leaves no earlier than its producer's end, and with consumer posting no earlier than the
        # consumer rank's previous action
        ends = {(r, p): e for r, row in enumerate(ref.ends) for p, e in enumerate(row)}
        for row in sends.itertuples():
            assert row.send >= ends[(row.src_rank, row.src_position)]
            if costs.recv_posting == "consumer" and row.dst_position > 0:
                assert row.send >= ends[(row.dst_rank, row.dst_position - 1)]


@SETTINGS
@given(schedule=random_orders(valid=False), costs=uniform_costs())
def test_engine_deadlocks_exactly_when_the_reference_gets_stuck(schedule: Schedule, costs: StageCosts) -> None:
    ref = replay(schedule, costs)
    if ref.stuck:
        with pytest.raises(DeadlockError) as info:
            simulate(schedule, costs)
        assert {r: head for r, (head, _) in info.value.blocked.items()} == ref.stuck
        assert all(waits for _, waits in info.value.blocked.values())
    else:
        assert times(simulate(schedule, costs)) == (ref.starts, ref.ends)


@SETTINGS
@given(schedule=st.one_of(library_schedules(), pair_schedules(), random_orders()), costs=uniform_costs())
def test_makespan_bounds_busy_and_critical_path_and_ranks_never_overlap(schedule: Schedule, costs: StageCosts) -> None:
    r = simulate(schedule, costs)
    eps = 1e-9 * max(1.0, r.makespan)
    for s in r.per_rank:
        assert r.makespan >= s.busy - eps
        assert s.idle >= -eps
    assert r.makespan >= critical_path(schedule, costs) - eps
    for rank, row in enumerate(schedule.actions):
        prev_end = 0.0
        for pos, action in enumerate(row):
            start, end = r.starts[rank][pos], r.ends[rank][pos]
            assert start >= prev_end
            assert end == pytest.approx(start + costs.duration(schedule, action))
            prev_end = end


@SETTINGS
@given(schedule=st.one_of(library_schedules(), pair_schedules(), random_orders()), costs=uniform_costs(),
       k=st.sampled_from([0.5, 2.0, 4.0]))
def test_scaling_every_cost_by_k_scales_every_time_by_k(schedule: Schedule, costs: StageCosts, k: float) -> None:
    scaled = dataclasses.replace(
        costs, F=(costs.F[0] * k,), B=(costs.B[0] * k,), I=(costs.I[0] * k,), W=(costs.W[0] * k,),
        FB=(costs.FB[0] * k,), comm=costs.comm * k,
    )
    base, big = simulate(schedule, costs), simulate(schedule, scaled)
    assert big.makespan == base.makespan * k
    assert [[t * k for t in row] for row in base.starts] == [list(row) for row in big.starts]
    assert [[t * k for t in row] for row in base.ends] == [list(row) for row in big.ends]


@SETTINGS
@given(schedule=st.one_of(library_schedules(), pair_schedules(), random_orders()), scale=st.floats(1e-3, 1e3))
def test_memory_returns_to_the_static_level_and_peaks_match_the_memory_frame(
    schedule: Schedule, scale: float
) -> None:
    chain_len = len(schedule.pipelines[0])
    costs = CostSpec.from_profile(make_profile(chain_len, scale=scale)).tables
    r = simulate(schedule, costs)
    mem = r.memory()
    for rank, g in mem.groupby("rank"):
        static = r.trace.static_bytes[rank]
        assert g["activations"].iloc[-1] == 0
        assert g["bytes"].iloc[-1] == static
        assert (g["activations"] >= 0).all() and (g["bytes"] >= static).all()
        assert g["time"].is_monotonic_increasing
        assert g["activations"].max() == r.per_rank[rank].peak_activations
        assert g["bytes"].max() == r.per_rank[rank].peak_memory_bytes

