"""`ppsim plan`: the space, the verdicts, the ranking, bad input (ppsim.plan, ppsim.cli.plan)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.compare import build
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.job.settings import JobSettings
from ppsim.plan import ModelFacts, PlanError, PlanRequest, UnitRates, candidates, global_batch
from ppsim.plan_search import PlanStopped, plan

runner = CliRunner()
DATA = Path(__file__).parents[1] / "data"
DEBUG = ["plan", "--torchtitan-config", "llama3:llama3_debugmodel"]
FREE_LINKS = UnitRates(intra_node_bytes_per_s=math.inf, inter_node_bytes_per_s=math.inf)
"""Communication that costs nothing: unit costs as compute alone."""
CANDIDATE_KEYS = {"pp", "tp", "dp_shard", "dp_replicate", "schedule", "microbatches", "layers_per_stage", "recompute",
                  "fits", "peak_memory_bytes", "step_s", "tokens_per_s_per_gpu", "overrides"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A searched order's CSV goes to the current folder without -o: keep it out of the project."""
    monkeypatch.chdir(tmp_path)


# --- the core, on synthetic shapes (no torch) ------------------------------------------------------------------
def _settings(*, num_layers: int = 6, local_batch: int = 4) -> JobSettings:
    return JobSettings(source="toy:job", parallelism={"data_parallel_shard_degree": -1},
                       training={"local_batch_size": local_batch, "seq_len": 16}, in_file=False,
                       model_source="toy", num_model_layers=num_layers)


