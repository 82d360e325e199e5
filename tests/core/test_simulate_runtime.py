"""Runtime overheads on the cost model (compute_scale, dispatch_s, recv_posting), finiteness, and sizes that come
from counts (not from the largest id)."""

from __future__ import annotations

import dataclasses

import pytest
from replay import replay
from typer.testing import CliRunner

from ppsim import get_schedule, simulate
from ppsim.cli import app
from ppsim.costs import parse_costs
from ppsim.errors import CostError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.validate import validate

F, B = ActionType.F, ActionType.B


def test_default_overheads_reproduce_the_plain_cost_model_exactly() -> None:
    for name, r, m in (("1F1B", 4, 8), ("DualPipeV", 4, 10), ("ZBH1", 3, 5)):
        schedule = get_schedule(name, r, m)
        plain = parse_costs("F=1.3,B=2.9,FB=3.7,comm=0.35")
        explicit = dataclasses.replace(plain, compute_scale=1.0, dispatch_s=0.0, recv_posting="early")
        a, b = simulate(schedule, plain), simulate(schedule, explicit)
        assert a.starts == b.starts and a.ends == b.ends and a.makespan == b.makespan


def test_compute_scale_multiplies_every_duration_and_dispatch_is_added_per_computation() -> None:
    schedule = get_schedule("DualPipeV", 2, 4)
    base = parse_costs("F=1,B=2,FB=2.5")
    costs = dataclasses.replace(base, compute_scale=2.0, dispatch_s=0.25)
    result = simulate(schedule, costs)
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            took = result.ends[rank][pos] - result.starts[rank][pos]
            halves = len(action.computations)
            assert took == pytest.approx(base.duration(schedule, action) * 2.0 + 0.25 * halves)
    assert any(a.type is ActionType.OVERLAP_F_B for row in schedule.actions for a in row)


def test_consumer_posting_starts_a_hand_off_after_the_consumer_rank_is_free() -> None:
    # GPipe on 2 ranks: 0F1 ends at 2 while rank 1 runs 1F0 until 3; early posting delivers 0F1 at 3, consumer
    # posting sends it at 3 and delivers it at 4
    schedule = get_schedule("GPipe", 2, 2)
    early = parse_costs("F=1,B=2,comm=1")
    consumer = dataclasses.replace(early, recv_posting="consumer")
    assert simulate(schedule, early).starts[1][:2] == (2.0, 3.0)
    late = simulate(schedule, consumer)
    assert late.starts[1][:2] == (2.0, 4.0)
    ref = replay(schedule, consumer)
    assert [list(r) for r in late.starts] == ref.starts
    sends = late.transfers()
    row = sends[(sends.dst_rank == 1) & (sends.dst_position == 1)].iloc[0]
    assert (row.send, row.arrive) == (3.0, 4.0)


def test_unknown_recv_posting_is_refused() -> None:
    costs = dataclasses.replace(parse_costs(None), recv_posting="late")
    with pytest.raises(CostError, match="recv_posting 'late'"):
        simulate(get_schedule("1F1B", 2, 2), costs)


@pytest.mark.parametrize(
    "fields", [{"F": (1e308,), "B": (1e308,)}, {"comm": 1e308}, {"F": (1e308,)}, {"FB": (float("inf"),)}]
)
def test_costs_that_overflow_the_step_are_refused_with_one_line(fields: dict) -> None:
    # built directly: `--costs` refuses such values up front, a library caller or a profile may not
    costs = dataclasses.replace(parse_costs(None), **fields)
    with pytest.raises(CostError) as info:
        simulate(get_schedule("DualPipeV" if "FB" in fields else "1F1B", 4, 8), costs)
    message = str(info.value)
    assert "\n" not in message and "costs must keep the step finite" in message and "smaller units" in message


def test_cli_refuses_a_non_finite_makespan_instead_of_printing_nan() -> None:
    result = CliRunner().invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--costs", "F=1e308,B=1e308",
                                      "--json"])
    assert result.exit_code == 2
    assert "NaN" not in result.stdout and "Infinity" not in result.stdout
    assert result.stderr.strip().count("\n") == 0


def test_a_huge_microbatch_id_sizes_tables_by_count_not_by_id() -> None:
    big = 999_999_999
    rows = ((Action(0, F, big), Action(0, B, big)), (Action(1, F, big), Action(1, B, big)))
    schedule = Schedule("sparse", rows, (0, 1), big + 1)
    result = simulate(schedule)
    assert result.makespan == 6.0


def test_twenty_thousand_ranks_simulate_and_validate() -> None:
    schedule = get_schedule("1F1B", 20_000, 1)
    assert validate(schedule) == []
    assert simulate(schedule).makespan == 3.0 * 20_000


def test_an_id_beyond_64_bits_is_a_format_error() -> None:
    from ppsim.errors import ScheduleFormatError

    rows = ((Action(0, F, 0), Action(0, B, 0)), (Action(1, F, 2**70), Action(1, B, 0)))
    with pytest.raises(ScheduleFormatError, match="rank 1 position 0: 1F1180591620717411303424 has an id beyond"):
        simulate(Schedule("huge", rows, (0, 1), 1))
