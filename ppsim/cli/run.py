"""`ppsim run`: option checks, then the one request (:class:`RunOptions`), the library call, output.

Every option is checked here before torch is imported (a bad integer is refused at once). ``--model`` (or the job of
``--torchtitan-config``) is resolved here, once, into the request's :class:`ModelSource`; the work is done by
:func:`ppsim.calibrate.execute.run.execute`; the measured-vs-predicted figure is drawn by
:func:`ppsim.viz.run_figure.plot_run` after it returns.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.calibrate import check_output, fmt_bytes, model_options, resolve_model
from ppsim.cli.common import job_overrides, user_errors, warn
from ppsim.cli.options import (
    JOB_CONTEXT,
    ClusterOpt,
    DTypeOpt,
    LayersOpt,
    MbOpt,
    MbSizeOpt,
    ModelOpt,
    PresetOpt,
    SeqLenOpt,
    TorchtitanConfigOpt,
)
from ppsim.errors import PPSimError
from ppsim.io import output_file
from ppsim.limits import check_timeout

if TYPE_CHECKING:
    from ppsim.calibrate.execute.run import RunOptions, RunReport
    from ppsim.calibrate.models import ModelOptions
    from ppsim.calibrate.torchtitan.job import JobRun

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".html")


class Backend(str, Enum):
    gloo = "gloo"
    nccl = "nccl"


class Executor(str, Enum):
    auto = "auto"
    torchtitan = "torchtitan"
    ppsim = "ppsim"


# --- the options of `run` alone ---------------------------------------------------------------------------------
RunScheduleOpt = Annotated[
    Optional[str],
    typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file "
                 "(required unless --torchtitan-config gives it)."),
]
RunRanksOpt = Annotated[Optional[int], typer.Option("--ranks", "-r", help="Pipeline ranks (processes).")]
RunVOpt = Annotated[
    Optional[int],
    typer.Option("--stages-per-rank", "-v", help="Virtual stages per rank (interleaved/looped schedules)."),
]
BackendOpt = Annotated[
    Backend, typer.Option("--backend", case_sensitive=False, help="gloo (CPU) or nccl (one GPU per rank).")
]
RunProfileOpt = Annotated[
    Optional[Path],
    typer.Option("--profile", help="Profile JSON from `ppsim calibrate` (default: calibrate here first)."),
]
ProfileOutOpt = Annotated[
    Optional[Path],
    typer.Option("--profile-out", parser=output_file,
                 help="Without --profile: keep the calibration made first here (default: next to -o as "
                 "NAME.profile.json; an existing file is never replaced)."),
]
RunSplitOpt = Annotated[
    Optional[str],
    typer.Option("--split", metavar="N,N,...", help="Layers per stage (per-block profile), as for simulate."),
]
RunLayersPerStageOpt = Annotated[
    Optional[int],
    typer.Option("--layers-per-stage", help="torchtitan's pipeline_parallel_layers_per_stage, as for simulate."),
]
StepsOpt = Annotated[int, typer.Option("--steps", help="Timed steps (after the warm-up steps).")]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps.")]
ProbesOpt = Annotated[
    Optional[int],
    typer.Option("--probes", help="Steps interleaved with the timed ones for the post-hoc model "
                 "(explained_step_s; default: as many as --steps; 0: fit it on the warm-up steps)."),
]
RunOutputOpt = Annotated[
    Optional[Path], typer.Option("--output", "-o", parser=output_file, help="Write the run JSON here.")
]
PlotOpt = Annotated[
    Optional[Path], typer.Option("--plot", parser=output_file,
                                 help="Measured timeline above the predicted one: .png/.svg/.pdf/.html.")
]
SyntheticOpt = Annotated[
    bool, typer.Option("--synthetic", help="Stages sleep their cost instead of computing (exact gradients).")
]
RunCostsOpt = Annotated[
    Optional[str],
    typer.Option("--costs", help='With --synthetic: per-op costs in units of --time-unit, e.g. "F=1,B=2,comm=0".'),
]
TimeUnitOpt = Annotated[
    Optional[float], typer.Option("--time-unit", help="With --synthetic --costs: seconds per cost unit (default 0.01).")
]
ExecutorOpt = Annotated[
    Executor,
    typer.Option("--executor", case_sensitive=False,
                 help="Who builds the stages and the schedule: torchtitan (its pipeline helpers given ppsim's "
                 "CSV; auto for torchtitan models) or ppsim (ppsim's executor; auto otherwise)."),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the weights and the batch.", min=0, max=2**63 - 1)]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Stop the processes after this many seconds.")]
RunAllowLargeOpt = Annotated[
    bool, typer.Option("--allow-large", help="Run even beyond the work, rank and memory limits.")
]
DpShardOpt = Annotated[int, typer.Option("--dp-shard", help="FSDP degree: each pipeline rank runs as dp-shard x tp "
                                         "processes, sharded by torchtitan's own parallelize (torchtitan models).")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (torchtitan models), as --dp-shard.")]
RunAcOpt = Annotated[Optional[str], typer.Option(
    "--activation-checkpoint", metavar="none|selective|full",
    help="torchtitan's activation checkpointing of each model part (torchtitan models): selective is its per-op "
    "SAC policy (the default of its 8B and DeepSeek-V3 jobs); the memory prediction counts what the policy saves. "
    "Default: the --torchtitan-config job's own mode, else none.")]
OverlapOpt = Annotated[bool, typer.Option(
    "--overlap/--no-overlap", help="With --ep: run each overlapped F&B pair's (DualPipeV) halves at once on CPU ranks, "
    "each one's all-to-alls under the other's compute, one compute stream between them (measures the overlap; on a "
    "2-core host its threads cost more than it hides); default --no-overlap: one after the other, as torch's runtime "
    "does.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (torchtitan MoE models): the routed "
                                    "experts split over ep of each pipeline rank's dp-shard x tp processes "
                                    "(torchtitan carves EP out of them), tokens exchanged by all-to-alls.")]
RunJsonOpt = Annotated[bool, typer.Option("--json", help="Print the run JSON instead of the table.")]
RunRecomputeOpt = Annotated[
    Optional[str],
    typer.Option("--recompute", metavar="none|full|FILE.json", help="Recompute these (stage, microbatch) "
                 "forwards in their backward with torch.utils.checkpoint, as `simulate --recompute` models them "
                 "(default: none, or for -s FILE.csv the FILE.recompute.json beside it)."),
]


@app.command("run", context_settings=JOB_CONTEXT)
@user_errors
def run_cmd(
    ctx: typer.Context,
    schedule: RunScheduleOpt = None,
    ranks: RunRanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: RunVOpt = None,
    backend: BackendOpt = Backend.gloo,
    profile: RunProfileOpt = None,
    profile_out: ProfileOutOpt = None,
    split: RunSplitOpt = None,
    layers_per_stage: RunLayersPerStageOpt = None,
    steps: StepsOpt = 5,
    warmup: WarmupOpt = 3,
    probes: ProbesOpt = None,
    output: RunOutputOpt = None,
    plot: PlotOpt = None,
    synthetic: SyntheticOpt = False,
    costs: RunCostsOpt = None,
    time_unit: TimeUnitOpt = None,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    layers: LayersOpt = None,
    seq_len: SeqLenOpt = None,
    mb_size: MbSizeOpt = None,
    dtype: DTypeOpt = None,
    executor: ExecutorOpt = Executor.auto,
    seed: SeedOpt = 0,
    timeout: TimeoutOpt = 600.0,
    override_limits: RunAllowLargeOpt = False,
    json_out: RunJsonOpt = False,
    recompute: RunRecomputeOpt = None,
    torchtitan_config: TorchtitanConfigOpt = None,
    dp_shard: DpShardOpt = 1,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    overlap: OverlapOpt = False,
    activation_checkpoint: RunAcOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Execute the schedule on R processes with torch's pipeline runtime; check gradients; compare with ppsim's
    before-run prediction."""
    check_run_values(ranks=ranks, mb=mb, stages_per_rank=stages_per_rank, steps=steps, warmup=warmup, probes=probes,
                     time_unit=time_unit, timeout=timeout)
    check_ignored_run_options(synthetic=synthetic, profile=profile, costs=costs, time_unit=time_unit, preset=preset,
                              split=split, layers_per_stage=layers_per_stage, profile_out=profile_out)
    for path, what in ((output, "-o"), (plot, "--plot"), (profile_out, "--profile-out")):
        if path is not None:
            check_output(path, what, suffix=".json" if what == "--profile-out" else None)
    if cluster is not None:
        from ppsim.cli.simulation import cluster_of

        found = cluster_of(cluster)  # a bad --cluster is one line before anything starts
        if found is not None and found.backend != backend.value:
            preset = "a preset such as h100" if backend.value == "nccl" else "the this-host preset"
            raise PPSimError(
                f"--cluster {cluster} runs its collectives on {found.backend} but --backend is {backend.value}: the "
                f"prediction would price {found.backend}'s collectives for a {backend.value} run; give a cluster of "
                f"backend {backend.value} ({preset}, or backend = \"{backend.value}\" in the file) or --backend "
                f"{found.backend}")
    overrides = job_overrides(ctx, torchtitan_config)
    if schedule is None and torchtitan_config is None:
        raise PPSimError("--schedule/-s is required (or --torchtitan-config MODULE:CONFIG or job.toml); e.g. -s 1F1B "
                         "-r 2 -m 4")
    save_calibration = calibration_path(output, profile_out, profile=profile, synthetic=synthetic)
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise PPSimError(
            f"--plot {plot}: unknown extension {plot.suffix or '(none)'!r}; use one of {', '.join(PLOT_SUFFIXES)}"
        )
    if costs is not None:
        from ppsim.costs import parse_costs

        parse_costs(costs)  # one-line errors before anything starts
    from ppsim.calibrate.execute.run import RunOptions
    from ppsim.calibrate.models import ModelOptions

    sizes = model_options(layers=layers, seq_len=seq_len, mb_size=mb_size, dtype=dtype)
    device = "cuda" if backend.value == "nccl" else "cpu"
    request = RunOptions(
        schedule=schedule or "", num_ranks=ranks, num_microbatches=mb, num_stages_per_rank=stages_per_rank,
        backend=backend.value, profile=profile, costs=costs, synthetic=synthetic,
        time_unit_s=0.01 if time_unit is None else time_unit, num_steps=steps, num_warmup=warmup, num_probes=probes,
        seed=seed, timeout_s=timeout, save_calibration=save_calibration, override_limits=override_limits,
        split=split, layers_per_stage=layers_per_stage, recompute=recompute, executor=executor.value,
        dp_shard=dp_shard, tp=tp, ep=ep, overlap=overlap, activation_checkpoint=activation_checkpoint or "none",
        cluster=cluster,
    )
    job = None
    if torchtitan_config is not None:
        job, request = job_request(request, torchtitan_config, overrides, model=model, preset=preset, sizes=sizes,
                                   device=device, activation_checkpoint=activation_checkpoint)
    elif profile is None or (model, preset) != (None, None) or sizes != ModelOptions():
        from dataclasses import replace

        request = replace(request, source=resolve_model(model, preset, sizes, device=device))
    from ppsim.io import check_distinct

    check_distinct((("-s", request.schedule if request.schedule.lower().endswith(".csv") else None),
                    ("--profile", profile), ("-o", output), ("--plot", plot), ("--profile-out", save_calibration),
                    ("--torchtitan-config", torchtitan_config)))
    report = execute_in_job_terms(request, job)
    if report is None:  # a torchrun rank other than 0
        return
    if profile is not None:  # the calibration's warning, repeated where its numbers are used
        from ppsim.profile import load_profile

        warn([line for line in [load_profile(profile).host_warning(str(profile))] if line])
    show_run(report, output=output, plot=plot, json_out=json_out)


