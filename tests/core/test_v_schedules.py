"""V-Min and V-Half against what Qi et al. ("Pipeline Parallelism with Controllable Memory", 2024) state.

The paper's table (F = I = W, p ranks, m microbatches): activation memory in microbatches (both chunks of a rank)
1F1B p, V-Min (p + 4) // 3, V-Half (p + 2) // 2; bubble rate 1F1B ~ p/m, V-Min ~ 2p/(3m), V-Half ~ p/(2m).
ppsim counts one activation per stage chunk, so a V rank's microbatch is 2 of them.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim import get_schedule, parse_costs, simulate
from ppsim.ir import ActionType
from ppsim.validate import validate

UNIT = parse_costs("F=1,B=2,I=1,W=1")
PAPER_MEMORY = {"V-Min": lambda p: (p + 4) // 3, "V-Half": lambda p: (p + 2) // 2}
PAPER_RATE = {"V-Min": lambda p, m: 2 * p / (3 * m), "V-Half": lambda p, m: p / (2 * m)}


@pytest.mark.parametrize("name", ["V-Min", "V-Half"])
@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 6, 8, 12, 16])
def test_peak_activations_are_the_papers_microbatch_count(name: str, ranks: int) -> None:
    result = simulate(get_schedule(name, ranks, 4 * ranks), UNIT)
    peak = max(p.peak_activations for p in result.per_rank)
    assert peak == 2 * PAPER_MEMORY[name](ranks)


@pytest.mark.parametrize("name, fraction", [("V-Min", 1 / 3), ("V-Half", 1 / 2)])
def test_memory_is_the_stated_fraction_of_1f1b(name: str, fraction: float) -> None:
    ranks = 24
    v_peak = max(p.peak_activations for p in simulate(get_schedule(name, ranks, 48), UNIT).per_rank)
    # 1F1B holds R activations of a one-stage-per-rank microbatch = 2R of half-size V chunks
    one_f_one_b = max(p.peak_activations for p in simulate(get_schedule("1F1B", ranks, 48), UNIT).per_rank)
    ratio = v_peak / (2 * one_f_one_b)
    assert fraction <= ratio <= fraction + 4 / ranks


@pytest.mark.parametrize("name", ["V-Min", "V-Half"])
@pytest.mark.parametrize("ranks, mb", [(4, 8), (4, 32), (8, 16), (8, 64), (16, 32), (16, 128)])
def test_bubble_rate_is_about_the_papers(name: str, ranks: int, mb: int) -> None:
    rate = simulate(get_schedule(name, ranks, mb), UNIT).bubble_ratio
    assert rate <= 1.1 * PAPER_RATE[name](ranks, mb)
    one_f_one_b = ranks / mb  # the paper's ~p/m
    assert rate < one_f_one_b


@pytest.mark.parametrize("name", ["V-Min", "V-Half"])
@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 8])
def test_steady_state_has_no_bubble(name: str, ranks: int) -> None:
    spans = [simulate(get_schedule(name, ranks, m), UNIT).makespan for m in range(2 * ranks, 3 * ranks)]
    assert all(b - a == pytest.approx(6.0) for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", ["V-Min", "V-Half"])
@pytest.mark.parametrize("ranks, mb", [(1, 1), (1, 3), (2, 1), (3, 2), (4, 5), (6, 12)])
def test_orders_are_valid_with_every_split_backward(name: str, ranks: int, mb: int) -> None:
    schedule = get_schedule(name, ranks, mb)
    assert validate(schedule) == []
    assert schedule.num_stages_per_rank == 2
    for rank, row in enumerate(schedule.actions):
        kinds = Counter(a.type for a in row)
        assert kinds == {ActionType.F: 2 * mb, ActionType.I: 2 * mb, ActionType.W: 2 * mb}
        assert {a.stage for a in row} == {rank, 2 * ranks - 1 - rank}


def test_v_min_holds_less_than_v_half_which_holds_less_than_zbv() -> None:
    def peak(name: str) -> int:
        return max(p.peak_activations for p in simulate(get_schedule(name, 8, 32), UNIT).per_rank)

    assert peak("V-Min") < peak("V-Half") < peak("ZBVZeroBubble")


# --- V-Half equals its authors' construction (issue 19) ------------------------------------------------------------
COMM = parse_costs("F=1,B=2,I=1,W=1,comm=0.1")


@pytest.mark.parametrize(
    "ranks, mb, makespan, peak",
    [(4, 8, 55.2, 6), (8, 16, 117.8, 10)],  # sail-sg's V-Half orders timed by ppsim, at their peak
)
def test_v_half_makespan_and_peak_equal_the_authors(ranks: int, mb: int, makespan: float, peak: int) -> None:
    result = simulate(get_schedule("V-Half", ranks, mb), COMM)
    assert result.makespan == pytest.approx(makespan)
    assert max(p.peak_activations for p in result.per_rank) == peak


def test_v_min_makespan_equals_the_authors() -> None:
    assert simulate(get_schedule("V-Min", 4, 8), COMM).makespan == pytest.approx(63.0)


@pytest.mark.parametrize("ranks, mb", [(4, 8), (8, 16), (5, 12)])
def test_reordering_never_raises_the_peak_or_slows_the_plain_pattern(ranks: int, mb: int) -> None:
    from ppsim.schedules import v_half, v_min
    from ppsim.schedules._vshape import pattern_schedule

    for module in (v_min, v_half):
        table = [module.offsets(ranks, r) for r in range(ranks)]
        plain = simulate(pattern_schedule("p", ranks, mb, table, reorder=False), COMM)
        built = simulate(get_schedule(module.NAME, ranks, mb), COMM)
        assert max(p.peak_activations for p in built.per_rank) <= max(p.peak_activations for p in plain.per_rank)
        assert built.makespan <= plain.makespan + 1e-9


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["V-Min", "V-Half"]),
    ranks=st.integers(1, 7),
    mb=st.integers(1, 18),
    costs=st.sampled_from(["F=1,B=2,I=1,W=1", "F=1,B=3,I=2,W=1,comm=0.3", "F=2,B=3,I=1,W=2,comm=0.05"]),
)
def test_every_size_is_valid_and_within_the_papers_memory(name: str, ranks: int, mb: int, costs: str) -> None:
    schedule = get_schedule(name, ranks, mb)
    assert validate(schedule) == []
    result = simulate(schedule, parse_costs(costs))
    assert max(p.peak_activations for p in result.per_rank) <= 2 * PAPER_MEMORY[name](ranks)
