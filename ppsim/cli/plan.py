"""`ppsim plan`: parse the job and the options, make the plan (:mod:`ppsim.plan`), print it (table, JSON, page).

The shapes (torchtitan's model on the meta device, TP-sharded on a fake process group) are computed once per
(TP degree, microbatch size, checkpoint mode) and cached: that is the expensive call."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import console, echo_json, user_errors
from ppsim.cli.options import JOB_CONTEXT, JsonOpt, output_file
from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.memory import JobShapes
    from ppsim.plan import Judged, ModelFacts, Plan, PlanRequest, ProfileCover

PLAN_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "data_parallel_shard_degree",
             "data_parallel_replicate_degree", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
             "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage", "local_batch_size",
             "num_pp_microbatches", "num_tokens_per_microbatch_per_dp_rank")


@app.command("plan", context_settings=JOB_CONTEXT)
@user_errors
def plan_cmd(
    ctx: typer.Context,
    torchtitan_config: Annotated[str, typer.Option("--torchtitan-config", metavar="MODULE:CONFIG",
                                                   help="The job: a torchtitan config function, e.g. "
                                                   "llama3:llama3_8b; override keys with --parallelism.KEY VALUE.")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs the job runs on.")],
    memory_cap: Annotated[str, typer.Option("--memory-cap", help="Each device's memory: 80GiB (2^30) or 80GB.")],
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (TP stays within one).")] = 8,
    profile: Annotated[Optional[list[Path]], typer.Option(
        "--profile", help="Profile JSON from `ppsim calibrate` (repeatable): times the candidates it covers (its TP "
        "degree, 1 if it records none, and its tokens per microbatch).")] = None,
    time_limit: Annotated[str, typer.Option("--time-limit", help="Seconds to plan (default 60).")] = "60",
    top: Annotated[int, typer.Option("--top", min=1, help="Candidates to show.")] = 5,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=output_file,
                                                   help="Write one offline HTML page.")] = None,
    json_out: JsonOpt = False,
    memory_as_run: Annotated[bool, typer.Option(
        "--memory-as-run", help="With --profile: judge memory as `ppsim run` executes each candidate on the "
        "profile's device (its dtype, no optimizer step), to check the plan against runs; default: the training "
        "job.")] = False,
) -> None:
    """The fastest configuration of a torchtitan job that fits each device's memory, with the overrides to launch
    it."""
    from ppsim.plan import plan

    started = time.monotonic()  # the time limit counts reading the job
    if output is not None and output.suffix.lower() != ".html":
        raise PPSimError(f"-o {output}: plan writes one offline HTML page; use a name ending in .html, e.g. "
                         "-o plan.html")
    request = _request(torchtitan_config, list(ctx.args), gpus=gpus, gpus_per_node=gpus_per_node,
                       memory_cap=memory_cap, profiles=profile or [], time_limit=time_limit, top=top)
    orders: dict[str, Any] = {}
    if memory_as_run and not request.profiles:
        raise PPSimError("--memory-as-run: needs --profile (the device and dtype `ppsim run` would execute on); "
                         "add --profile P.json, or drop --memory-as-run")
    if memory_as_run:
        request = _as_run_here(request)
    shapes_for = _shapes_cache(torchtitan_config, request, as_run=memory_as_run)
    result = plan(request, shapes_for=shapes_for, build=_build, timer=_time, progress=_progress_line(),
                  searcher=_searcher(output, orders), started=started)
    typer.echo("", err=True)
    typer.echo("memory: " + _memory_rule(bool(request.profiles), as_run=memory_as_run), err=True)
    _write_orders(result, orders)
    if output is not None and result.best is not None:
        from ppsim.viz.plan_page import write_plan_page  # plotly only when asked

        page = write_plan_page(result, output, best_result=_best_result(result, shapes_for),
                               job=torchtitan_config)
        typer.echo(f"wrote {page}", err=True)
    if json_out:
        from ppsim.plan import to_dict

        echo_json(to_dict(result, job=torchtitan_config))
    else:
        print_plan(result)
    if result.stopped.startswith("interrupted"):
        typer.echo(f"Interrupted: {result.stopped}; the plan above is the best so far.", err=True)
        raise typer.Exit(130)


# --- reading the request ---------------------------------------------------------------------------------------
def _time_limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise PPSimError(f"--time-limit {text!r}: must be a positive finite number of seconds; e.g. --time-limit 60")
    return value


def _split_overrides(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The overrides as ``{section.key: value}`` and as tokens without the keys the plan chooses."""
    pairs: dict[str, str] = {}
    kept: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if "=" in token:
            key, value, step = *token.split("=", 1), 1
        else:
            key, value, step = token, args[i + 1] if i + 1 < len(args) else "", 2
        name = key.lstrip("-")
        pairs[name] = value
        if name.split(".")[-1] not in PLAN_KEYS:
            kept += args[i:i + step]
        i += step
    return pairs, kept