def check_run_values(*, ranks: int | None, mb: int | None, stages_per_rank: int | None, steps: int, warmup: int,
                     probes: int | None, time_unit: float | None, timeout: float) -> None:
    """The counts, --time-unit and --timeout, each refused in one line."""
    for name, value, least in (("--ranks", ranks, 1), ("--mb", mb, 1), ("--stages-per-rank", stages_per_rank, 1),
                               ("--steps", steps, 1), ("--warmup", warmup, 0), ("--probes", probes, 0)):
        if value is not None and value < least:
            raise PPSimError(f"{name} {value}: must be at least {least}")
    if time_unit is not None and not (math.isfinite(time_unit) and time_unit >= 1e-4):
        raise PPSimError(f"--time-unit {time_unit}: must be a finite number >= 0.0001")
    check_timeout("--timeout", timeout, least=1.0)


def refuse_cp_on_cpu(overrides: list[str], device: str) -> None:
    """Context parallelism on CPU ranks, refused in one line: torch's SDPA context-parallel path
    (``_enable_context_parallel_dispatcher``) handles only CUDA's attention kernels (flash, efficient, cuDNN)."""
    from ppsim.job.overrides import split_overrides

    given, _ = split_overrides(overrides, ())
    text = given.get("parallelism.context_parallel_degree", "1")
    try:
        cp = int(text)
    except ValueError:
        raise PPSimError(f"--parallelism.context_parallel_degree {text!r}: not an integer; e.g. 2") from None
    if cp > 1 and device != "cuda":
        raise PPSimError(f"--parallelism.context_parallel_degree {cp}: context parallelism on {device} ranks cannot "
                         "run (torch's SDPA context-parallel path handles only CUDA's attention kernels); run with "
                         "--backend nccl on GPUs, or set it to 1 (`ppsim simulate` counts CP without running it)")


