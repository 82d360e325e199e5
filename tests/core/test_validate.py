"""`validate` and the CSV reader report each problem with rank, position and action."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import DeadlockError, ScheduleFormatError
from ppsim.formats import read_csv, read_schedule_file, schedule_from_rows
from ppsim.validate import check_progress, validate

runner = CliRunner()

GOOD_1F1B_2x2 = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def write(tmp_path: Path, text: str, name: str = "s.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(tmp_path: Path, text: str, **kw: int) -> list[str]:
    return [str(p) for p in validate(read_csv(write(tmp_path, text), **kw))]


def test_valid_file_passes(tmp_path: Path) -> None:
    assert problems_of(tmp_path, GOOD_1F1B_2x2) == []
    result = runner.invoke(app, ["validate", str(write(tmp_path, GOOD_1F1B_2x2))])
    assert result.exit_code == 0 and result.stdout.strip() == "valid"


def test_idle_cells_keep_their_column_positions(tmp_path: Path) -> None:
    text = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    sched = read_csv(write(tmp_path, text))
    assert sched.to_rows() == [r.split(",") for r in text.strip().split("\n")]
    dup = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F0,1B1\n"
    assert problems_of(tmp_path, dup)[0].startswith("rank 1, position 3, action 1F0: duplicate 1F0")


def test_duplicate_action_is_reported_at_second_occurrence(tmp_path: Path) -> None:
    out = problems_of(tmp_path, "0F0,0F0,0B0\n1F0,1B0\n")
    assert "rank 0, position 1, action 0F0: duplicate 0F0: already at rank 0, position 0" in out


def test_w_before_i_is_reported(tmp_path: Path) -> None:
    out = problems_of(tmp_path, "0F0,0W0,0I0\n1F0,1I0,1W0\n")
    assert any(p.startswith("rank 0, position 1, action 0W0: 0W0 runs before its input backward 0I0") for p in out)


def test_backward_before_forward_is_reported(tmp_path: Path) -> None:
    out = problems_of(tmp_path, "0B0,0F0\n1F0,1B0\n")
    assert any("rank 0, position 0, action 0B0: 0B0 runs before its forward 0F0" in p for p in out)


def test_missing_backward_is_reported(tmp_path: Path) -> None:
    out = problems_of(tmp_path, "0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")
    assert out == ["rank 0, action 0B1: missing backward 0B1 (or 0I1 and 0W1)"]


def test_missing_w_after_i_is_reported(tmp_path: Path) -> None:
    assert problems_of(tmp_path, "0F0,0I0\n1F0,1B0\n") == ["rank 0, action 0W0: missing backward 0W0"]


def test_microbatch_out_of_range_with_explicit_count(tmp_path: Path) -> None:
    out = problems_of(tmp_path, GOOD_1F1B_2x2, num_microbatches=1)
    assert any("microbatch 1 out of range 0..0" in p for p in out)


def test_stage_on_two_ranks_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(ScheduleFormatError, match="rank 1, position 0: action 0F1 runs stage 0, which rank 0"):
        read_csv(write(tmp_path, "0F0,0B0\n0F1,0B1\n"))
    result = runner.invoke(app, ["validate", str(write(tmp_path, "0F0,0B0\n0F1,0B1\n"))])
    assert result.exit_code == 1 and "each stage must live on exactly one rank" in result.stdout


def test_cross_rank_deadlock_names_every_blocked_head(tmp_path: Path) -> None:
    # rank 0 waits for the gradient of microbatch 0 before sending forward microbatch 1 that rank 1 waits for
    text = "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"
    sched = read_csv(write(tmp_path, text))
    with pytest.raises(DeadlockError) as err:
        check_progress(sched)
    assert err.value.blocked == {0: ("0B0", "1B0 (on rank 1)"), 1: ("1F1", "0F1 (on rank 0)")}
    assert "\n" not in str(err.value)
    out = [str(p) for p in validate(sched)]
    assert out == [
        "rank 0, position 1, action 0B0: deadlock: waits for 1B0 (on rank 1)",
        "rank 1, position 0, action 1F1: deadlock: waits for 0F1 (on rank 0)",
    ]
    result = runner.invoke(app, ["validate", str(write(tmp_path, text))])
    assert result.exit_code == 1 and "deadlock" in result.stdout


def test_malformed_token_exits_2_with_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(write(tmp_path, "0F0,0Q1\n"))])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "rank 0, position 1" in result.stderr and "'0Q1'" in result.stderr


def test_empty_file_and_missing_path_exit_2(tmp_path: Path) -> None:
    empty = runner.invoke(app, ["validate", str(write(tmp_path, "\n\n"))])
    assert empty.exit_code == 2 and "is empty" in empty.stderr
    missing = runner.invoke(app, ["validate", str(tmp_path / "nope.csv")])
    assert missing.exit_code == 2 and "not found" in missing.stderr


def test_comms_actions_are_dropped_and_counted(tmp_path: Path) -> None:
    text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    sf = read_schedule_file(write(tmp_path, text))
    assert sf.dropped == (("RECV_B", 1), ("RECV_F", 1), ("SEND_B", 1), ("SEND_F", 1))
    sched = schedule_from_rows(sf.rows, name="s")
    assert validate(sched) == []
    result = runner.invoke(app, ["validate", str(write(tmp_path, text))])
    assert result.exit_code == 0 and "dropped 1 RECV_B, 1 RECV_F, 1 SEND_B, 1 SEND_F" in result.stderr


def test_dualpipe_reference_needs_two_directions(reference_dir: Path) -> None:
    path = reference_dir / "dualpipe_4ranks_8mb.csv"
    assert validate(read_csv(path, num_pipelines=2)) == []
    one_chain = [str(p) for p in validate(read_csv(path))]
    assert one_chain and all("deadlock" in p for p in one_chain)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1 and "--directions 2" in result.stderr


@pytest.mark.torch
def test_torch_1f1b_export_is_reported_invalid(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ranks, m = 4, 8
    rows = get_schedule_ops("1F1B", ranks, m)
    text = "\n".join(",".join("" if a is None else str(a) for a in row) for row in rows) + "\n"
    path = write(tmp_path, text, "torch_1f1b.csv")
    out = [str(p) for p in validate(read_csv(path, num_microbatches=m))]
    last = ranks - 1
    assert any(p.startswith(f"rank {last},") and f"microbatch {m} out of range" in p for p in out)
    assert f"rank {last}, action {last}F0: missing forward {last}F0" in out
    result = runner.invoke(app, ["validate", str(path), "-m", str(m)])
    assert result.exit_code == 1 and f"missing forward {last}F0" in result.stdout


def test_a_huge_microbatch_id_lists_a_bounded_number_of_missing_computations() -> None:
    from ppsim.ir import Action, ActionType, Schedule

    F, B = ActionType.F, ActionType.B
    big = 999_999_999
    rows = ((Action(0, F, 0), Action(0, B, 0), Action(0, F, big), Action(0, B, big)),
            (Action(1, F, 0), Action(1, B, 0), Action(1, F, big), Action(1, B, big)))
    problems = [str(p) for p in validate(Schedule("sparse", rows, (0, 1), big + 1))]
    assert 0 < len(problems) <= 2 * 100 + 1  # at most two per (stage, microbatch) listed, then one summary
    assert problems[0] == "rank 0, action 0F1: missing forward 0F1"
    assert problems[-1].startswith("more computations are missing")


def test_a_deadlock_of_many_ranks_names_a_few_in_one_line_and_keeps_them_all() -> None:
    from ppsim import get_schedule

    base = get_schedule("1F1B", 40, 1)
    swapped = base.with_actions([row[::-1] for row in base.actions])  # every rank starts with its backward
    with pytest.raises(DeadlockError) as info:
        check_progress(swapped)
    assert len(info.value.blocked) == 40
    message = str(info.value)
    assert "\n" not in message and "and 28 more ranks" in message


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_array_check_agrees_with_the_walk_on_mutated_orders(data: st.DataObject) -> None:
    from ppsim import get_schedule
    from ppsim.errors import ScheduleConfigError
    from ppsim.ir import Action, ActionType
    from ppsim.validate import _sound, _walk

    name = data.draw(st.sampled_from(["1F1B", "ZBH1", "Interleaved1F1B", "DualPipeV", "DualPipe", "ZBVZeroBubble"]))
    try:
        schedule = get_schedule(name, data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9)))
    except ScheduleConfigError:
        return
    rows = [list(row) for row in schedule.actions]
    for _ in range(data.draw(st.integers(0, 2))):
        r = data.draw(st.integers(0, len(rows) - 1))
        if not rows[r]:
            continue
        p = data.draw(st.integers(0, len(rows[r]) - 1))
        a = rows[r][p]
        how = data.draw(st.sampled_from(["drop", "duplicate", "swap", "microbatch", "move", "split"]))
        if how == "drop":
            del rows[r][p]
        elif how == "duplicate":
            rows[r].insert(p, a)
        elif how == "swap":
            q = data.draw(st.integers(0, len(rows[r]) - 1))
            rows[r][p], rows[r][q] = rows[r][q], a
        elif how == "microbatch" and not a.sub_actions:
            rows[r][p] = Action(a.stage, a.type, (a.microbatch or 0) + data.draw(st.integers(-1, 2)))
        elif how == "move":
            rows[(r + 1) % len(rows)].append(rows[r].pop(p))
        elif how == "split" and a.type is ActionType.B:
            rows[r][p : p + 1] = [Action(a.stage, ActionType.W, a.microbatch), Action(a.stage, ActionType.I, a.microbatch)]
    mutated = schedule.with_actions(rows)
    assert _sound(mutated) == (_walk(mutated) == [])
