"""The 1F1B family: GPipe, 1F1B, ZBH1, ZBH2, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble.

Orders are checked for completeness and deadlock freedom on random configurations, and their timing and memory
against the closed forms in tests/data/formulas.md, replayed in-order with zero communication
(:mod:`schedule_checks`).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_checks import peak_activations, replay

from ppsim.costs import parse_costs
from ppsim.errors import ScheduleConfigError
from ppsim.ir import ActionType
from ppsim.schedules import get_schedule, get_spec
from ppsim.simulator import simulate
from ppsim.validate import validate

F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W

FAMILY = ("GPipe", "1F1B", "ZBH1", "ZBH2", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
SPLIT_BACKWARD = {"ZBH1", "ZBH2", "InterleavedZeroBubble"}
ROUNDS = {"Interleaved1F1B", "InterleavedZeroBubble"}  # torch's equal-rounds rule on microbatches

FAST = settings(max_examples=60, deadline=None)


def costs(f: float, i: float, w: float) -> dict[ActionType, float]:
    return {F: f, I: i, W: w, B: i + w}


def fits_rounds(num_ranks: int, num_microbatches: int) -> bool:
    return num_microbatches % max(1, num_microbatches // num_ranks) == 0


@st.composite
def configs(draw: st.DrawFn, names: tuple[str, ...] = FAMILY) -> tuple[str, int, int, int]:
    """A configuration the schedule accepts: (name, ranks, microbatches, stages per rank)."""
    name = draw(st.sampled_from(names))
    spec = get_spec(name)
    num_ranks = draw(st.integers(1, 8))
    v = spec.fixed_stages_per_rank or draw(st.integers(spec.min_stages_per_rank, 4))
    m = draw(st.integers(1, 4 * num_ranks * v))
    if name in ROUNDS and not fits_rounds(num_ranks, m):
        m = num_ranks * max(1, m // num_ranks)
    return name, num_ranks, m, v


def forwards_before_first_backward(row: tuple) -> int:
    return next(i for i, a in enumerate(row) if a.type in (B, I))


@FAST
@given(configs())
def test_every_stage_and_microbatch_gets_one_forward_and_one_backward(config) -> None:
    name, R, m, v = config
    schedule = get_schedule(name, R, m, v)
    kinds = (F, I, W) if name in SPLIT_BACKWARD else (F, B)
    expected = Counter((s, mb, k) for s in range(R * v) for mb in range(m) for k in kinds)
    got = Counter((c.stage, c.microbatch, c.type) for _, _, c in schedule.iter_computations())
    assert got == expected
    for rank, row in enumerate(schedule.actions):
        assert {schedule.stage_to_rank[a.stage] for a in row} <= {rank}
    assert schedule.stage_to_rank == tuple(s % R for s in range(R * v))


@FAST
@given(configs())
def test_orders_are_valid_and_run_in_order_without_deadlock(config) -> None:
    name, R, m, v = config
    assert validate(get_schedule(name, R, m, v)) == []


@FAST
@given(configs())
def test_the_simulator_agrees_with_the_reference_replay(config) -> None:
    name, R, m, v = config
    schedule = get_schedule(name, R, m, v)
    result = simulate(schedule, parse_costs("F=1,I=1,W=1"))
    assert result.makespan == replay(schedule).makespan
    assert tuple(r.peak_activations for r in result.per_rank) == peak_activations(schedule)


@FAST
@given(st.integers(1, 8), st.integers(1, 24), st.sampled_from([(1, 2), (1, 1), (2, 3)]))
def test_1f1b_makespan_and_memory_match_the_closed_forms(R: int, m: int, fb: tuple[int, int]) -> None:
    f, b = fb
    schedule = get_schedule("1F1B", R, m)
    assert replay(schedule, costs(f, b / 2, b / 2)).makespan == (m + R - 1) * (f + b)
    assert peak_activations(schedule) == tuple(min(R - r, m) for r in range(R))


@FAST
@given(st.integers(1, 8), st.integers(1, 24))
def test_gpipe_runs_all_forwards_first_and_holds_every_microbatch(R: int, m: int) -> None:
    schedule = get_schedule("GPipe", R, m)
    assert all(forwards_before_first_backward(row) == m for row in schedule.actions)
    assert peak_activations(schedule) == (m,) * R
    assert replay(schedule).makespan == (m + R - 1) * 3


@FAST
@given(
    R=st.integers(1, 8),
    extra=st.integers(0, 16),
    f=st.integers(1, 4),
    i=st.integers(1, 4),
    w_frac=st.floats(0.1, 1.0),
)
def test_zbh1_bubble_matches_the_zb1p_closed_form(R: int, extra: int, f: int, i: int, w_frac: float) -> None:
    # DualPipe README: ZB1P bubble (p-1)(F+B-2W) with B = I+W; it holds while W <= F and W <= I.
    w = max(1, round(min(f, i) * w_frac))
    m = R + extra
    zb = replay(get_schedule("ZBH1", R, m), costs(f, i, w))
    ref = replay(get_schedule("1F1B", R, m), costs(f, i, w))
    assert max(zb.idle) == (R - 1) * (f + (i + w) - 2 * w)
    assert max(ref.idle) == (R - 1) * (f + i + w)


@FAST
@given(st.integers(1, 8), st.integers(0, 16))
def test_zbh1_keeps_1f1b_peak_activations(R: int, extra: int) -> None:
    m = R + extra
    zb = peak_activations(get_schedule("ZBH1", R, m))
    assert max(zb) == max(peak_activations(get_schedule("1F1B", R, m))) == R
    assert zb == (R,) * R  # every rank holds the same number (the paper's ZB-H1 layout)


@FAST
@given(st.integers(1, 8), st.integers(0, 16), st.integers(1, 3))
def test_zbh2_never_idles_between_a_ranks_first_and_last_action(R: int, extra: int, c: int) -> None:
    # F = I = W: each rank is busy for its whole span m(F+I+W); the step is that plus the forward fill (R-1)F.
    m = 2 * R - 1 + extra
    result = replay(get_schedule("ZBH2", R, m), costs(c, c, c))
    assert result.spans == (3 * c * m,) * R
    assert result.makespan == 3 * c * m + (R - 1) * c
    assert result.makespan <= replay(get_schedule("ZBH1", R, m), costs(c, c, c)).makespan


@FAST
@given(st.integers(1, 8), st.integers(0, 16))
def test_zbh2_holds_at_most_twice_1f1b_activations(R: int, extra: int) -> None:
    m = 2 * R - 1 + extra
    peaks = peak_activations(get_schedule("ZBH2", R, m))
    assert peaks == (2 * R - 1,) * R
    assert max(peaks) < 2 * max(peak_activations(get_schedule("1F1B", R, m)))


@FAST
@given(st.integers(1, 8), st.integers(1, 24))
def test_zbh1_is_torch_interleaved_zero_bubble_with_one_stage_per_rank(R: int, m: int) -> None:
    if not fits_rounds(R, m):
        m = R * max(1, m // R)
    zbh1 = get_schedule("ZBH1", R, m)
    assert get_schedule("InterleavedZeroBubble", R, m, 1).actions == zbh1.actions


@FAST
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_interleaved_1f1b_bubble_rate_is_megatrons(R: int, v: int, k: int) -> None:
    # formulas.md: rate (p-1)/(v*m) for m divisible by the ranks, i.e. (R-1)(F+B) idle with per-chunk costs.
    m = k * R
    result = replay(get_schedule("Interleaved1F1B", R, m, v), costs(1, 1, 1))
    assert result.idle == ((R - 1) * 3,) * R
    assert max(result.idle) / max(result.busy) == pytest.approx((R - 1) / (v * m))


@FAST
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 4))
def test_interleaved_1f1b_warmup_matches_megatron(R: int, v: int, k: int) -> None:
    # formulas.md: warm-up forwards on rank r are 2(R-r-1) + (v-1)g with group size g = R; then one more forward
    # opens the steady state before the first backward.
    m = k * R
    schedule = get_schedule("Interleaved1F1B", R, m, v)
    for r, row in enumerate(schedule.actions):
        assert forwards_before_first_backward(row) == min(2 * (R - r - 1) + (v - 1) * R + 1, m * v)


@FAST
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 12))
def test_looped_bfs_runs_each_chunk_over_the_whole_batch(R: int, v: int, m: int) -> None:
    schedule = get_schedule("LoopedBFS", R, m, v)
    for row in schedule.actions:
        forwards = [a.stage for a in row if a.type is F]
        assert forwards == sorted(forwards)  # chunk by chunk
        assert forwards_before_first_backward(row) == m * v
    assert peak_activations(schedule) == (m * v,) * R


def test_1f1b_builds_fewer_microbatches_than_ranks_which_torch_refuses() -> None:
    schedule = get_schedule("1F1B", 6, 2)
    assert validate(schedule) == []
    assert peak_activations(schedule) == (2, 2, 2, 2, 2, 1)


# --- configuration errors -------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    pytest.param("GPipe", 4, 8, 2, "--stages-per-rank 2", id="gpipe-v2"),
    pytest.param("1F1B", 4, 8, 3, "--stages-per-rank 3", id="1f1b-v3"),
    pytest.param("ZBH1", 4, 8, 2, "--stages-per-rank 2", id="zbh1-v2"),
    pytest.param("ZBH2", 0, 8, 1, "--ranks 0", id="zbh2-no-ranks"),
    pytest.param("1F1B", 4, 0, 1, "--mb 0", id="1f1b-no-microbatches"),
    pytest.param("LoopedBFS", 4, 8, 0, "--stages-per-rank 0", id="looped-v0"),
    pytest.param("Interleaved1F1B", 2, 5, 2, "--mb 5", id="interleaved-uneven-rounds"),
    pytest.param("InterleavedZeroBubble", 3, 7, 2, "--mb 7", id="izb-uneven-rounds"),
]


@pytest.mark.parametrize(("name", "R", "m", "v", "names_value"), BAD_CONFIGS)
def test_impossible_configurations_raise_one_line_naming_value_and_fix(name, R, m, v, names_value) -> None:
    with pytest.raises(ScheduleConfigError) as info:
        get_spec(name).build(R, m, v)
    message = str(info.value)
    assert "\n" not in message
    assert names_value in message and name in message
    assert re.search(r"\bpass (e\.g\. )?-[rmv] \d+|drop -v", message)


@FAST
@given(st.sampled_from(sorted(ROUNDS)), st.integers(1, 8), st.integers(1, 64), st.integers(1, 4))
def test_uneven_rounds_are_refused_exactly_as_torch_and_the_suggested_mb_builds(name, R, m, v) -> None:
    if fits_rounds(R, m):
        schedule = get_schedule(name, R, m, v)
        assert (schedule.num_ranks, schedule.num_microbatches, schedule.num_stages_per_rank) == (R, m, v)
        # rank 0 runs its forwards round by round: each chunk in turn takes the round's microbatches
        size = m // max(1, m // R)
        rounds = [range(k, min(k + size, m)) for k in range(0, m, size)]
        expected = [(chunk * R, mb) for r in rounds for chunk in range(v) for mb in r]
        assert [(a.stage, a.microbatch) for _, _, a in schedule.iter_computations() if a.type is F and
                schedule.stage_to_rank[a.stage] == 0] == expected
        return
    with pytest.raises(ScheduleConfigError) as info:
        get_schedule(name, R, m, v)
    suggested = int(re.search(r"pass e\.g\. -m (\d+)", str(info.value)).group(1))
    assert abs(suggested - m) < R
    assert validate(get_schedule(name, R, suggested, v)) == []