def _pins(pairs: dict[str, str]) -> dict[str, int]:
    from ppsim.plan import DEGREE_KEYS

    pins: dict[str, int] = {}
    for short, key in DEGREE_KEYS.items():
        text = pairs.get(f"parallelism.{key}")
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            raise PPSimError(f"--parallelism.{key} {text!r}: not an integer; e.g. --parallelism.{key} 2") from None
        if short == "dp_shard" and value == -1:
            continue  # fill the GPUs the other degrees leave: the plan's own choice
        if value < 1:
            raise PPSimError(f"--parallelism.{key} {value}: must be at least 1"
                             + (" (or -1 to fill the GPUs)" if short == "dp_shard" else "")
                             + f"; e.g. --parallelism.{key} 1")
        pins[short] = value
    return pins


def _request(value: str, args: list[str], *, gpus: int, gpus_per_node: int, memory_cap: str,
             profiles: list[Path], time_limit: str, top: int) -> PlanRequest:
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.cli.job_memory import job_config_context
    from ppsim.io import parse_memory_cap
    from ppsim.plan import PlanRequest, node_layout
    from ppsim.torchtitan import is_registry_name

    limit = _time_limit(time_limit)
    for option, number in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node)):
        if number < 1:
            raise PPSimError(f"{option} {number}: must be a positive integer; e.g. {option} 8")
    note = node_layout(gpus, gpus_per_node)
    if note:
        typer.echo(note, err=True)
    cap = parse_memory_cap(memory_cap)
    if cap is None or cap.bytes is None:
        raise PPSimError(f"--memory-cap {memory_cap!r}: plan needs bytes (80GiB = 80 x 2^30, 80GB = 80 x 10^9), "
                         "not activations")
    if not is_registry_name(value):
        raise PPSimError(f"--torchtitan-config {value}: plan needs a config function (MODULE:CONFIG, e.g. "
                         "llama3:llama3_8b) to build the model's shapes; a TOML job names no model")
    pairs, kept = _split_overrides(args)
    with job_config_context(value):
        settings = read_job_settings(value, args)
    facts = _model_facts(value, settings)
    ac = _checkpoint_modes(value)
    return PlanRequest(settings=settings, user_overrides=tuple(kept), model=facts, num_gpus=gpus,
                       gpus_per_node=gpus_per_node, cap_bytes=cap.bytes, pinned=_pins(pairs),
                       profiles=tuple(_cover(p, facts, value) for p in profiles), time_limit_s=limit, top=top,
                       activation_checkpoints=ac)


def _model_facts(value: str, settings: Any) -> ModelFacts:
    from ppsim.calibrate.torchtitan.shapes import converters_set_aside, trainer_config
    from ppsim.plan import ModelFacts

    with converters_set_aside():
        layers = list(trainer_config(value).model_spec.model.layers)
    attn = layers[0].attention
    return ModelFacts(num_layers=len(layers), num_heads=attn.n_heads,
                      num_kv_heads=getattr(attn, "n_kv_heads", None) or attn.n_heads,
                      source=settings.model_source or value)


def _checkpoint_modes(value: str) -> tuple[str, ...]:
    """The job's own checkpoint mode and full checkpointing (counted as 'none' for 'selective')."""
    from ppsim.calibrate.torchtitan.shapes import _ac_mode, converters_set_aside, trainer_config

    with converters_set_aside():
        own = _ac_mode(trainer_config(value).activation_checkpoint)
    own = "none" if own == "selective" else own
    return (own,) if own == "full" else (own, "full")


