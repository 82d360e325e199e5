"""The schedule search: valid orders under the cap, the simulator's makespan, never worse than the named start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppsim import get_schedule, parse_costs, simulate
from ppsim.cli import app
from ppsim.costs import CostSpec
from ppsim.errors import PPSimError
from ppsim.formats import read_csv
from ppsim.schedules._phases import loop_placement, make_schedule, v_placement
from ppsim.search import MemoryCap, MemoryCapError, lower_bound, parse_memory_cap, search
from ppsim.search.listsched import Rule, list_schedule, make_problem
from ppsim.validate import validate

runner = CliRunner()
COMM = parse_costs("F=1,B=2,I=1,W=1,comm=0.1")
SLOW_I = parse_costs("F=1,B=3,I=2,W=1,comm=0.1")


def peaks(schedule, costs):  # type: ignore[no-untyped-def]
    return [p.peak_activations for p in simulate(schedule, costs).per_rank]


@pytest.mark.parametrize(
    "ranks, mb, costs, cap, placement",
    [
        (4, 8, COMM, 4, "loop"),
        (4, 8, SLOW_I, 8, "loop"),
        (3, 6, COMM, 6, "v"),
        (4, 8, parse_costs("F=1,B=2,I=1,W=1,FB=2.4,comm=0.05"), 8, "v"),
        (4, 8, COMM, 8, "any"),
    ],
)
def test_found_order_is_valid_fits_the_cap_and_resimulates_to_the_reported_makespan(
    ranks: int, mb: int, costs, cap: int, placement: str  # type: ignore[no-untyped-def]
) -> None:
    result = search(ranks, mb, costs, f"{cap}act", placement=placement, time_limit=1.0, seed=1)
    assert validate(result.schedule) == []
    resim = simulate(result.schedule, result.sim.costs)
    assert resim.makespan == pytest.approx(result.makespan)
    assert max(p.peak_activations for p in resim.per_rank) <= cap
    assert result.peak <= cap
    assert result.makespan >= result.lower_bound - 1e-9


@pytest.mark.parametrize("ranks, mb, cap", [(4, 8, 4), (4, 8, 8), (8, 8, 8), (4, 16, 7)])
def test_never_worse_than_the_best_named_schedule_that_fits(ranks: int, mb: int, cap: int) -> None:
    result = search(ranks, mb, COMM, f"{cap}act", time_limit=0.5)
    best = result.best_named
    assert best is not None and best.fits
    assert result.makespan <= best.makespan + 1e-9
    fitting = [n for n in result.named if n.fits]
    assert all(n.peak <= cap for n in fitting)
    assert {n.name for n in result.named} >= {"1F1B", "ZBH1", "GPipe"}


def test_beats_zbh1_on_the_zero_bubble_papers_case() -> None:
    # 8 ranks, 8 microbatches, F = I = W = 1, comm 0.1: ZBH1 takes 33.6; the bound (and sail-sg's auto
    # schedule) is 32.4
    result = search(8, 8, COMM, "8act", time_limit=2.0)
    assert result.lower_bound == pytest.approx(32.4)
    assert result.makespan < 33.6 - 1e-9


def test_list_scheduler_makespan_is_the_simulators() -> None:
    for placement, v in ((loop_placement(4, 1), 1), (loop_placement(4, 2), 2), (v_placement(4), 2)):
        tpl = make_schedule("t", [[] for _ in range(4)], placement, 8, v)
        for rule in (Rule(), Rule(w_fill="fit", wait_b=0.5), Rule(backward="fused"), Rule(reserve="one", pairs=True)):
            out = list_schedule(make_problem(tpl, SLOW_I, 2 * v * 4), rule)
            assert out is not None
            orders, makespan, peak = out
            sched = tpl.with_actions(orders)
            assert validate(sched) == []
            sim = simulate(sched, SLOW_I)
            assert sim.makespan == pytest.approx(makespan)
            assert [p.peak_activations for p in sim.per_rank] == [int(x) for x in peak]


def test_lower_bound_matches_closed_forms_without_communication() -> None:
    # zero communication, F = I = W, enough memory: ZB-H2 has no bubble inside any rank's span, and the bound is
    # its makespan m(F+I+W) + (R-1)F
    unit = parse_costs("F=1,B=2,I=1,W=1")
    tpl = make_schedule("t", [[] for _ in range(4)], loop_placement(4, 1), 8, 1)
    lb = lower_bound(make_problem(tpl, unit, 8))
    zbh2 = simulate(get_schedule("ZBH2", 4, 8), unit).makespan
    assert lb == pytest.approx(zbh2)
    # with communication, 1F1B's cap (4) binds: the last microbatch can enter rank 0 only after 4 have left it,
    # which is what ZB-H1 achieves (28.2); with 8 the bound is 27.3 (what ZB-H2 achieves)
    assert lower_bound(make_problem(tpl, COMM, 8)) == pytest.approx(27.3)
    assert lower_bound(make_problem(tpl, COMM, 4)) == pytest.approx(28.2)
    assert simulate(get_schedule("ZBH1", 4, 8), COMM).makespan == pytest.approx(28.2)


def test_cap_too_small_names_the_smallest_feasible_cap() -> None:
    with pytest.raises(MemoryCapError) as err:
        search(4, 8, COMM, "1act", placement="v", time_limit=0.5)
    message = str(err.value)
    assert "\n" not in message and "2act" in message


def test_bytes_cap_needs_a_profile() -> None:
    with pytest.raises(MemoryCapError, match="profile"):
        search(4, 8, COMM, "80GiB", time_limit=0.5)


def test_parse_memory_cap() -> None:
    assert parse_memory_cap("8act") == MemoryCap(8, "act")
    assert parse_memory_cap("1KiB") == MemoryCap(1024, "bytes")
    assert parse_memory_cap(2e9) == MemoryCap(2e9, "bytes")
    with pytest.raises(PPSimError):
        parse_memory_cap("eight")


def test_same_seed_gives_the_same_order() -> None:
    # a budget of orders, not the clock, ends these runs: the orders are the same
    a = search(4, 6, SLOW_I, "8act", time_limit=120.0, seed=7, max_orders=300)
    b = search(4, 6, SLOW_I, "8act", time_limit=120.0, seed=7, max_orders=300)
    assert a.stopped == b.stopped == "done"
    assert a.schedule.actions == b.schedule.actions
    assert a.makespan == b.makespan


def test_time_limit_is_honoured_and_progress_reported() -> None:
    seen = []
    result = search(8, 32, SLOW_I, "16act", time_limit=0.2, progress=seen.append)
    # the clock, not the work, ended it (how long it overran is the benchmark's business, not a unit test's)
    assert result.stopped == "time limit"
    assert seen and all(p.best_makespan >= result.makespan - 1e-9 for p in seen)


def test_interrupt_returns_best_so_far() -> None:
    calls = {"n": 0}

    def interrupt(progress) -> None:  # type: ignore[no-untyped-def]
        calls["n"] += progress.phase != "set-up"
        if calls["n"] >= 2:
            raise KeyboardInterrupt

    # a case no phase can close (the bound is not met), so the search is still going when Ctrl-C comes
    result = search(4, 8, COMM, "4act", placement="v", time_limit=5.0, solver="none", progress=interrupt)
    assert result.stopped == "interrupted"
    assert validate(result.schedule) == []


def test_interrupt_before_any_order_raises() -> None:
    def interrupt(progress) -> None:  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt  # the first report: the set-up, before any order is known

    with pytest.raises(KeyboardInterrupt):
        search(4, 8, COMM, "8act", time_limit=5.0, progress=interrupt)


def test_the_first_progress_report_comes_before_any_work() -> None:
    seen = []
    search(4, 8, COMM, "8act", time_limit=0.3, progress=seen.append)
    assert seen[0].phase == "set-up" and seen[0].evaluations == 0 and seen[0].best_makespan == float("inf")


def test_profile_costs_and_byte_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ppsim.costs import StageCosts

    R = 4
    costs = StageCosts(
        F=(1.0, 1.2, 1.1, 1.5), B=(2.0, 2.4, 2.2, 3.0), I=(1.0, 1.2, 1.1, 1.6), W=(1.0, 1.2, 1.1, 1.4),
        FB=(3.0, 3.6, 3.3, 4.5), comm=0.0, p2p_alpha=0.01, p2p_beta=1e9, output_bytes=(10**6,) * R,
        activation_bytes=(100,) * R, activation_bytes_freed_by_I=(40,) * R, static_bytes=(1000,) * R, unit="s",
    )
    cap = 1000 + 4 * 100
    result = search(R, 8, costs, cap, time_limit=1.0)
    sim = simulate(result.schedule, costs)
    assert max(p.peak_memory_bytes or 0 for p in sim.per_rank) <= cap
    assert result.makespan <= (result.best_named.makespan if result.best_named else float("inf")) + 1e-9


def test_cli_search_writes_a_csv_simulate_accepts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "best.csv"
    costs = "F=1,B=2,I=1,W=1,comm=0.1"
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--costs", costs, "--memory-cap", "4act",
                              "--time-limit", "0.5", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["makespan"] <= min(n["makespan"] for n in data["named"] if n["fits"]) + 1e-9
    assert data["lower_bound"] <= data["makespan"]
    sched = read_csv(str(out), num_microbatches=8)
    assert validate(sched) == []
    sim = runner.invoke(app, ["simulate", "-s", str(out), "-m", "8", "--costs", costs, "--json"])
    assert sim.exit_code == 0, sim.output
    assert json.loads(sim.stdout)["makespan"] == pytest.approx(data["makespan"])


def test_cli_search_prints_the_table_with_named_schedules() -> None:
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--memory-cap", "8act", "--time-limit", "0.3", "-q"])
    assert res.exit_code == 0, res.output
    for word in ("searched", "ZBH1", "1F1B", "lower bound"):
        assert word in res.stdout
    assert "gap" in res.stdout or "optimal: no order is faster" in res.stdout


def test_cli_cap_too_small_is_one_line_exit_2() -> None:
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--memory-cap", "1act", "--placement", "v"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "2act" in lines[0]


def test_cli_no_order_in_time_names_the_smallest_cap_known_to_fit_and_its_order(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # a search that finds nothing in time (here: list scheduling made to find nothing) at a feasible but tight cap
    import ppsim.search.driver as driver

    monkeypatch.setattr(driver, "list_schedule", lambda *a, **k: None)
    monkeypatch.setattr(driver, "_seeds", lambda *a, **k: None)  # the zero-bubble greedy fits 1act (serially)
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--memory-cap", "1act", "--time-limit", "1", "-q"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1
    # 4 activations on 4 ranks: the lowest named peak (1F1B's and others'); the message names the order with it
    assert "smallest cap known to fit is 4act" in lines[0] and "--memory-cap 4act" in lines[0]
    assert re.search(r"\([\w-]+'s peak, makespan [\d.]+\)", lines[0]), lines[0]


def test_cli_report_includes_the_searched_schedule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "report.html"
    res = runner.invoke(app, ["report", "-s", "1F1B,ZBH1", "-r", "4", "-m", "8", "--costs", "F=1,B=2,comm=0.1",
                              "--memory-cap", "8act", "--search", "--search-time", "0.5", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "Searched" in out.read_text(encoding="utf-8")


def test_cli_report_search_needs_a_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = runner.invoke(app, ["report", "-s", "1F1B", "-r", "4", "-m", "8", "--search", "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2
    assert "--memory-cap" in res.output


def test_works_without_or_tools(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ppsim.search import cpsat

    monkeypatch.setattr(cpsat, "available", lambda: False)
    result = search(4, 8, COMM, "4act", time_limit=0.5)
    assert result.source != "CP-SAT"
    assert validate(result.schedule) == []
    with pytest.raises(PPSimError, match="OR-Tools"):
        search(4, 8, COMM, "4act", time_limit=0.5, solver="cpsat")


def test_cpsat_polish_reaches_the_bound_on_the_zero_bubble_papers_case() -> None:
    pytest.importorskip("ortools")
    # a budget of orders (and of the solver's deterministic time), not the clock, ends the run
    result = search(8, 8, COMM, "8act", time_limit=120.0, solver="cpsat", max_orders=400)
    assert result.stopped == "done"
    assert result.makespan == pytest.approx(32.4)  # sail-sg's auto schedule, and the lower bound
    assert max(p.peak_activations for p in simulate(result.schedule, COMM).per_rank) <= 8
    assert validate(result.schedule) == []


def _profile(path, num_stages: int):  # type: ignore[no-untyped-def]
    from ppsim.profile import ModelInfo, P2PProfile, Profile, StageProfile, Stat, save_profile

    def stat(x: float) -> Stat:
        return Stat.from_samples([x, x, x])

    stages = []
    for s in range(num_stages):
        f = 0.010 * (1.2 if s == num_stages - 1 else 1.0)
        stages.append(StageProfile(
            stage=s, layers=(s, s + 1), has_embedding=s == 0, has_head=s == num_stages - 1, param_bytes=2**30,
            grad_bytes=2**30, optimizer_bytes=0, output_bytes=0 if s == num_stages - 1 else 8 * 2**20,
            F=stat(f), B=stat(2 * f), I=stat(f), W=stat(f), FB=stat(3 * f),
            activation_bytes=100 * 2**20, activation_bytes_freed_by_I=25 * 2**20,
        ))
    profile = Profile(
        created="2026-01-01T00:00:00Z", device="cpu", device_name="test", torch_version="0", host="test",
        world_size=1, backend=None,
        model=ModelInfo(preset="tiny", hidden=8, heads=1, ffn=8, layers=num_stages, vocab=8, seq_len=8, mb_size=1,
                        dtype="float32"),
        num_stages=num_stages, stages=tuple(stages),
        p2p=P2PProfile(alpha_s=1e-4, beta_bytes_per_s=5e9, fit_rel_error=0.0, measured=True, samples=()),
        complete=True,
    )
    save_profile(profile, path)
    return path


def test_cli_search_with_a_profile_and_a_byte_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    profile = _profile(tmp_path / "p.json", 4)
    out = tmp_path / "best.csv"
    cap = 2 * 2**30 + 4 * 100 * 2**20  # 1F1B's four activations on rank 0 plus the static bytes
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--profile", str(profile), "--memory-cap", str(cap),
                              "--time-limit", "1", "--json", "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["cap_unit"] == "bytes" and data["peak"] <= cap
    sim = runner.invoke(app, ["simulate", "-s", str(out), "-m", "8", "--profile", str(profile), "--json"])
    assert sim.exit_code == 0, sim.output
    peaks = [r["peak_memory_bytes"] for r in json.loads(sim.stdout)["per_rank"]]
    assert max(peaks) <= cap


@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("text", ["F=1,B=2,I=1,W=1", "F=1,B=3,I=2,W=1,comm=0.3", "F=2,B=3,I=1,W=2,comm=0.1",
                                  "F=1,B=2,I=1,W=1,FB=2.2,comm=0.1"])  # a pair cheaper than its halves
def test_lower_bound_never_exceeds_any_named_schedule_that_fits(placement: str, text: str) -> None:
    from ppsim.search import Placement
    from ppsim.search.common import problem_for as _problem
    from ppsim.search.driver import _named, _templates

    costs = parse_costs(text)
    for ranks, mb in ((2, 3), (3, 6), (4, 8), (4, 13)):
        templates = _templates(ranks, mb, Placement(placement), None)
        for cap_count in range(2, 4 * ranks + 1, 3):
            cap = MemoryCap(cap_count, "act")
            lb = lower_bound(_problem(templates[0], costs, cap))
            for named, _, _ in _named(templates, ranks, mb, CostSpec.uniform(costs), "stage", cap):
                if named.fits:
                    assert lb <= named.makespan + 1e-9, (named.name, ranks, mb, cap_count)


def test_cli_refuses_a_search_too_large_without_allow_large() -> None:
    res = runner.invoke(app, ["search", "-r", "64", "-m", "1000", "--memory-cap", "8act"])
    assert res.exit_code == 2
    assert "--allow-large" in res.output


@pytest.mark.parametrize("seed", range(6))
def test_random_rules_give_valid_orders_the_simulator_times_alike(seed: int) -> None:
    import random

    from ppsim.search.rules import random_rule as _random_rule

    rng = random.Random(seed)
    costs = parse_costs(rng.choice(["F=1,B=2,I=1,W=1,FB=2.5,comm=0.1", "F=1,B=2.5,I=1.5,W=1,FB=3", "F=2,B=3,comm=0.3"]))
    for _ in range(8):
        ranks, mb = rng.choice([2, 3, 4, 5]), rng.choice([1, 2, 5, 8, 11])
        v = rng.choice([1, 2, 3])
        placement = v_placement(ranks) if v == 2 and rng.random() < 0.5 else loop_placement(ranks, v)
        tpl = make_schedule("t", [[] for _ in range(ranks)], placement, mb, v)
        cap = rng.choice([v, v + 1, 2 * v + 1, ranks * v, 10**6])
        problem = make_problem(tpl, costs, cap)
        out = list_schedule(problem, _random_rule(rng, problem, allow_pairs=placement == v_placement(ranks)))
        if out is None:  # a rule's limits may stall; the search then drops it
            continue
        orders, makespan, peak = out
        sched = tpl.with_actions(orders)
        assert validate(sched) == []
        sim = simulate(sched, costs)
        assert sim.makespan == pytest.approx(makespan)
        assert max(p.peak_activations for p in sim.per_rank) <= cap
        assert [p.peak_activations for p in sim.per_rank] == [int(x) for x in peak]


def test_a_per_block_profile_searches_every_placement(tmp_path: Path) -> None:
    """One profile serves loop and V templates of different stage counts: no cost-scope question arises."""
    from profile_v2 import make_v2_profile

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(make_v2_profile().to_dict()))
    res = runner.invoke(app, ["search", "-r", "2", "-m", "4", "--memory-cap", "8act", "--placement", "any",
                              "--profile", str(profile), "--time-limit", "1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["makespan"] >= data["lower_bound"] - 1e-12


# --- never worse than the peers: named schedules and the V building blocks (issue 19) -------------------------------
@settings(max_examples=12, deadline=None)
@given(
    ranks=st.sampled_from([2, 3]),
    mb=st.integers(1, 5),
    text=st.sampled_from(["F=1,B=2,I=1,W=1,comm=0.1", "F=1,B=3,I=2,W=1,comm=0.3", "F=2,B=3,I=1,W=2,comm=0.05"]),
    cap=st.integers(2, 7),
    placement=st.sampled_from(["v", "any"]),
)
def test_searched_is_never_slower_than_a_named_schedule_or_a_v_building_block_that_fits(
    ranks: int, mb: int, text: str, cap: int, placement: str
) -> None:
    from ppsim.schedules._vshape import block_schedule, building_blocks

    costs = parse_costs(text)
    try:
        result = search(ranks, mb, costs, f"{cap}act", placement=placement, time_limit=120.0, max_orders=300,
                        solver="none")
    except MemoryCapError:
        return  # a cap below one microbatch on every chunk: refused, tested elsewhere
    assert result.stopped == "done"  # the order budget, not the clock, ended it
    for named in result.named:
        if named.fits:
            assert result.makespan <= named.makespan + 1e-9, named.name
    scope = result.cost_scope
    for offsets in building_blocks(ranks):
        block = block_schedule(ranks, mb, offsets)
        sim = simulate(block, CostSpec.uniform(costs).for_schedule(block, scope=scope))
        if max(p.peak_activations for p in sim.per_rank) <= cap:
            assert result.makespan <= sim.makespan + 1e-9, offsets


# --- proofs: CP-SAT proves small cases optimal, and its bound is a bound (issue 19) ---------------------------------
@pytest.mark.parametrize(
    "ranks, mb, cap, placement, optimum",
    [(2, 4, 3, "v", 27.8), (4, 6, 2, "loop", 32.6),
     (3, 5, 2, "loop", 22.2)],  # each above the analytic bound: only CP-SAT can prove it (V 3 x 4 at 4act, 30.2,
    # was one: the last-forward term now meets it, tests/core/test_search_production.py)
)
def test_cpsat_proves_small_cases_optimal(ranks: int, mb: int, cap: int, placement: str, optimum: float) -> None:
    pytest.importorskip("ortools")
    # the order budget (and the solver's deterministic time), not the clock, ends the run
    result = search(ranks, mb, COMM, f"{cap}act", placement=placement, time_limit=120.0, max_orders=400,
                    solver="cpsat")
    assert result.stopped == "done"
    assert result.optimal and result.bound_source == "CP-SAT"
    assert result.makespan == pytest.approx(optimum) and result.lower_bound == pytest.approx(optimum)
    assert result.gap == 0.0
    assert validate(result.schedule) == [] and result.peak <= cap


def test_the_occupancy_bound_makes_the_serial_order_at_one_activation_provably_optimal() -> None:
    # 2 ranks x 6 microbatches at 1act: rank 0 holds one microbatch at a time, each for its round trip at least
    # (5.2: F, comm, F, I, comm, I, W), 6 times: 31.2, which CP-SAT proved optimal; the occupancy term gives it alone
    problem = make_problem(make_schedule("t", [[], []], loop_placement(2, 1), 6, 1), COMM, 1.0)
    assert lower_bound(problem) == pytest.approx(31.2)
    result = search(2, 6, COMM, "1act", time_limit=30.0, max_orders=200, solver="none")
    assert result.optimal and result.makespan == pytest.approx(31.2)


def test_an_order_meeting_the_analytic_bound_is_optimal_without_cpsat() -> None:
    result = search(8, 8, COMM, "8act", time_limit=120.0, max_orders=300, solver="none")
    assert result.optimal == (result.makespan <= result.lower_bound + 1e-9)
    no_proof = search(4, 8, COMM, "4act", placement="v", time_limit=120.0, max_orders=50, solver="none")
    assert not no_proof.optimal and no_proof.bound_source == "analytic" and no_proof.gap > 0


@settings(max_examples=12, deadline=None)
@given(
    ranks=st.sampled_from([2, 3]),
    mb=st.integers(1, 5),
    text=st.sampled_from(["F=1,B=2,I=1,W=1,comm=0.1", "F=1,B=3,I=2,W=1,comm=0.3", "F=2,B=3,I=1,W=2",
                          "F=1,B=2.5,I=1.3,W=0.7,comm=0.07",  # exact in hundredths
                          "F=1,B=2,I=0.3333333,W=1.6666667,comm=0.0123457"]),  # rounded down: a relaxation
    cap=st.integers(1, 6),
    placement=st.sampled_from(["loop", "v"]),
)
def test_the_proven_bound_is_never_above_a_feasible_order(
    ranks: int, mb: int, text: str, cap: int, placement: str
) -> None:
    """CP-SAT's bound (a short run, so usually not closed) against every order known to fit: the named ones,
    the V building blocks, and CP-SAT's own order re-simulated with the exact costs."""
    pytest.importorskip("ortools")
    from ppsim.schedules._vshape import block_schedule, building_blocks
    from ppsim.search import Placement, cpsat
    from ppsim.search.bounds import pair_saving
    from ppsim.search.common import problem_for
    from ppsim.search.driver import _named, _templates

    costs = parse_costs(text)
    (tpl,) = _templates(ranks, mb, Placement(placement), None)
    problem = problem_for(tpl, costs, MemoryCap(cap, "act"))
    saving = max(pair_saving(problem, tpl.stages_of(r)) for r in range(ranks))
    assert cpsat.provable(problem, pair_saving=saving)
    feasible = [sim.makespan
                for named, _, sim in _named([tpl], ranks, mb, CostSpec.uniform(costs), "stage", MemoryCap(cap, "act"))
                if named.fits]
    if placement == "v":
        for offsets in building_blocks(ranks):
            sim = simulate(block_schedule(ranks, mb, offsets), costs)
            if max(p.peak_activations for p in sim.per_rank) <= cap:
                feasible.append(sim.makespan)
    if not feasible:
        return
    incumbent = min((named
                     for named in _named([tpl], ranks, mb, CostSpec.uniform(costs), "stage", MemoryCap(cap, "act"))
                     if named[0].fits), key=lambda x: x[0].makespan, default=None)
    if incumbent is None:
        return
    sched = tpl.with_actions(incumbent[1].actions)
    outcome = cpsat.polish(problem, sched, simulate(sched, costs).starts, time_limit=5.0, seed=0,
                           deterministic_time=0.3, prove=True)
    assert outcome.bound is not None
    if outcome.schedule is not None:
        found = simulate(outcome.schedule, costs)
        if max(p.peak_activations for p in found.per_rank) <= cap:
            feasible.append(found.makespan)
        if outcome.optimal:
            assert found.makespan == pytest.approx(outcome.bound)
    assert outcome.bound <= min(feasible) + 1e-9