def job_request(request: RunOptions, torchtitan_config: str, overrides: list[str], *, model: str | None,
                preset: str | None, sizes: ModelOptions, device: str,
                activation_checkpoint: str | None = None) -> tuple[JobRun, RunOptions]:
    """The request with what the job config sets: schedule, ranks, microbatches, split, the resolved model, and its
    activation-checkpoint mode unless ``--activation-checkpoint`` gives one (``activation_checkpoint``)."""
    from dataclasses import replace

    from ppsim.calibrate.torchtitan.job import run_inputs

    refuse_cp_on_cpu(overrides, device)
    job = run_inputs(torchtitan_config, overrides, options=sizes, model=model, preset=preset,
                     profile=request.profile, schedule=request.schedule or None, num_ranks=request.num_ranks,
                     num_microbatches=request.num_microbatches, stages_per_rank=request.num_stages_per_rank,
                     split=request.split, layers_per_stage=request.layers_per_stage, device=device,
                     allow_large=request.override_limits)
    warn(job.notes)
    job_tp = job.job.tensor_parallel_degree
    if job_tp != request.tp:  # run executes its own --tp/--dp-shard, never silently the job's degree
        warn([f"warning: the job's tensor_parallel_degree is {job_tp}; this run executes --tp {request.tp} (pass "
              f"--tp {job_tp} to run the job's)"])
    job_ep = job.job.expert_parallel_degree
    if job_ep != request.ep:  # the same for EP: the run, its calibration and its prediction are at --ep
        carve = "" if request.dp_shard * request.tp % job_ep == 0 else f" --dp-shard {job_ep}"
        warn([f"warning: the job's expert_parallel_degree is {job_ep}; this run executes --ep {request.ep} (and "
              f"calibrates and predicts at it; pass --ep {job_ep}{carve} to run the job's)"])
    # synthetic stages sleep their costs: no model for torchtitan's checkpointing to wrap
    mode = activation_checkpoint or (None if request.synthetic else job.job.activation_checkpoint) or "none"
    return job, replace(
        request, activation_checkpoint=mode,
        schedule=job.schedule, num_ranks=job.num_ranks, num_microbatches=job.num_microbatches,
        num_stages_per_rank=job.stages_per_rank, source=job.source, layers_per_stage=None,
        split=None if request.synthetic and request.profile is None else job.split,  # synthetic: no layers to split
    )


