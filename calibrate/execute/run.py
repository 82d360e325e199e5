"""`ppsim run`'s library side: execute a schedule, predict it from the profile alone, compare; returns a RunReport.

Flow: build the schedule -> refuse what cannot run (torch cannot execute it, the order deadlocks, too much work or
memory for this machine) -> costs: the profile through ``ppsim.costs`` exactly as ``simulate --profile`` reads it
(calibrated first on this machine if none is given; a cost string for synthetic stages) -> **predict** (simulate the
order with those costs: nothing from this run) -> execute on R processes (:mod:`ppsim.calibrate.execute.executor`) ->
compare step time, every action's start and end, the bubble ratio and each rank's peak activation bytes. A runtime
model fitted on this run's probe steps is reported apart, as ``explained_step_s`` (post-hoc).

torch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.calibrate.execute.predict import predict_step, prediction_costs
from ppsim.errors import PPSimError
from ppsim.limits import MAX_REAL_RANKS_PER_CORE, MAX_SYNTHETIC_RANKS, MEMORY_SHARE  # --allow-large lifts them
from ppsim.limits import MAX_RUN_ACTIONS as MAX_ACTIONS

MAX_LOCAL_PROCESSES = 4096
"""The most local processes one run may start (-r x --dp-shard x --tp), even with --allow-large."""

if TYPE_CHECKING:
    from ppsim.calibrate.execute.steps import ExecSpec, Measurement
    from ppsim.calibrate.measure.runtime_model import RuntimeModel
    from ppsim.calibrate.models import ModelSource
    from ppsim.costs import StageCosts
    from ppsim.ir import Schedule
    from ppsim.job.memory import JobShapes
    from ppsim.result import SimResult

DEFAULT_STEPS = 5
DEFAULT_WARMUP = 3
DEFAULT_TIME_UNIT_S = 0.01

Bars = list[tuple[int, float, float, str]]
"""(rank, start, end, computation) per drawn bar."""


@dataclass(frozen=True)
class RunOptions:
    """What `ppsim run` was asked to do (CLI-independent, so scripts and the benchmark can call :func:`execute`)."""

    schedule: str
    num_ranks: int | None = None
    num_microbatches: int | None = None
    num_stages_per_rank: int | None = None
    backend: str = "gloo"
    profile: Path | None = None
    costs: str | None = None
    synthetic: bool = False
    time_unit_s: float = DEFAULT_TIME_UNIT_S
    source: ModelSource | None = None
    """The model to run, resolved once from ``--model`` / ``--preset`` and the size options (``None``: the
    profile's model, else ``builtin:tiny``)."""
    num_steps: int = DEFAULT_STEPS
    num_warmup: int = DEFAULT_WARMUP
    num_probes: int | None = None
    """Probe steps interleaved with the timed ones, for the post-hoc model only (``None``: as many as timed)."""
    seed: int = 0
    timeout_s: float = 600.0
    save_calibration: Path | None = None
    """Where to keep the profile when the run calibrates first (no ``profile``)."""
    override_limits: bool = False
    executor: str = "auto"
    """Who builds stages and schedule: ``torchtitan`` (its pipeline helpers; ``auto`` for torchtitan models) or
    ``ppsim`` (ppsim's executor; ``auto`` for every other model). See :mod:`ppsim.calibrate.torchtitan.runner`."""
    split: str | None = None
    """Layers per stage, e.g. ``"3,5"`` (``--split``); with ``layers_per_stage``, as `simulate` takes them."""
    layers_per_stage: int | None = None
    recompute: str | None = None
    """``--recompute none|full|FILE.json`` as `simulate` takes it (a CSV's ``.recompute.json`` beside it is read)."""
    dp_shard: int = 1
    """FSDP degree (``--dp-shard``): each pipeline rank runs as ``dp_shard x tp`` processes (torchtitan models)."""
    tp: int = 1
    """Tensor-parallel degree (``--tp``)."""
    activation_checkpoint: str = "none"
    """torchtitan's activation checkpointing applied to each model part (``--activation-checkpoint``: ``none``,
    ``selective`` (its per-op SAC policy) or ``full``), as its parallelize function applies it (torchtitan models)."""
    ep: int = 1
    """Expert-parallel degree (``--ep``): a MoE model's routed experts split over ``ep`` of the ``dp_shard x tp``
    processes of each pipeline rank (torchtitan carves EP out of them), their tokens exchanged by all-to-alls."""
    overlap: bool = False
    """``--overlap/--no-overlap``: with ``--ep`` above 1, run each overlapped F&B pair's halves at once (each one's
    all-to-alls under the other's compute, one compute stream between them), or (default) one after the other as
    torch's runtime does. The prediction follows (:func:`run_step`)."""
    cluster: str | None = None
    """``--cluster NAME|FILE``: where the run's ranks sit (its groups placed on nodes; hand-offs and collectives
    across nodes priced on the network); ``None``: one host."""


@dataclass(frozen=True)
class RankMemoryReport:
    rank: int
    measured_peak_activation_bytes: int
    predicted_peak_activation_bytes: int | None
    param_bytes: int
    grad_bytes: int
    predicted_static_bytes: int | None
    measured_peak_allocated_bytes: int | None
    predicted_peak_allocated_bytes: int | None = None
    """:func:`ppsim.job.memory.job_memory`'s peak for this rank, made before the run."""
    predicted_parts: dict[str, int] | None = None
    predicted_during: str | None = None
    measured_during: str | None = None
    measured_by_action: tuple[tuple[str, int], ...] = ()
    measured_peak_reserved_bytes: int | None = None
    """On CUDA: ``max_memory_reserved`` over the allocator's peak step."""
    predicted_peak_reserved_bytes: int | None = None
    """On CUDA: the caching allocator's reserved peak, replayed (expandable segments) before the run."""
    predicted_outside_allocator_bytes: int | None = None
    """On CUDA: the CUDA context and NCCL's buffers, outside the allocator (stated defaults)."""

    @property
    def allocated_error_pct(self) -> float | None:
        p, m = self.predicted_peak_allocated_bytes, self.measured_peak_allocated_bytes
        return None if p is None or not m else 100.0 * (p - m) / m

    @property
    def activation_error_pct(self) -> float | None:
        p, m = self.predicted_peak_activation_bytes, self.measured_peak_activation_bytes
        return None if p is None or m <= 0 else 100.0 * (p - m) / m


@dataclass(frozen=True)
class RunReport:
    """The outcome of one run. :meth:`to_dict` is the run JSON (the contract's keys plus additions)."""

    schedule: Schedule
    measurement: Measurement
    predicted: SimResult
    """The before-run prediction: the order simulated with the profile's costs (runtime section included)."""
    measured_step_s: float
    predicted_step_s: float
    costs_only_step_s: float
    explained_step_s: float | None
    """Post-hoc: the same simulation after a runtime model fitted on this run's probe steps."""
    explained: RuntimeModel | None
    memory: tuple[RankMemoryReport, ...]
    step_index: int
    """The timed step with the median step time (per-action comparison and figure)."""
    costs: StageCosts
    costs_source: str
    time_scale: float

    @property
    def grad_ok(self) -> bool:
        return self.measurement.grad_ok

    @property
    def loss_match(self) -> bool:
        return self.measurement.loss_match

    @property
    def step_error_pct(self) -> float:
        return _pct(self.predicted_step_s - self.measured_step_s, self.measured_step_s)

    def measured_bars(self) -> Bars:
        return [(c.rank, c.start, c.end, c.name) for c in self.measurement.steps[self.step_index]]

    def predicted_bars(self) -> Bars:
        tl = self.predicted.timeline()
        return [
            (int(r.rank), float(r.half_start), float(r.half_end), f"{r.stage}{r.type}{r.microbatch}")
            for r in tl.itertuples(index=False)
        ]

    def to_dict(self) -> dict[str, Any]:
        return _run_json(self)


# --- orchestration ----------------------------------------------------------------------------------------------
def execute(options: RunOptions, *, log: Callable[[str], None] | None = None) -> RunReport | None:
    """Refuse, predict, run, compare. ``None`` on torchrun ranks other than 0 (rank 0 reports). ``log`` gets the
    line naming the model before the run starts (default: stderr)."""
    from ppsim.calibrate.execute import launch, torch_adapter
    from ppsim.calibrate.torchtitan.runner import choose_runner

    schedule = load_checked_schedule(options)
    device = check_backend(options)
    if options.source is None and options.profile is None:  # the default model, resolved once
        from ppsim.calibrate.models import parse_model_source

        options = dataclasses.replace(options, source=parse_model_source(None, device=device))
    torch_adapter.check()  # the torch release: refused, or warned about once, before anything is measured
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    if world is not None and options.dp_shard * options.tp == 1 and world != schedule.num_ranks:
        raise PPSimError(
            f"--ranks {schedule.num_ranks}: torchrun started {world} processes; launch {schedule.num_ranks} "
            f"(--nproc-per-node) or pass -r {world}"
        )
    runner = None
    if world is None and options.profile is None and not options.synthetic:
        early = run_source(options)
        check_split(options, schedule, early)
        check_run_degrees(options, schedule, early, world=None)
        check_machine(options, schedule, early)  # before calibrating
        runner = choose_runner(options.executor, early, schedule, synthetic=False)
    chosen = _recompute_set(options, schedule)
    costs, time_scale, model, source, prof = costs_and_model(options, schedule, device)
    measured_ac = _measured_ac(options)
    spec = dataclasses.replace(exec_spec(options, schedule, costs, time_scale, model, device), recompute=chosen,
                               dp_shard=options.dp_shard, tp=options.tp, ep=options.ep,
                               overlap=options.overlap,
                               activation_checkpoint=options.activation_checkpoint)
    check_run_degrees(options, schedule, model, world=world)
    if runner is None:
        runner = choose_runner(options.executor, model, schedule, synthetic=options.synthetic)
    if world is None:
        check_machine(options, schedule, model)
    from ppsim.job.degrees import Degrees
    from ppsim.job.memory import job_memory

    costs = dataclasses.replace(costs, outputs_held_to_backward=torch_adapter.keeps_forward_outputs())
    shapes = None if options.synthetic else run_memory_inputs(options, schedule, model, spec, profile=prof)
    fsdp = run_step(schedule, prediction_costs(costs, time_scale), options, shapes, spec, profile=prof)
    ac_note = ac_mismatch(options, measured_ac)
    if ac_note is not None:
        costs = dataclasses.replace(costs, notes=(*costs.notes, ac_note))
    if fsdp.notes:
        costs = dataclasses.replace(costs, notes=(*costs.notes, *fsdp.notes))
    # before anything runs: the step (FSDP's collectives in it; local processes sharing the cores) and each rank's
    # memory
    predicted, costs = predict_step(fsdp, costs, time_scale, recompute=_predicted_recompute(options, schedule, chosen,
                                                                                     measured_ac=measured_ac),
                                    per_rank=options.dp_shard * options.tp,
                                    shared=(world is None or _emulated_on_one_host(options)) and device == "cpu"
                                    and not options.synthetic)
    memory = None if shapes is None else job_memory(shapes[0], degrees=Degrees(
        pp=schedule.num_ranks, tp=spec.tp, dp_shard=spec.dp_shard, ep=spec.ep), schedule=schedule,
        stage_modules=shapes[1], recompute=spec.recompute,  # measured on a step whose pairs run in turn
        with_events=device == "cuda")
    if memory is not None and shapes is not None and device == "cuda":  # what an out-of-memory judges: reserved
        memory = with_reserved_prediction(memory, shapes, schedule, spec)
    check_predicted_time(options, predicted)
    if not options.synthetic and int(os.environ.get("RANK", "0")) == 0:  # after every refusal: an error stands alone
        (log or _stderr)(model.summary())
        if options.profile is not None:
            from ppsim.profile import load_profile

            for note in (tp_mismatch(options, load_profile(options.profile), options.profile), ac_note):
                if note is not None:
                    (log or _stderr)(f"warning: {note}")
    if world is None:
        measurement = runner.launch(spec)
    else:
        result = runner.run_rank(spec, rank=int(os.environ["RANK"]), world=world)
        if result is None:
            return None
        measurement = result
    return build_report(schedule, measurement, costs, predicted, time_scale=time_scale, source=source,
                        memory_predicted=memory)


def check_run_degrees(options: RunOptions, schedule: Schedule, source: ModelSource, *, world: int | None) -> None:
    """FSDP/TP degrees the run cannot take, refused in one line before anything starts: not a torchtitan model (its
    own parallelize function shards it), a degree that does not divide the heads, processes that are not
    PP x FSDP x TP (under torchrun)."""
    from ppsim.job.degrees import Degrees, check_degrees

    if options.dp_shard < 1 or options.tp < 1 or options.ep < 1:
        raise PPSimError(f"--dp-shard {options.dp_shard} --tp {options.tp} --ep {options.ep}: degrees must be at "
                         "least 1")
    if schedule.num_ranks == 1 and options.dp_shard * options.tp > 1:
        raise PPSimError(f"-r 1 with --dp-shard {options.dp_shard} --tp {options.tp}: ppsim run executes a pipeline "
                         "through torchtitan's pipeline helpers, which need pipeline_parallel_degree 2 or more; a job "
                         "without a pipeline (FSDP/TP alone) runs with torchtitan's own trainer")
    from ppsim.profile import AC_MODES

    if options.activation_checkpoint not in AC_MODES:
        raise PPSimError(f"--activation-checkpoint {options.activation_checkpoint}: one of {', '.join(AC_MODES)}")
    if options.activation_checkpoint != "none" and (options.synthetic or source.scheme != "torchtitan"
                                                    or options.executor == "ppsim"):
        raise PPSimError(f"--activation-checkpoint {options.activation_checkpoint}: torchtitan's checkpointing is "
                         "applied by its parallelize function, so it needs a torchtitan model and the torchtitan "
                         "executor; for ppsim's own recomputation use --recompute full")
    if options.activation_checkpoint != "none" and schedule.splits_backward:
        raise PPSimError(f"--activation-checkpoint {options.activation_checkpoint} with {schedule.name}: its backward "
                         "is split into I and W, and torch's checkpointing reruns a checkpointed region for each "
                         "(selective refuses the second backward; full recomputes the forward twice), which ppsim "
                         "does not model; use a schedule with whole backwards (1F1B, Interleaved1F1B, GPipe) or pass "
                         "--activation-checkpoint none (a --torchtitan-config job's own mode is the default)")
    if options.activation_checkpoint != "none" and options.recompute not in (None, "none"):
        raise PPSimError(f"--activation-checkpoint {options.activation_checkpoint} with --recompute "
                         f"{options.recompute}: pick one way to recompute")
    if options.ep > 1 and options.dp_shard * options.tp % options.ep:
        raise PPSimError(f"--ep {options.ep}: torchtitan carves EP out of the dp_shard x tp = "
                         f"{options.dp_shard * options.tp} processes of each pipeline rank, so it must divide them; "
                         f"pass --dp-shard {options.ep} (or a multiple) with --ep {options.ep}")
    if options.overlap and len(schedule.pipelines) > 1:
        raise PPSimError(f"--overlap with {schedule.name}: its {len(schedule.pipelines)} pipelines run on ppsim's "
                         "chain executor, which runs an overlapped pair's halves one after the other; drop "
                         "--overlap (or run DualPipeV, whose pairs --overlap runs at once)")
    if options.dp_shard * options.tp == 1 and world in (None, schedule.num_ranks):
        return
    processes = schedule.num_ranks * options.dp_shard * options.tp
    if world is None and processes > MAX_LOCAL_PROCESSES:  # not liftable: no host starts them (and no hang trying)
        raise PPSimError(f"--dp-shard {options.dp_shard} --tp {options.tp}: {processes:,} local processes (-r "
                         f"{schedule.num_ranks} x {options.dp_shard} x {options.tp}), more than any host starts "
                         f"(limit {MAX_LOCAL_PROCESSES:,}); use degrees whose product with -r fits the host's cores")
    if options.dp_shard * options.tp > 1 and (options.synthetic or source.scheme != "torchtitan"
                                             or options.executor == "ppsim"):
        why = ("--synthetic stages are not torchtitan modules" if options.synthetic else
               "--executor ppsim does not shard" if source.scheme == "torchtitan"
               else f"{source.text} is not a torchtitan model")
        raise PPSimError(f"--dp-shard {options.dp_shard} --tp {options.tp}: FSDP and TP runs go through torchtitan's "
                         f"own parallelize function, so they need a torchtitan model (--model torchtitan:FAMILY/"
                         f"FLAVOR) and the torchtitan executor; {why}: use the torchtitan executor or drop the degrees")
    cfg = source.config
    experts = None
    if source.scheme == "torchtitan":
        from ppsim.calibrate.models.torchtitan import num_experts

        experts = num_experts(source)
    if options.ep > 1 and experts is None:
        raise PPSimError(f"--ep {options.ep}: {source.text} is a dense model (no routed experts); drop --ep, or run a "
                         "MoE model (e.g. --model torchtitan:deepseek_v3/debugmodel)")
    check_degrees(Degrees(pp=schedule.num_ranks, tp=options.tp, dp_shard=options.dp_shard, ep=options.ep),
                  num_heads=cfg.heads, num_experts=experts,
                  num_kv_heads=cfg.heads, num_layers=source.num_layers, world_size=world,
                  fix="pass --dp-shard/--tp whose product with -r is the process count and that divide the heads")


def run_memory_inputs(options: RunOptions, schedule: Schedule, source: ModelSource, spec: ExecSpec, *,
                      profile: Any = None) -> tuple[JobShapes, list[list[str]]] | None:
    """The run's shapes (:func:`ppsim.calibrate.torchtitan.shapes.run_shapes`) and its stages' module names, for
    :func:`ppsim.job.memory.job_memory` and the FSDP collectives; ``None`` where the model's blocks cannot be named as
    torchtitan's stage modules (a stderr note says so). ``profile``: the profile the costs came from (``--profile``,
    or the calibration the run made first), whose measured activation bytes the prediction takes."""
    from ppsim.calibrate.torchtitan.parts import stage_modules_of
    from ppsim.calibrate.torchtitan.shapes import run_shapes

    prof = profile
    if prof is None and options.profile is not None:
        from ppsim.profile import load_profile

        prof = load_profile(options.profile)
    try:
        shapes = run_shapes(source, tp=spec.tp, fsdp=spec.dp_shard * spec.tp > 1, profile=prof, ep=spec.ep,
                            dp_shard=spec.dp_shard, ac=spec.activation_checkpoint)
        return shapes, stage_modules_of(source, schedule, spec.layer_counts)
    except (PPSimError, KeyError, IndexError) as exc:
        _stderr(f"note: no memory prediction for {source.text} ({type(exc).__name__}: {exc})")
        return None


def run_step(schedule: Schedule, stage_costs: Any, options: RunOptions,
             shapes: tuple[JobShapes, list[list[str]]] | None, spec: ExecSpec, *, profile: Any = None) -> Any:
    """The run's step by the one step model (:func:`ppsim.step.build.build_step`): FSDP's exposed all-gathers and
    reduce-scatters for ``--dp-shard`` above 1, EP's all-to-alls for ``--ep`` above 1, priced by the profile's
    measured collectives (else its p2p alpha/beta; EP without either: the stated default ratio) on the run's
    cluster (``--cluster``; this host's processes otherwise). EP runs go through torchtitan's helpers and torch's
    runtime, which runs an overlapped F&B pair's halves one after the other; on CPU ranks ppsim runs them at once
    (``spec.overlap``, :mod:`ppsim.calibrate.execute.overlap`), so a pair hides one direction's all-to-alls under the
    other's compute (``"dualpipe"``); otherwise every all-to-all is exposed (``"sequential"``). ``profile``: the
    profile the costs came from (``--profile``, or the calibration the run made first)."""
    from ppsim.job.degrees import Degrees
    from ppsim.step.build import StepJob, build_step
    from ppsim.step.pricing import CollectiveCosts

    if shapes is None or (spec.dp_shard <= 1 and spec.ep <= 1):
        return build_step(schedule, stage_costs, None)
    costs, in_blocks = None, False
    cluster = None
    if options.cluster is not None:
        from ppsim.step.cluster import load_cluster

        cluster = load_cluster(options.cluster)
    prof = profile
    if prof is None and options.profile is not None:
        from ppsim.profile import load_profile

        prof = load_profile(options.profile)
    if prof is not None:
        costs, in_blocks = CollectiveCosts.from_profile(prof, cluster), prof.expert_parallel_degree == spec.ep
    degrees = Degrees(pp=schedule.num_ranks, tp=spec.tp, dp_shard=spec.dp_shard, ep=spec.ep)
    placement = None
    if cluster is not None:
        from ppsim.step.placement import place

        placement = place(degrees, cluster.gpus_per_node, cluster_name=f"--cluster {cluster.name}",
                          rank_order=cluster.rank_order)
    job = StepJob(shapes=shapes[0], stage_modules=shapes[1], degrees=degrees, costs=costs, placement=placement,
                  ep_overlap="dualpipe" if spec.overlap else "sequential", ep_in_blocks=in_blocks,
                  activation_bytes=shapes[0].boundary_bytes, runtime_order=True)
    return build_step(schedule, stage_costs, job)


def _measured_ac(options: RunOptions) -> str:
    """The activation-checkpoint mode the run's costs were measured under: the profile's, or the run's own where it
    calibrates first (:func:`calibrate_here` times the blocks under it); synthetic stages sleep their costs."""
    if options.synthetic:
        return options.activation_checkpoint
    if options.profile is None:
        return options.activation_checkpoint
    from ppsim.profile import load_profile

    return load_profile(options.profile).activation_checkpoint


def ac_mismatch(options: RunOptions, measured_ac: str) -> str | None:
    """What costs measured under another activation-checkpoint mode than the run's make of the predicted step
    (:meth:`ppsim.profile.Profile.check_activation_checkpoint`), or ``None`` where they agree (the costs then hold
    the backward's rerun as measured)."""
    from ppsim.profile import checkpoint_mismatch

    shown = str(options.profile) if options.profile is not None else "the calibration"
    added = options.activation_checkpoint == "full" and measured_ac == "none"  # _predicted_recompute adds it
    return checkpoint_mismatch(measured_ac, options.activation_checkpoint, source=shown, rerun_added=added)


def _predicted_recompute(options: RunOptions, schedule: Schedule, chosen: frozenset[tuple[int, int]], *,
                         measured_ac: str = "none") -> frozenset[tuple[int, int]]:
    """The pairs the predicted step recomputes: ``--recompute``'s, or every pair under torchtitan's full
    checkpointing (each backward first reruns its forward) with costs measured without checkpointing; costs
    measured under a checkpoint mode hold its rerun in B already (not counted twice: under ``full`` a ``selective``
    profile is taken as measured, a lower bound the run's warning states). Selective checkpointing reruns only what
    its policy does not save: in B when measured under it, else missing (the run's warning says so)."""
    if options.activation_checkpoint != "full" or measured_ac != "none":
        return chosen
    return frozenset((s, m) for s in range(schedule.num_stages) for m in range(schedule.num_microbatches))


def _recompute_set(options: RunOptions, schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) pairs to recompute with torch's checkpointing (:func:`ppsim.recompute.resolve`)."""
    from ppsim.recompute import resolve

    csv = options.schedule if options.schedule.lower().endswith(".csv") else None
    chosen, _ = resolve(options.recompute, schedule, csv_path=csv)
    if chosen and options.synthetic:
        raise PPSimError("--recompute with --synthetic: synthetic stages sleep fixed costs, so a recomputed forward "
                         "would not take its time; drop --synthetic to recompute for real")
    return frozenset(chosen)


def load_checked_schedule(options: RunOptions) -> Schedule:
    """The schedule, refused up front when torch cannot run it, it deadlocks, or it is too much work."""
    from ppsim.calibrate.execute.executor import schedule_refusal
    from ppsim.schedules import load_schedule
    from ppsim.validate import validate

    r, m, v = options.num_ranks, options.num_microbatches, options.num_stages_per_rank
    if not options.override_limits and r is not None and m is not None:
        estimate = r * m * 3 * (v or 2)
        if estimate > MAX_ACTIONS:
            raise PPSimError(
                f"-r {r} -m {m}: about {estimate:,} actions per step (limit {MAX_ACTIONS:,}): every action runs and "
                "is timed; use fewer microbatches or ranks, or pass --allow-large"
            )
    schedule = load_schedule(options.schedule, r, m, v)
    refusal = schedule_refusal(schedule)
    if refusal is not None:
        raise PPSimError(refusal)
    actions = sum(len(row) for row in schedule.actions)
    if actions > MAX_ACTIONS and not options.override_limits:
        raise PPSimError(f"{options.schedule}: {actions:,} actions per step (limit {MAX_ACTIONS:,}); use fewer "
                         "microbatches or ranks, or pass --allow-large")
    from ppsim.limits import check_run_steps

    check_run_steps(f"{schedule.name} -r {schedule.num_ranks} -m {schedule.num_microbatches}", num_actions=actions,
                    num_steps=total_steps(options), allow_large=options.override_limits)
    problems = validate(schedule)
    if problems:
        first = str(problems[0])
        more = f" (and {len(problems) - 1} more; see `ppsim validate`)" if len(problems) > 1 else ""
        raise PPSimError(f"{options.schedule}: {first}{more}; torch's runtime would fail or hang on it; fix the order")
    return schedule


def total_steps(options: RunOptions) -> int:
    """Warm-up, timed and probe steps: every one executes the whole order."""
    probes = options.num_steps if options.num_probes is None else options.num_probes
    return options.num_warmup + options.num_steps + probes


def check_predicted_time(options: RunOptions, predicted: SimResult) -> None:
    """Refuse, before any rank starts, a run whose predicted steps alone outlast ``--timeout``."""
    if options.override_limits:
        return
    steps = total_steps(options)
    need = predicted.makespan * steps
    if need > options.timeout_s:
        raise PPSimError(
            f"{predicted.schedule.name}: {steps:,} steps of about {predicted.makespan:.3g} s each (the prediction) "
            f"need about {need:,.0f} s, beyond --timeout {options.timeout_s:g} s; use fewer --steps, --warmup or "
            "--probes, raise --timeout, or pass --allow-large to start it anyway"
        )


def run_source(options: RunOptions) -> ModelSource:
    """The model a run without ``--profile`` executes (resolved once: at the command line, or :func:`execute`'s
    default)."""
    assert options.source is not None, "execute resolves the default model"
    return options.source


def check_split(options: RunOptions, schedule: Schedule, source: ModelSource) -> None:
    """Refuse, before calibrating, a model that cannot be cut into the schedule's stages."""
    from ppsim.split import SplitSpec, parse_split, resolve_split

    spec = SplitSpec(split=None if options.split is None else parse_split(options.split),
                     layers_per_stage=options.layers_per_stage)
    resolve_split(spec, source.num_layers, len(schedule.pipelines[0]), schedule=f"{schedule.name} with "
                  f"{schedule.num_ranks} ranks")


def check_backend(options: RunOptions) -> str:
    if options.num_steps < 1:
        raise PPSimError(f"--steps {options.num_steps}: need at least 1 timed step; pass --steps 1 or more")
    if options.num_warmup < 0:
        raise PPSimError(f"--warmup {options.num_warmup}: must be 0 or more")
    if options.backend == "gloo":
        return "cpu"
    if options.backend != "nccl":
        raise PPSimError(f"--backend {options.backend!r}: use gloo (CPU) or nccl (GPU)")
    if options.synthetic:
        raise PPSimError("--synthetic with --backend nccl: synthetic stages sleep on the host; use --backend gloo")
    if options.overlap:
        raise PPSimError("--overlap with --backend nccl: ppsim overlaps a pair's halves on CPU ranks only (two host "
                         "threads on one CUDA stream would not overlap); drop --overlap, or use --backend gloo")
    import torch

    if not torch.cuda.is_available():
        raise PPSimError("--backend nccl: no CUDA GPU is visible here; use --backend gloo (CPU) or run on a GPU host")
    return "cuda"


def check_machine(options: RunOptions, schedule: Schedule, model: ModelSource) -> None:
    """Refuse more local ranks than this machine holds (cores for real ranks; memory for all), with the estimate."""
    if options.override_limits:
        return
    from ppsim.step.sharing import host_cores

    ranks = schedule.num_ranks
    cores = host_cores()
    per_rank = 1 if options.synthetic else options.dp_shard * options.tp
    if options.backend == "gloo" and per_rank > 1 and ranks * per_rank > MAX_REAL_RANKS_PER_CORE * cores:
        raise PPSimError(
            f"-r {ranks} --dp-shard {options.dp_shard} --tp {options.tp}: {ranks * per_rank:,} computing processes "
            f"on {cores} CPU core(s) (limit {MAX_REAL_RANKS_PER_CORE} per core); timings would say little; use "
            "smaller degrees or fewer ranks, torchrun across hosts, or --allow-large")
    if options.synthetic:
        if ranks > MAX_SYNTHETIC_RANKS:
            raise PPSimError(f"-r {ranks}: {ranks} synthetic rank processes on this host (limit "
                             f"{MAX_SYNTHETIC_RANKS}); use fewer ranks or pass --allow-large")
    elif options.backend == "gloo" and ranks > MAX_REAL_RANKS_PER_CORE * cores:
        raise PPSimError(
            f"-r {ranks}: {ranks} computing ranks on {cores} CPU core(s) (limit {MAX_REAL_RANKS_PER_CORE} per core); "
            "timings would say little; use fewer ranks, --synthetic, torchrun across hosts, or --allow-large"
        )
    elif options.backend == "gloo" and ranks > cores:
        import sys

        print(f"note: {ranks} computing ranks share {cores} CPU core(s); the run's timings include that sharing "
              "(the profile's compute scale was measured for at most 2 ranks)", file=sys.stderr, flush=True)
    from ppsim.calibrate.execute.launch import available_memory_bytes

    need = estimate_run_bytes(model, schedule, synthetic=options.synthetic)
    have = available_memory_bytes()
    if have is not None and need > MEMORY_SHARE * have:
        raise PPSimError(
            f"{schedule.name} -r {ranks} -m {schedule.num_microbatches}: needs about {_gib(need)} of memory "
            f"(weights, gradients and every microbatch's activations of {ranks} ranks, plus a reference copy) but "
            f"{_gib(have)} is available; use fewer microbatches, a smaller model, or pass --allow-large"
        )


def estimate_run_bytes(source: ModelSource, schedule: Schedule, *, synthetic: bool) -> int:
    """A generous estimate of what a local run holds (:meth:`ModelSource.run_bytes`, which the calibration's probe
    shares)."""
    return source.run_bytes(num_ranks=schedule.num_ranks, num_microbatches=schedule.num_microbatches,
                            synthetic=synthetic)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def costs_and_model(
    options: RunOptions, schedule: Schedule, device: str
) -> tuple[StageCosts, float, ModelSource, str, Any]:
    """Costs for the prediction (and for synthetic sleeps), composed for ``schedule``; seconds per cost unit; the
    executed model; where the costs came from; the profile they came from (``None`` for a cost string and on
    torchrun ranks other than 0). A profile is read exactly as ``simulate --profile`` reads it (``load_costs`` with
    the same split options, then ``for_schedule``). Without ``--profile`` the run calibrates first at its own
    expert-parallel degree and checkpoint mode (:func:`calibrate_here`), so the profile covers the job it runs: its
    MoE layers' costs hold the run's all-to-alls and its measured activation bytes the run's expert shards."""
    from ppsim.costs import parse_costs
    from ppsim.profile import load_profile

    if options.costs is not None and not options.synthetic:
        raise PPSimError(
            "--costs applies to --synthetic runs only; a real run takes its costs from --profile (or calibrates)"
        )
    if options.profile is not None:
        prof = load_profile(options.profile)
        if not options.synthetic:  # its MoE layers' costs hold the all-to-alls and expert shards of its EP degree
            prof.check_expert_parallel(options.ep, source=str(options.profile))
        return (*profile_costs(options, options.profile, schedule, device), prof)
    if options.synthetic:
        return parse_costs(options.costs), options.time_unit_s, run_source(options), "cost string", None
    model = run_source(options)
    path, where = calibrate_here(model, device, save_to=options.save_calibration,
                                 activation_checkpoint=options.activation_checkpoint, ep=options.ep)
    if path is None:  # a torchrun rank other than 0: it only executes, rank 0 predicts
        return parse_costs(None), 1.0, model, where, None
    try:
        costs, scale, model, _ = profile_costs(options, path, schedule, device, model=model)
        prof = load_profile(path)  # read before an unsaved calibration's folder goes
    finally:
        if options.save_calibration is None:  # the unsaved calibration's folder: read, so no longer needed
            shutil.rmtree(path.parent, ignore_errors=True)
    return costs, scale, model, where, prof


def profile_costs(options: RunOptions, path: Path, schedule: Schedule, device: str, *,
                  model: ModelSource | None = None) -> tuple[StageCosts, float, ModelSource, str]:
    """Costs from the profile at ``path``; ``model``: the model it was just calibrated on (``None``: the profile's
    own, checked against the request's)."""
    from ppsim.costs import load_costs
    from ppsim.profile import load_profile

    costs = load_costs(costs=options.costs, profile=path, split=options.split,
                       layers_per_stage=options.layers_per_stage).for_schedule(schedule)  # refuses both given
    prof = load_profile(path)
    if model is None:
        model = profile_source(options, prof, path, device)
    if options.synthetic:
        costs = synthetic_runtime(costs, prof)
    elif prof.device != device:
        raise PPSimError(
            f"--profile {path}: measured on {prof.device} but this run uses {device}; calibrate on "
            f"{device} (`ppsim calibrate --device {device}`) or pick the matching --backend"
        )
    note = tp_mismatch(options, prof, path)
    if note is not None:
        costs = dataclasses.replace(costs, notes=(*costs.notes, note))
    return costs, 1.0, model, str(path)


def tp_mismatch(options: RunOptions, prof: Any, path: Path) -> str | None:
    """What a profile measured at another tensor-parallel degree than ``--tp`` makes of the predicted step (its layer
    costs are one rank's of its own split), or ``None`` where the degrees agree (or the stages are synthetic)."""
    measured = prof.tensor_parallel_degree
    if options.synthetic or measured == options.tp:
        return None
    bound = "an upper bound" if measured < options.tp else "a lower bound"
    return (f"{path} was measured at tensor_parallel_degree {measured} but this run uses --tp {options.tp}: the "
            f"predicted step takes its layer costs as measured ({bound}); calibrate with --tp {options.tp} for a "
            "prediction at the run's degree")


def profile_source(options: RunOptions, prof: Any, path: Path, device: str) -> ModelSource:
    """The model a profile was measured on (version 3: its ``source``; older: the builtin model of its shapes); a
    ``--model`` naming another model is refused."""
    from ppsim.calibrate.models import ModelOptions, parse_model_source
    from ppsim.calibrate.models.builtin import source_for
    from ppsim.model_config import ModelConfig

    if prof.source is not None:
        opts = ModelOptions(**{k: v for k, v in prof.source.options.items() if k in ModelOptions.__dataclass_fields__})
        source = parse_model_source(prof.source.source, opts, device=device)
    else:
        source = source_for(ModelConfig(**prof.model.to_dict()), device=device)
    mine = options.source
    if mine is not None and (mine.text, mine.config) != (source.text, source.config):
        raise PPSimError(f"--profile {path}: measured on {source.text} ({_shape(source)}) but --model asks for "
                         f"{mine.text} ({_shape(mine)}); drop --model to run the profile's model, or calibrate "
                         "the one you want")
    return source


def _shape(source: ModelSource) -> str:
    c = source.config
    return f"{c.layers} layers, microbatch {c.mb_size}x{c.seq_len}, {c.dtype}"


def synthetic_runtime(costs: StageCosts, profile: Any) -> StageCosts:
    """Composed profile costs for a synthetic run: the op costs are slept exactly (no compute scale) and the runtime
    overheads are the profile's synthetic probe's (``runtime.synthetic``), when it has one."""
    syn = None if profile.runtime is None else profile.runtime.synthetic
    changes: dict[str, Any] = {"compute_scale": 1.0, "dispatch_s": 0.0 if syn is None else syn.dispatch_s}
    if syn is not None:
        changes["recv_posting"] = syn.recv_posting
        if syn.handoff_s is not None:
            if profile.p2p is not None:
                changes.update(p2p_alpha=syn.handoff_s, p2p_beta=profile.p2p.beta_bytes_per_s)
            else:
                changes.update(comm=syn.handoff_s, p2p_alpha=None, p2p_beta=None)
    notes = (*costs.notes, "synthetic stages: compute_scale 1 and the profile's synthetic probe overheads")
    return dataclasses.replace(costs, notes=notes, **changes)


def calibrate_here(model: ModelSource, device: str, *, save_to: Path | None = None,
                   activation_checkpoint: str = "none", ep: int = 1) -> tuple[Path | None, str]:
    """Calibrate ``model`` on this machine as `ppsim calibrate` does, for the job the run executes: its blocks timed
    under the run's ``activation_checkpoint``, its MoE layers at the run's expert-parallel degree ``ep`` (the experts
    split over ``ep`` local ranks, the run's all-to-all exchange inside; ``ppsim calibrate --ep``); returns the
    profile's path (``None`` on torchrun ranks other than 0) and a description of where it is. ``save_to`` is
    created new: an existing file there (a user's) is refused, never replaced."""
    import sys

    from ppsim.calibrate.measure.calibration import CalibrationOptions, calibrate
    from ppsim.io import release_unused, reserve_new

    def run(path: Path) -> Path | None:
        opts = CalibrationOptions(output=path, config=model.config, device=device, source=model,
                                  activation_checkpoint=activation_checkpoint, expert_parallel_degree=ep)
        at = f" at --ep {ep}" if ep > 1 else ""
        print(f"no --profile: calibrating the {model.text} model on {device} first{at} (--activation-checkpoint "
              f"{activation_checkpoint})", file=sys.stderr, flush=True)
        return path if calibrate(opts) is not None else None

    if save_to is not None and not writes_profile():
        return run(save_to), str(save_to)  # a torchrun rank other than 0: rank 0 creates and writes the file
    if save_to is not None:
        reserve_new(save_to, refusal=profile_taken(save_to), option="--profile-out")
        try:
            return run(save_to), str(save_to)
        finally:
            release_unused(save_to)  # a calibration that wrote nothing leaves no empty file behind
    tmp = Path(tempfile.mkdtemp(prefix="ppsim-run-"))  # removed once read (costs_and_model), or on failure
    try:
        return run(tmp / "profile.json"), "calibrated by ppsim run (not saved)"
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def writes_profile() -> bool:
    """Whether this process writes the calibration's profile: a local run, or rank 0 of a torchrun job."""
    from ppsim.calibrate.execute.launch import under_torchrun

    return not under_torchrun() or os.environ.get("RANK") == "0"


def profile_taken(path: Path) -> str:
    """The refusal when the automatic calibration's file name is taken."""
    return (f"{path} exists: a run without --profile calibrates first and keeps the profile there, and never replaces "
            f"a file; pass --profile {path} to use it, or --profile-out NEW.json to keep the new one elsewhere")


def exec_spec(
    options: RunOptions, schedule: Schedule, costs: StageCosts, time_scale: float, source: ModelSource, device: str
) -> ExecSpec:
    from ppsim.calibrate.execute import steps, synthetic

    model = source.config
    sleep_s = None
    if options.synthetic:
        model = synthetic.synthetic_model(model, schedule.num_stages)
        sleep_s = synthetic.cost_plan(schedule, costs, time_scale)
        synthetic.check_plan(sleep_s, "--synthetic")
    return steps.ExecSpec(
        schedule=schedule, model=model, synthetic=options.synthetic, sleep_s=sleep_s, backend=options.backend,
        device=device, num_steps=options.num_steps, num_warmup=options.num_warmup,
        num_probes=options.num_steps if options.num_probes is None else options.num_probes, seed=options.seed,
        timeout_s=options.timeout_s, layer_counts=None if options.synthetic else costs.split_counts,
        source=None if options.synthetic else source,
    )


# --- comparison -------------------------------------------------------------------------------------------------
def build_report(schedule: Schedule, measurement: Measurement, costs: StageCosts, predicted: SimResult, *,
                 time_scale: float, source: str, memory_predicted: list[Any] | None = None) -> RunReport:
    """Compare the measurement with the before-run prediction; fit the post-hoc model on the probe steps."""
    from ppsim.calibrate.measure.runtime_model import fit_runtime_model, with_runtime
    from ppsim.simulator import simulate

    op_only = dataclasses.replace(costs, compute_scale=1.0, dispatch_s=0.0)
    plain = simulate(schedule, prediction_costs(op_only, time_scale), recompute=predicted.recompute)
    explained = fit_runtime_model(measurement, schedule, op_only, time_scale=time_scale)
    explained_step = None
    if explained is not None:
        explained_step = simulate(schedule, with_runtime(op_only, explained, time_scale),
                                  recompute=predicted.recompute).makespan
    spans = measurement.step_spans
    order = sorted(range(len(spans)), key=lambda k: spans[k])
    rep = order[(len(order) - 1) // 2]
    memory = []
    for mem in measurement.memory:
        static = sum(costs.static_bytes_of(schedule, s) for s in schedule.stages_of(mem.rank)) \
            if costs.static_bytes is not None else None
        peak = predicted.per_rank[mem.rank].peak_memory_bytes
        memory.append(RankMemoryReport(
            rank=mem.rank, measured_peak_activation_bytes=mem.peak_activation_bytes,
            predicted_peak_activation_bytes=None if peak is None or static is None else peak - static,
            param_bytes=mem.param_bytes, grad_bytes=mem.grad_bytes, predicted_static_bytes=static,
            measured_peak_allocated_bytes=mem.peak_allocated_bytes, measured_during=mem.peak_allocated_during,
            measured_by_action=mem.allocated_by_action, measured_peak_reserved_bytes=mem.peak_reserved_bytes,
            **_predicted_fields(memory_predicted, mem.rank),
        ))
    return RunReport(
        schedule=schedule, measurement=measurement, predicted=predicted, measured_step_s=statistics.median(spans),
        predicted_step_s=predicted.makespan, costs_only_step_s=plain.makespan, explained_step_s=explained_step,
        explained=explained, memory=tuple(memory), step_index=rep, costs=costs, costs_source=source,
        time_scale=time_scale,
    )


def _all_to_all_json(measurement: Measurement, predicted: SimResult) -> dict[str, Any]:
    """EP's all-to-alls of the step, all PP ranks summed: measured (median over the timed steps; the time in the
    calls includes waiting for the EP peers) against the before-run step model's (transfer time only)."""
    totals = [sum(r["total_s"] for r in step) for step in measurement.comm]
    exposed = [sum(r["exposed_s"] for r in step) for step in measurement.comm]
    first = measurement.comm[0]
    model = (predicted.collectives or {}).get("all_to_all")
    return {
        "calls_per_step": int(sum(r["calls"] for r in first)),
        "measured_total_s": statistics.median(totals),
        "measured_exposed_s": statistics.median(exposed),
        "measured_exposed_spread_s": [min(exposed), max(exposed)],
        "measured_exposed_share": statistics.median(e / t for e, t in zip(exposed, totals) if t > 0)
        if any(totals) else None,
        "pairs_overlapped_per_step": int(sum(r["pairs_overlapped"] for r in first)),
        "pairs_in_turn_per_step": int(sum(r["pairs_in_turn"] for r in first)),
        "predicted_total_s": None if model is None else model.total_s,
        "predicted_exposed_s": None if model is None else model.exposed_s,
        "predicted_exposed_share": None if model is None or model.total_s <= 0 else model.exposed_s / model.total_s,
    }


def _emulated_on_one_host(options: RunOptions) -> bool:
    """Whether the run's ``--cluster`` emulates its nodes on this one host (``shared_host``): its torchrun ranks then
    share this host's cores as local processes do."""
    if options.cluster is None:
        return False
    from ppsim.step.cluster import load_cluster

    return load_cluster(options.cluster).shared_host


def with_reserved_prediction(memory: list[Any], shapes: tuple[JobShapes, list[list[str]]], schedule: Schedule,
                             spec: ExecSpec) -> list[Any]:
    """A CUDA run's predicted memory with the caching allocator replayed (expandable segments, as torchtitan
    launches) and the bytes outside it, as ``simulate`` counts them (:mod:`ppsim.job.outside`)."""
    from ppsim.job.degrees import Degrees
    from ppsim.job.outside import reserved_per_rank

    degrees = Degrees(pp=schedule.num_ranks, tp=spec.tp, dp_shard=spec.dp_shard, ep=spec.ep)
    reserved = reserved_per_rank(shapes[0], degrees=degrees, schedule=schedule, stage_modules=shapes[1],
                                 recompute=spec.recompute, events=[m.events for m in memory])
    return [dataclasses.replace(m, reserved=r) for m, r in zip(memory, reserved)]


def _predicted_fields(memory: list[Any] | None, rank: int) -> dict[str, Any]:
    if memory is None:
        return {}
    mem = memory[rank]
    res = mem.reserved
    return {"predicted_peak_allocated_bytes": mem.peak_memory_bytes, "predicted_parts": dict(mem.parts),
            "predicted_during": mem.during,
            "predicted_peak_reserved_bytes": None if res is None else res.reserved_peak_bytes,
            "predicted_outside_allocator_bytes": None if res is None else res.outside_allocator_bytes}


def _run_json(report: RunReport) -> dict[str, Any]:
    from ppsim.calibrate.execute.numerics import GRAD_RTOL
    from ppsim.result import schedule_header

    schedule, measurement, predicted = report.schedule, report.measurement, report.predicted
    spans = measurement.step_spans
    rep = report.step_index
    step = measurement.steps[rep]
    measured = report.measured_step_s
    per_action = _per_action(schedule, step, predicted)
    start_err = [abs(a["start_s"] - a["predicted_start_s"]) for a in per_action]
    end_err = [abs(a["end_s"] - a["predicted_end_s"]) for a in per_action]
    span_rep = spans[rep]
    busy = [0.0] * schedule.num_ranks
    for c in step:
        busy[c.rank] += c.end - c.start
    bubble_measured = 1 - sum(busy) / (schedule.num_ranks * span_rep) if span_rep > 0 else 0.0
    costs = report.costs
    return {
        **schedule_header(schedule),
        **({"recompute": [list(p) for p in sorted(predicted.recompute)]} if predicted.recompute else {}),
        "backend": measurement.backend,
        "device": measurement.device,
        "device_name": measurement.device_name,
        "torch_version": measurement.torch_version,
        "synthetic": measurement.synthetic,
        "grad_max_abs_diff": measurement.grad_max_abs_diff,
        "grad_ref_max_abs": measurement.grad_ref_max_abs,
        "grad_tolerance": measurement.grad_tolerance,
        "grad_rtol": GRAD_RTOL.get(measurement.dtype, 1e-2),
        "grad_ok": measurement.grad_ok,
        "num_params_checked": measurement.num_params_checked,
        "loss": measurement.loss,
        "ref_loss": measurement.ref_loss,
        "loss_match": measurement.loss_match,
        "steps": len(spans),
        "warmup_steps": measurement.num_warmup,
        "probe_steps": len(measurement.probe_steps),
        "measured_step_s": measured,
        "measured_steps_s": list(spans),
        "measured_step_spread_s": [min(spans), max(spans)],
        "wall_step_s": statistics.median(measurement.step_walls),
        "predicted_step_s": report.predicted_step_s,
        "step_error_pct": report.step_error_pct,
        "prediction_inputs": {
            "source": report.costs_source,
            "compute_scale": costs.compute_scale,
            "dispatch_s": costs.dispatch_s,
            "recv_posting": costs.recv_posting,
            "handoff_latency_s": costs.p2p_alpha if costs.p2p_alpha is not None else costs.comm,
            "handoff_bytes_per_s": costs.p2p_beta,
            "notes": list(costs.notes),
            "fitted_on_this_run": False,
        },
        "predicted_step_costs_only_s": report.costs_only_step_s,
        "step_error_costs_only_pct": _pct(report.costs_only_step_s - measured, measured),
        "explained_step_s": report.explained_step_s,
        "explained_error_pct": None if report.explained_step_s is None
        else _pct(report.explained_step_s - measured, measured),
        "explained_model": None if report.explained is None else {
            **report.explained.to_dict(), "post_hoc": True,
            "note": "fitted on this run's probe steps: explains the run, is not a prediction",
        },
        "bubble_ratio_measured": bubble_measured,
        "bubble_ratio_predicted": predicted.bubble_ratio,
        "action_error": {
            "step_index": rep,
            "start_median_abs_s": statistics.median(start_err),
            "start_max_abs_s": max(start_err),
            "end_median_abs_s": statistics.median(end_err),
            "end_max_abs_s": max(end_err),
            "start_median_abs_pct_of_step": _pct(statistics.median(start_err), span_rep),
            "start_max_abs_pct_of_step": _pct(max(start_err), span_rep),
            "end_median_abs_pct_of_step": _pct(statistics.median(end_err), span_rep),
            "end_max_abs_pct_of_step": _pct(max(end_err), span_rep),
        },
        "per_rank": [
            {
                "rank": r,
                "busy_s": busy[r],
                "bubble_ratio_measured": 1 - busy[r] / span_rep if span_rep > 0 else 0.0,
                "bubble_ratio_predicted": predicted.per_rank[r].bubble_ratio,
            }
            for r in range(schedule.num_ranks)
        ],
        "memory": [
            {
                "rank": m.rank,
                "peak_activation_bytes_measured": m.measured_peak_activation_bytes,
                "peak_activation_bytes_predicted": m.predicted_peak_activation_bytes,
                "peak_activation_error_pct": m.activation_error_pct,
                "param_bytes_measured": m.param_bytes,
                "grad_bytes_measured": m.grad_bytes,
                "static_bytes_predicted": m.predicted_static_bytes,
                "peak_allocated_bytes_measured": m.measured_peak_allocated_bytes,
                "peak_allocated_bytes_predicted": m.predicted_peak_allocated_bytes,
                "peak_allocated_error_pct": m.allocated_error_pct,
                "memory_parts_predicted": m.predicted_parts,
                "memory_during_predicted": m.predicted_during,
                "memory_during_measured": m.measured_during,
                "allocated_by_action_measured": [list(x) for x in m.measured_by_action],
                # CUDA runs: the caching allocator's reserved peak, measured and replayed before the run
                "peak_reserved_bytes_measured": m.measured_peak_reserved_bytes,
                "peak_reserved_bytes_predicted": m.predicted_peak_reserved_bytes,
                "outside_allocator_bytes_predicted": m.predicted_outside_allocator_bytes,
            }
            for m in report.memory
        ],
        "profile_p2p_s": (
            None if costs.p2p_alpha is None else costs.boundary_delay(schedule, schedule.pipelines[0][0])
        ),
        "costs_source": report.costs_source,
        "time_unit_s": report.time_scale,
        "clock": measurement.clock,
        "hosts": sorted(set(measurement.hosts)),
        **({"all_to_all": _all_to_all_json(measurement, predicted)} if measurement.comm else {}),
        "notes": list(measurement.notes),
        "per_action": per_action,
    }


def _pct(numerator: float, denominator: float) -> float:
    from ppsim.result import safe_ratio

    return 100.0 * safe_ratio(numerator, denominator)


def _per_action(schedule: Schedule, step: tuple[Any, ...], predicted: SimResult) -> list[dict[str, Any]]:
    halves: dict[tuple[int, int], list[Any]] = {}
    for c in step:
        halves.setdefault((c.rank, c.position), []).append(c)
    from ppsim.step.fsdp import original_positions

    at = original_positions(predicted.schedule, schedule)  # FSDP's collectives are actions of the prediction's own
    out: list[dict[str, Any]] = []
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            comps = halves[(rank, pos)]
            entry: dict[str, Any] = {
                "rank": rank,
                "position": pos,
                "action": str(action),
                "start_s": comps[0].start,
                "end_s": comps[-1].end,
                "predicted_start_s": predicted.starts[rank][at[rank][pos]],
                "predicted_end_s": predicted.ends[rank][at[rank][pos]],
                "wait_s": comps[0].wait + (comps[1].wait if len(comps) > 1 else 0.0),
            }
            if len(comps) > 1:
                entry["halves"] = [{"action": c.name, "start_s": c.start, "end_s": c.end} for c in comps]
            out.append(entry)
    return out


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
