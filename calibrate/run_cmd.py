"""`ppsim run`: execute a schedule with torch's pipeline runtime and compare the measured step with ppsim's prediction.

Flow: build the schedule -> costs (the profile, calibrated first on this machine if none is given; or a cost string
for synthetic stages) -> execute on R processes (:mod:`ppsim.calibrate.executor`): warm-up steps, then timed steps
alternating with probe steps -> fit the runtime model (:class:`RuntimeModel`) on the probe steps -> simulate the same
order with the costs and that model -> compare step time, every action's start and end, and the bubble ratio with
the timed steps -> run JSON, summary table, optional figure.

torch, matplotlib and plotly are imported inside functions only: the CLI imports this module at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.calibrate.executor import ExecSpec, Measurement
    from ppsim.costs import CostModel
    from ppsim.ir import Schedule
    from ppsim.result import SimResult

DEFAULT_STEPS = 5
DEFAULT_WARMUP = 3
DEFAULT_TIME_UNIT_S = 0.01
#: A computation counts as having waited for its input when its receive wait exceeds this (seconds).
WAITED_S = 100e-6
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".html")


class Backend(str, Enum):
    gloo = "gloo"
    nccl = "nccl"


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
    preset: str = "tiny"
    num_steps: int = DEFAULT_STEPS
    num_warmup: int = DEFAULT_WARMUP
    num_probes: int | None = None
    """Probe steps interleaved with the timed ones, to fit the runtime model on (``None``: as many as timed)."""
    seed: int = 0
    timeout_s: float = 600.0
    runtime_model: bool = True
    save_calibration: Path | None = None
    """Where to keep the profile when the run calibrates first (no ``profile``)."""


@dataclass(frozen=True)
class RuntimeModel:
    """What executing under torch's runtime changes about the per-op costs, fitted on the probe steps (interleaved
    with the timed steps, never the timed steps themselves); the prediction simulates
    ``cost * compute_scale + dispatch_s`` per computation with ``latency_s`` per cross-rank hand-off.

    ``compute_scale`` (real stages), per chain position: measured computation time of the stage over its profile
    cost. Calibration times one stage at a time in one process, at another moment; in the run all ranks compute at
    once and share cores, caches and memory bandwidth, and a shared or virtual machine changes speed with its
    neighbours' load, so a stage's computations run slower (or faster) by about this factor. The profile's ratios
    between F, B, I and W of a stage are kept.
    ``dispatch_s``: mean time from one computation's end to the next one's start on a rank, input waits excluded
    (posting sends and receives, the runtime's bookkeeping, waking up); for synthetic stages plus the mean amount by
    which a sleep overran its cost.
    ``latency_s``: mean travel time of a hand-off between ranks, from when it could start (the producer's action
    end, or the consumer's receive post when torch's lowering posts it later: gloo and NCCL transfer only once both
    sides are posted) plus ``dispatch_s`` to the start of a consumer that was waiting for it (wire time, the
    receiver's wake-up, the runtime's receive path); the prediction uses it as the flat ``comm`` in place of the
    profile's p2p fit or the cost string's comm.
    Each quantity is a mean within a step (a step accumulates these delays, so their average is what lengthens it)
    and the median over the probe steps (one disturbed step does not skew it).
    """

    compute_scale: tuple[float, ...]
    dispatch_s: float
    latency_s: float
    gap_s: float
    overrun_s: float
    num_gap_samples: int
    num_latency_samples: int
    comm_source: str
    fitted_on: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunReport:
    """The outcome of one run: the run JSON plus the objects it was computed from."""

    data: dict[str, Any]
    measurement: Measurement
    predicted: SimResult
    time_scale: float
    """Seconds per simulated time unit (1 for profile costs)."""

    @property
    def grad_ok(self) -> bool:
        return bool(self.data["grad_ok"])


# --- the command ------------------------------------------------------------------------------------------------
def run_command(
    schedule: Annotated[
        str, typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file.")
    ],
    ranks: Annotated[Optional[int], typer.Option("--ranks", "-r", help="Pipeline ranks (processes).")] = None,
    mb: Annotated[Optional[int], typer.Option("--mb", "-m", help="Microbatches per step.")] = None,
    stages_per_rank: Annotated[
        Optional[int],
        typer.Option("--stages-per-rank", "-v", help="Virtual stages per rank (interleaved/looped schedules)."),
    ] = None,
    backend: Annotated[
        Backend, typer.Option("--backend", case_sensitive=False, help="gloo (CPU) or nccl (one GPU per rank).")
    ] = Backend.gloo,
    profile: Annotated[
        Optional[Path],
        typer.Option("--profile", help="Profile JSON from `ppsim calibrate` (default: calibrate here first)."),
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", help="Timed steps (after the warm-up steps).", min=1)
    ] = DEFAULT_STEPS,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps.", min=0)] = DEFAULT_WARMUP,
    probes: Annotated[
        Optional[int],
        typer.Option("--probes", help="Steps interleaved with the timed ones to fit the runtime model on "
                     "(default: as many as --steps; 0: fit on the warm-up steps).", min=0),
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the run JSON here.")] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", help="Measured timeline above the predicted one: .png/.svg/.pdf/.html.")
    ] = None,
    synthetic: Annotated[
        bool, typer.Option("--synthetic", help="Stages sleep their cost instead of computing (exact gradients).")
    ] = False,
    costs: Annotated[
        Optional[str],
        typer.Option("--costs", help='With --synthetic: per-op costs in units of --time-unit, e.g. "F=1,B=2,comm=0".'),
    ] = None,
    time_unit: Annotated[
        float, typer.Option("--time-unit", help="With --synthetic --costs: seconds per cost unit.", min=1e-4)
    ] = DEFAULT_TIME_UNIT_S,
    preset: Annotated[
        str, typer.Option("--preset", help="Model to calibrate and run when no --profile is given (tiny, 1b, 8b).")
    ] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the weights and the batch.")] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Stop the processes after this many seconds.", min=1)
    ] = 600.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the run JSON instead of the table.")] = False,
) -> None:
    """Execute the schedule on R processes with torch's pipeline runtime; check gradients; compare with ppsim."""
    for path, what in ((output, "-o"), (plot, "--plot")):
        if path is not None:
            _check_writable(path, what)
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise PPSimError(
            f"--plot {plot}: unknown extension {plot.suffix or '(none)'!r}; use one of {', '.join(PLOT_SUFFIXES)}"
        )
    options = RunOptions(
        schedule=schedule, num_ranks=ranks, num_microbatches=mb, num_stages_per_rank=stages_per_rank,
        backend=backend.value, profile=profile, costs=costs, synthetic=synthetic, time_unit_s=time_unit,
        preset=preset, num_steps=steps, num_warmup=warmup, num_probes=probes, seed=seed, timeout_s=timeout,
        save_calibration=None if output is None else output.with_name(output.stem + ".profile.json"),
    )
    report = execute(options)
    if report is None:  # a torchrun rank other than 0
        return
    if output is not None:
        from ppsim.io import write_atomic

        write_atomic(output, json.dumps(report.data, indent=1, allow_nan=False) + "\n")
    if plot is not None:
        plot_run(report, plot)
    if json_out:
        typer.echo(json.dumps(report.data, indent=1, allow_nan=False))
    else:
        print_summary(report)
        for path in (output, plot):
            if path is not None:
                typer.echo(str(path))
    if not report.grad_ok or not report.data["loss_match"]:
        d = report.data
        typer.echo(
            f"Error: gradients or loss differ from the non-pipelined reference beyond the tolerance "
            f"(max |grad diff| {d['grad_max_abs_diff']:.3g} > {d['grad_tolerance']:.3g}, or loss {d['loss']:.8g} vs "
            f"{d['ref_loss']:.8g}); the execution is wrong",
            err=True,
        )
        raise typer.Exit(code=1)


def _check_writable(path: Path, what: str) -> None:
    from ppsim.io import check_writable

    check_writable(path, option=what, example="run.json")


# --- orchestration ----------------------------------------------------------------------------------------------
def execute(options: RunOptions) -> RunReport | None:
    """Run, measure, predict, compare. ``None`` on torchrun ranks other than 0 (rank 0 reports)."""
    from ppsim.calibrate import executor
    from ppsim.schedules import load_schedule

    schedule = load_schedule(
        options.schedule, options.num_ranks, options.num_microbatches, options.num_stages_per_rank
    )
    refusal = executor.schedule_refusal(schedule)
    if refusal is not None:
        raise PPSimError(refusal)
    device = _check_backend(options)
    world = _torchrun_world()
    if world is not None and world != schedule.num_ranks:
        raise PPSimError(
            f"--ranks {schedule.num_ranks}: torchrun started {world} processes; launch {schedule.num_ranks} "
            f"(--nproc-per-node) or pass -r {world}"
        )
    costs, time_scale, model, profile_note = _costs_and_model(options, schedule, device)
    spec = _exec_spec(options, schedule, costs, time_scale, model, device)
    if world is None:
        measurement = executor.launch(spec)
    else:
        rank = int(os.environ["RANK"])
        result = executor.run_rank(spec, rank=rank, world=world)
        if result is None:
            return None
        measurement = result
    return build_report(
        schedule, measurement, costs, time_scale=time_scale, profile_note=profile_note,
        use_runtime_model=options.runtime_model,
    )


def _torchrun_world() -> int | None:
    from ppsim.calibrate.executor import under_torchrun

    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def _check_backend(options: RunOptions) -> str:
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
    import torch

    if not torch.cuda.is_available():
        raise PPSimError("--backend nccl: no CUDA GPU is visible here; use --backend gloo (CPU) or run on a GPU host")
    return "cuda"


def _costs_and_model(
    options: RunOptions, schedule: Schedule, device: str
) -> tuple[CostModel, float, Any, str]:
    """Costs for the prediction (and for synthetic sleeps), seconds per cost unit, the executed model's shapes, and
    where the costs came from."""
    from ppsim.calibrate.model import ModelConfig, get_preset
    from ppsim.costs import CostModel, parse_costs
    from ppsim.profile import load_profile

    if options.costs is not None and not options.synthetic:
        raise PPSimError(
            "--costs applies to --synthetic runs only; a real run takes its costs from --profile (or calibrates)"
        )
    if options.costs is not None and options.profile is not None:
        raise PPSimError("--costs and --profile both given: a profile replaces the cost string; pass only one")
    chain = len(schedule.pipelines[0])
    if options.profile is not None:
        prof = load_profile(options.profile)
        costs = CostModel.from_profile(prof.to_dict(), source=str(options.profile))
        costs.check(schedule)
        model = ModelConfig(**prof.model.to_dict())
        if not options.synthetic and prof.device != device:
            raise PPSimError(
                f"--profile {options.profile}: measured on {prof.device} but this run uses {device}; calibrate on "
                f"{device} (`ppsim calibrate --device {device}`) or pick the matching --backend"
            )
        return costs, 1.0, model, str(options.profile)
    if options.synthetic:
        return parse_costs(options.costs), options.time_unit_s, get_preset(options.preset), "cost string"
    model = get_preset(options.preset)
    from ppsim.calibrate.model import split_layers

    split_layers(model.layers, chain)  # a model too short for the chain fails here, before calibrating
    prof, where = calibrate_here(model, chain, device, save_to=options.save_calibration)
    if prof is None:  # a torchrun rank other than 0: it only executes, rank 0 predicts
        return parse_costs(None), 1.0, model, where
    return CostModel.from_profile(prof.to_dict(), source=where), 1.0, model, where


def calibrate_here(
    model: Any, num_stages: int, device: str, *, save_to: Path | None = None, reps: int = 20
) -> tuple[Any, str]:
    """Calibrate ``model`` split into ``num_stages`` stages on this machine, as `ppsim calibrate` does (under torchrun
    every rank takes part and rank 0 gets the profile; others get ``None``). Returns the profile and where it is
    saved (``save_to``, or nowhere: a temporary file)."""
    from ppsim.calibrate.calibrate_cmd import Options, calibrate

    def run(path: Path) -> Any:
        opts = Options(
            output=path, config=model, num_stages=num_stages, device=device, warmup=3, reps=reps, resume=False,
            p2p=True, init_timeout_s=120.0,
        )
        typer.echo(f"no --profile: calibrating {num_stages} stage(s) of the {model.preset} model on {device} first",
                   err=True)
        return calibrate(opts)

    if save_to is not None:
        return run(save_to), str(save_to)
    with tempfile.TemporaryDirectory(prefix="ppsim-run-") as tmp:
        return run(Path(tmp) / "profile.json"), "calibrated by ppsim run (not saved)"


def cost_plan(schedule: Schedule, costs: CostModel, time_scale: float) -> tuple[tuple[float, ...], ...]:
    """Per rank, the cost in seconds of each computation in execution order (a pair's halves split in the cost
    model's forward share)."""
    from ppsim.calibrate.executor import sleep_plan

    def durations(action: Any) -> tuple[float, ...]:
        if action.sub_actions:
            f, b = action.sub_actions
            total, share = costs.pair_split(schedule, f.stage, b.stage, b.type)
            return (total * share * time_scale, total * (1 - share) * time_scale)
        return (costs.op_cost(schedule, action.stage, action.type) * time_scale,)

    return sleep_plan(schedule, durations)


def _exec_spec(
    options: RunOptions, schedule: Schedule, costs: CostModel, time_scale: float, model: Any, device: str
) -> ExecSpec:
    from ppsim.calibrate import executor

    sleep_s = None
    if options.synthetic:
        model = executor.synthetic_model(model, schedule.num_stages)
        sleep_s = cost_plan(schedule, costs, time_scale)
    return executor.ExecSpec(
        schedule=schedule, model=model, synthetic=options.synthetic, sleep_s=sleep_s, backend=options.backend,
        device=device, num_steps=options.num_steps, num_warmup=options.num_warmup,
        num_probes=options.num_steps if options.num_probes is None else options.num_probes, seed=options.seed,
        timeout_s=options.timeout_s,
    )


# --- the runtime model ----------------------------------------------------------------------------------------------
def fit_runtime_model(
    measurement: Measurement, schedule: Schedule, costs: CostModel, *, time_scale: float = 1.0,
    per_stage: bool = True,
) -> RuntimeModel | None:
    """Fit :class:`RuntimeModel` on the probe steps, or without probes on the warm-up steps (the first skipped
    when there are more: it sets up the communicators and infers shapes). Never on the timed steps. ``None`` when
    there is nothing to fit on.

    Each quantity is fitted per step (a mean over the step's samples: a step adds up its delays) and the median
    over the steps is kept, as the measured step time is the median over the timed steps."""
    steps = measurement.probe_steps or (
        measurement.warmup_steps[1:] if len(measurement.warmup_steps) > 1 else measurement.warmup_steps
    )
    if not steps:
        return None
    plan = cost_plan(schedule, costs, time_scale)
    num_positions = costs.num_positions or 1
    fits = [_fit_step(step, schedule, costs, plan, num_positions, per_stage, measurement.synthetic) for step in steps]
    scale = tuple(statistics.median(f[0][k] for f in fits) for k in range(num_positions))
    gap = statistics.median(f[1] for f in fits)
    overrun = statistics.median(f[2] for f in fits)
    dispatch = gap + overrun
    latencies = [lat for step in steps for lat in _latencies(step, schedule, dispatch)]
    per_step_latency = [statistics.fmean(x) for x in (_latencies(st, schedule, dispatch) for st in steps) if x]
    latency = max(0.0, statistics.median(per_step_latency)) if per_step_latency else 0.0
    if latencies:
        source = "measured hand-offs"
    elif costs.p2p_alpha is not None:
        source = "profile p2p (alpha + bytes/beta)"
    else:
        source = "cost string comm"
    fitted_on = f"{len(steps)} probe step(s)" if measurement.probe_steps else f"{len(steps)} warm-up step(s)"
    num_gaps = sum(len(st) for st in steps) - len(steps) * schedule.num_ranks
    return RuntimeModel(scale, dispatch, latency, gap, overrun, num_gaps, len(latencies), source, fitted_on)


def _fit_step(
    step: tuple[Any, ...], schedule: Schedule, costs: CostModel, plan: tuple[tuple[float, ...], ...],
    num_positions: int, per_stage: bool, synthetic: bool,
) -> tuple[tuple[float, ...], float, float]:
    """One step's (compute scale per chain position, mean dispatch gap, mean sleep overrun)."""
    from ppsim.ir import parse_action

    gaps: list[float] = []
    measured = [0.0] * num_positions
    planned = [0.0] * num_positions
    by_rank: dict[int, list[Any]] = {}
    for c in step:
        by_rank.setdefault(c.rank, []).append(c)
    for rank, comps in by_rank.items():
        for prev, cur in zip(comps, comps[1:]):
            gaps.append(max(0.0, cur.start - prev.end - cur.wait))
        for c, cost in zip(comps, plan[rank]):
            comp = parse_action(c.name)
            assert comp is not None
            pos = costs.position(schedule, comp.stage) if per_stage else 0
            measured[pos] += c.end - c.start
            planned[pos] += cost
    gap = statistics.fmean(gaps) if gaps else 0.0
    if synthetic:
        return (1.0,) * num_positions, gap, max(0.0, (sum(measured) - sum(planned)) / len(step))
    total = sum(measured) / sum(planned) if sum(planned) > 0 else 1.0
    if not per_stage:
        return (total,) * num_positions, gap, 0.0
    return tuple(m / p if p > 0 else total for m, p in zip(measured, planned)), gap, 0.0


def _latencies(step: tuple[Any, ...], schedule: Schedule, dispatch: float) -> list[float]:
    """Hand-off latencies of one step: for consumers that waited, start minus when the hand-off could start, minus
    the dispatch the simulation adds to the producer."""
    handoffs = _cross_rank_handoffs(schedule, step)
    return [cons.start - sent - dispatch for sent, cons in handoffs if cons.wait > WAITED_S]


def _cross_rank_handoffs(schedule: Schedule, step: tuple[Any, ...]) -> list[tuple[float, Any]]:
    """(time the hand-off could start, consumer computation timing) for every input that crosses ranks.

    The output leaves when the producer's whole action ends (the runtime posts a pair's sends after both halves),
    and moves only once the consumer has posted its receive (gloo and NCCL both rendezvous), whichever is later.
    """
    from ppsim import deps
    from ppsim.ir import parse_action

    action_end: dict[tuple[int, int], float] = {}
    for c in step:
        action_end[(c.rank, c.position)] = max(action_end.get((c.rank, c.position), c.end), c.end)
    producers: dict[tuple[int, int, int], Any] = {}
    parsed = []
    for c in step:
        comp = parse_action(c.name)
        assert comp is not None
        parsed.append((c, comp))
        for key in deps.provides(comp):
            producers[key] = c
    pairs = []
    for c, comp in parsed:
        for key in deps.requires(schedule, comp):
            prod = producers.get(key)
            if prod is not None and prod.rank != c.rank:
                sent = action_end[(prod.rank, prod.position)]
                pairs.append((sent if c.posted is None else max(sent, c.posted), c))
    return pairs


def with_runtime(costs: CostModel, runtime: RuntimeModel | None, time_scale: float) -> CostModel:
    """``costs`` in seconds; with a runtime model, every computation scaled by ``compute_scale`` plus ``dispatch_s``
    (a pair holds two computations) and the fitted hand-off latency as the flat comm (when the fitted steps had
    hand-offs to fit it on)."""
    n = len(costs.F)
    scale = [time_scale * (runtime.compute_scale[k] if runtime is not None else 1.0) for k in range(n)]
    o = runtime.dispatch_s if runtime is not None else 0.0
    f, b, i, w = (tuple(x * scale[k] + o for k, x in enumerate(t)) for t in (costs.F, costs.B, costs.I, costs.W))
    fb = tuple(x * scale[k] + 2 * o for k, x in enumerate(costs.FB))
    if runtime is not None and runtime.num_latency_samples:
        return dataclasses.replace(
            costs, F=f, B=b, I=i, W=w, FB=fb, comm=runtime.latency_s, p2p_alpha=None, p2p_beta=None, unit="s"
        )
    return dataclasses.replace(costs, F=f, B=b, I=i, W=w, FB=fb, comm=costs.comm * time_scale, unit="s")


# --- comparison -------------------------------------------------------------------------------------------------
def build_report(
    schedule: Schedule,
    measurement: Measurement,
    costs: CostModel,
    *,
    time_scale: float,
    profile_note: str,
    use_runtime_model: bool = True,
) -> RunReport:
    """Simulate the executed order and compare it with the measurement: the run JSON."""
    from ppsim.calibrate.executor import GRAD_RTOL
    from ppsim.simulate import simulate

    runtime = fit_runtime_model(measurement, schedule, costs, time_scale=time_scale) if use_runtime_model else None
    predicted = simulate(schedule, with_runtime(costs, runtime, time_scale))
    plain = simulate(schedule, with_runtime(costs, None, time_scale))
    spans = measurement.step_spans
    order = sorted(range(len(spans)), key=lambda k: spans[k])
    rep = order[(len(order) - 1) // 2]
    step = measurement.steps[rep]
    measured = statistics.median(spans)
    pred = predicted.makespan
    per_action = _per_action(schedule, step, predicted)
    start_err = [abs(a["start_s"] - a["predicted_start_s"]) for a in per_action]
    end_err = [abs(a["end_s"] - a["predicted_end_s"]) for a in per_action]
    span_rep = spans[rep]
    busy = [0.0] * schedule.num_ranks
    for c in step:
        busy[c.rank] += c.end - c.start
    bubble_measured = 1 - sum(busy) / (schedule.num_ranks * span_rep) if span_rep > 0 else 0.0
    data: dict[str, Any] = {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "stages": schedule.num_stages,
        "stages_per_rank": schedule.num_stages_per_rank,
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
        "wall_step_s": statistics.median(measurement.step_walls),
        "predicted_step_s": pred,
        "step_error_pct": _pct(pred - measured, measured),
        "predicted_step_costs_only_s": plain.makespan,
        "step_error_costs_only_pct": _pct(plain.makespan - measured, measured),
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
        "runtime_model": None if runtime is None else runtime.to_dict(),
        "profile_p2p_s": (
            None if costs.p2p_alpha is None else costs.boundary_delay(schedule, schedule.pipelines[0][0])
        ),
        "costs_source": profile_note,
        "time_unit_s": time_scale,
        "clock": measurement.clock,
        "hosts": sorted(set(measurement.hosts)),
        "notes": list(measurement.notes),
        "per_action": per_action,
    }
    return RunReport(data=data, measurement=measurement, predicted=predicted, time_scale=time_scale)


def _pct(numerator: float, denominator: float) -> float:
    return 100.0 * numerator / denominator if denominator > 0 else (0.0 if numerator == 0 else math.inf)


def _per_action(schedule: Schedule, step: tuple[Any, ...], predicted: SimResult) -> list[dict[str, Any]]:
    halves: dict[tuple[int, int], list[Any]] = {}
    for c in step:
        halves.setdefault((c.rank, c.position), []).append(c)
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
                "predicted_start_s": predicted.starts[rank][pos],
                "predicted_end_s": predicted.ends[rank][pos],
                "wait_s": comps[0].wait + (comps[1].wait if len(comps) > 1 else 0.0),
            }
            if len(comps) > 1:
                entry["halves"] = [{"action": c.name, "start_s": c.start, "end_s": c.end} for c in comps]
            out.append(entry)
    return out


# --- output -----------------------------------------------------------------------------------------------------
def print_summary(report: RunReport) -> None:
    from rich.console import Console
    from rich.table import Table

    d = report.data
    kind = "synthetic stages" if d["synthetic"] else f"{d['device']} ({d['device_name']})"
    table = Table(
        title=f"{d['schedule']}: {d['ranks']} ranks, {d['microbatches']} microbatches, {d['stages']} stages, "
        f"{kind}, {d['backend']}"
    )
    table.add_column("", justify="left")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    table.add_column("error", justify="right")
    table.add_row(
        f"step time (median of {d['steps']})", _fmt_s(d["measured_step_s"]), _fmt_s(d["predicted_step_s"]),
        f"{d['step_error_pct']:+.1f}%",
    )
    table.add_row(
        "step time, costs only", "", _fmt_s(d["predicted_step_costs_only_s"]), f"{d['step_error_costs_only_pct']:+.1f}%"
    )
    table.add_row(
        "bubble ratio", f"{d['bubble_ratio_measured']:.1%}", f"{d['bubble_ratio_predicted']:.1%}",
        f"{100 * (d['bubble_ratio_predicted'] - d['bubble_ratio_measured']):+.1f} pt",
    )
    ae = d["action_error"]
    table.add_row(
        "action start |error| median / max", "", "",
        f"{_fmt_s(ae['start_median_abs_s'])} / {_fmt_s(ae['start_max_abs_s'])}",
    )
    table.add_row(
        "action end |error| median / max", "", "", f"{_fmt_s(ae['end_median_abs_s'])} / {_fmt_s(ae['end_max_abs_s'])}"
    )
    Console().print(table)
    rt = d["runtime_model"]
    if rt is not None:
        scales = "/".join(f"{k:.2f}" for k in rt["compute_scale"])
        typer.echo(
            f"runtime model (fitted on {rt['fitted_on']}): compute x{scales}, "
            f"dispatch {_fmt_s(rt['dispatch_s'])} per computation, "
            f"hand-off latency {_fmt_s(rt['latency_s'])}; comm from {rt['comm_source']}"
        )
    verdict = "OK" if d["grad_ok"] and d["loss_match"] else "MISMATCH"
    typer.echo(
        f"numerics {verdict}: loss {d['loss']:.8g} (reference {d['ref_loss']:.8g}); max |grad - reference| "
        f"{d['grad_max_abs_diff']:.3g} over {d['num_params_checked']} parameters (tolerance {d['grad_tolerance']:.3g})"
    )


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


_COLORS = {"F": "#F1B238", "B": "#7FD650", "I": "#7FD650", "W": "#77BEFA"}


Bars = list[tuple[int, float, float, str]]
"""(rank, start, end, computation) per drawn bar."""


def _timeline_rows(report: RunReport) -> tuple[Bars, Bars]:
    """(rank, start, end, computation) for the measured step and for the prediction (pair halves separately)."""
    step = report.measurement.steps[report.data["action_error"]["step_index"]]
    measured = [(c.rank, c.start, c.end, c.name) for c in step]
    tl = report.predicted.timeline()
    predicted = [
        (int(r.rank), float(r.half_start), float(r.half_end), f"{r.stage}{r.type}{r.microbatch}")
        for r in tl.itertuples(index=False)
    ]
    return measured, predicted


def plot_run(report: RunReport, path: Path) -> Path:
    """The measured step's timeline above the predicted one, on one time axis (png/svg/pdf, or interactive html)."""
    measured, predicted = _timeline_rows(report)
    d = report.data
    title = (
        f"{d['schedule']}, {d['ranks']} ranks, {d['microbatches']} microbatches: measured "
        f"{_fmt_s(d['measured_step_s'])}, predicted {_fmt_s(d['predicted_step_s'])} ({d['step_error_pct']:+.1f}%)"
    )
    if path.suffix.lower() in (".html", ".htm"):
        return _write_bytes(path, _plotly_html(measured, predicted, d["ranks"], title).encode("utf-8"))
    import io

    fig = gantt_pair_figure(measured, predicted, d["ranks"], title)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lower().lstrip("."), dpi=150, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return _write_bytes(path, buf.getvalue())


def gantt_pair_figure(measured: Bars, predicted: Bars, num_ranks: int, title: str) -> Any:
    """Two Gantt panels sharing the time axis: measured (top) and predicted (bottom). Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(max(e for _, _, e, _ in measured), max(e for _, _, e, _ in predicted))
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(12, 1.2 + 0.8 * num_ranks), squeeze=True)
    for ax, rows, label in ((axes[0], measured, "measured"), (axes[1], predicted, "predicted")):
        for rank, start, end, name in rows:
            kind = "".join(ch for ch in name if ch.isalpha())
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8, color=_COLORS.get(kind, "#cccccc"),
                    edgecolor="black", linewidth=0.4)
            digits = name[len(name.rstrip("0123456789")):]
            if (end - start) / span > 0.012:
                ax.text((start + end) / 2 * 1e3, rank, digits, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
        ax.set_ylim(num_ranks - 0.5, -0.5)
        ax.set_ylabel(label)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("time (ms)")
    axes[1].set_xlim(0, span * 1e3)
    handles = [Patch(facecolor=_COLORS[k], edgecolor="black", label=lbl)
               for k, lbl in (("F", "forward"), ("B", "backward / for input"), ("W", "backward for weights"))]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _plotly_html(measured: Bars, predicted: Bars, num_ranks: int, title: str) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("measured", "predicted"),
                        vertical_spacing=0.08)
    for row, rows in ((1, measured), (2, predicted)):
        for kind in ("F", "B", "I", "W"):
            sel = [r for r in rows if "".join(ch for ch in r[3] if ch.isalpha()) == kind]
            if not sel:
                continue
            fig.add_trace(
                go.Bar(
                    x=[(e - s) * 1e3 for _, s, e, _ in sel], base=[s * 1e3 for _, s, _, _ in sel],
                    y=[f"rank {r}" for r, _, _, _ in sel], orientation="h", marker_color=_COLORS[kind],
                    marker_line_color="black", marker_line_width=0.5,
                    name=f"{kind} ({'measured' if row == 1 else 'predicted'})", text=[n for _, _, _, n in sel],
                    hovertemplate="%{text}: %{base:.3f} ms + %{x:.3f} ms<extra></extra>",
                ),
                row=row, col=1,
            )
        fig.update_yaxes(autorange="reversed", categoryorder="array",
                         categoryarray=[f"rank {r}" for r in range(num_ranks)], row=row, col=1)
    fig.update_xaxes(title_text="time (ms)", row=2, col=1)
    fig.update_layout(title=title, barmode="overlay", height=250 + 90 * num_ranks, bargap=0.15)
    return fig.to_html(include_plotlyjs=True, full_html=True)


def _write_bytes(path: Path, payload: bytes) -> Path:
    from ppsim.io import write_atomic

    return write_atomic(path, payload, option="--plot")
