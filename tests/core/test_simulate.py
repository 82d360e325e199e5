"""The discrete-event simulator against closed forms (formulas.md), the reference orders, and its result API."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_costs import make_profile

import ppsim
from ppsim import DeadlockError, get_schedule, parse_costs, simulate
from ppsim.costs import CostSpec
from ppsim.errors import CostError, ScheduleFormatError
from ppsim.formats import read_csv
from ppsim.ir import Schedule, parse_action

DEFAULT = dict(F=1.0, B=2.0, I=1.0, W=1.0, FB=3.0)


def max_idle(result: ppsim.SimResult) -> float:
    return max(s.idle for s in result.per_rank)


def max_peak(result: ppsim.SimResult) -> int:
    return max(s.peak_activations for s in result.per_rank)


def schedule_of(rows: list[list[str]], stage_to_rank: tuple[int, ...], num_microbatches: int) -> Schedule:
    actions = tuple(tuple(a for a in map(parse_action, row) if a is not None) for row in rows)
    return Schedule("hand", actions, stage_to_rank, num_microbatches)


# -- closed forms: the DualPipe README table ---------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_1f1b_bubble_makespan_and_activations_match_the_table(p: int, factor: int) -> None:
    m = factor * p + (factor == 3)
    for text in (None, "F=1.5,B=2.5"):
        costs = parse_costs(text)
        f, b = costs.F[0], costs.B[0]
        r = simulate(get_schedule("1F1B", p, m), costs)
        assert r.makespan == pytest.approx((m + p - 1) * (f + b))
        assert max_idle(r) == pytest.approx((p - 1) * (f + b))
        assert max_peak(r) == p


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_zb1p_bubble_and_activations_match_the_table(p: int, factor: int) -> None:
    m = factor * p + (factor == 3)
    c = DEFAULT
    r = simulate(get_schedule("ZBH1", p, m))
    assert max_idle(r) == pytest.approx((p - 1) * (c["F"] + c["B"] - 2 * c["W"]))
    assert max_peak(r) == p


@pytest.mark.parametrize("num_ranks", [2, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 2, 5])
@pytest.mark.parametrize("fb", [3.0, 2.5, 2.0])
def test_dualpipev_bubble_and_activations_match_the_table(num_ranks: int, extra: int, fb: float) -> None:
    p = 2 * num_ranks
    m = 2 * num_ranks + extra
    r = simulate(get_schedule("DualPipeV", num_ranks, m), parse_costs(f"FB={fb}"))
    c = DEFAULT
    assert max_idle(r) == pytest.approx((p / 2 - 1) * (fb + c["B"] - 3 * c["W"]))
    assert max_peak(r) == p + 1


@pytest.mark.parametrize("num_ranks", [4, 6, 8])
@pytest.mark.parametrize("extra", [0, 2, 6])
@pytest.mark.parametrize("fb", [3.0, 2.5])
def test_dualpipe_bubble_and_activations_match_the_table(num_ranks: int, extra: int, fb: float) -> None:
    p = num_ranks
    m = 2 * num_ranks + extra
    r = simulate(get_schedule("DualPipe", num_ranks, m), parse_costs(f"FB={fb}"))
    c = DEFAULT
    assert max_idle(r) == pytest.approx((p / 2 - 1) * (fb + c["B"] - 3 * c["W"]))
    assert max_peak(r) == p + 1


def test_dualpipe_holds_two_model_copies_so_static_bytes_double() -> None:
    costs = CostSpec.from_profile(make_profile(4)).tables
    one = simulate(get_schedule("1F1B", 4, 8), costs)
    two = simulate(get_schedule("DualPipe", 4, 8), costs)
    assert two.trace.static_bytes[0] == one.trace.static_bytes[0] + one.trace.static_bytes[3]


# -- closed forms: Megatron interleaved ----------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m", "expected"), [(4, 8, 28.5), (8, 16, 58.5)])
def test_megatron_interleaved_worked_values(p: int, m: int, expected: float) -> None:
    # F=1, B=2 per full stage: with v=2 chunks each chunk costs F/v and B/v
    r = simulate(get_schedule("Interleaved1F1B", p, m, 2), parse_costs("F=0.5,B=1"))
    assert r.makespan == pytest.approx(expected)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2])
def test_interleaved_bubble_is_1f1b_bubble_over_v(p: int, v: int, rounds: int) -> None:
    m = rounds * p
    f, b = 1.0, 2.0
    r = simulate(get_schedule("Interleaved1F1B", p, m, v), parse_costs(f"F={f / v},B={b / v}"))
    for s in r.per_rank:
        assert s.idle == pytest.approx((p - 1) * (f + b) / v)
    assert r.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))


# -- the worked cases --------------------------------------------------------------------------------------------


def test_dualpipev_4_ranks_10_microbatches_is_66_wide_with_idle_6_and_peak_9() -> None:
    r = simulate(get_schedule("DualPipeV", 4, 10))
    assert r.makespan == 66
    assert [s.busy for s in r.per_rank] == [60] * 4
    assert [s.idle for s in r.per_rank] == [6] * 4
    assert [s.peak_activations for s in r.per_rank] == [9] * 4


def test_dualpipe_8_ranks_20_microbatches_is_66_wide_with_idle_6_and_peak_9() -> None:
    r = simulate(get_schedule("DualPipe", 8, 20))
    assert r.makespan == 66
    assert [s.idle for s in r.per_rank] == [6] * 8
    assert [s.peak_activations for s in r.per_rank] == [9] * 8


def test_dualpipev_with_cheaper_overlap_is_59_with_uneven_idle() -> None:
    r = simulate(get_schedule("DualPipeV", 4, 10), parse_costs("FB=2.5"))
    assert r.makespan == 59
    assert [s.idle for s in r.per_rank] == [3.5, 4, 4.5, 4.5]
    assert max_idle(r) == (8 / 2 - 1) * (2.5 + 2 - 3)


def test_dualpipe_4_ranks_8_microbatches_is_26_with_idle_2_and_peak_5() -> None:
    r = simulate(get_schedule("DualPipe", 4, 8))
    assert r.makespan == 26
    assert [s.idle for s in r.per_rank] == [2] * 4
    assert [s.peak_activations for s in r.per_rank] == [5] * 4


def test_reference_dualpipev_csv_replays_to_the_figure_width(reference_dir: Path) -> None:
    s = read_csv(reference_dir / "dualpipev_4ranks_10mb.csv")
    r = simulate(s)
    assert r.makespan == 66
    assert [st.peak_activations for st in r.per_rank] == [9] * 4


@pytest.mark.parametrize(("name", "ranks", "mbs", "width", "idle"), [
    ("dualpipe_8ranks_20mb.csv", 8, 20, 66, 6), ("dualpipe_4ranks_8mb.csv", 4, 8, 26, 2)])
def test_reference_dualpipe_csvs_replay_with_two_pipelines(
    reference_dir: Path, name: str, ranks: int, mbs: int, width: float, idle: float
) -> None:
    s = read_csv(reference_dir / name, num_pipelines=2)
    assert s.num_ranks == ranks and s.num_microbatches == mbs
    r = simulate(s)
    assert r.makespan == width
    assert [st.idle for st in r.per_rank] == [idle] * ranks


# -- engine rules ------------------------------------------------------------------------------------------------


def test_cross_rank_hand_off_arrives_comm_after_the_producer_and_same_rank_is_free() -> None:
    # rank 0 holds stages 0 and 2, rank 1 holds stage 1
    s = schedule_of([["0F0", "2F0", "2B0", "0B0"], ["1F0", "1B0"]], (0, 1, 0), 1)
    r = simulate(s, parse_costs("F=1,B=2,comm=0.25"))
    assert r.starts[1][0] == 1.25  # 1F0 waits for 0F0 (ends 1) + comm
    assert r.starts[0][1] == 2.25 + 0.25  # 2F0 waits for 1F0 (ends 2.25) + comm
    assert r.starts[0][2] == 3.5  # 2B0 needs its own F on the same rank: no delay
    assert r.starts[1][1] == 5.5 + 0.25
    assert r.starts[0][3] == 7.75 + 0.25
    assert r.makespan == 10.0


def test_an_overlapped_pair_waits_for_both_inputs_and_both_halves_end_together() -> None:
    s = get_schedule("DualPipeV", 2, 4)
    r = simulate(s, parse_costs("FB=2.5,comm=0.1"))
    tl = r.timeline()
    pairs = tl[tl["pair"]]
    assert len(pairs) > 0
    for (_rank, _pos), g in pairs.groupby(["rank", "position"]):
        assert len(g) == 2
        assert g["end"].nunique() == 1 and g["start"].nunique() == 1
        f_half, b_half = g.iloc[0], g.iloc[1]
        assert f_half["type"] == "F" and b_half["type"] in ("B", "I")
        assert f_half["half_end"] == pytest.approx(b_half["half_start"])
        assert f_half["half_start"] == f_half["start"] and b_half["half_end"] == b_half["end"]
        assert f_half["end"] - f_half["start"] == pytest.approx(2.5)
        # forward half drawn in its F : B share
        assert f_half["half_end"] - f_half["start"] == pytest.approx(2.5 / 3)


def test_schedule_with_no_actions_simulates_to_zero() -> None:
    s = Schedule("empty", ((), ()), (0, 1), 1)
    r = simulate(s)
    assert r.makespan == 0 and r.bubble_ratio == 0
    assert r.timeline().empty and r.transfers().empty


# -- deadlocks and malformed orders ------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "order.csv"
    path.write_text(text)
    return path


def test_a_cyclic_wait_raises_deadlock_naming_each_blocked_rank(tmp_path: Path) -> None:
    path = _write(tmp_path, "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(DeadlockError) as info:
        simulate(read_csv(path))
    err = info.value
    assert err.blocked == {0: ("0B0", "1B0 (on rank 1)"), 1: ("1F1", "0F1 (on rank 0)")}
    assert "\n" not in str(err) and "rank 0" in str(err) and "rank 1" in str(err)


def test_an_action_before_its_own_input_on_the_same_rank_deadlocks(tmp_path: Path) -> None:
    path = _write(tmp_path, "0F0,0B0\n1B0,1F0\n")
    with pytest.raises(DeadlockError) as info:
        simulate(read_csv(path))
    assert info.value.blocked[1] == ("1B0", "1F0 (later on the same rank)")


def test_an_input_no_rank_computes_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "0F0,0B0,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(DeadlockError) as info:
        simulate(read_csv(path))
    assert info.value.blocked[1] == ("1F1", "0F1 (no rank computes it)")


def test_a_duplicated_computation_is_a_format_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "0F0,0F0,0B0\n1F0,1B0\n")
    with pytest.raises(ScheduleFormatError, match="second time"):
        simulate(read_csv(path))


def test_a_deadlock_is_a_user_error_not_a_crash() -> None:
    assert issubclass(DeadlockError, ValueError)


# -- memory ------------------------------------------------------------------------------------------------------


def test_without_a_profile_peak_bytes_are_none_and_no_rank_is_flagged() -> None:
    r = simulate(get_schedule("1F1B", 4, 8), memory_cap_bytes=1)
    assert all(s.peak_memory_bytes is None and not s.over_memory_cap for s in r.per_rank)
    assert r.memory()["bytes"].isna().all()


def test_profile_peak_bytes_are_static_plus_held_activations_and_the_cap_flags_ranks() -> None:
    costs = CostSpec.from_profile(make_profile(4)).tables
    s = get_schedule("1F1B", 4, 8)
    r = simulate(s, costs)
    for st in r.per_rank:
        stage = st.rank
        static = 40_000 + stage
        assert st.peak_memory_bytes == static + st.peak_activations * 1000 * (stage + 1)
    peaks = [st.peak_memory_bytes or 0 for st in r.per_rank]
    cap = sorted(peaks)[1]
    capped = simulate(s, costs, memory_cap_bytes=cap)
    expected = tuple(rank for rank, peak in enumerate(peaks) if peak > cap)
    assert 0 < len(expected) < 4
    assert capped.over_memory_cap == expected
    assert [st.over_memory_cap for st in capped.per_rank] == [rank in expected for rank in range(4)]


def test_split_backward_frees_the_input_part_at_i_and_the_rest_at_w() -> None:
    costs = CostSpec.from_profile(make_profile(2)).tables
    s = schedule_of([["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]], (0, 1), 1)
    mem = simulate(s, costs).memory()
    rank1 = mem[mem["rank"] == 1]["bytes"].tolist()
    static = 40_001
    assert rank1 == [static, static + 2000, static + 2000 - 800, static]


def test_memory_over_time_starts_and_ends_at_the_static_level() -> None:
    costs = CostSpec.from_profile(make_profile(4)).tables
    r = simulate(get_schedule("DualPipe", 4, 8), costs)
    mem = r.memory()
    for rank, g in mem.groupby("rank"):
        assert g["time"].iloc[0] == 0 and g["activations"].iloc[0] == 0
        assert g["activations"].iloc[-1] == 0
        assert g["bytes"].iloc[-1] == g["bytes"].iloc[0] == r.trace.static_bytes[rank]
        assert g["activations"].max() == r.per_rank[rank].peak_activations
        assert g["bytes"].max() == r.per_rank[rank].peak_memory_bytes


# -- result API --------------------------------------------------------------------------------------------------


def test_to_dict_has_exactly_the_contract_keys() -> None:
    r = simulate(get_schedule("ZBH1", 4, 8), parse_costs("F=1,B=2"))
    d = r.to_dict()
    assert set(d) == {"schedule", "ranks", "microbatches", "stages", "stages_per_rank", "makespan", "bubble_ratio",
                      "per_rank", "costs"}
    assert set(d["per_rank"][0]) == {"rank", "busy", "idle", "bubble_ratio", "peak_activations",
                                     "peak_memory_bytes"}
    assert d["costs"] == r.costs.to_dict()
    assert d["bubble_ratio"] == pytest.approx(1 - sum(s["busy"] for s in d["per_rank"]) / (4 * d["makespan"]))
    json.dumps(d)


def test_timeline_has_one_row_per_computation_aligned_with_starts() -> None:
    s = get_schedule("DualPipeV", 2, 4)
    r = simulate(s)
    tl = r.timeline()
    assert len(tl) == sum(len(a.computations) for row in s.actions for a in row)
    assert list(tl.columns) == ["rank", "position", "action", "stage", "microbatch", "type", "start", "end", "chunk",
                                "direction", "pair", "half_start", "half_end"]
    for row in tl.itertuples():
        action = s.actions[row.rank][row.position]
        assert row.action == str(action)
        assert row.start == r.starts[row.rank][row.position] and row.end == r.ends[row.rank][row.position]
        assert row.chunk == s.chunk(row.stage) and row.direction == s.direction(row.stage)


def test_transfers_are_the_rank_crossing_hand_offs_with_their_delay() -> None:
    s = get_schedule("1F1B", 3, 4)
    r = simulate(s, parse_costs("comm=0.5"))
    tr = r.transfers()
    # each of 2 boundaries carries m activations forward and m gradients back
    assert len(tr) == 2 * 2 * 4
    assert (tr["src_rank"] != tr["dst_rank"]).all()
    assert (tr["arrive"] - tr["send"] == 0.5).all()
    assert set(tr["kind"]) == {"F", "B"}
    for row in tr.itertuples():
        assert r.starts[row.dst_rank][row.dst_position] >= row.arrive
        assert r.ends[row.src_rank][row.src_position] == row.send


def test_throughput_is_microbatches_per_unit_time() -> None:
    r = simulate(get_schedule("GPipe", 2, 4))
    assert r.throughput == pytest.approx(4 / r.makespan)
    assert r.unit == "unit"


def test_a_profile_that_does_not_fit_the_schedule_is_refused() -> None:
    with pytest.raises(CostError, match="--stages 8"):
        simulate(get_schedule("DualPipeV", 4, 8), CostSpec.from_profile(make_profile(4)).tables)


def test_library_api_exports_simulate_and_cost_parsers() -> None:
    assert ppsim.simulate is simulate
    import ppsim.simulator as module  # the module has its own name: importing it leaves the function in place

    assert module.simulate is simulate and ppsim.simulate is simulate
    for name in ("simulate", "parse_costs", "load_costs", "SimResult", "StageCosts"):
        assert name in ppsim.__all__
    assert callable(ppsim.load_costs)


def test_times_are_finite() -> None:
    r = simulate(get_schedule("ZBVZeroBubble", 4, 8), parse_costs("comm=0.2"))
    assert all(math.isfinite(t) for row in r.ends for t in row)


def test_communication_actions_in_an_order_take_no_time_and_change_nothing() -> None:
    plain = schedule_of([["0F0", "0B0"], ["1F0", "1B0"]], (0, 1), 1)
    with_comms = schedule_of([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
                             (0, 1), 1)
    a, b = simulate(plain, parse_costs("comm=0.5")), simulate(with_comms, parse_costs("comm=0.5"))
    assert b.makespan == a.makespan
    assert [s.busy for s in b.per_rank] == [s.busy for s in a.per_rank]
    assert b.starts[0][3] == a.starts[0][1] and b.starts[1][1] == a.starts[1][0]
    assert len(b.timeline()) == 4