def _cover(path: Path, facts: ModelFacts, value: str) -> ProfileCover:
    from ppsim.profile import load_profile
    from ppsim.plan import PlanError, ProfileCover

    prof = load_profile(path)
    measured = prof.source.source if prof.source is not None else prof.model.preset
    if measured.lower() != facts.source.lower():
        raise PlanError(f"--profile {path}: measured {measured}, but the job {value} trains {facts.source}; "
                        f"calibrate with --model {facts.source}")
    options = prof.source.options if prof.source is not None else {}
    tp = int(options.get("tensor_parallel_degree", options.get("tp", 1)) or 1)
    return ProfileCover(path=str(path), tp=tp, tokens_per_microbatch=prof.model.seq_len * prof.model.mb_size,
                        collectives=_collective_costs(path, prof))


def _collective_costs(path: Path, prof: Any) -> Any:
    """The profile's FSDP collective costs, and on stderr where they come from (dp_shard > 1 candidates)."""
    from ppsim.fsdp import CollectiveCosts

    costs = CollectiveCosts.from_profile(prof)
    if not costs.available:
        typer.echo(f"plan: {path} measured no all-gather / reduce-scatter and has no p2p alpha/beta: dp_shard > 1 "
                   "candidates are timed without FSDP's collectives", err=True)
        return None
    groups = sorted({m.group_size for m in costs.measured}) or [2]
    typer.echo(f"plan: FSDP's collectives (dp_shard > 1) in the step from {path}: {costs.describe(groups[0])}",
               err=True)
    return costs


# --- the callbacks ---------------------------------------------------------------------------------------------
def _as_run_here(request: PlanRequest) -> PlanRequest:
    """As `ppsim run` executes the candidates here: with a CPU profile, their local processes share this host's
    cores (the step time by processor sharing, as run's own prediction)."""
    import dataclasses

    from ppsim.profile import load_profile
    from ppsim.sharing import host_cores

    if load_profile(request.profiles[0].path).device != "cpu":
        return request
    return dataclasses.replace(request, shared_cores=host_cores())


def _memory_rule(profiled: bool, *, as_run: bool) -> str:
    """How the candidates' memory was counted (one stderr line after the plan)."""
    if as_run:
        return ("each candidate as `ppsim run` holds it on the profile's device (its dtype, no optimizer state, "
                "fully_shard only where FSDP or TP shards), activations as the profile measured them where it covers "
                "the microbatch, else the formula")
    if profiled:
        return ("each candidate as torchtitan trains it (mixed precision, AdamW), activations as the profile "
                "measured them where it covers the microbatch, else the formula")
    return "each candidate as torchtitan trains it (mixed precision, AdamW); activations from the formula (no --profile)"


def _shapes_cache(value: str, request: PlanRequest, *, as_run: bool = False) -> Any:
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes
    from ppsim.cli.job_memory import job_config_context
    from ppsim.plan import batch_shape

    cache: dict[tuple[int, int, str], JobShapes] = {}
    keys = batch_shape(request.settings).keys
    seq = batch_shape(request.settings).seq_len

    def shapes_for(tp: int, mb_size: int, ac: str) -> JobShapes:
        if (tp, mb_size, ac) not in cache:
            size = mb_size if keys.size.endswith("microbatch_size") else mb_size * seq
            args = [*request.user_overrides, "--parallelism.tensor_parallel_degree", str(tp),
                    "--parallelism.data_parallel_shard_degree", "1", f"--{keys.size}", str(size)]
            with job_config_context(value):
                settings = read_job_settings(value, args)
            cache[(tp, mb_size, ac)] = job_shapes(value, settings, activation_checkpoint=ac,
                                                  profile=_memory_profile(request, tp, mb_size * seq),
                                                  as_run=as_run)[0]
        return cache[(tp, mb_size, ac)]

    return shapes_for


