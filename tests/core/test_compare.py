"""ppsim.compare: build several schedules, skip the impossible ones with reasons, simulate, rank, pick the scope."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.compare import CostScope, NothingToCompareError, build, compare, rank
from ppsim.costs import CostSpec, parse_costs
from ppsim.errors import PPSimError
from ppsim.formats import write_csv
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate

runner = CliRunner()
README_REPORT = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]


def test_compare_ranks_fastest_first_and_keeps_the_reasons_of_skipped_schedules() -> None:
    c = compare(["1F1B", "DualPipe", "ZBH1"], num_ranks=3, num_microbatches=6)
    assert [s.name for s in c.skipped] == ["DualPipe"]
    assert "DualPipe" in c.skipped[0].reason
    makespans = [r.makespan for r in c.results]
    assert makespans == sorted(makespans) and len(makespans) == 2
    assert c.best is c.results[0]
    assert [n for n, _ in c.entries()] == [r.schedule.name for r in c.results] + ["DualPipe"]


def test_a_callers_builder_replaces_the_default_one() -> None:
    built: list[str] = []

    def builder(name: str):  # type: ignore[no-untyped-def]
        built.append(name)
        if name == "Mine":
            raise PPSimError("Mine: refused by the caller's loader")
        return get_schedule(name, 2, 4)

    c = compare(["1F1B", "Mine"], builder=builder)
    assert built == ["1F1B", "Mine"]
    assert [r.schedule.name for r in c.results] == ["1F1B"]
    assert c.skipped[0].reason == "Mine: refused by the caller's loader"


def test_rank_is_stable_for_ties() -> None:
    a = simulate(get_schedule("1F1B", 2, 2))
    b = simulate(get_schedule("GPipe", 2, 2))
    assert a.makespan == b.makespan
    assert rank([a, b]) == [a, b] and rank([b, a]) == [b, a]


def test_one_name_that_cannot_be_built_raises_its_own_error() -> None:
    with pytest.raises(PPSimError, match="unknown schedule 'Nope'"):
        compare(["Nope"], num_ranks=4, num_microbatches=8)


def test_nothing_buildable_raises_with_every_reason() -> None:
    with pytest.raises(NothingToCompareError, match="Nope: unknown schedule.*Zilch: unknown schedule"):
        compare(["Nope", "Zilch"], num_ranks=4, num_microbatches=8)


def test_different_stage_counts_compare_on_the_same_model_by_default() -> None:
    costs = parse_costs("F=1,B=2")
    c = compare(README_REPORT, num_ranks=4, num_microbatches=16, costs=costs)
    assert c.scope is CostScope.rank and "different numbers of stages" in c.scope_text
    for r in c.results:
        expected = simulate(r.schedule, CostSpec.uniform(costs).for_schedule(r.schedule, scope="rank")).makespan
        assert r.makespan == pytest.approx(expected)
    names = [r.schedule.name for r in c.results]
    assert names.index("DualPipeV") < names.index("1F1B")  # the README example: same model, DualPipeV wins
    assert c.notes == ()


def test_explicit_stage_scope_is_honoured_with_a_warning() -> None:
    c = compare(["1F1B", "DualPipeV"], num_ranks=4, num_microbatches=8, scope="stage")
    assert c.scope is CostScope.stage and c.scope_reason == "given"
    assert any("chunks differ in size" in n for n in c.notes)
    assert c.results[0].schedule.name == "1F1B"  # per chunk, 1F1B's chunks are twice the model


def test_same_stage_counts_keep_the_per_chunk_default() -> None:
    c = compare(["1F1B", "ZBH1"], num_ranks=4, num_microbatches=8)
    assert c.scope is CostScope.stage and c.scope_reason == "default" and c.notes == ()
    assert c.results[-1].makespan == simulate(get_schedule("1F1B", 4, 8)).makespan


def test_directions_on_a_named_schedule_is_a_warning_and_v_on_a_csv_must_match(tmp_path: Path) -> None:
    _, notes = build("1F1B", 4, 8, num_pipelines=2)
    assert len(notes) == 1 and "--directions 2 applies to .csv files only" in notes[0]
    path = write_csv(get_schedule("Interleaved1F1B", 2, 4, 2), tmp_path / "i.csv")
    schedule, notes = build(str(path), None, None, 2)
    assert schedule.num_stages_per_rank == 2 and notes == []
    with pytest.raises(PPSimError, match=r"--stages-per-rank 3: .*places 2 stage"):
        build(str(path), None, None, 3)


# --- through the command line -----------------------------------------------------------------------------------
def test_repeated_schedule_option_compares_all_of_them() -> None:
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-s", "ZBH1", "-r", "4", "-m", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(r["schedule"] for r in json.loads(result.stdout)) == ["1F1B", "ZBH1"]


@pytest.mark.parametrize("command", [["show"], ["plot"], ["export", "-o", "x.csv"]])
def test_repeated_schedule_option_on_a_one_schedule_command_is_an_error(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "-s", "1F1B", "-s", "ZBH1", "-r", "4", "-m", "8"])
    assert result.exit_code == 2
    assert "--schedule given 2 times (1F1B, ZBH1)" in result.stderr and result.stderr.count("\n") == 1


def test_report_with_nothing_reportable_exits_2_and_writes_no_page(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    result = runner.invoke(app, ["report", "-s", "Nope,Zilch", "-r", "4", "-m", "8", "-o", str(out)])
    assert result.exit_code == 2
    assert "none of these schedules can run" in result.stderr and "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_report_states_the_cost_scope_on_the_page(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    result = runner.invoke(app, ["report", "-s", ",".join(README_REPORT), "-r", "4", "-m", "16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    costs_section = page[page.index("<h2>Costs used</h2>"):]
    assert "cost scope: rank" in costs_section
    ranking = page[page.index('id="summary"'):page.index("</table>", page.index('id="summary"'))]
    assert ranking.index("DualPipeV") < ranking.index("1F1B")
    stage = tmp_path / "s.html"
    result = runner.invoke(app, ["report", "-s", ",".join(README_REPORT), "-r", "4", "-m", "16", "-o", str(stage),
                                 "--cost-scope", "stage"])
    assert result.exit_code == 0 and "warning: --cost-scope stage" in result.stderr
    assert "cost scope: stage" in stage.read_text()


def test_directions_on_a_named_schedule_warns_on_stderr() -> None:
    result = runner.invoke(app, ["show", "-s", "1F1B", "-r", "2", "-m", "2", "--directions", "2"])
    assert result.exit_code == 0
    assert "warning: --directions 2 applies to .csv files only" in result.stderr


def test_stages_per_rank_contradicting_a_csv_exits_2(tmp_path: Path) -> None:
    path = write_csv(get_schedule("1F1B", 2, 4), tmp_path / "a.csv")
    result = runner.invoke(app, ["simulate", "-s", str(path), "-v", "2"])
    assert result.exit_code == 2 and "drop -v" in result.stderr
