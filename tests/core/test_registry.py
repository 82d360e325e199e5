"""Every registered schedule: valid orders, exact action counts, clean refusals, exact file round trips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import ScheduleConfigError
from ppsim.formats import read_csv, write_csv
from ppsim.ir import ActionType, Schedule
from ppsim.schedules import all_specs, get_schedule
from ppsim.validate import validate

runner = CliRunner()
SPECS = all_specs()
NAMES = [s.name for s in SPECS]
EXPECTED_NAMES = {
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
    "ZBH1", "ZBH2", "DualPipe", "V-Min", "V-Half",
}


def test_registry_has_every_named_schedule() -> None:
    assert set(NAMES) == EXPECTED_NAMES
    assert get_schedule("afab", 2, 2).name == get_schedule("GPipe", 2, 2).name


def build_or_none(name: str, ranks: int, mb: int, v: int | None) -> Schedule | None:
    try:
        return get_schedule(name, ranks, mb, v)
    except ScheduleConfigError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, f"refusal must be one line: {msg!r}"
        return None


def assert_exact_counts(s: Schedule) -> None:
    per_pipeline = s.num_microbatches // len(s.pipelines)
    counts = Counter((c.stage, c.microbatch, c.type) for _, _, c in s.iter_computations())
    for stage in range(s.num_stages):
        for mb in range(per_pipeline):
            assert counts[(stage, mb, ActionType.F)] == 1, (stage, mb)
            b, i, w = (counts[(stage, mb, t)] for t in (ActionType.B, ActionType.I, ActionType.W))
            assert (b, i, w) in ((1, 0, 0), (0, 1, 1)), (stage, mb, b, i, w)
    assert sum(counts.values()) == sum(1 for _ in s.iter_computations())
    assert sum(counts.values()) == s.num_stages * per_pipeline * 2 + sum(
        1 for k in counts if k[2] is ActionType.I
    )
    per_rank = Counter(s.stage_to_rank)
    assert set(per_rank.values()) == {s.num_stages_per_rank}


def splits_into_rounds(num_ranks: int, mb: int) -> bool:
    """torch's interleaved rule: max(1, mb // ranks) equal rounds."""
    return mb % max(1, mb // num_ranks) == 0


#: Each schedule's ``constraints`` text as a predicate on (ranks, microbatches); stages per rank are fixed or any.
ACCEPTS = {
    "GPipe": lambda r, mb: True,
    "1F1B": lambda r, mb: True,
    "ZBH1": lambda r, mb: True,
    "ZBH2": lambda r, mb: True,
    "LoopedBFS": lambda r, mb: True,
    "ZBVZeroBubble": lambda r, mb: True,
    "Interleaved1F1B": splits_into_rounds,
    "InterleavedZeroBubble": splits_into_rounds,
    "DualPipeV": lambda r, mb: mb >= 2 * r,
    "DualPipe": lambda r, mb: r % 2 == 0 and mb % 2 == 0 and mb >= 2 * r,
    "V-Min": lambda r, mb: True,
    "V-Half": lambda r, mb: True,
}


def test_accepts_table_covers_every_schedule() -> None:
    assert set(ACCEPTS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ranks=st.integers(1, 8), mb=st.integers(1, 32), v=st.integers(1, 4))
def test_builds_exactly_what_its_constraints_allow_valid_with_exact_counts(
    name: str, ranks: int, mb: int, v: int
) -> None:
    spec = next(s for s in SPECS if s.name == name)
    sched = build_or_none(name, ranks, mb, None if spec.fixed_stages_per_rank else v)
    allowed = ACCEPTS[name](ranks, mb)
    assert (sched is not None) == allowed, f"{name} ranks={ranks} mb={mb}: constraints say {allowed}"
    if sched is None:
        return
    assert sched.num_ranks == ranks and sched.num_microbatches == mb
    assert sched.num_stages_per_rank == (spec.fixed_stages_per_rank or v)
    assert validate(sched) == []
    assert_exact_counts(sched)


@pytest.mark.parametrize("name", NAMES)
def test_each_schedule_builds_a_typical_config(name: str) -> None:
    ranks, mb = (4, 16)
    sched = get_schedule(name, ranks, mb)
    assert validate(sched) == []


@pytest.mark.parametrize("name", NAMES)
def test_csv_export_reads_back_identically(name: str, tmp_path: Path) -> None:
    sched = get_schedule(name, 4, 16)
    path = write_csv(sched, tmp_path / "s.csv")
    back = read_csv(path, num_microbatches=16, num_pipelines=len(sched.pipelines))
    assert back.actions == sched.actions
    assert back.stage_to_rank == sched.stage_to_rank


@pytest.mark.torch
@pytest.mark.parametrize("name", [n for n in NAMES if n != "DualPipe"])
def test_csv_export_loads_in_torch_runtime_with_same_order(name: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from unittest import mock

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    ranks, mb = 4, 8
    sched = get_schedule(name, ranks, mb)
    path = write_csv(sched, tmp_path / f"{name}.csv")
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
    stage.num_stages = sched.num_stages
    stages = [stage] * max(2, sched.num_stages_per_rank)
    runtime = _PipelineScheduleRuntime(stages, mb)
    runtime._load_csv(str(path), format="compute_only")
    loaded = [[str(a) for a in runtime.pipeline_order[r] if a is not None] for r in range(ranks)]
    assert loaded == [[str(a) for a in row] for row in sched.actions]
    assert "REDUCE_GRAD" not in path.read_text()


def test_cli_list_shows_every_schedule() -> None:
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0
    import json

    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} == EXPECTED_NAMES
    assert all(r["description"] and r["constraints"] and r["stages_per_rank"] for r in rows)
    table = runner.invoke(app, ["list"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and all(n in table.stdout for n in EXPECTED_NAMES)


def test_cli_show_prints_one_row_per_rank() -> None:
    result = runner.invoke(app, ["show", "-s", "1f1b", "-r", "3", "-m", "4"])
    assert result.exit_code == 0
    rows = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(rows) == 3 and rows[0].split("|")[1].split()[0] == "0F0"


def test_cli_export_csv_writes_file(tmp_path: Path) -> None:
    out = tmp_path / "d.csv"
    result = runner.invoke(app, ["export", "-s", "DualPipeV", "-r", "4", "-m", "10", "-o", str(out)])
    assert result.exit_code == 0 and result.stdout.strip() == str(out)
    assert read_csv(out).actions == get_schedule("DualPipeV", 4, 10).actions


@pytest.mark.parametrize(
    "args, needle",
    [
        (["show", "-s", "DualPipeVV", "-r", "4", "-m", "8"], "did you mean DualPipeV"),
        (["show", "-s", "DualPipe", "-r", "3", "-m", "8"], "3"),
        (["show", "-s", "1F1B", "-r", "4"], "--mb/-m is required"),
        (["show", "-s", "1F1B", "-r", "0", "-m", "4"], "--ranks 0"),
        (["show", "-s", "DualPipeV", "-r", "4", "-m", "8", "-v", "3"], "always places 2"),
        (["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "/nonexistent/dir/x.csv"], "does not exist"),
        (["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", "x.csv", "--format", "xml"], "xml"),
        (["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", "lots"], "--memory-cap 'lots'"),
    ],
)
def test_cli_bad_values_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
