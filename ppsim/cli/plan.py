"""`ppsim plan`: parse the job and the options, make the plan (:func:`ppsim.plan_search.plan`), print it (table,
JSON, page). The torch side is here: the model's shapes (torchtitan's model on the meta device, TP-sharded on a fake
process group), passed to the plan's :class:`ppsim.plan_search.ShapeCache`."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import console, echo_json, user_errors
from ppsim.cli.options import JOB_CONTEXT, ClusterOpt, JsonOpt, output_file
from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ppsim.job.memory import JobShapes
    from ppsim.plan import ModelFacts, Plan, PlanRequest, ProfileCover
    from ppsim.plan_search import OrderSearch, PlanProgress

PLAN_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "data_parallel_shard_degree",
             "data_parallel_replicate_degree", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
             "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage", "local_batch_size",
             "num_pp_microbatches", "num_tokens_per_microbatch_per_dp_rank", "expert_parallel_degree",
             "context_parallel_degree")


@app.command("plan", context_settings=JOB_CONTEXT)
@user_errors
def plan_cmd(
    ctx: typer.Context,
    torchtitan_config: Annotated[str, typer.Option("--torchtitan-config", metavar="MODULE:CONFIG",
                                                   help="The job: a torchtitan config function, e.g. "
                                                   "llama3:llama3_8b; override keys with --parallelism.KEY VALUE.")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs the job runs on.")],
    memory_cap: Annotated[str, typer.Option("--memory-cap", help="Each device's memory: 80GiB (2^30) or 80GB.")],
    gpus_per_node: Annotated[Optional[int], typer.Option(
        "--gpus-per-node", help="GPUs per node (TP stays within one); default: the cluster's, else 8.")] = None,
    profile: Annotated[Optional[list[Path]], typer.Option(
        "--profile", help="Profile JSON from `ppsim calibrate` (repeatable): times the candidates it covers: each "
        "(TP degree, tokens per microbatch) it measured (`calibrate --tp 1,2 --mb-size 1,2` measures several)."
    )] = None,
    time_limit: Annotated[str, typer.Option("--time-limit", help="Seconds to plan (default 60).")] = "60",
    top: Annotated[int, typer.Option("--top", min=1, help="Candidates to show.")] = 5,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=output_file,
                                                   help="Write one offline HTML page.")] = None,
    json_out: JsonOpt = False,
    link_bandwidth: Annotated[Optional[str], typer.Option(
        "--link-bandwidth", metavar="INTRA[,INTER]", help="GB/s per GPU and direction within a node and across "
        "nodes that unit costs (candidates no profile times) charge TP's and FSDP's collectives at (default 450,50: "
        "H100 NVLink, 400 Gb/s InfiniBand; one value: both).")] = None,
    memory_as_run: Annotated[bool, typer.Option(
        "--memory-as-run", help="With --profile: judge memory as `ppsim run` executes each candidate on the "
        "profile's device (its dtype, no optimizer step), to check the plan against runs; default: the training "
        "job.")] = False,
    cluster: ClusterOpt = None,
    allocator: Annotated[str, typer.Option(
        "--allocator", help="The caching allocator replayed for the verdict: expandable (torchtitan's launch) or "
        "default segments, judging reserved plus what lives outside the allocator (CUDA context, NCCL's buffers) "
        "against the cap, as simulate does; none: the tensors' peak alone.")] = "expandable",
    workers: Annotated[Optional[int], typer.Option(
        "--workers", help="Processes judging candidates' memory at once (default: the cores this process may use; "
        "1: in this process alone).")] = None,
) -> None:
    """The fastest configuration of a torchtitan job that fits each device's memory, with the overrides to launch
    it."""
    from ppsim.cli import command_started
    from ppsim.cli.simulation import cluster_of
    from ppsim.plan import UnitRates, link_rates
    from ppsim.plan_search import OrderSearch, PlanStopped, ShapeCache, Simulations, plan
    from ppsim.workers import available_cores

    started = command_started()  # the time limit counts the whole command: start-up and reading the job
    if workers is not None and workers < 1:
        raise PPSimError(f"--workers {workers}: must be at least 1 (1 judges in this process alone); e.g. --workers "
                         f"{available_cores()}, this host's cores")
    if output is not None and output.suffix.lower() != ".html":
        raise PPSimError(f"-o {output}: plan writes one offline HTML page; use a name ending in .html, e.g. "
                         "-o plan.html")
    machines = cluster_of(cluster)
    rates = (link_rates(link_bandwidth) if link_bandwidth is not None
             else UnitRates.of_cluster(machines) if machines is not None else UnitRates())
    per_node = gpus_per_node if gpus_per_node is not None else machines.gpus_per_node if machines is not None else 8
    if machines is not None:
        machines.nodes_for(gpus)  # whole nodes, one line otherwise
    request = _request(torchtitan_config, list(ctx.args), gpus=gpus, gpus_per_node=per_node,
                       memory_cap=memory_cap, profiles=profile or [], time_limit=time_limit, top=top)
    request = dataclasses.replace(request, unit_rates=rates, cluster=machines,
                                  allocator=_allocator_mode(allocator, memory_as_run=memory_as_run))
    if memory_as_run and not request.profiles:
        raise PPSimError("--memory-as-run: needs --profile (the device and dtype `ppsim run` would execute on); "
                         "add --profile P.json, or drop --memory-as-run")
    if memory_as_run:  # judged as `run` measures a run: the tensors' peak (no allocator: _allocator_mode)
        request = _as_run_here(request)
    simulations = Simulations()
    orders = OrderSearch(simulations, folder=output.parent if output is not None else Path("."),
                         stem=output.stem if output is not None else "plan")
    try:
        result = plan(request, shapes_for=ShapeCache(_shapes(torchtitan_config, request, as_run=memory_as_run)),
                      simulate=simulations.simulate, progress=_progress_line(), searcher=orders, started=started,
                      page=output is not None, workers=workers if workers is not None else available_cores())
    except PlanStopped as exc:
        typer.echo(f"\nError: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo("", err=True)
    typer.echo("memory: " + _memory_rule(bool(request.profiles), as_run=memory_as_run), err=True)
    if any(j.relative_step is not None for j in result.ranked):
        typer.echo("unit costs: " + _unit_rule(request.unit_rates, given=link_bandwidth is not None,
                                               cluster=request.cluster), err=True)
    _print_result(result, orders, output, job=torchtitan_config, json_out=json_out)


def _print_result(result: Plan, orders: OrderSearch, output: Path | None, *, job: str, json_out: bool) -> None:
    """The searched orders' CSVs, the page, the table or JSON; Ctrl-C's note and exit 130."""
    _write_orders(result, orders.orders)
    if output is not None and result.best is not None:
        from ppsim.viz.plan_page import write_plan_page  # plotly only when asked

        try:
            typer.echo(f"wrote {write_plan_page(result, output, job=job)}", err=True)
        except (PPSimError, OSError) as exc:  # the disk filled during the search: the plan itself is not lost
            from ppsim.plan import to_dict

            echo_json(to_dict(result, job=job))
            raise PPSimError(f"{exc}; the plan's JSON is on stdout, nothing searched is lost") from None
    if json_out:
        from ppsim.plan import to_dict

        echo_json(to_dict(result, job=job))
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
    from ppsim.io import parse_memory_cap
    from ppsim.job.overrides import split_overrides
    from ppsim.job.settings import is_registry_name
    from ppsim.plan import PlanRequest, node_layout

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
    pairs, kept = split_overrides(args, PLAN_KEYS)
    settings, facts, ac = _job_facts(value, args)
    pins = _pins(pairs)
    covers = tuple(c for p in profiles for c in _covers(p, facts, value))
    _check_pinned_tp(covers, pins)
    _warn_checkpoint_mismatch(profiles, ac[0])
    return PlanRequest(settings=settings, user_overrides=tuple(kept), model=facts, num_gpus=gpus,
                       gpus_per_node=gpus_per_node, cap_bytes=cap.bytes, pinned=pins, profiles=covers,
                       time_limit_s=limit, top=top, activation_checkpoints=ac)


def _warn_checkpoint_mismatch(profiles: list[Path], mode: str) -> None:
    """One warning per profile measured under another activation-checkpoint mode than the job's (the candidates it
    times in seconds run the job's mode), as ``simulate`` says it."""
    from ppsim.profile import load_profile

    for path in profiles:
        line = load_profile(path).check_activation_checkpoint(mode, source=f"--profile {path}")
        if line is not None:
            typer.echo(f"warning: {line}", err=True)