def execute_in_job_terms(request: RunOptions, job: JobRun | None) -> RunReport | None:
    """The library call; a refusal of a job's ``-r``/``-m`` names the job's keys that set them."""
    from ppsim.calibrate.execute.run import execute

    try:
        return execute(request)
    except PPSimError as exc:
        if job is None:
            raise
        raise job.in_job_terms(exc) from None


def show_run(report: RunReport, *, output: Path | None, plot: Path | None, json_out: bool) -> None:
    """Write the run JSON and the figure, print the table (or the JSON), and fail when the numerics do."""
    data = report.to_dict()
    text = json.dumps(data, indent=1, allow_nan=False)
    if json_out:  # the measurement first: a file that cannot be written never takes it with it
        typer.echo(text)
    else:
        print_run_summary(report)
    try:
        _write_run(report, data, text, output=output, plot=plot)
    except (PPSimError, OSError) as exc:
        if not json_out:
            typer.echo(text)
        raise PPSimError(f"{exc}; the run's JSON is on stdout above, nothing measured is lost") from None
    if not json_out:
        for path in (output, plot):
            if path is not None:
                typer.echo(str(path))
    if not report.grad_ok or not report.loss_match:
        typer.echo(
            f"Error: gradients or loss differ from the non-pipelined reference beyond the tolerance "
            f"(max |grad diff| {data['grad_max_abs_diff']:.3g} > {data['grad_tolerance']:.3g}, or loss "
            f"{data['loss']:.8g} vs {data['ref_loss']:.8g}); the execution is wrong",
            err=True,
        )
        raise typer.Exit(code=1)


