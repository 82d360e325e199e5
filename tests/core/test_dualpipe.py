"""DualPipe and DualPipeV: DeepSeek's orders, the facts in tests/data/formulas.md, and configuration errors.

torch parity of DualPipeV (and ZBV) over the whole grid lives in test_torch_parity.py.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim.errors import ScheduleConfigError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.schedules import get_schedule, get_spec
from ppsim.validate import validate

F, B, I, W, PAIR = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    return get_schedule("DualPipeV", num_ranks, num_microbatches)


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    return get_schedule("DualPipe", num_ranks, num_microbatches)


def read_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return [row for row in csv.reader(fh)]


def cells(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in row] for row in schedule.actions]


def v_position(schedule: Schedule, rank: int) -> tuple[int, int]:
    """(position h in its V, ranks in the V): DualPipeV is one V, DualPipe one V per half of the ranks."""
    if len(schedule.pipelines) == 1:
        return rank, schedule.num_ranks
    half = schedule.num_ranks // 2
    return min(rank, schedule.num_ranks - 1 - rank), half


dualpipev_configs = st.integers(1, 12).flatmap(lambda r: st.tuples(st.just(r), st.integers(2 * r, 6 * r)))
dualpipe_configs = st.integers(1, 8).flatmap(
    lambda h: st.tuples(st.just(2 * h), st.integers(2 * h, 6 * h).map(lambda k: 2 * k))
)


# --- DeepSeek's orders, cell for cell ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "num_ranks", "num_microbatches", "file"),
    [
        ("DualPipeV", 4, 10, "dualpipev_4ranks_10mb.csv"),
        ("DualPipe", 8, 20, "dualpipe_8ranks_20mb.csv"),
        ("DualPipe", 4, 8, "dualpipe_4ranks_8mb.csv"),
    ],
)
def test_order_equals_reference_csv_cell_for_cell(
    reference_dir: Path, name: str, num_ranks: int, num_microbatches: int, file: str
) -> None:
    schedule = get_schedule(name, num_ranks, num_microbatches)
    expected = read_rows(reference_dir / file)
    assert len(expected) == num_ranks
    for rank, (want, got) in enumerate(zip(expected, cells(schedule), strict=True)):
        assert got == want, f"rank {rank} differs"


def dualpipev_relabelled_onto(schedule: Schedule, rank: int) -> list[str]:
    """DualPipeV(R/2, M/2)'s order for DualPipe ``rank``'s V position, each stage replaced by the DualPipe stage
    that plays its role: the V's first chunk is the direction fed from this half's outer end (direction 0 on
    ranks 0..R/2-1, direction 1 on the mirrored half), the second chunk the other direction."""
    h, half = v_position(schedule, rank)
    v_sched = dualpipev(half, schedule.num_microbatches // 2)
    first_dir = 0 if rank < half else 1
    by_dir = {schedule.direction(s): s for s in schedule.stages_of(rank)}
    relabel = {h: by_dir[first_dir], 2 * half - 1 - h: by_dir[1 - first_dir]}

    def swap(a: Action) -> Action:
        if a.sub_actions:
            return Action(a.stage, a.type, a.microbatch, tuple(swap(c) for c in a.sub_actions))
        return Action(relabel[a.stage], a.type, a.microbatch)

    return [str(swap(a)) for a in v_sched.actions[h]]


@settings(max_examples=30, deadline=None)
@given(dualpipe_configs)
def test_dualpipe_is_dualpipev_on_half_the_ranks_relabelled_and_mirrored(config: tuple[int, int]) -> None:
    num_ranks, num_microbatches = config
    schedule = dualpipe(num_ranks, num_microbatches)
    for rank in range(num_ranks):
        assert cells(schedule)[rank] == dualpipev_relabelled_onto(schedule, rank), f"rank {rank}"


def test_dualpipe_directions_are_two_independent_chains() -> None:
    schedule = dualpipe(4, 8)
    assert schedule.pipelines == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.next_stage(3) is None and schedule.prev_stage(4) is None
    assert schedule.num_microbatches == 8 and schedule.microbatches_per_pipeline == 4


# --- facts from formulas.md, over random valid configurations ----------------------------------------------------


def check_deepseek_facts(schedule: Schedule) -> None:
    assert validate(schedule) == []
    m = schedule.microbatches_per_pipeline
    for rank, row in enumerate(schedule.actions):
        h, n = v_position(schedule, rank)
        tip = h == n - 1
        comps = [c for a in row for c in a.computations]
        kinds = [c.type for c in comps]
        # each of the rank's two stages runs every microbatch forward and backward once
        assert kinds.count(F) == 2 * m and kinds.count(B) + kinds.count(I) == 2 * m
        # W is strictly first-in first-out: the W order repeats the I order
        order_i = [(c.stage, c.microbatch) for c in comps if c.type is I]
        assert [(c.stage, c.microbatch) for c in comps if c.type is W] == order_i
        # splits: every step-3 and step-7 backward, and h+1 of the step-6 ones
        assert len(order_i) == 2 * (n - h - 1) + (h + 1)
        pairs = [a for a in row if a.type is PAIR]
        # pairs hold a full B, forward and backward from the rank's two different stages
        for pair in pairs:
            fwd, bwd = pair.sub_actions
            assert fwd.type is F and bwd.type is B and fwd.stage != bwd.stage
        # every forward after the warm-up (steps 1-3) is overlapped, except the V tip's first main-phase one
        assert len(pairs) == 2 * m - (3 * n - h - 1) - int(tip)
        first_full_b = next(a for a in row if B in (c.type for c in a.computations))
        assert (first_full_b.type is B) == tip, "only the V's tip leaves its first main-phase pair split"


@settings(max_examples=40, deadline=None)
@given(dualpipev_configs)
def test_dualpipev_follows_deepseek_facts(config: tuple[int, int]) -> None:
    check_deepseek_facts(dualpipev(*config))


@settings(max_examples=30, deadline=None)
@given(dualpipe_configs)
def test_dualpipe_follows_deepseek_facts(config: tuple[int, int]) -> None:
    check_deepseek_facts(dualpipe(*config))


def test_dualpipe_middle_ranks_start_main_phase_unoverlapped() -> None:
    schedule = dualpipe(8, 20)
    split_first = [r for r, row in enumerate(schedule.actions) if next(a for a in row if a.type in (B, PAIR)).type is B]
    assert split_first == [3, 4]


@pytest.mark.parametrize(("name", "num_ranks"), [("DualPipeV", 1), ("DualPipeV", 3), ("DualPipe", 2), ("DualPipe", 6)])
def test_smallest_microbatch_count_builds_a_valid_schedule(name: str, num_ranks: int) -> None:
    assert validate(get_schedule(name, num_ranks, 2 * num_ranks)) == []


# --- configuration errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "num_ranks", "num_microbatches", "v", "needle"),
    [
        ("DualPipe", 3, 12, None, "--ranks 3"),
        ("DualPipe", 1, 4, None, "--ranks 1"),
        ("DualPipe", 4, 9, None, "--mb 9"),
        ("DualPipe", 4, 6, None, "--mb 6"),
        ("DualPipe", 4, 8, 3, "--stages-per-rank 3"),
        ("DualPipeV", 4, 7, None, "--mb 7"),
        ("DualPipeV", 4, 8, 1, "--stages-per-rank 1"),
    ],
)
def test_impossible_config_is_refused_in_one_line(
    name: str, num_ranks: int, num_microbatches: int, v: int | None, needle: str
) -> None:
    with pytest.raises(ScheduleConfigError) as info:
        get_schedule(name, num_ranks, num_microbatches, v)
    message = str(info.value)
    assert needle in message and "\n" not in message and "pass -" in message


def test_dualpipev_microbatch_minimum_is_twice_the_ranks() -> None:
    dualpipev(5, 10)
    with pytest.raises(ScheduleConfigError, match="at least"):
        dualpipev(5, 9)


def test_error_suggestion_is_itself_accepted() -> None:
    # the fix named in each message builds
    for name, r, m, fixed in (("DualPipe", 4, 5, ("DualPipe", 4, 8)), ("DualPipeV", 3, 4, ("DualPipeV", 3, 6))):
        with pytest.raises(ScheduleConfigError, match=f"pass -m {fixed[2]}"):
            get_schedule(name, r, m)
        assert validate(get_schedule(*fixed)) == []


def test_specs_describe_placement_and_torch_names() -> None:
    v_spec, d_spec = get_spec("dualpipev"), get_spec("DUALPIPE")
    assert v_spec.torch_name == "DualPipeV" and d_spec.torch_name is None
    assert v_spec.fixed_stages_per_rank == d_spec.fixed_stages_per_rank == 2
    assert "even" in d_spec.constraints and "2 x ranks" in v_spec.constraints


# --- unit-cost worked cases (formulas.md) --------------------------------------------------------------------------


UNIT = "F=1,B=2,I=1,W=1,FB=3"


@pytest.mark.parametrize(
    ("name", "num_ranks", "num_microbatches", "makespan", "idle", "peak"),
    [("DualPipeV", 4, 10, 66, 6, 9), ("DualPipe", 8, 20, 66, 6, 9), ("DualPipe", 4, 8, 26, 2, 5)],
)
def test_unit_cost_worked_case(
    name: str, num_ranks: int, num_microbatches: int, makespan: float, idle: float, peak: int
) -> None:
    from ppsim.costs import parse_costs
    from ppsim.simulator import simulate

    result = simulate(get_schedule(name, num_ranks, num_microbatches), parse_costs(UNIT))
    assert result.makespan == pytest.approx(makespan)
    assert [s.idle for s in result.per_rank] == pytest.approx([idle] * num_ranks)
    assert [s.busy for s in result.per_rank] == pytest.approx([makespan - idle] * num_ranks)
    # the README's p + 1 activations, p = stages in one chain
    assert max(s.peak_activations for s in result.per_rank) == peak == len(result.schedule.pipelines[0]) + 1


def test_dualpipev_cheaper_pairs_worked_case() -> None:
    from ppsim.costs import parse_costs
    from ppsim.simulator import simulate

    R = 4
    result = simulate(dualpipev(R, 10), parse_costs("F=1,B=2,I=1,W=1,FB=2.5"))
    assert result.makespan == pytest.approx(59)
    idle = [s.idle for s in result.per_rank]
    assert idle == pytest.approx([3.5, 4, 4.5, 4.5])
    # the README bubble (p/2-1)(F&B+B-3W) with p = 2R stages is the largest idle time
    assert max(idle) == pytest.approx((2 * R / 2 - 1) * (2.5 + 2 - 3 * 1))