def test_cli_prints_optimal_and_json_has_the_proof_keys() -> None:
    pytest.importorskip("ortools")
    args = ["search", "-r", "2", "-m", "4", "--memory-cap", "3act", "--placement", "v", "--costs",
            "F=1,B=2,I=1,W=1,comm=0.1", "--time-limit", "60", "--max-orders", "400", "-q"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "optimal: no order is faster" in res.output and "CP-SAT" in res.output
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["optimal"] is True and data["bound_source"] == "CP-SAT" and data["gap"] == 0.0
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--memory-cap", "4act", "--placement", "v",
                              "--costs", "F=1,B=2,I=1,W=1,comm=0.1", "--max-orders", "30", "--solver", "none", "-q"])
    assert res.exit_code == 0, res.output
    assert "optimal" not in res.output and "gap" in res.output


# --- the greedy V construction (a seed family) ----------------------------------------------------------------------
def test_greedy_v_beats_zbv_with_communication_at_zbvs_memory() -> None:
    from ppsim.search.vgreedy import greedy_v

    orders = greedy_v(8, 8, (1.0, 1.0, 1.0), 0.1, 16)
    sims = [simulate(s, COMM) for s in orders]
    assert orders and all(validate(s) == [] for s in orders)
    assert all(max(p.peak_activations for p in sim.per_rank) <= 16 for sim in sims)
    best = min(sim.makespan for sim in sims)
    assert best == pytest.approx(58.8)  # ZBVZeroBubble: 64.8; the zero-bubble authors' V: 58.2
    assert best < simulate(get_schedule("ZBVZeroBubble", 8, 8), COMM).makespan