def _job_facts(value: str, args: list[str]) -> tuple[Any, ModelFacts, tuple[str, ...]]:
    """The job's settings with its overrides, the model's facts and its checkpoint modes: read from torchtitan (3-5 s
    of importing it), kept in the job cache for torchtitan's own config functions, so a plan asked again starts
    judging at once."""
    from ppsim.calibrate.torchtitan.config import cacheable, read_job_settings
    from ppsim.cli.job_memory import job_config_context
    from ppsim.job.cache import JobCache

    def read() -> tuple[Any, ModelFacts, tuple[str, ...]]:
        with job_config_context(value):
            settings = read_job_settings(value, args)
        return settings, _model_facts(value, settings), _checkpoint_modes(value)

    if not cacheable(value):
        return read()
    cache = JobCache()
    return cache.get_or_build("plan-job", cache.key("plan-job", job=value, overrides=list(args)), read)


def _model_facts(value: str, settings: Any) -> ModelFacts:
    from ppsim.calibrate.torchtitan.shapes import converters_set_aside, trainer_config
    from ppsim.plan import ModelFacts

    with converters_set_aside():
        layers = list(trainer_config(value).model_spec.model.layers)
    attn = layers[0].attention
    experts = [getattr(getattr(layer, "moe", None), "num_experts", None) for layer in layers]
    return ModelFacts(num_layers=len(layers), num_heads=attn.n_heads,
                      num_kv_heads=getattr(attn, "n_kv_heads", None) or attn.n_heads,
                      source=settings.model_source or value, num_experts=next((e for e in experts if e), None))


