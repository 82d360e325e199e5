"""Activation recomputation: the memory and time model against the independent replay, and its invariants."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay import replay
from test_costs import make_profile
from test_simulate_properties import library_schedules, pair_schedules, random_orders, runtime_costs, times

from ppsim import get_schedule, simulate
from ppsim.costs import ACTIVATION_PARTS, CostSpec, StageCosts, parse_costs
from ppsim.errors import CostError
from ppsim.ir import Schedule
from ppsim.recompute import (
    Recompute,
    RecomputeError,
    RecomputeSet,
    read_sidecar,
    resolve,
    sidecar_path,
    write_sidecar,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def recompute_cases(draw: Any) -> tuple[Schedule, StageCosts, RecomputeSet]:
    schedule = draw(st.one_of(library_schedules(), pair_schedules(), random_orders()))
    costs = draw(runtime_costs(len(schedule.pipelines[0])))
    if costs.activation_bytes is None:
        costs = dataclasses.replace(costs, recompute_act=draw(st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 1.0])))
    else:  # boundaries from none to more than the stage's activation
        sizes = st.integers(0, 5000)
        costs = dataclasses.replace(costs, output_bytes=tuple(draw(sizes) for _ in costs.activation_bytes))
    full = sorted(RecomputeSet.full(schedule))
    chosen = draw(st.lists(st.sampled_from(full), unique=True)) if full else []
    return schedule, costs, RecomputeSet.of(chosen)


# -- against the replay -------------------------------------------------------------------------------------------


@SETTINGS
@given(recompute_cases())
def test_recompute_times_and_memory_equal_the_independent_replay(
    case: tuple[Schedule, StageCosts, RecomputeSet]
) -> None:
    schedule, costs, chosen = case
    result = simulate(schedule, costs, recompute=chosen)
    ref = replay(schedule, costs, chosen)
    assert not ref.stuck
    assert times(result) == (ref.starts, ref.ends)
    assert [p.peak_activations for p in result.per_rank] == ref.peak_activations
    if costs.activation_bytes is not None:
        static = [sum(costs.static_bytes_of(schedule, s) for s in schedule.stages_of(r))
                  for r in range(schedule.num_ranks)]
        assert [p.peak_memory_bytes for p in result.per_rank] == [a + b for a, b in zip(ref.peak_bytes, static)]
    mem = result.memory()
    for r, p in enumerate(result.per_rank):
        rows = mem[mem["rank"] == r]
        assert rows["activations"].max() == pytest.approx(p.peak_activations, abs=1e-9)
        assert rows["activations"].iloc[-1] == pytest.approx(0.0, abs=1e-9)


def test_an_empty_set_changes_nothing_float_for_float() -> None:
    s = get_schedule("ZBH1", 4, 8)
    c = parse_costs("F=1,B=2,comm=0.1")
    a, b = simulate(s, c), simulate(s, c, recompute=RecomputeSet())
    assert a.to_dict() == b.to_dict() and "recompute" not in b.to_dict()
    assert all(type(p.peak_activations) is int for p in b.per_rank)


# -- invariants -----------------------------------------------------------------------------------------------------


@SETTINGS
@given(recompute_cases(), st.data())
def test_recomputing_more_never_raises_memory_nor_lowers_the_makespan(
    case: tuple[Schedule, StageCosts, RecomputeSet], data: st.DataObject
) -> None:
    schedule, costs, chosen = case
    full = sorted(RecomputeSet.full(schedule))
    more = chosen | RecomputeSet.of(data.draw(st.lists(st.sampled_from(full), unique=True)) if full else [])
    less_result, more_result = simulate(schedule, costs, recompute=chosen), simulate(schedule, costs, recompute=more)
    plain = simulate(schedule, costs)
    for a, b, p in zip(less_result.per_rank, more_result.per_rank, plain.per_rank):
        assert b.peak_activations <= a.peak_activations <= p.peak_activations
        if p.peak_memory_bytes is not None:
            assert b.peak_memory_bytes <= a.peak_memory_bytes <= p.peak_memory_bytes  # type: ignore[operator]
    # a longer backward never lets anything finish earlier (in-order lanes, monotone in durations)
    assert more_result.makespan >= less_result.makespan >= plain.makespan


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "Interleaved1F1B", "ZBH2", "DualPipeV"])
def test_full_recompute_with_nothing_kept_holds_only_the_activation_being_recomputed(name: str) -> None:
    s = get_schedule(name, 4, 8)
    c = parse_costs("F=1,B=2,recompute_act=0")
    result = simulate(s, c, recompute=RecomputeSet.full(s))
    split_backward = any(a.type.value == "I" for row in s.actions for a in row)
    for p in result.per_rank:
        if split_backward:  # an I re-materialises and W releases: at most what is between I and W, plus one
            assert p.peak_activations <= simulate(s, c).per_rank[p.rank].peak_activations
        else:
            assert p.peak_activations == 1  # only the one being recomputed (a pair's forward keeps nothing)


def test_full_recompute_with_a_profile_keeps_the_boundaries_and_one_activation() -> None:
    s = get_schedule("1F1B", 4, 8)
    c = dataclasses.replace(CostSpec.from_profile(make_profile(4)).tables, output_bytes=(300, 300, 300, 0))
    result = simulate(s, c, recompute=RecomputeSet.full(s))
    plain = simulate(s, c)
    for p, q in zip(result.per_rank, plain.per_rank):
        stage = s.stages_of(p.rank)[0]
        held, _ = c.activation_of(s, stage)
        kept, _ = c.recompute_kept(s, stage)
        static = c.static_bytes_of(s, stage)
        in_flight = q.peak_activations  # 1F1B: the most microbatches a rank has forwarded and not backwarded
        assert p.peak_memory_bytes == static + (in_flight - 1) * kept + held
        assert p.peak_memory_bytes < q.peak_memory_bytes or in_flight == 1  # type: ignore[operator]


def test_a_recomputed_backward_takes_its_forward_again() -> None:
    s = get_schedule("1F1B", 2, 2)
    c = parse_costs("F=1,B=2")
    result = simulate(s, c, recompute=RecomputeSet.of([(1, 0)]))
    tl = result.timeline()
    row = tl[(tl["stage"] == 1) & (tl["microbatch"] == 0) & (tl["type"] == "B")].iloc[0]
    assert row["end"] - row["start"] == 3.0
    assert result.makespan == simulate(s, c).makespan + 1.0
    assert c.duration(s, s.actions[1][1], recomputed=True) == 3.0


def test_recompute_act_is_a_fraction_parsed_by_parse_costs() -> None:
    assert parse_costs("recompute_act=0.25").recompute_act == 0.25
    assert parse_costs("F=1").recompute_act == 0.1
    assert parse_costs("recompute_act=0.25").to_dict()["recompute_act"] == 0.25
    with pytest.raises(CostError, match="recompute_act=2 is a fraction"):
        parse_costs("recompute_act=2")
    s = get_schedule("1F1B", 2, 2)
    assert parse_costs("recompute_act=0.25").recompute_kept(s, 0) == (0, ACTIVATION_PARTS // 4)


# -- the set, the option and the file ---------------------------------------------------------------------------


def test_resolve_reads_none_full_and_refuses_auto() -> None:
    s = get_schedule("1F1B", 2, 3)
    assert resolve("none", s) == (RecomputeSet(), "")
    full, _ = resolve("FULL", s)
    assert full == {(st_, m) for st_ in range(2) for m in range(3)}
    with pytest.raises(RecomputeError, match="search --recompute auto"):
        resolve(Recompute.auto.value, s)
    with pytest.raises(RecomputeError, match="use none, full or a recompute JSON"):
        resolve("half", s)


def test_the_sidecar_round_trips_and_is_found_beside_its_csv(tmp_path: Path) -> None:
    s = get_schedule("1F1B", 2, 3)
    csv = tmp_path / "best.csv"
    assert sidecar_path(csv) == tmp_path / "best.recompute.json"
    chosen = RecomputeSet.of([(0, 1), (1, 2)])
    write_sidecar(sidecar_path(csv), chosen, s, cap="2act")
    data = json.loads(sidecar_path(csv).read_text())
    assert data["recompute"] == [[0, 1], [1, 2]] and data["cap"] == "2act"
    assert read_sidecar(sidecar_path(csv), s) == chosen
    found, note = resolve(None, s, csv_path=csv)
    assert found == chosen and "best.recompute.json" in note
    assert resolve("none", s, csv_path=csv)[0] == RecomputeSet()


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "not JSON"),
        ('{"recompute": [[0]]}', "recompute"),
        ('{"recompute": [[0, -1]]}', "integers >= 0"),
        ('{"recompute": [[5, 0]]}', r"\(5, 0\) is not a \(stage, microbatch\)"),
        ('{"recompute": [], "ranks": 3}', "ranks=3"),
    ],
)
def test_a_bad_recompute_file_is_one_line(tmp_path: Path, content: str, match: str) -> None:
    s = get_schedule("1F1B", 2, 3)
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(RecomputeError, match=match) as info:
        read_sidecar(path, s)
    assert "\n" not in str(info.value)


def test_a_broken_set_beside_a_csv_names_the_way_out(tmp_path: Path) -> None:
    s = get_schedule("1F1B", 2, 3)
    csv = tmp_path / "best.csv"
    sidecar_path(csv).write_text("{")
    with pytest.raises(RecomputeError, match="--recompute none ignores it"):
        resolve(None, s, csv_path=csv)
    assert resolve("none", s, csv_path=csv) == (RecomputeSet(), "")