def _write_run(report: RunReport, data: dict[str, Any], text: str, *, output: Path | None,
               plot: Path | None) -> None:
    """``-o`` (the run JSON, atomically) and ``--plot`` (measured above predicted)."""
    if output is not None:
        from ppsim.io import write_atomic

        write_atomic(output, text + "\n")
    if plot is not None:
        from ppsim.viz.run_figure import plot_run

        title = (f"{data['schedule']}, {data['ranks']} ranks, {data['microbatches']} microbatches: measured "
                 f"{fmt_s(data['measured_step_s'])}, predicted {fmt_s(data['predicted_step_s'])} "
                 f"({data['step_error_pct']:+.1f}%)")
        plot_run(report.measured_bars(), report.predicted_bars(), data["ranks"], title, plot)


def check_ignored_run_options(*, synthetic: bool, profile: Path | None, costs: str | None, time_unit: float | None,
                              preset: str | None, split: str | None, layers_per_stage: int | None,
                              profile_out: Path | None) -> None:
    """Refuse, in one line, an option this run would ignore."""
    if time_unit is not None and not (synthetic and profile is None):
        why = "a profile's costs are seconds already" if synthetic else "a real run computes instead of sleeping"
        raise PPSimError(f"--time-unit {time_unit}: applies to --synthetic runs with --costs only ({why}); drop it")
    if preset is not None and profile is not None:
        raise PPSimError(f"--preset {preset}: a run with --profile runs the profile's own model; drop --preset (or "
                         "--profile to calibrate the preset first)")
    if profile is not None and profile_out is not None:
        raise PPSimError(f"--profile-out {profile_out}: keeps the calibration a run without --profile makes first; "
                         "with --profile nothing is calibrated, so drop it")
    if synthetic and profile is None:
        if profile_out is not None:
            raise PPSimError(f"--profile-out {profile_out}: a --synthetic run without --profile calibrates nothing; "
                             "drop it")
        for option, value in (("--split", split), ("--layers-per-stage", layers_per_stage)):
            if value is not None:
                raise PPSimError(f"{option} {value}: synthetic stages from a cost string have no layers to split; "
                                 "pass a per-block --profile, or drop it")


def calibration_path(output: Path | None, profile_out: Path | None, *, profile: Path | None,
                     synthetic: bool) -> Path | None:
    """Where a run without --profile keeps its calibration: --profile-out, or NAME.profile.json beside -o; a file
    already there is refused now, before anything runs (it is created new, never replaced)."""
    if profile is not None or synthetic:
        return None
    path = profile_out
    if path is None and output is not None:
        path = output.with_name(output.stem + ".profile.json")
    from ppsim.calibrate.execute.run import profile_taken, writes_profile

    if path is not None and writes_profile() and (path.exists() or path.is_symlink()):
        raise PPSimError(profile_taken(path))
    return path