def _checkpoint_modes(value: str) -> tuple[str, ...]:
    """The job's own checkpoint mode (selective counted as its policy saves) and full checkpointing."""
    from ppsim.calibrate.torchtitan.checkpointing import mode_of
    from ppsim.calibrate.torchtitan.shapes import converters_set_aside, trainer_config

    with converters_set_aside():
        own = mode_of(trainer_config(value).activation_checkpoint)
    return (own,) if own == "full" else (own, "full")


def _covers(path: Path, facts: ModelFacts, value: str) -> tuple[ProfileCover, ...]:
    """Every pass the profile holds (its TP degree and microbatch size), each a cover of its own."""
    from ppsim.plan import PlanError, ProfileCover
    from ppsim.profile import load_profile

    prof = load_profile(path)
    measured = prof.source.source if prof.source is not None else prof.model.preset
    if measured.lower() != facts.source.lower():
        raise PlanError(f"--profile {path}: measured {measured}, but the job {value} trains {facts.source}; "
                        f"calibrate with --model {facts.source}")
    collectives = _collective_costs(path, prof)
    shared = None if prof.runtime is None else prof.runtime.shared_scale
    return tuple(ProfileCover(path=str(path), tp=tp, tokens_per_microbatch=prof.model.seq_len * mb_size,
                              collectives=collectives, mb_size=mb_size, shared_scale=shared or 1.0)
                 for tp, mb_size in prof.covers)


def _check_pinned_tp(covers: tuple[ProfileCover, ...], pins: dict[str, int]) -> None:
    """A pinned TP degree that no ``--profile`` measured: one line naming the degrees they have."""
    from ppsim.plan import PlanError
    from ppsim.profile import degrees_text

    tp = pins.get("tp")
    have = sorted({c.tp for c in covers})
    if tp is None or not covers or tp in have:
        return
    raise PlanError(f"--parallelism.tensor_parallel_degree {tp}: the --profile measured tensor_parallel_degree "
                    f"{degrees_text(have)}, not {tp}; calibrate it (`ppsim calibrate --tp "
                    f"{','.join(map(str, [*have, tp]))} ...`) or pin a degree the profile has")


def _collective_costs(path: Path, prof: Any) -> Any:
    """The profile's FSDP collective costs, and on stderr where they come from (dp_shard > 1 candidates)."""
    from ppsim.step.pricing import CollectiveCosts

    costs = CollectiveCosts.from_profile(prof)
    if not costs.available:
        typer.echo(f"plan: {path} measured no all-gather / reduce-scatter and has no p2p alpha/beta: dp_shard > 1 "
                   "candidates are timed without FSDP's collectives", err=True)
        return None
    groups = sorted({m.group_size for m in costs.measured}) or [2]
    typer.echo(f"plan: FSDP's collectives (dp_shard > 1) in the step from {path}: {costs.describe(groups[0])}",
               err=True)
    return costs


def _allocator_mode(text: str, *, memory_as_run: bool) -> str | None:
    """``--allocator``: a mode the verdict replays, or ``None`` (``none``, or ``--memory-as-run``: a run's count is
    the tensors')."""
    from ppsim.cli.job_memory import check_allocator

    mode = check_allocator(text)
    return None if memory_as_run else mode


