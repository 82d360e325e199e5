"""The action IR parses and formats torch's action strings exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppsim.errors import ScheduleFormatError
from ppsim.ir import Action, ActionType, overlap, parse_action

SINGLE_TYPES = [t for t in ActionType if t is not ActionType.OVERLAP_F_B]


@given(
    stage=st.integers(0, 999),
    kind=st.sampled_from(SINGLE_TYPES),
    microbatch=st.one_of(st.none(), st.integers(0, 9999)),
)
def test_single_action_string_round_trips(stage: int, kind: ActionType, microbatch: int | None) -> None:
    text = f"{stage}{kind.value}{'' if microbatch is None else microbatch}"
    action = parse_action(text)
    assert action == Action(stage, kind, microbatch)
    assert str(action) == text


def test_overlapped_pair_round_trips_with_halves() -> None:
    action = parse_action("(0F7;7B3)OVERLAP_F_B")
    assert action is not None
    assert action.type is ActionType.OVERLAP_F_B
    assert action.stage == -1 and action.microbatch is None
    assert action.sub_actions == (Action(0, ActionType.F, 7), Action(7, ActionType.B, 3))
    assert str(action) == "(0F7;7B3)OVERLAP_F_B"
    assert action.computations == action.sub_actions


def test_empty_cell_is_idle() -> None:
    assert parse_action("") is None
    assert parse_action("   ") is None


@pytest.mark.parametrize(
    "bad", ["F0", "0X1", "0F", "0F1x", "(0F1)OVERLAP_F_B", "(0F1;1B0", "(0B1;1F0)OVERLAP_F_B", "(0F1;)OVERLAP_F_B"]
)
def test_malformed_action_names_the_token_and_the_format(bad: str) -> None:
    if bad == "0F":  # torch's grammar allows a stage-wide action without microbatch
        assert str(parse_action(bad)) == "0F"
        return
    with pytest.raises(ScheduleFormatError) as err:
        parse_action(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "\n" not in msg


def test_overlap_requires_forward_then_backward() -> None:
    f, b = Action(0, ActionType.F, 1), Action(3, ActionType.B, 0)
    assert str(overlap(f, b)) == "(0F1;3B0)OVERLAP_F_B"
    with pytest.raises(ScheduleFormatError):
        overlap(b, f)


@pytest.mark.torch
def test_every_string_torch_writes_round_trips() -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    strings: set[str] = set()
    for name, v in [("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)]:
        for with_comms in (False, True):
            for row in get_schedule_ops(name, 4, 8, v, with_comms=with_comms):
                strings.update(str(a) for a in row if a is not None)
    for kind in _ComputationType:
        if kind is not _ComputationType.OVERLAP_F_B:
            strings.add(str(_Action(3, kind, None)))
            strings.add(str(_Action(12, kind, 34)))
    assert any("OVERLAP_F_B" in s for s in strings) and any("SEND_F" in s for s in strings)
    for s in strings:
        action = parse_action(s)
        assert str(action) == s
        assert str(_Action.from_str(str(action))) == s
