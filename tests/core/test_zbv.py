"""ZBVZeroBubble: valid for every microbatch count torch accepts, backwards split, zero-bubble memory and bubble.

torch parity over the whole grid lives in test_torch_parity.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim.errors import ScheduleConfigError
from ppsim.ir import ActionType
from ppsim.schedules import get_schedule
from ppsim.validate import validate


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 60))
def test_zbv_is_valid_for_any_microbatch_count(num_ranks: int, num_microbatches: int) -> None:
    # fewer than 2R-1 microbatches included: torch lays out 2R-1 and drops the missing ones
    schedule = get_schedule("ZBVZeroBubble", num_ranks, num_microbatches)
    assert validate(schedule) == []
    assert schedule.stage_to_rank == tuple(list(range(num_ranks)) + list(reversed(range(num_ranks))))


@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(1, 1), (4, 3), (4, 16)])
def test_zbv_splits_every_backward(num_ranks: int, num_microbatches: int) -> None:
    schedule = get_schedule("ZBVZeroBubble", num_ranks, num_microbatches)
    kinds = [c.type for _, _, c in schedule.iter_computations()]
    assert ActionType.B not in kinds and ActionType.OVERLAP_F_B not in kinds
    expected = 2 * num_ranks * num_microbatches
    assert kinds.count(ActionType.I) == kinds.count(ActionType.W) == kinds.count(ActionType.F) == expected


def test_zbv_refuses_other_stages_per_rank() -> None:
    with pytest.raises(ScheduleConfigError, match="--stages-per-rank 3.*pass -v 2"):
        get_schedule("ZBVZeroBubble", 4, 8, 3)


def test_zbv_bubble_does_not_grow_with_microbatches_and_memory_matches_1f1b() -> None:
    from ppsim.costs import parse_costs
    from ppsim.simulator import simulate

    R = 4
    costs = parse_costs("F=1,B=2,I=1,W=1")
    idle = [
        [s.idle for s in simulate(get_schedule("ZBVZeroBubble", R, m), costs).per_rank] for m in (2 * R, 4 * R, 8 * R)
    ]
    assert idle[0] == idle[1] == idle[2]
    # zero-bubble README: ZBV holds 1x the activations of 1F1B, whose first stage holds p = 2R
    peaks = [s.peak_activations for s in simulate(get_schedule("ZBVZeroBubble", R, 8 * R), costs).per_rank]
    assert max(peaks) == 2 * R