def _memory_profile(request: PlanRequest, tp: int, tokens: int) -> Any:
    """The profile whose measured activations (and device) judge memory: the one
    measured at this TP degree and tokens per microbatch, else the first (its model, dtype and device; the formula's
    activations); ``None`` without ``--profile`` (torchtitan's training job, the formula's activations)."""
    from ppsim.profile import load_profile

    if not request.profiles:
        return None
    cover = next((p for p in request.profiles if p.tp == tp and p.tokens_per_microbatch == tokens),
                 request.profiles[0])
    return load_profile(cover.path)


def _build(name: str, ranks: int, mb: int, v: int) -> Any:
    from ppsim.compare import build

    return build(name, ranks, mb, v)[0]


_COSTS: dict[tuple[str, Any], Any] = {}


def _costs(job: Any, profile: str | None, unit: str) -> Any:
    from ppsim.costs import load_costs

    key = (profile or unit, job.split if profile else None)
    if key not in _COSTS:
        _COSTS[key] = load_costs(profile=profile, split=job.split) if profile else load_costs(costs=unit)
    return _COSTS[key]


def _simulated(schedule: Any, job: Any, profile: str | None, unit: str, fsdp: Any = None) -> Any:
    from ppsim.compare import compare

    return compare([schedule.name], builder=lambda _: schedule, costs=_costs(job, profile, unit),
                   scope=None if profile else "stage", fsdp=fsdp).best


def _time(schedule: Any, job: Any, profile: str | None, unit: str, *, fsdp: Any = None) -> float:
    return float(_simulated(schedule, job, profile, unit, fsdp).makespan)


def _searcher(output: Path | None, orders: dict[str, Any]) -> Any:
    """``search``'s order for a configuration, at no more activations per rank than its named schedule holds; its
    CSV goes beside ``-o`` (or in the current folder)."""
    folder = output.parent if output is not None else Path(".")
    stem = output.stem if output is not None else "plan"

    def run(named: Any, job: Any, profile: str | None, unit: str, seconds: float, c: Any) -> Any:
        from ppsim.plan import V_SHAPE
        from ppsim.search import search

        base = _simulated(named, job, profile, unit)
        peak = max(r.peak_activations for r in base.per_rank)
        v_shape = c.schedule in V_SHAPE
        try:
            found = search(named.num_ranks, named.num_microbatches, _costs(job, profile, unit), f"{peak}act",
                           placement="v" if v_shape else "loop",
                           num_stages_per_rank=None if v_shape else c.num_stages_per_rank, time_limit=seconds,
                           solver="none", cost_scope=None if profile else "stage")
        except PPSimError:
            return None
        if found.makespan >= base.makespan * (1 - 1e-9):
            return None
        path = folder / f"{stem}_pp{named.num_ranks}_m{named.num_microbatches}_v{c.num_stages_per_rank}.csv"
        orders[str(path)] = found.schedule
        return found.schedule, str(path)

    return run


def _write_orders(result: Plan, orders: dict[str, Any]) -> None:
    """The CSV of each searched order among the candidates shown (named in their overrides)."""
    from ppsim.formats import write_csv

    for j in result.ranked[:result.request.top]:
        if j.candidate.csv is not None and j.candidate.csv in orders:
            typer.echo(f"wrote {write_csv(orders[j.candidate.csv], j.candidate.csv)} (search's order)", err=True)


def _progress_line() -> Any:
    last = [0.0]

    def show(done: int, total: int, best: Judged | None, elapsed: float) -> None:
        if elapsed - last[0] < 1.0 and done < total:
            return
        last[0] = elapsed
        from ppsim.plan import describe

        lead = f"best so far: {describe(best.candidate)}" if best is not None else "nothing fits yet"
        end = "\r" if sys.stderr.isatty() else "\n"
        estimate = f" (all {total}: ~{elapsed / done * total:.0f} s at this pace)" if done < total else ""
        typer.echo(f"plan: {done}/{total} candidates judged in {elapsed:.1f} s{estimate}; {lead}", err=True, nl=False)
        typer.echo(end, err=True, nl=False)

    return show