def print_run_summary(report: RunReport) -> None:
    from rich.table import Table

    from ppsim.cli.output import console

    d = report.to_dict()
    kind = "synthetic stages" if d["synthetic"] else f"{d['device']} ({d['device_name']})"
    table = Table(
        title=f"{d['schedule']}: {d['ranks']} ranks, {d['microbatches']} microbatches, {d['stages']} stages, "
        f"{kind}, {d['backend']}"
    )
    for col, justify in (("", "left"), ("measured", "right"), ("predicted", "right"), ("error", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    lo, hi = d["measured_step_spread_s"]
    table.add_row(f"step time (median of {d['steps']}; {fmt_s(lo)}-{fmt_s(hi)})", fmt_s(d["measured_step_s"]),
                  fmt_s(d["predicted_step_s"]), f"{d['step_error_pct']:+.1f}%")
    table.add_row("step time, op costs only", "", fmt_s(d["predicted_step_costs_only_s"]),
                  f"{d['step_error_costs_only_pct']:+.1f}%")
    if d["explained_step_s"] is not None:
        table.add_row("step time, post-hoc (fitted on this run)", "", fmt_s(d["explained_step_s"]),
                      f"{d['explained_error_pct']:+.1f}%")
    table.add_row(
        "bubble ratio", f"{d['bubble_ratio_measured']:.1%}", f"{d['bubble_ratio_predicted']:.1%}",
        f"{100 * (d['bubble_ratio_predicted'] - d['bubble_ratio_measured']):+.1f} pt",
    )
    recomputed = bool(d.get("recompute"))
    for m in d["memory"]:
        pred = m["peak_activation_bytes_predicted"]
        err = None if recomputed else m["peak_activation_error_pct"]
        table.add_row(f"rank {m['rank']} peak activations{' *' if recomputed else ''}",
                      fmt_bytes(m["peak_activation_bytes_measured"]), fmt_bytes(pred),
                      "" if err is None else f"{err:+.1f}%")
    for m in d["memory"]:
        if m["peak_allocated_bytes_measured"] is None:
            continue
        pred, err = m["peak_allocated_bytes_predicted"], m["peak_allocated_error_pct"]
        table.add_row(f"rank {m['rank']} peak allocated", fmt_bytes(m["peak_allocated_bytes_measured"]),
                      "" if pred is None else fmt_bytes(pred), "" if err is None else f"{err:+.1f}%")
    a2a = d.get("all_to_all")
    if a2a is not None:
        pred_total, pred_exposed = a2a["predicted_total_s"], a2a["predicted_exposed_s"]
        table.add_row("EP all-to-alls, in calls (all ranks)", fmt_s(a2a["measured_total_s"]),
                      "" if pred_total is None else fmt_s(pred_total), "")
        table.add_row("EP all-to-alls, exposed (all ranks)", fmt_s(a2a["measured_exposed_s"]),
                      "" if pred_exposed is None else fmt_s(pred_exposed), "")
    ae = d["action_error"]
    table.add_row("action start |error| median / max", "", "",
                  f"{fmt_s(ae['start_median_abs_s'])} / {fmt_s(ae['start_max_abs_s'])}")
    console().print(table)
    if recomputed:
        typer.echo(RECOMPUTED_ACTIVATIONS)
    pi = d["prediction_inputs"]
    typer.echo(f"prediction (before the run, from {pi['source']}): compute x{pi['compute_scale']:.2f}, dispatch "
               f"{fmt_s(pi['dispatch_s'])} per computation, hand-off latency {fmt_s(pi['handoff_latency_s'])}")
    for note in d["notes"]:
        typer.echo(note)
    verdict = "OK" if d["grad_ok"] and d["loss_match"] else "MISMATCH"
    typer.echo(
        f"numerics {verdict}: loss {d['loss']:.8g} (reference {d['ref_loss']:.8g}); max |grad - reference| "
        f"{d['grad_max_abs_diff']:.3g} over {d['num_params_checked']} parameters (tolerance {d['grad_tolerance']:.3g})"
    )


#: under the table of a run that recomputes: why its activation rows carry no error
RECOMPUTED_ACTIVATIONS = (
    "* with --recompute, the measured activations (saved-tensor hooks) leave out what each recomputing backward "
    "re-materialises, which the prediction counts at its high point; the peak allocated rows compare the two whole")


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"