# --- the callbacks ---------------------------------------------------------------------------------------------
def _as_run_here(request: PlanRequest) -> PlanRequest:
    """As `ppsim run` executes the candidates here: with a CPU profile, their local processes share this host's
    cores (the step time by processor sharing, as run's own prediction)."""
    import dataclasses

    from ppsim.profile import load_profile
    from ppsim.step.sharing import host_cores

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
    return ("each candidate as torchtitan trains it (mixed precision, AdamW); activations from the formula (no "
            "--profile)")


def _unit_rule(rates: Any, *, given: bool, cluster: Any = None) -> str:
    """What unit costs assumed (one stderr line after the plan, where a candidate was ranked by them)."""
    source = ("--link-bandwidth" if given else
              f"--cluster {cluster.name}: its device's peak x 40 % MFU, its links; --link-bandwidth INTRA,INTER to "
              "override" if cluster is not None else
              "defaults: an H100 node, 989 TFLOP/s bf16 x 40 % MFU, NVLink 450 GB/s, 400 Gb/s InfiniBand per GPU; "
              "--link-bandwidth INTRA,INTER or --cluster to override")
    return f"{rates.describe()} ({source}; docs/plan.md)"


def _shapes(value: str, request: PlanRequest, *, as_run: bool = False) -> Callable[[int, int, str], JobShapes]:
    """The model's TP-local shapes for (TP degree, microbatch size, checkpoint mode), from torchtitan's own
    parallelize on the meta device (the expensive call: :class:`ppsim.plan_search.ShapeCache` makes it once per key)."""
    from ppsim.calibrate.torchtitan.config import cacheable, read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes
    from ppsim.cli.job_memory import job_config_context
    from ppsim.job.cache import JobCache
    from ppsim.plan import batch_shape

    keys = batch_shape(request.settings).keys
    seq = batch_shape(request.settings).seq_len

    def compute(tp: int, mb_size: int, ac: str, ep: int = 1, cp: int = 1) -> JobShapes:
        if cache is None:
            return build(tp, mb_size, ac, ep, cp)
        key = cache.key("plan-shapes", job=value, overrides=list(request.user_overrides), tp=tp, mb=mb_size, ac=ac,
                        ep=ep, cp=cp, as_run=as_run)
        return cache.get_or_build("plan-shapes", key, lambda: build(tp, mb_size, ac, ep, cp))

    def build(tp: int, mb_size: int, ac: str, ep: int, cp: int) -> JobShapes:
        size = mb_size if keys.size.endswith("microbatch_size") else mb_size * seq
        # the shapes depend on TP, EP and CP, not on how far FSDP shards (job_memory does): the fewest dp_shard
        # ranks EP can be carved out of
        dp_shard = ep // math.gcd(ep, cp * tp)
        args = [*request.user_overrides, "--parallelism.tensor_parallel_degree", str(tp),
                "--parallelism.data_parallel_shard_degree", str(dp_shard), "--parallelism.expert_parallel_degree",
                str(ep), "--parallelism.context_parallel_degree", str(cp), f"--{keys.size}", str(size)]
        with job_config_context(value):
            settings = read_job_settings(value, args)
        profile = _memory_profile(request, tp, mb_size * seq)
        return job_shapes(value, settings, activation_checkpoint=ac, profile=profile, as_run=as_run,
                          local_cache=local)[0]

    local: dict[Any, Any] = {}  # the model's parallelize once per (TP, EP) degree
    # torchtitan's own configs without a profile: kept in the job cache (ppsim.job.cache), so planning the same job
    # again skips building the model on the meta device (about 0.5 s a shape); a user's module or a profile is not
    cache = JobCache() if not request.profiles and cacheable(value) else None
    return compute


def _memory_profile(request: PlanRequest, tp: int, tokens: int) -> Any:
    """The profile whose measured activations (and device) judge memory: the one
    measured at this TP degree and tokens per microbatch, else the first (its model, dtype and device; the formula's
    activations); ``None`` without ``--profile`` (torchtitan's training job, the formula's activations)."""
    if not request.profiles:
        return None
    cover = next((p for p in request.profiles if p.tp == tp and p.tokens_per_microbatch == tokens),
                 request.profiles[0])
    return cover.profile()


def _write_orders(result: Plan, orders: dict[str, Any]) -> None:
    """The CSV of each searched order among the candidates shown (named in their overrides)."""
    from ppsim.formats import write_csv

    for j in result.ranked[:result.request.top]:
        if j.candidate.csv is not None and j.candidate.csv in orders:
            typer.echo(f"wrote {write_csv(orders[j.candidate.csv], j.candidate.csv)} (search's order)", err=True)