def _best_result(result: Plan, shapes_for: Any) -> Any:
    """The best candidate's simulated timeline (for its Gantt chart), with the costs and FSDP collectives that
    ranked it."""
    from ppsim.compare import compare
    from ppsim.costs import load_costs
    from ppsim.plan import covering_profile, job_of, stage_modules, step_collectives, unit_costs
    from ppsim.split import resolve_split

    best = result.best
    assert best is not None
    c, request = best.candidate, result.request
    job = job_of(c, request)
    schedule = _build(c.schedule, c.degrees.pp, c.num_microbatches, c.num_stages_per_rank)
    cover = covering_profile(c, request)
    costs = (load_costs(profile=cover.path, split=job.split) if cover is not None
             else load_costs(costs=unit_costs(c.activation_checkpoint)))
    counts = resolve_split(job.split, request.model.num_layers, schedule.num_stages, schedule=c.schedule)
    fsdp = step_collectives(c, shapes_for(c.degrees.tp, c.microbatch_size, c.activation_checkpoint),
                            stage_modules(request.model.num_layers, counts), cover,
                            shared_cores=request.shared_cores)
    return compare([schedule.name], builder=lambda _: schedule, costs=costs,
                   scope=None if cover is not None else "stage", fsdp=fsdp).best


# --- printing --------------------------------------------------------------------------------------------------
def print_plan(result: Plan) -> None:
    from rich.table import Table

    from ppsim.memory import GIB

    best = result.best
    timed = best is not None and best.step_s is not None
    title = (f"plan for {result.request.num_gpus} GPUs, cap {result.request.cap_bytes / GIB:.2f} GiB, global batch "
             f"{result.global_batch}: {len(result.judged)} of {result.num_candidates} candidates judged"
             + (f", {result.pruned} pruned by their lower bound" if result.pruned else "")
             + (f"; stopped: {result.stopped}" if result.stopped else ""))
    table = Table(title=title)
    for col in ("#", "pp", "tp", "dp", "schedule", "m", "size", "v", "AC", "peak GiB",
                *(("step s", "tok/s/GPU") if timed else ("rel. step",))):
        table.add_column(col)
    base = best.relative_step if best is not None and best.relative_step else 1.0
    for i, j in enumerate(result.ranked[:result.request.top]):
        c, d = j.candidate, j.candidate.degrees
        if j.step_s is not None:
            tps = result.global_batch * _seq(result) / (j.step_s * result.request.num_gpus)
            step = (f"{j.step_s:.4g}", f"{tps:.1f}")
        else:
            step = (f"{(j.relative_step or 0) / base:.3f}",) + (("-",) if timed else ())
        name = f"{c.schedule} searched" if c.csv else c.schedule
        table.add_row(str(i + 1), str(d.pp), str(d.tp), str(d.dp_shard * d.dp_replicate), name,
                      str(c.num_microbatches), str(c.microbatch_size), str(c.num_stages_per_rank),
                      c.activation_checkpoint, f"{j.peak_bytes / GIB:.2f}", *step)
    console().print(table)
    if not timed:
        typer.echo("no --profile covers these candidates: ranked by unit costs (rel. step, the best = 1.000; F=1, "
                   "B=2 per weighted layer and token / TP), memory from the model's shapes; `ppsim calibrate` a "
                   "profile for seconds")
    _print_tail(result)


def _seq(result: Plan) -> int:
    from ppsim.plan import batch_shape

    return batch_shape(result.request.settings).seq_len


def _print_tail(result: Plan) -> None:
    from ppsim.memory import GIB
    from ppsim.plan import describe

    frontier = result.frontier()
    typer.echo("time-memory frontier: " + "; ".join(
        f"{describe(j.candidate)} -> {j.peak_bytes / GIB:.2f} GiB" for j in frontier[:5]))
    best = result.best
    if best is None:
        return
    typer.echo(f"best: {describe(best.candidate)}")
    for m in best.memory:
        typer.echo(f"  rank {m.rank}: {m.peak_memory_bytes / GIB:.2f} GiB ({m.verdict()})")
    if best.candidate.activation_checkpoint == "full" and result.request.activation_checkpoints[0] != "full":
        typer.echo("  set activation_checkpoint=FullAC.Config() in the config function (no command-line override)")
    typer.echo("launch with: " + " ".join(best.overrides))
    over = [j for j in result.judged if j.memory and not j.fits][:3]
    for j in over:
        typer.echo(f"does not fit: {describe(j.candidate)}: {j.reason}")