def _shapes_for(saved: int) -> Any:
    def shapes_for(tp: int, mb_size: int, ac: str) -> JobShapes:
        keep = saved * mb_size // (8 if ac == "full" else 1)
        layer = BlockShapes("layer", (("w", (64 // tp, 32)),), saved_bytes=keep, backward_transient_bytes=keep)
        blocks = {f"layers.{i}": layer for i in range(6)}
        blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (100, 32)),), saved_bytes=8 * mb_size)
        blocks["norm"] = BlockShapes("head", (("w", (32,)),), saved_bytes=0)
        blocks["lm_head"] = BlockShapes("head", (("w", (100 // tp, 32)),), saved_bytes=keep)
        return JobShapes(source="toy", blocks=blocks, tp=tp, boundary_bytes=64 * mb_size)

    return shapes_for


def _request(**kw: Any) -> PlanRequest:
    base: dict[str, Any] = dict(settings=_settings(), user_overrides=(), model=ModelFacts(6, 4, 2, "toy"),
                                num_gpus=4, gpus_per_node=2, cap_bytes=10**6, activation_checkpoints=("none", "full"),
                                allocator=None)  # the plan's mechanics on toy caps: the tensors' peak
    base.update(kw)
    return PlanRequest(**base)


def _unit_timer(schedule: Any, job: Any, profile: str | None, unit: str, step: Any = None) -> Any:
    from ppsim.compare import compare
    from ppsim.costs import load_costs

    costs = load_costs(costs=unit)
    return compare([schedule.name], builder=lambda _: schedule, costs=costs, scope="stage", step=step).best


def _build(name: str, ranks: int, mb: int, v: int) -> Any:
    return build(name, ranks, mb, v)[0]


def _plan(request: PlanRequest, saved: int = 2000, **kw: Any) -> Any:
    return plan(request, shapes_for=_shapes_for(saved), build=_build, simulate=kw.pop("timer", _unit_timer), **kw)


@given(cap=st.integers(20_000, 400_000), saved=st.integers(100, 20_000), gpus=st.sampled_from([2, 4, 8]))
@settings(max_examples=15, deadline=None)
def test_every_candidate_marked_fits_has_every_ranks_peak_within_the_cap(cap: int, saved: int, gpus: int) -> None:
    try:
        result = _plan(_request(cap_bytes=cap, num_gpus=gpus), saved=saved)
    except PlanError as exc:
        assert "no candidate fits" in str(exc)
        return
    for j in result.judged:
        if j.fits:
            assert all(m.peak_memory_bytes <= cap for m in j.memory)
        elif j.memory:
            assert any(m.peak_memory_bytes > cap for m in j.memory) and "over by" in j.reason
    assert all(j.fits for j in result.ranked)


def test_candidates_multiply_to_the_gpu_count_and_keep_the_global_batch() -> None:
    request = _request(num_gpus=8)
    batch = global_batch(request.settings, 8)
    assert batch == 4 * 8  # local batch x the GPUs data_parallel_shard_degree -1 fills
    for c in candidates(request, batch):
        d = c.degrees
        assert d.pp * d.tp * d.dp_shard * d.dp_replicate == 8 and d.tp <= 2
        assert c.local_batch_size * d.dp_shard * d.dp_replicate == batch


def test_ranked_candidates_are_fastest_first_and_the_frontier_trades_time_for_memory() -> None:
    result = _plan(_request())
    steps = [j.relative_step for j in result.ranked]
    assert steps == sorted(steps)
    frontier = result.frontier()
    assert frontier[0] is result.best
    assert [j.peak_bytes for j in frontier] == sorted((j.peak_bytes for j in frontier), reverse=True)


def test_a_cap_below_every_candidate_names_the_smallest_peak_and_its_configuration() -> None:
    with pytest.raises(PlanError, match=r"no candidate fits; the smallest peak is .* GiB \(pp \d"):
        _plan(_request(cap_bytes=1000))


def test_pinned_degrees_that_do_not_divide_the_gpus_are_refused() -> None:
    with pytest.raises(PlanError, match="pinned degrees pp 3 multiply to 3, which does not divide --gpus 4"):
        _plan(_request(pinned={"pp": 3}))
    with pytest.raises(PlanError, match="pinned tensor_parallel_degree 4 is more than --gpus-per-node 2"):
        _plan(_request(pinned={"tp": 4}))


def test_pinned_degrees_are_kept_in_every_candidate() -> None:
    result = _plan(_request(num_gpus=8, pinned={"pp": 2}))
    assert {j.candidate.degrees.pp for j in result.judged} == {2}


def test_ctrl_c_keeps_the_best_judged_so_far() -> None:
    calls = []

    def timer(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return _unit_timer(*args, **kw)

    result = _plan(_request(), timer=timer)
    assert result.stopped.startswith("interrupted") and len(result.ranked) == 3


def test_the_time_limit_stops_the_plan_and_says_the_limit_not_the_cap_stopped_it() -> None:
    with pytest.raises(PlanStopped, match=r"--time-limit 1e-09: ran out after 0.0 s, before any candidate was judged "
                       r"\(start-up and reading the job took that long\): the limit, not the memory cap, stopped the "
                       r"plan; raise --time-limit"):
        _plan(_request(time_limit_s=1e-9))


def test_a_limit_that_ends_with_candidates_that_fit_untimed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory judged, the first that fits found, and no time left to time it: the limit, not the cap."""
    with pytest.raises(PlanStopped, match=r"--time-limit 10: ran out after 10.0 s, having judged the memory of \d+ of "
                       r"\d+ candidates \(1 fit, none timed yet\): the limit, not the memory cap, stopped the "
                       r"plan; raise --time-limit \(e.g. --time-limit 20\)"):
        _clocked(monkeypatch, _request(cap_bytes=10**9, time_limit_s=10.0), shape_s=10.0)


def test_the_time_limit_counts_from_when_the_command_began() -> None:
    """Reading the job counts against --time-limit: a plan begun a limit ago judges one candidate and stops."""
    import time

    with pytest.raises(PlanStopped, match="ran out after 30.0 s, before any candidate was judged"):
        _plan(_request(time_limit_s=30.0), started=time.monotonic() - 30.0)


class _Clock:
    """A fake ``time.monotonic`` for the plan's budget: each new model shape costs ``shape_s`` (torch's call)."""

    def __init__(self, shape_s: float) -> None:
        self.now, self.shape_s = 1000.0, shape_s

    def __call__(self) -> float:
        return self.now

    def shapes(self, saved: int) -> Any:
        from ppsim.plan_search import ShapeCache

        inner = _shapes_for(saved)

        def compute(tp: int, mb_size: int, ac: str) -> JobShapes:
            self.now += self.shape_s
            return inner(tp, mb_size, ac)

        return ShapeCache(compute)


def _clocked(monkeypatch: pytest.MonkeyPatch, request: PlanRequest, shape_s: float) -> Any:
    import types

    import ppsim.plan_search

    clock = _Clock(shape_s)
    monkeypatch.setattr(ppsim.plan_search, "time", types.SimpleNamespace(monotonic=clock))
    return plan(request, shapes_for=clock.shapes(2000), build=_build, simulate=_unit_timer, started=clock.now)


def test_a_fitting_answer_comes_before_the_time_limit_where_the_lowest_bounds_do_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: the lowest lower bounds do not fit and each new shape costs 10 s; judged in lower-bound order, 5
    shapes (50 s) come before the first that fits, so a 35 s limit ran out and the plan blamed the cap. Memory
    judged shape by shape finds one after 2 shapes, and the plan says the limit stopped it."""
    result = _clocked(monkeypatch, _request(num_gpus=8, cap_bytes=100_000, time_limit_s=35.0), shape_s=10.0)
    assert result.best is not None and result.best.fits
    assert result.stopped.startswith("time limit (35 s): memory of ") and result.memory_judged < result.num_candidates


def test_a_time_limit_that_ends_before_any_fit_is_found_blames_the_limit_not_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanStopped, match=r"--time-limit 35: ran out after 30.0 s, having judged the memory of \d+ of "
                       r"\d+ candidates, none of which fits \(the smallest peak so far is .*the limit, not the memory "
                       r"cap, stopped the plan before the rest were judged; raise --time-limit"):
        _clocked(monkeypatch, _request(num_gpus=8, cap_bytes=60_000, time_limit_s=35.0), shape_s=10.0)
    with pytest.raises(PlanError, match="no candidate fits; the smallest peak is"):  # all judged: the cap's doing
        _clocked(monkeypatch, _request(num_gpus=8, cap_bytes=60_000, time_limit_s=1e6), shape_s=10.0)


def test_candidates_that_fit_left_untimed_by_the_named_share_are_timed_before_the_order_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing is cut at the named orders' share of the limit (the rest for the order search); once every
    candidate's memory is judged, the ones that fit and were left untimed are timed first: one of them may be the
    fastest, a searched order only refines one already timed."""
    import types

    import ppsim.plan_search

    clock, events = _Clock(0.0), []
    monkeypatch.setattr(ppsim.plan_search, "time", types.SimpleNamespace(monotonic=clock))

    def timer(*args: Any, **kw: Any) -> Any:  # each timing costs 1 s of the limit
        clock.now += 1.0
        events.append("time")
        return _unit_timer(*args, **kw)

    def searcher(*args: Any) -> None:
        events.append("search")
        return None

    # 90 of the 228 candidates fit: the named share (0.75 of 100 s less the output's reserve) times about 72 of
    # them, the whole limit all 90
    result = plan(_request(num_gpus=8, cap_bytes=100_000, top=10**6, time_limit_s=100.0),
                  shapes_for=clock.shapes(2000), build=_build, simulate=timer, searcher=searcher, started=clock.now)
    fitting = [j for j in result.judged if j.fits]
    assert len(fitting) == 90 and len(result.ranked) == 90
    assert not any(j.reason for j in fitting) and result.stopped == ""
    assert "search" in events and events == sorted(events, key=lambda e: e == "search")  # every timing first


def test_every_candidates_memory_is_judged_before_any_is_timed() -> None:
    events: list[str] = []
    shapes = _shapes_for(2000)

    def shapes_for(*key: Any) -> JobShapes:
        events.append("memory")
        return shapes(*key)

    def simulate(*args: Any, **kw: Any) -> Any:
        events.append("time")
        return _unit_timer(*args, **kw)

    result = plan(_request(num_gpus=8, cap_bytes=100_000, top=10**6), shapes_for=shapes_for, build=_build,
                  simulate=simulate)
    assert result.memory_judged == result.num_candidates and len(result.ranked) > 1
    assert events == sorted(events)  # every "memory" before the first "time"


def test_the_output_reserve_grows_with_what_is_left_to_print_and_is_at_most_a_quarter_of_the_limit() -> None:
    from ppsim.plan_search import OUTPUT_PAGE_S, Budget

    small, rows, page = Budget(0.0, 60.0).reserve_s(0), Budget(0.0, 60.0).reserve_s(1000), Budget(0.0, 60.0, True)
    assert small < rows < page.reserve_s(1000) and page.reserve_s(0) - small == pytest.approx(OUTPUT_PAGE_S)
    assert Budget(0.0, 1.0, page=True).reserve_s(10**6) == 0.25


def test_a_plan_with_a_page_stops_judging_earlier_to_leave_time_to_draw_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import ppsim.plan_search

    judged = []
    for page in (False, True):
        clock = _Clock(1.0)
        monkeypatch.setattr(ppsim.plan_search, "time", types.SimpleNamespace(monotonic=clock))
        result = plan(_request(num_gpus=8, cap_bytes=100_000, time_limit_s=12.0), shapes_for=clock.shapes(2000),
                      build=_build, simulate=_unit_timer, started=clock.now, page=page)
        judged.append(result.memory_judged)
        reserve = ppsim.plan_search.Budget(0.0, 12.0, page).reserve_s(len(result.judged))
        assert clock.now - 1000.0 <= 12.0 - reserve + clock.shape_s  # the last shape may end past the check
    assert judged[1] < judged[0]


def test_pp_1_candidates_are_fsdp_alone_tp_without_a_pipeline_and_hsdp_across_nodes() -> None:
    from ppsim.plan import NO_PIPELINE

    request = _request(num_gpus=8, gpus_per_node=2)
    no_pipeline = [c for c in candidates(request, global_batch(request.settings, 8)) if c.degrees.pp == 1]
    assert {c.schedule for c in no_pipeline} == {NO_PIPELINE}
    layouts = {(c.degrees.tp, c.degrees.dp_shard, c.degrees.dp_replicate) for c in no_pipeline}
    assert layouts == {(1, 8, 1), (2, 4, 1), (1, 2, 4), (2, 1, 4)}  # FSDP, or HSDP: one replica per node of 2
    assert all(c.num_microbatches * c.microbatch_size * c.degrees.dp_shard * c.degrees.dp_replicate == 32
               for c in no_pipeline)  # the global batch, as gradient accumulation steps


def test_a_pp_1_candidate_launches_with_gradient_accumulation_and_is_timed_without_a_bubble() -> None:
    from ppsim.plan import NO_PIPELINE, lower_bound

    result = _plan(_request(num_gpus=4, cap_bytes=10**7, top=10**6, unit_rates=FREE_LINKS))  # compute alone
    fsdp = [j for j in result.ranked if j.candidate.schedule == NO_PIPELINE]
    assert fsdp
    for j in fsdp:
        c = j.candidate
        assert j.overrides[-2:] == (f"--training.local_batch_size {c.microbatch_size}",
                                    f"--training.global_batch_size {result.global_batch}")
        assert not any("pipeline_parallel_schedule" in o or "microbatch_size" in o for o in j.overrides)
        assert j.relative_step == pytest.approx(lower_bound(c, result.request))  # each step's F and B in turn
        assert len(j.memory) == 1 and j.fits


def test_the_best_candidates_timeline_is_the_one_that_ranked_it_not_simulated_again(tmp_path: Path) -> None:
    from ppsim.viz.plan_page import write_plan_page

    calls: list[int] = []

    def simulate(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return _unit_timer(*args, **kw)

    result = plan(_request(), shapes_for=_shapes_for(2000), build=_build, simulate=simulate)
    timed = len(calls)
    assert result.best_timeline is not None and result.best is not None
    assert result.best_timeline.schedule.name == result.best.candidate.order_name
    write_plan_page(result, tmp_path / "plan.html", job="toy:job")
    assert len(calls) == timed  # the page drew the judged timeline


def test_plan_json_names_the_checkpoint_mode_activation_checkpoint_with_recompute_as_its_alias() -> None:
    from ppsim.plan import to_dict

    rows = to_dict(_plan(_request()), job="toy:job")["candidates"]
    assert {r["activation_checkpoint"] for r in rows} == {"none", "full"}
    assert all(r["recompute"] == r["activation_checkpoint"] and r["ep"] == 1 and r["cp"] == 1 for r in rows)


def test_lower_bound_pruning_never_drops_a_candidate_faster_than_the_kth() -> None:
    full = _plan(_request(top=10**6))
    pruned = _plan(_request(top=3))
    assert pruned.pruned > 0
    best3 = [j.relative_step for j in full.ranked[:3]]
    assert [j.relative_step for j in pruned.ranked[:3]] == best3


# --- the command on torchtitan's debug model ------------------------------------------------------------------

def _json(args: list[str]) -> dict[str, Any]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.torch
@pytest.mark.parametrize("gpus", [2, 4])
def test_plan_prints_a_ranked_table_and_the_overrides_of_the_best(gpus: int) -> None:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, [*DEBUG, "--gpus", str(gpus), "--gpus-per-node", "2", "--memory-cap", "1GiB"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "launch with: --parallelism.pipeline_parallel_degree" in result.stdout
    assert "time-memory frontier" in result.stdout and "rel. step" in result.stdout


@pytest.mark.torch
def test_plan_json_has_the_contract_keys_and_best_points_at_the_fastest_fitting() -> None:
    pytest.importorskip("torchtitan")
    data = _json([*DEBUG, "--gpus", "4", "--gpus-per-node", "2", "--memory-cap", "1GiB"])
    assert {"job", "gpus", "memory_cap_bytes", "candidates", "best"} <= data.keys()
    assert data["gpus"] == 4 and data["memory_cap_bytes"] == 2**30
    for row in data["candidates"]:
        assert CANDIDATE_KEYS <= row.keys()
    best = data["candidates"][data["best"]]
    assert best["fits"] and all(p <= 2**30 for p in best["peak_memory_bytes"])
    assert len(best["peak_memory_bytes"]) == best["pp"]
    no_pipeline = [r for r in data["candidates"] if r["pp"] == 1]
    assert no_pipeline and {r["schedule"] for r in no_pipeline} == {"none"}  # FSDP alone, TP without a pipeline
    assert ({(r["tp"], r["dp_shard"], r["dp_replicate"]) for r in no_pipeline}
            == {(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)})  # HSDP: a replica per node of 2


def _flat(overrides: list[str]) -> list[str]:
    return [tok for o in overrides for tok in o.split(" ", 1)]


@pytest.mark.torch
def test_the_best_candidates_memory_per_rank_equals_simulates_for_its_overrides() -> None:
    pytest.importorskip("torchtitan")
    data = _json([*DEBUG, "--gpus", "4", "--gpus-per-node", "2", "--memory-cap", "1GiB"])
    for row in [r for r in data["candidates"] if r["pp"] > 1][:3]:  # simulate refuses pp 1 (torchtitan's pipeline)
        sim = runner.invoke(app, ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel",
                                  *_flat(row["overrides"]), "--memory-cap", "1GiB", "--json"])
        assert sim.exit_code == 0, sim.output
        peaks = [r["peak_memory_bytes"] for r in json.loads(sim.stdout)["per_rank"]]
        assert peaks == row["peak_memory_bytes"]


@pytest.mark.torch
def test_a_profile_times_the_candidates_it_covers_in_seconds() -> None:
    pytest.importorskip("torchtitan")
    data = _json([*DEBUG, "--training.seq_len", "32", "--gpus", "2", "--gpus-per-node", "1", "--memory-cap",
                  "1GiB", "--time-limit", "25", "--profile", str(DATA / "llama3_debugmodel_s32.profile.json")])
    best = data["candidates"][data["best"]]
    assert best["step_s"] > 0 and best["tokens_per_s_per_gpu"] > 0 and best["tp"] == 1
    assert "--training.seq_len 32" in " ".join(best["overrides"])


@pytest.mark.torch
@pytest.mark.parametrize(("extra", "message"), [
    (["--gpus", "7", "--training.global_batch_size", "8"], "--gpus 7: no degrees make it up"),
    (["--gpus", "4", "--memory-cap", "1MiB"], "no candidate fits; the smallest peak is"),
    (["--gpus", "4", "--parallelism.pipeline_parallel_degree", "3"], "pinned degrees pp 3 multiply to 3"),
    (["--gpus", "4", "--time-limit", "0"], "--time-limit '0': must be a positive finite number"),
    (["--gpus", "4", "--time-limit", "nan"], "--time-limit 'nan': must be a positive finite number"),
    (["--gpus", "4", "--time-limit", "inf"], "--time-limit 'inf': must be a positive finite number"),
])
def test_bad_input_is_one_line_and_exit_2(extra: list[str], message: str) -> None:
    pytest.importorskip("torchtitan")
    args = [*DEBUG, *extra]
    if "--memory-cap" not in args:
        args += ["--memory-cap", "1GiB"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.torch
def test_a_profile_of_another_model_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    data = json.loads((DATA / "llama3_debugmodel_s32.profile.json").read_text())
    data["source"]["source"] = "torchtitan:llama3/8B"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    result = runner.invoke(app, [*DEBUG, "--gpus", "2", "--memory-cap", "1GiB", "--profile", str(other)])
    assert result.exit_code == 2, result.output
    assert "measured torchtitan:llama3/8B, but the job llama3:llama3_debugmodel trains" in result.stderr


def test_a_searched_order_that_beats_its_named_schedule_is_ranked_with_its_csv_in_the_overrides() -> None:
    calls: list[str] = []
    faster: list[Any] = []

    def searcher(named: Any, job: Any, profile: Any, unit: str, seconds: float, c: Any) -> Any:
        calls.append(named.name)
        if named.name != "GPipe":
            return None
        faster.append(build("1F1B", named.num_ranks, named.num_microbatches)[0])
        return faster[-1], "plan_pp2.csv"

    def timer(schedule: Any, *args: Any, **kw: Any) -> Any:  # the searched order takes half its named schedule's time
        sim = _unit_timer(schedule, *args, **kw)
        return dataclasses.replace(sim, makespan=sim.makespan * (0.5 if any(schedule is f for f in faster) else 1))

    # one node of 4: no hand-off crosses the network (whose latency would swamp this toy model's compute)
    request = _request(cap_bytes=10**7, activation_checkpoints=("none",), pinned={"pp": 2, "tp": 2}, gpus_per_node=4)

    def gpipe_only(name: str, ranks: int, mb: int, v: int) -> Any:
        if name != "GPipe":
            raise PlanError(f"{name}: not in this test's space")
        return _build(name, ranks, mb, v)

    only_gpipe = plan(request, shapes_for=_shapes_for(2000), build=gpipe_only, simulate=timer, searcher=searcher)
    assert calls and only_gpipe.best.candidate.csv == "plan_pp2.csv"
    assert "--parallelism.pipeline_parallel_schedule_csv plan_pp2.csv" in only_gpipe.best.overrides


@pytest.mark.torch
def test_plan_html_has_the_frontier_the_best_gantt_and_memory_and_why_the_others_lost(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    page = tmp_path / "plan.html"
    result = runner.invoke(app, [*DEBUG, "--gpus", "2", "--memory-cap", "1GiB", "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    for part in ('id="frontier"', 'id="gantt-best"', 'id="memory-best"', 'id="runners-up"', "--parallelism."):
        assert part in text


@pytest.mark.torch
def test_ctrl_c_prints_the_best_so_far_and_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    from ppsim.plan_search import Simulations

    real, calls = Simulations.simulate, []

    def interrupted_after_two(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(Simulations, "simulate", interrupted_after_two)
    result = runner.invoke(app, [*DEBUG, "--gpus", "2", "--memory-cap", "1GiB"], env={"COLUMNS": "200"})
    assert result.exit_code == 130, result.output
    assert re.search(r"Interrupted: interrupted: memory of (\d+) of \1 candidates judged, 2 timed", result.stderr)
    assert "launch with:" in result.stdout


def test_the_plan_pages_memory_over_time_peaks_at_the_plans_per_rank_verdict(tmp_path: Path) -> None:
    """One memory model per page: the best candidate's memory over time (the page's panel) reaches exactly each
    rank's peak in the plan's verdict, never the simulator's own activation count beside it."""
    from ppsim.viz.plan_page import write_plan_page

    result = _plan(_request(num_gpus=4, cap_bytes=10**7))
    best = result.best
    assert best is not None and result.best_timeline is not None and best.memory
    frame = result.best_timeline.memory()
    drawn = [int(frame[frame["rank"] == m.rank]["bytes"].max()) for m in best.memory]
    assert drawn == [m.peak_memory_bytes for m in best.memory]
    assert [s.peak_memory_bytes for s in result.best_timeline.per_rank] == drawn
    page = write_plan_page(result, tmp_path / "plan.html", job="toy:job")
    assert page.exists()


def test_the_plans_verdict_judges_reserved_plus_outside_the_allocator_as_simulate_does() -> None:
    """With the caching allocator replayed (the default of `plan`, as of `simulate`), a candidate whose tensors fit
    is over the cap when the allocator's reserved peak plus the CUDA context and NCCL's buffers are not: here the
    toy's tensors are a few MB and the outside terms alone about 0.8 GiB."""
    from ppsim.plan import Judge, candidates

    tensors = _plan(_request(cap_bytes=2**29, top=10**6))  # the tensors' peak alone: fits
    assert tensors.ranked and all(m.reserved is None for j in tensors.ranked for m in j.memory)
    request = _request(cap_bytes=2**29, top=10**6, allocator="expandable")
    # the smallest: one NCCL group and the context outside the allocator, not the toy's MB
    with pytest.raises(PlanError, match=r"no candidate fits; the smallest peak is 0\.[5-9]\d GiB"):
        _plan(request)
    judge = Judge(request, shapes_for=_shapes_for(2000), build=_build, simulate=_unit_timer)
    judged, prepared = judge.memory(candidates(request, global_batch(request.settings, 4))[0])
    assert prepared is None and not judged.fits and "outside" in judged.reason
    assert all(m.reserved is not None and m.peak_memory_bytes < 2**29 < m.reserved.device_bytes
               for m in judged.memory)


def test_workers_judge_the_same_verdicts_in_the_same_order_as_one_process() -> None:
    from ppsim.workers import can_fork

    if not can_fork():
        pytest.skip("needs fork (Linux, macOS)")
    request = _request(cap_bytes=100_000, num_gpus=8, gpus_per_node=8)  # some fit, some stop at a rank over
    one, two = (_plan(request, workers=w) for w in (1, 2))
    assert len(one.judged) > 8  # runs of 4 or more share their shapes: forked
    assert [(j.candidate, j.fits, j.reason, [m.peak_memory_bytes for m in j.memory]) for j in one.judged] == \
        [(j.candidate, j.fits, j.reason, [m.peak_memory_bytes for m in j.memory]) for j in two.judged]
    assert [j.candidate for j in one.ranked] == [j.candidate for j in two.ranked]


def test_a_candidate_over_the_cap_is_judged_up_to_its_first_rank_over() -> None:
    result = _plan(_request(cap_bytes=100_000, num_gpus=8, gpus_per_node=8))
    over = [j for j in result.judged if j.memory and not j.fits]
    assert any(len(j.memory) < j.candidate.degrees.pp for j in over)
    for j in over:
        assert j.memory[-1].fits is False and all(m.fits for m in j.memory[:-1])
        assert (len(j.memory) < j.candidate.degrees.pp) == ("the ranks after it not counted" in j.reason)


def test_the_json_keeps_a_slot_per_pp_rank_null_where_a_rank_was_not_counted() -> None:
    from ppsim.plan import to_dict

    result = _plan(_request(cap_bytes=100_000, num_gpus=8, gpus_per_node=8))
    rows = to_dict(result, job="toy")["candidates"]
    stopped = [r for r in rows if r["memory_parts"] and None in r["peak_memory_bytes"]]
    assert stopped and all(not r["fits"] for r in stopped)
    for r in rows:
        if r["memory_parts"]:
            assert len(r["peak_memory_bytes"]) == len(r["memory_parts"]) == r["pp"]
            counted = [p for p in r["peak_memory_bytes"] if p is not None]
            assert r["peak_memory_bytes"][:len(counted)] == counted  # counted from rank 0 up to the first over


def test_a_space_with_no_candidate_is_refused_in_one_line_saying_why_not_blaming_the_time_limit() -> None:
    # 8 GPUs, global batch 2, PP 4 pinned: a pipeline gets at most 2 sequences, fewer than its 4 microbatches
    request = _request(num_gpus=8, gpus_per_node=8, settings=_settings(local_batch=1), pinned={"pp": 4})
    with pytest.raises(PlanError, match="fewer sequences than microbatches its pipeline needs") as got:
        candidates(request, 2)
    assert "time" not in str(got.value) and "--training.global_batch_size" in str(got.value)


def _steady_cases(request: PlanRequest, saved: int, just_in_time: bool) -> list[tuple[Any, Any, Any]]:
    """Each candidate of ``request``: its named order judged on its steady state (or ``None``) and walked whole."""
    from ppsim.plan import Judge

    shapes = _shapes_for(saved)

    def shapes_for(tp: int, mb_size: int, ac: str) -> JobShapes:
        return dataclasses.replace(shapes(tp, mb_size, ac), receives_just_in_time=just_in_time)

    judge = Judge(request, shapes_for=shapes_for, build=_build, simulate=_unit_timer)
    return [(c, judge.steady(c), judge.walked(c)) for c in candidates(request, global_batch(request.settings,
                                                                                           request.num_gpus))]


@given(saved=st.integers(100, 20_000), cap=st.integers(200_000, 3_000_000), just_in_time=st.booleans(),
       allocator=st.sampled_from([None, "expandable", "default"]), local_batch=st.sampled_from([24, 40]))
@settings(max_examples=6, deadline=None)
def test_a_long_order_judged_on_its_steady_state_is_judged_as_walked_whole(
        saved: int, cap: int, just_in_time: bool, allocator: str | None, local_batch: int) -> None:
    """The plan judges a named order of many microbatches on two short ones (``Judge.steady``); wherever it does,
    every rank's peak, parts, the action it is in, the reserved peak and the verdict equal the whole order's, and
    it does so for 1F1B and Interleaved 1F1B (whose memory does not grow with the microbatches), never for GPipe."""
    request = _request(settings=_settings(local_batch=local_batch), cap_bytes=cap if allocator is None else 2**31,
                       num_gpus=4, gpus_per_node=2, allocator=allocator)
    from ppsim.plan import _same_memory

    engaged: set[str] = set()
    for c, steady, whole in _steady_cases(request, saved, just_in_time):
        if steady is None:
            continue
        engaged.add(c.schedule)
        judged, prepared = steady
        assert judged.candidate == c and judged.overrides == whole[0].overrides
        assert _same_memory(judged, whole[0]), (c, judged.reason, whole[0].reason)
        assert [m.peak_memory_bytes for m in judged.memory] == [m.peak_memory_bytes for m in whole[0].memory]
        assert (prepared is None) == (whole[1] is None)
        if prepared is not None:
            assert prepared.schedule.num_microbatches == c.num_microbatches  # timing gets the whole order
    assert {"1F1B", "Interleaved1F1B"} <= engaged and "GPipe" not in engaged


def test_a_candidate_refused_at_once_is_refused_as_judging_it_whole_would() -> None:
    """``Judge.refusal`` (the stage split, a split backward under checkpointing: known without shapes or the whole
    order) gives the verdict the whole judging gives, and answers ``None`` for every candidate that can run."""
    from ppsim.plan import Judge

    request = _request(settings=_settings(local_batch=24), num_gpus=8, gpus_per_node=8)
    judge = Judge(request, shapes_for=_shapes_for(2000), build=_build, simulate=_unit_timer)
    refused = 0
    for c in candidates(request, global_batch(request.settings, request.num_gpus)):
        quick, whole = judge.refusal(c), judge.walked(c)[0]
        if quick is None:
            assert not whole.reason.startswith("cannot run") or "splits its backward" not in whole.reason
            continue
        refused += 1
        assert (quick.candidate, quick.overrides, quick.reason, quick.memory) == \
            (whole.candidate, whole.overrides, whole.reason, whole.memory)
    assert refused > 0
