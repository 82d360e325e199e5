"""`search --recompute auto` and the recompute option on the command line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim import get_schedule, simulate
from ppsim.cli import app
from ppsim.costs import CostSpec, parse_costs
from ppsim.formats import read_csv
from ppsim.recompute import RecomputeSet, read_sidecar, sidecar_path
from ppsim.search import MemoryCap
from ppsim.search.recompute import choose_recompute, polish, search_recompute
from ppsim.validate import validate

runner = CliRunner()
COSTS = "F=1,B=2,comm=0.1"
NAMED = ["GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBH2", "InterleavedZeroBubble", "LoopedBFS"]


def named_peak(name: str, ranks: int, mb: int) -> float:
    s = get_schedule(name, ranks, mb)
    return max(p.peak_activations for p in simulate(s, parse_costs(COSTS)).per_rank)


@pytest.mark.parametrize("name, cap", [("1F1B", 2.0), ("GPipe", 1.8), ("ZBH2", 3.0), ("Interleaved1F1B", 2.5)])
def test_choose_recompute_makes_a_named_order_fit_and_costs_time(name: str, cap: float) -> None:
    s = get_schedule(name, 4, 8)
    costs = parse_costs(COSTS)
    choice = choose_recompute(s, costs, MemoryCap(cap))
    assert choice is not None
    order = choice.schedule  # ZBH2's deferred W: some I and W fused into a B
    assert not validate(order)
    assert (order == s) == (name != "ZBH2")
    again = simulate(order, costs, recompute=choice.recompute)
    assert max(p.peak_activations for p in again.per_rank) <= cap
    assert again.makespan == choice.sim.makespan
    if order == s:
        assert again.makespan >= simulate(s, costs).makespan
    # nothing chosen is superfluous: giving any one up breaks the cap or costs no less
    for pair in choice.recompute:
        fewer = simulate(order, costs, recompute=RecomputeSet(choice.recompute - {pair}))
        assert max(p.peak_activations for p in fewer.per_rank) > cap or fewer.makespan > choice.sim.makespan - 1e-9


def test_choose_recompute_returns_none_below_one_activation() -> None:
    assert choose_recompute(get_schedule("1F1B", 4, 8), parse_costs(COSTS), MemoryCap(0.9)) is None


def test_polish_keeps_the_cap_and_never_slows_down() -> None:
    s = get_schedule("1F1B", 4, 8)
    costs = parse_costs(COSTS)
    start = choose_recompute(s, costs, MemoryCap(2.0))
    assert start is not None
    out = polish(start, costs, MemoryCap(2.0), random.Random(0), deadline=float("inf"), max_tries=150)
    sim = simulate(out.schedule, costs, recompute=out.recompute)
    assert sim.makespan == out.sim.makespan <= start.sim.makespan
    assert max(p.peak_activations for p in sim.per_rank) <= 2.0
    assert not validate(out.schedule)


def test_a_cap_below_every_named_peak_returns_a_valid_fitting_order() -> None:
    cap = 1.5
    assert all(named_peak(n, 4, 8) > cap for n in NAMED)
    result = search_recompute(4, 8, parse_costs(COSTS), f"{cap}act", time_limit=3.0, max_orders=200, solver="none")
    assert not validate(result.schedule)
    again = simulate(result.schedule, parse_costs(COSTS), recompute=result.recompute)
    assert again.makespan == result.makespan
    assert max(p.peak_activations for p in again.per_rank) <= cap
    assert result.recompute and result.time_lost > 0
    assert result.uncapped.makespan < result.makespan


def test_a_cap_the_uncapped_order_meets_needs_no_recompute() -> None:
    result = search_recompute(2, 4, parse_costs(COSTS), "100act", time_limit=1.0, max_orders=50, solver="none")
    assert result.makespan == pytest.approx(result.uncapped.makespan)
    assert result.time_lost == pytest.approx(0.0, abs=1e-12)


# -- command line ---------------------------------------------------------------------------------------------------


def test_cli_search_recompute_auto_writes_the_csv_and_the_set_simulate_reads(tmp_path: Path) -> None:
    out = tmp_path / "best.csv"
    res = runner.invoke(app, ["search", "-r", "4", "-m", "8", "--costs", COSTS, "--memory-cap", "1.5act",
                              "--recompute", "auto", "--time-limit", "2", "--max-orders", "100", "--solver", "none",
                              "-q", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "time lost" in res.output and "uncapped best" in res.output
    side = sidecar_path(out)
    schedule = read_csv(out)
    chosen = read_sidecar(side, schedule)
    assert chosen
    sim = runner.invoke(app, ["simulate", "-s", str(out), "-m", "8", "--costs", COSTS, "--json"])
    assert sim.exit_code == 0, sim.output
    data = json.loads(sim.stdout)
    assert max(p["peak_activations"] for p in data["per_rank"]) <= 1.5
    assert sorted(map(tuple, data["recompute"])) == sorted(chosen)
    assert "best.recompute.json" in sim.stderr
    plain = runner.invoke(app, ["simulate", "-s", str(out), "-m", "8", "--costs", COSTS, "--json",
                                "--recompute", "none"])
    assert "recompute" not in json.loads(plain.stdout)


def test_cli_search_recompute_json(tmp_path: Path) -> None:
    res = runner.invoke(app, ["search", "-r", "2", "-m", "4", "--costs", COSTS, "--memory-cap", "1.2act",
                              "--recompute", "auto", "--time-limit", "1", "--max-orders", "40", "--solver", "none",
                              "--json", "-o", str(tmp_path / "b.csv")])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["peak"] <= 1.2 and data["recompute_file"].endswith("b.recompute.json")
    assert data["time_lost"] == pytest.approx(data["makespan"] / data["uncapped_makespan"] - 1)


@pytest.mark.parametrize(
    "args, match",
    [
        (["search", "-r", "2", "-m", "2", "--memory-cap", "2act", "--recompute", "full"], "search takes none or auto"),
        (["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--recompute", "auto"], "search --recompute auto"),
        (["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--recompute", "most"], "use none, full or"),
        (["plot", "-s", "1F1B", "-r", "2", "-m", "2", "--recompute", "missing.json"], "cannot read it"),
    ],
)
def test_cli_bad_recompute_is_one_line_exit_2(args: list[str], match: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert match in res.output and "Traceback" not in res.output


def test_cli_simulate_recompute_full_lowers_the_peak_and_reports_the_set() -> None:
    res = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--recompute", "full", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert len(data["recompute"]) == 32
    assert [p["peak_activations"] for p in data["per_rank"]] == [1.3, 1.2, 1.1, 1]


def test_cli_report_names_and_hatches_the_recomputed_schedules(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", "-s", "1F1B,ZBH1", "-r", "4", "-m", "8", "--recompute", "full", "-o", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "recomputing 32 of 32 activations (hatched)" in page
    assert '"pattern":{' in page.replace(" ", "")


def test_choose_recompute_meets_a_byte_cap_with_a_profile() -> None:
    import dataclasses

    from test_costs import make_profile

    costs = dataclasses.replace(CostSpec.from_profile(make_profile(4)).tables, output_bytes=(300, 300, 300, 0))
    s = get_schedule("1F1B", 4, 8)
    plain = simulate(s, costs)
    worst = max(p.peak_memory_bytes for p in plain.per_rank)  # type: ignore[type-var]
    cap = MemoryCap(float(worst - 1500), "bytes")
    choice = choose_recompute(s, costs, cap)
    assert choice is not None and choice.recompute
    again = simulate(choice.schedule, costs, recompute=choice.recompute)
    assert max(p.peak_memory_bytes for p in again.per_rank) <= cap.amount  # type: ignore[type-var]
