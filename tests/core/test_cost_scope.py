"""`--cost-scope rank` reads --costs as one rank's share of the model, so schedules compare on the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.costs import CostSpec, parse_costs
from ppsim.errors import CostError
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate

runner = CliRunner()


def simulate_json(*args: str) -> object:
    result = runner.invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("ranks, mb, expected", [(4, 8, 28.5), (8, 16, 58.5)])
def test_rank_scope_reproduces_megatron_interleaved_values(ranks: int, mb: int, expected: float) -> None:
    out = simulate_json("-s", "Interleaved1F1B", "-r", str(ranks), "-m", str(mb), "-v", "2",
                        "--costs", "F=1,B=2", "--cost-scope", "rank")
    assert out["makespan"] == pytest.approx(expected)


def test_rank_scope_leaves_one_stage_per_rank_schedules_unchanged() -> None:
    base = parse_costs("F=1,B=2,FB=2.5")
    for name in ("1F1B", "ZBH1", "DualPipe"):
        sched = get_schedule(name, 4, 16)
        per_rank = CostSpec.uniform(base).for_schedule(sched, scope="rank")
        assert simulate(sched, per_rank).makespan == simulate(sched, base).makespan


def test_rank_scope_halves_each_chunk_of_a_v_schedule() -> None:
    sched = get_schedule("DualPipeV", 4, 10)
    per_rank = simulate(sched, CostSpec.uniform(parse_costs("F=2,B=4,FB=6")).for_schedule(sched, scope="rank"))
    assert per_rank.makespan == pytest.approx(66.0)  # the worked case, per chunk F=1, B=2, FB=3


def test_ranking_different_stage_counts_defaults_to_rank_scope_and_says_so() -> None:
    result = runner.invoke(app, ["simulate", "-s", "1F1B,DualPipeV", "-r", "4", "-m", "8", "--json"])
    assert result.exit_code == 0
    assert "cost scope: rank" in result.stderr and "1F1B: 4" in result.stderr and "DualPipeV: 8" in result.stderr
    explicit = runner.invoke(app, ["simulate", "-s", "1F1B,DualPipeV", "-r", "4", "-m", "8", "--json",
                                   "--cost-scope", "rank"])
    assert explicit.exit_code == 0 and "warning:" not in explicit.stderr
    assert json.loads(explicit.stdout) == json.loads(result.stdout)
    per_chunk = runner.invoke(app, ["simulate", "-s", "1F1B,DualPipeV", "-r", "4", "-m", "8", "--json",
                                    "--cost-scope", "stage"])
    assert per_chunk.exit_code == 0 and "warning: --cost-scope stage" in per_chunk.stderr
    assert "chunks differ in size" in per_chunk.stderr


def test_rank_scope_with_a_profile_is_refused(tmp_path: Path) -> None:
    from test_costs import make_profile

    sched = get_schedule("1F1B", 4, 8)
    from ppsim.costs import CostSpec

    costs = CostSpec.from_profile(make_profile(4))
    with pytest.raises(CostError, match="--cost-scope rank applies to --costs"):
        costs.for_schedule(sched, scope="rank")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile(4)))
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--profile", str(path),
                                 "--cost-scope", "rank"])
    assert result.exit_code == 2 and "--cost-scope rank applies to --costs" in result.stderr


def test_memory_cap_without_profile_warns() -> None:
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--memory-cap", "1GiB"])
    assert result.exit_code == 0 and "--memory-cap needs byte sizes from --profile" in result.stderr