@settings(max_examples=20, deadline=None)
@given(ranks=st.integers(1, 5), mb=st.integers(1, 10), cap=st.integers(2, 10))
def test_greedy_v_seeds_are_valid_and_fit_the_cap(ranks: int, mb: int, cap: int) -> None:
    """The construction aims at a memory level (its balancing step may overshoot it by one); the search keeps
    only the orders that fit, simulated."""
    import time

    from ppsim.search import Placement
    from ppsim.search.common import problem_for
    from ppsim.search.driver import _templates
    from ppsim.search.seeds import v_greedy_seeds

    costs = parse_costs("F=1,I=1.5,W=0.7,B=2.2,comm=0.05")
    (tpl,) = _templates(ranks, mb, Placement.v, None)
    mcap = MemoryCap(cap, "act")
    for schedule, sim in v_greedy_seeds(tpl, costs, problem_for(tpl, costs, mcap), mcap,
                                        deadline=time.perf_counter() + 60):
        assert validate(schedule) == []
        assert max(p.peak_activations for p in sim.per_rank) <= cap
        assert sim.makespan == pytest.approx(simulate(schedule, costs).makespan)


def test_critical_chain_moves_are_actions_their_rank_mate_delayed_on_the_chain_to_the_makespan() -> None:
    from ppsim.search.local import critical_chain

    sched = get_schedule("V-Half", 4, 8, 2)
    costs = parse_costs("F=1,I=1.5,W=0.5,comm=0.1")
    sim = simulate(sched, CostSpec.uniform(costs).for_schedule(sched, scope="stage"))
    chain = critical_chain(sched, sim)
    assert chain
    for r, k in chain:  # each started the moment the previous action of its rank ended
        assert k > 0 and sim.starts[r][k] == pytest.approx(sim.ends[r][k - 1])
    last_rank = max(range(4), key=lambda r: sim.ends[r][-1])
    assert max(chain) <= (3, 10**9) and any(r == last_rank for r, _ in chain)