def _progress_line() -> Callable[[PlanProgress], None]:
    """At most one progress line a second on stderr (rewritten in place on a terminal)."""
    last = [0.0]

    def show(p: PlanProgress) -> None:
        if p.elapsed_s - last[0] < 1.0 and p.done < p.total:
            return
        last[0] = p.elapsed_s
        from ppsim.plan import describe

        lead = f"best so far: {describe(p.best.candidate)}" if p.best is not None else f"{p.fitting} fit so far"
        what = {"memory": "candidates' memory judged", "timing": "candidates that fit timed",
                "orders": "searched orders judged"}[p.phase]
        end = "\r" if sys.stderr.isatty() else "\n"
        estimate = f" (all {p.total}: ~{p.elapsed_s / p.done * p.total:.0f} s at this pace)" if p.done < p.total else ""
        typer.echo(f"plan: {p.done}/{p.total} {what} in {p.elapsed_s:.1f} s{estimate}; {lead}", err=True, nl=False)
        typer.echo(end, err=True, nl=False)

    return show


# --- printing --------------------------------------------------------------------------------------------------
def print_plan(result: Plan) -> None:
    """The ranking: one table per step unit (seconds with a profile, unit costs without), never one list."""
    from ppsim.job.memory import GIB

    head = (f"plan for {result.request.num_gpus} GPUs, cap {result.request.cap_bytes / GIB:.2f} GiB, global batch "
            f"{result.global_batch}: {result.counts()}")
    units = result.units or ("unit",)
    for n, unit in enumerate(units):
        _print_table(result, unit, title=head if n == 0 else "")
    if "unit" in units:
        other = " (not comparable with the seconds above: a profile covers none of them)" if "s" in units else ""
        typer.echo("ranked by unit costs" + other + ": rel. step, the first = 1.000; F=1, B=2 per weighted layer "
                   "and token / TP, plus TP's and FSDP's collectives at the stated link speeds (stderr); memory "
                   "from the model's shapes; `ppsim calibrate` a profile for seconds")
    _print_tail(result)


def _print_table(result: Plan, unit: str, *, title: str) -> None:
    from rich.table import Table

    from ppsim.job.memory import GIB

    ranked = result.ranked_in(unit)
    what = "timed in seconds (--profile)" if unit == "s" else "ranked by unit costs (no profile covers them)"
    table = Table(title=f"{title}\n{what}" if title else what)
    shown = ranked[:result.request.top]
    extra = [k for k in ("cp", "ep") if any(getattr(j.candidate.degrees, k) > 1 for j in shown)]  # MoE, long seqs
    for col in ("#", "pp", "tp", *extra, "dp", "schedule", "m", "size", "v", "AC", "peak GiB",
                *(("step s", "tok/s/GPU") if unit == "s" else ("rel. step",))):
        table.add_column(col)
    base = ranked[0].relative_step if ranked and ranked[0].relative_step else 1.0
    for i, j in enumerate(shown):
        c, d = j.candidate, j.candidate.degrees
        if unit == "s":
            step_s = j.step_s or 0.0
            tps = result.global_batch * _seq(result) / (step_s * result.request.num_gpus)
            step: tuple[str, ...] = (f"{step_s:.4g}", f"{tps:.1f}")
        else:
            step = (f"{(j.relative_step or 0) / base:.3f}",)
        name = f"{c.schedule} searched" if c.csv else c.schedule
        table.add_row(str(i + 1), str(d.pp), str(d.tp), *(str(getattr(d, k)) for k in extra),
                      str(d.dp_shard * d.dp_replicate), name,
                      str(c.num_microbatches), str(c.microbatch_size), str(c.num_stages_per_rank),
                      c.activation_checkpoint, f"{j.peak_bytes / GIB:.2f}", *step)
    console().print(table)


def _seq(result: Plan) -> int:
    from ppsim.plan import batch_shape

    return batch_shape(result.request.settings).seq_len


def _print_tail(result: Plan) -> None:
    from ppsim.job.memory import GIB
    from ppsim.plan import describe

    for unit in result.units or ("unit",):
        label = "" if len(result.units) < 2 else " (seconds)" if unit == "s" else " (unit costs)"
        typer.echo(f"time-memory frontier{label}: " + "; ".join(
            f"{describe(j.candidate)} -> {j.peak_bytes / GIB:.2f} GiB" for j in result.frontier(unit)[:5]))
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

