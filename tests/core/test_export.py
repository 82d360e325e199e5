"""Timed JSON and Chrome/Perfetto trace exports of a simulated timeline."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_costs import make_profile
from test_simulate_properties import library_schedules, pair_schedules, uniform_costs

from ppsim import get_schedule, parse_costs, simulate
from ppsim.costs import CostSpec
from ppsim.export import chrome_trace, write_chrome_trace, write_json_timeline


def _ns(x: float) -> int:
    return round(x * 1000)


def _lanes(trace: dict[str, Any]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    lanes: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
    return lanes


def test_json_timeline_lists_every_action_with_its_simulated_times(tmp_path: Path) -> None:
    s = get_schedule("DualPipeV", 2, 4)
    r = simulate(s, parse_costs("FB=2.5,comm=0.1"))
    path = write_json_timeline(r, tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert data["schedule"] == "DualPipeV" and data["ranks"] == 2 and data["stage_to_rank"] == list(s.stage_to_rank)
    assert data["makespan"] == r.makespan and data["unit"] == "unit"
    assert len(data["actions"]) == s.num_actions
    for entry in data["actions"]:
        rank, pos = entry["rank"], entry["position"]
        assert entry["action"] == str(s.actions[rank][pos])
        assert (entry["start"], entry["end"]) == (r.starts[rank][pos], r.ends[rank][pos])
        if entry["type"] == "OVERLAP_F_B":
            f, b = entry["halves"]
            assert f["start"] == entry["start"] and b["end"] == entry["end"] and f["end"] == b["start"]
        else:
            assert entry["microbatch"] == s.actions[rank][pos].microbatch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("name", "ranks", "mbs", "costs"),
    [("1F1B", 4, 8, "comm=5"), ("DualPipeV", 3, 8, "FB=2.5,comm=0.75"), ("Interleaved1F1B", 2, 4, None)],
)
def test_chrome_trace_parses_and_no_two_events_overlap_on_a_lane(
    tmp_path: Path, name: str, ranks: int, mbs: int, costs: str | None
) -> None:
    s = get_schedule(name, ranks, mbs)
    r = simulate(s, parse_costs(costs))
    path = write_chrome_trace(r, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    for (_pid, _tid), spans in _lanes(trace).items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {rank: f"rank {rank}" for rank in range(ranks)}
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert len(compute) == sum(len(a.computations) for row in s.actions for a in row)
    assert all({"stage", "microbatch"} <= set(e["args"]) for e in compute)


def test_chrome_trace_uses_real_durations_in_microseconds() -> None:
    costs = CostSpec.from_profile(make_profile(2)).tables
    r = simulate(get_schedule("1F1B", 2, 2), costs)
    trace = chrome_trace(r)
    first = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "0F0")
    assert first["dur"] == pytest.approx(costs.F[0] * 1e6)
    assert trace["otherData"]["us_per_unit"] == 1e6


def test_overlapping_hand_offs_to_one_peer_get_separate_comm_lanes() -> None:
    # forwards of 1 unit with a 5-unit comm: several activations are in flight to rank 1 at once
    r = simulate(get_schedule("GPipe", 2, 6), parse_costs("F=1,B=2,comm=5"))
    trace = chrome_trace(r)
    comm_lanes = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"}
    assert len([lane for lane in comm_lanes if lane[0] == 0]) > 1
    lane_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert all(lane in lane_names and "send to rank" in lane_names[lane] for lane in comm_lanes)


def test_flow_arrows_join_each_producer_to_its_consumer_on_another_rank() -> None:
    r = simulate(get_schedule("DualPipeV", 2, 4), parse_costs("comm=0.5"))
    trace = chrome_trace(r)
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert starts.keys() == finishes.keys() and len(starts) == len(r.transfers())
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]

    def inside(event: dict[str, Any]) -> bool:
        t = _ns(event["ts"])
        return any(e["pid"] == event["pid"] and _ns(e["ts"]) <= t <= _ns(e["ts"]) + _ns(e["dur"]) for e in compute)

    for k, s_event in starts.items():
        f_event = finishes[k]
        assert f_event["bp"] == "e"
        assert s_event["pid"] != f_event["pid"]
        assert _ns(f_event["ts"]) >= _ns(s_event["ts"]) + _ns(0.5 * 1000) - 1
        assert inside(s_event) and inside(f_event)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.one_of(library_schedules(), pair_schedules()), costs=uniform_costs())
def test_random_schedules_give_traces_without_overlap_on_any_lane(schedule: Any, costs: Any) -> None:
    trace = json.loads(json.dumps(chrome_trace(simulate(schedule, costs))))
    for spans in _lanes(trace).values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