def test_orders_above_cpsats_size_limit_are_big_and_skip_cpsat_under_solver_auto() -> None:
    import ppsim.search.driver as driver

    mb = driver.CPSAT_MAX_COMPUTATIONS // (3 * 8)  # 4 ranks x 2 stages (V): at the limit, then just above it
    assert not driver._is_big(driver._templates(4, mb, driver.Placement.v, None))
    assert driver._is_big(driver._templates(4, mb + 1, driver.Placement.v, None))
    assert driver._is_big(driver._templates(32, 128, driver.Placement.v, None))  # 24,576 computations


def test_at_16_ranks_and_zbvs_memory_the_search_is_no_slower_than_the_zero_bubble_authors() -> None:
    # PV02 of the authors' reference grid (tests/data/zb_peer_r16_r32.json): V, 16 ranks x 64 microbatches,
    # F=1, I=1.5, W=0.5, comm 0.1, 32act; their best order there (zbv) takes 422.3, ppsim's ZBV 422.8
    data = json.loads((Path(__file__).parents[1] / "data" / "zb_peer_r16_r32.json").read_text())
    case = next(c for c in data["cases"] if c["id"] == "PV02")
    costs = parse_costs(f"F={case['F']},I={case['I']},W={case['W']},comm={case['comm']}")
    result = search(case["R"], case["M"], costs, f"{case['cap_act']}act", placement="v", time_limit=600.0,
                    max_orders=3, solver="none")
    assert result.stopped == "done"
    assert result.makespan <= case["peer_makespan"] + 1e-6
    assert result.peak <= case["cap_act"]
