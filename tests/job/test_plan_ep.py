"""`ppsim plan` with expert parallelism: every candidate carries its EP degree (pinned, varied on a MoE model, 1 on a
dense one), its memory and step count it, its launch line sets it (ppsim.plan, ppsim.plan_search); no torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from job.test_plan import _build, _request, _settings, _unit_timer

from ppsim.errors import PPSimError
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.plan import (
    MAX_LOCAL_EXPERTS,
    Candidate,
    ModelFacts,
    PlanError,
    candidates,
    degree_layouts,
    ep_options,
    global_batch,
    to_dict,
)
from ppsim.plan_search import ORDER_TIERS, ShapeCache, memory_order, order_size, plan

EXPERTS = 8
MOE = ModelFacts(6, 4, 2, "toy", num_experts=EXPERTS)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _moe_shapes_for(calls: list[tuple[Any, ...]] | None = None) -> Any:
    """A toy MoE model: each layer has routed experts (EP-local: experts / ep on dim 0) and a dense weight."""

    def shapes_for(tp: int, mb_size: int, ac: str, ep: int = 1, cp: int = 1) -> JobShapes:
        if calls is not None:
            calls.append((tp, mb_size, ac, ep, cp))
        keep = 2000 * mb_size // (8 if ac == "full" else 1)
        experts = "moe.routed_experts.inner_experts.w1"
        layer = BlockShapes("moe", (("attention.w", (64 // tp, 32)), (experts, (EXPERTS // ep, 64, 32))),
                            saved_bytes=keep, backward_transient_bytes=keep, sparse=frozenset({experts}))
        blocks = {f"layers.{i}": layer for i in range(6)}
        blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (100, 32)),), saved_bytes=8 * mb_size)
        blocks["norm"] = BlockShapes("head", (("w", (32,)),), saved_bytes=0)
        blocks["lm_head"] = BlockShapes("head", (("w", (100 // tp, 32)),), saved_bytes=keep)
        return JobShapes(source="toy", blocks=blocks, tp=tp, boundary_bytes=64 * mb_size,
                         moe_layers=tuple(f"layers.{i}" for i in range(6)), moe_top_k=2, moe_tokens=16 * mb_size // tp,
                         dim=32)

    return shapes_for


def _moe_request(**kw: Any) -> Any:
    base: dict[str, Any] = dict(model=MOE, num_gpus=8, gpus_per_node=4, cap_bytes=10**7)
    base.update(kw)
    return _request(**base)


# --- the space ----------------------------------------------------------------------------------------------------
def test_a_dense_model_keeps_ep_1_and_its_launch_line_does_not_name_it() -> None:
    request = _request()
    space = candidates(request, global_batch(request.settings, request.num_gpus))
    assert space and {c.degrees.ep for c in space} == {1}
    assert not any("expert_parallel_degree" in o for c in space for o in c.overrides(request.settings))


def test_a_moe_model_varies_ep_over_powers_of_two_dividing_the_experts_and_dp_shard_cp_tp() -> None:
    request = _moe_request()
    space = candidates(request, global_batch(request.settings, request.num_gpus))
    by_carved: dict[int, set[int]] = {}
    for c in space:
        d = c.degrees
        by_carved.setdefault(d.dp_shard * d.cp * d.tp, set()).add(d.ep)
    # 8 GPUs: dp_shard x tp is 8 (pp 1), 4 (pp 2) or 2 (pp 4; pp 8 is more than the 6 layers)
    assert by_carved == {8: {1, 2, 4, 8}, 4: {1, 2, 4}, 2: {1, 2}}
    # each EP is in the launch line
    c = next(c for c in space if c.degrees.ep == 4)
    assert "--parallelism.expert_parallel_degree 4" in c.overrides(request.settings)


def test_many_experts_leave_at_most_max_local_experts_a_rank_and_a_small_group_its_largest_degree() -> None:
    request = _moe_request(model=dataclasses.replace(MOE, num_experts=256))
    assert ep_options(request, 2048) == [8, 16, 32, 64, 128, 256]  # 256 / 8 = 32 experts a rank at most
    assert all(256 // e <= MAX_LOCAL_EXPERTS for e in ep_options(request, 2048))
    assert ep_options(request, 4) == [4]  # no degree leaves <= 32: the largest valid one
    odd = _moe_request(model=dataclasses.replace(MOE, num_experts=60))
    assert ep_options(odd, 64) == [2, 4]  # powers of two dividing 60 and 64 with at most 32 a rank


def test_a_pinned_ep_is_kept_for_every_candidate() -> None:
    request = _moe_request(pinned={"ep": 2})
    space = candidates(request, global_batch(request.settings, request.num_gpus))
    assert space and {c.degrees.ep for c in space} == {2}
    # pp 8 leaves dp_shard x tp = 1, which EP 2 cannot be carved out of: no such layout
    assert all(c.degrees.dp_shard * c.degrees.tp % 2 == 0 for c in space)
    assert all("--parallelism.expert_parallel_degree 2" in c.overrides(request.settings) for c in space)


@pytest.mark.parametrize(("model", "pins", "words"), [
    (MOE, {"ep": 3}, "pinned expert_parallel_degree 3 does not divide the model's 8 routed experts"),
    (ModelFacts(6, 4, 2, "toy"), {"ep": 2}, "pinned expert_parallel_degree 2: the model has no experts"),
])
def test_a_pinned_ep_torchtitan_cannot_run_is_one_line(model: ModelFacts, pins: dict[str, int], words: str) -> None:
    request = _request(model=model, num_gpus=8, gpus_per_node=4, pinned=pins)
    with pytest.raises(PlanError, match=words) as info:
        degree_layouts(request, global_batch(request.settings, 8))
    assert "\n" not in str(info.value)


def test_a_pinned_ep_does_not_count_in_the_gpu_product() -> None:
    request = _moe_request(pinned={"ep": 8, "pp": 1, "tp": 1, "dp_shard": 8, "dp_replicate": 1, "cp": 1})
    layouts = degree_layouts(request, global_batch(request.settings, 8))
    assert {(d.pp, d.dp_shard, d.ep) for d in layouts} == {(1, 8, 8)}


@settings(max_examples=60, deadline=None)
@given(nodes=st.sampled_from([1, 2, 4]), per_node=st.sampled_from([2, 4, 8]),
       experts=st.sampled_from([None, 4, 6, 8, 16, 64, 256]), pin=st.sampled_from([None, 1, 2, 4]))
def test_every_candidates_degrees_make_the_gpus_and_its_ep_divides_experts_and_dp_shard_cp_tp(
        nodes: int, per_node: int, experts: int | None, pin: int | None) -> None:
    gpus = nodes * per_node
    model = ModelFacts(6, 4, 2, "toy", num_experts=experts)
    pins = {} if pin is None else {"ep": pin}
    request = _request(model=model, num_gpus=gpus, gpus_per_node=per_node, pinned=pins,
                       settings=_settings(local_batch=8))
    try:
        space = candidates(request, global_batch(request.settings, gpus))
    except PlanError as exc:  # a pinned EP the model or the GPUs cannot carve: one line, naming the pin
        assert pin is not None and pin > 1 and "pinned" in str(exc) and "\n" not in str(exc)
        return
    for c in space:
        d = c.degrees
        assert d.pp * d.tp * d.cp * d.dp_shard * d.dp_replicate == gpus
        assert (d.dp_shard * d.cp * d.tp) % d.ep == 0
        if experts is None:
            assert d.ep == 1
        else:
            assert experts % d.ep == 0
        if pin is not None:
            assert d.ep == pin


# --- judged and timed with EP -------------------------------------------------------------------------------------
def test_a_moe_plan_judges_each_ep_with_its_own_shapes_and_launches_the_best_with_it() -> None:
    calls: list[tuple[Any, ...]] = []
    request = _moe_request(top=10**6)
    result = plan(request, shapes_for=_moe_shapes_for(calls), build=_build, simulate=_unit_timer)
    assert result.best is not None
    assert {k[3] for k in calls} == {1, 2, 4, 8}  # the shapes made at each EP degree tried
    assert len(calls) == len(set(calls))  # once per key
    eps = {j.candidate.degrees.ep for j in result.ranked}
    assert len(eps) > 1
    best = result.best.candidate
    launch = " ".join(result.best.overrides)
    if best.degrees.ep > 1:
        assert f"--parallelism.expert_parallel_degree {best.degrees.ep}" in launch
    rows = to_dict(result, job="toy")["candidates"]
    assert {r["ep"] for r in rows} == {c.degrees.ep for c in (j.candidate for j in result.judged)}
    # EP's gathered experts per rank shrink with EP: the same configuration at a larger EP holds less
    same = {}
    for j in result.judged:
        c = j.candidate
        if j.memory and c.degrees.pp == 2 and c.schedule == "1F1B" and c.microbatch_size == 1 \
                and c.activation_checkpoint == "none" and c.degrees.tp == 1:
            same[c.degrees.ep] = j.peak_bytes
    assert len(same) >= 2 and all(same[a] > same[b] for a, b in zip(sorted(same), sorted(same)[1:]))


def test_the_ep_pass_prices_the_all_to_alls_in_a_candidates_step() -> None:
    from ppsim.plan import job_of, stage_modules, step_collectives, unit_costs
    from ppsim.plan_search import build_named
    from ppsim.split import resolve_split

    request = _moe_request()
    shapes_for = _moe_shapes_for()
    c = next(c for c in candidates(request, global_batch(request.settings, 8))
             if c.degrees.ep == 4 and c.degrees.pp == 2 and c.schedule == "1F1B")
    shapes = shapes_for(c.degrees.tp, c.microbatch_size, c.activation_checkpoint, ep=4)
    job = job_of(c, request)
    modules = stage_modules(6, resolve_split(job.split, 6, 2, schedule="1F1B"))
    step = step_collectives(c, shapes, modules, None, unit=unit_costs(c, request, shapes), request=request)
    assert step is not None
    sim = _unit_timer(build_named("1F1B", 2, c.num_microbatches, 1), job, None,
                      unit_costs(c, request, shapes).text(), step=step)
    assert sim.collectives["all_to_all"].count > 0


# --- the cost of judging ------------------------------------------------------------------------------------------
def test_a_failing_shape_key_is_computed_once_and_refused_each_time() -> None:
    calls: list[int] = []

    def compute(tp: int, mb: int, ac: str, **kw: int) -> JobShapes:
        calls.append(tp)
        raise PPSimError("expert_parallel_degree 64 does not divide dp_shard x cp x tp = 1")

    cache = ShapeCache(compute)
    for _ in range(3):
        with pytest.raises(PPSimError, match="does not divide"):
            cache(1, 1, "none", ep=64)
    assert calls == [1]
    assert cache.has((1, 1, "none", 64, 1)) and not cache.has((1, 1, "none", 1, 1))


def test_cheap_orders_are_judged_before_huge_ones() -> None:
    request = _moe_request(settings=_settings(local_batch=4096))
    space = memory_order(candidates(request, global_batch(request.settings, 8)), request)
    tiers = [sum(order_size(c) > t for t in ORDER_TIERS) for c in space]
    assert tiers == sorted(tiers) and len(set(tiers)) > 1


def test_order_size_counts_every_ranks_forwards() -> None:
    request = _moe_request()
    c = next(c for c in candidates(request, global_batch(request.settings, 8)) if c.num_stages_per_rank == 2)
    assert isinstance(c, Candidate)
    assert order_size(c) == c.degrees.pp * 2 * c.num_microbatches


# --- nothing fits, or nothing can run: counted apart --------------------------------------------------------------
def _judged(request: Any, n_refused: int, peaks: list[int]) -> Any:
    from ppsim.job.memory import RankMemory
    from ppsim.plan import Judged, Plan

    space = candidates(request, global_batch(request.settings, request.num_gpus))
    judged = []
    for k in range(n_refused):
        reason = (f"cannot run: {k + 7} stages for 6 layers + embedding (1) + head (1) = 8 weighted layers: every "
                  "stage needs at least one" if k else "cannot run: DualPipeV splits its backward into I and W")
        judged.append(Judged(space[k], (), reason=reason))
    for i, peak in enumerate(peaks):
        mem = RankMemory(rank=0, parts={"activations": peak}, during="0F0", cap_bytes=request.cap_bytes)
        judged.append(Judged(space[n_refused + i], (), memory=(mem,), reason="over"))
    return Plan(request=request, global_batch=4, judged=tuple(judged), ranked=(), num_candidates=len(judged),
                memory_judged=len(judged))


def test_nothing_fits_counts_those_that_could_not_run_apart_from_those_that_ran_over_the_cap() -> None:
    from ppsim.plan import nothing_fits

    request = _moe_request(cap_bytes=2**30)
    line = nothing_fits(_judged(request, 4, [5 * 2**30, 3 * 2**30, 4 * 2**30]))
    assert "\n" not in line
    assert "no candidate fits; the smallest peak is 3.00 GiB (" in line
    assert "3 of the 7 ran and none fits" in line
    # the rule that refused most (3 of the 4, numbers aside), with one of its reasons, and the other rule counted
    assert "4 could not run (3 of them: 8 stages for 6 layers" in line and "1 other rule)" in line
    assert line.endswith("raise the cap to at least that or use more GPUs")


def test_nothing_can_run_names_the_rule_that_refused_most() -> None:
    from ppsim.plan import nothing_fits

    line = nothing_fits(_judged(_moe_request(), 3, []))
    assert line.startswith("--gpus 8: none of the 3 candidates can run: 3 could not run (2 of them: ")
    assert "every stage needs at least one; 1 other rule)" in line and "\n" not in line


def test_all_ran_and_none_fits_says_so() -> None:
    from ppsim.plan import nothing_fits

    line = nothing_fits(_judged(_moe_request(cap_bytes=2**20), 0, [2**30, 2**31]))
    assert "the smallest peak is 1.00 GiB" in line and "all 2 candidates ran and none fits;" in line
    assert "could not run" not in line


def test_the_plan_exits_with_the_count_when_nothing_fits() -> None:
    request = _moe_request(cap_bytes=1000)
    with pytest.raises(PlanError) as info:
        plan(request, shapes_for=_moe_shapes_for(), build=_build, simulate=_unit_timer)
    text = str(info.value)
    assert "no candidate fits; the smallest peak is" in text and "none fits" in text and "\n" not in text
