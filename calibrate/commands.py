"""The `ppsim calibrate` and `ppsim run` commands: option checks, then the library call, then output.

Every option is checked here before torch is imported (a bad integer is refused at once), the work is done by
:mod:`ppsim.calibrate.calibration` and :mod:`ppsim.calibrate.run`, and output is printed here. The measured-vs-
predicted figure is drawn by ``ppsim.viz.run_figure``: calibrate/ does not import viz, so the CLI hands the drawing
function in through :func:`register`.

    from ppsim.calibrate.commands import register
    register(app, wrap=user_errors, plot_run=ppsim.viz.run_figure.plot_run)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.errors import PPSimError
from ppsim.io import output_file, progress_path
from ppsim.limits import check_timeout
from ppsim.torchtitan import JOB_CONTEXT

if TYPE_CHECKING:
    from ppsim.calibrate.models import ModelSource
    from ppsim.calibrate.run import RunReport
    from ppsim.model_config import ModelConfig

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".html")
PlotRun = Callable[..., Path]
_plot_run: PlotRun | None = None


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Backend(str, Enum):
    gloo = "gloo"
    nccl = "nccl"


class Executor(str, Enum):
    auto = "auto"
    torchtitan = "torchtitan"
    ppsim = "ppsim"


def register(app: typer.Typer, *, wrap: Callable[[Any], Any] = lambda f: f, plot_run: PlotRun | None = None) -> None:
    """Add `calibrate` and `run` to ``app``; ``wrap`` turns user errors into one line; ``plot_run(measured,
    predicted, num_ranks, title, path)`` draws `run --plot` (without it `--plot` is refused)."""
    global _plot_run
    _plot_run = plot_run
    app.command("calibrate", context_settings=JOB_CONTEXT)(wrap(calibrate_command))
    app.command("run", context_settings=JOB_CONTEXT)(wrap(run_command))


TorchtitanConfigOption = Annotated[
    Optional[str],
    typer.Option("--torchtitan-config", metavar="MODULE:CONFIG|TOML",
                 help="torchtitan job config (e.g. llama3:llama3_debugmodel; needs the torchtitan extra) or an older "
                 "release's job TOML: take the model, its training.seq_len and pipeline_parallel_microbatch_size "
                 "from it (run: also the schedule, ranks, microbatches and split). Override its keys as torchtitan "
                 "does: --parallelism.KEY VALUE, --training.KEY VALUE."),
]


def job_overrides(ctx: typer.Context, torchtitan_config: str | None) -> list[str]:
    """The extra arguments: the job config's overrides (:func:`ppsim.torchtitan.extra_overrides`)."""
    from ppsim.torchtitan import extra_overrides

    names = [opt for p in ctx.command.params for opt in (*p.opts, *p.secondary_opts)]
    return extra_overrides(ctx.args, job_given=torchtitan_config is not None, option_names=names,
                           command=ctx.command_path)


def warn(lines: Any) -> None:
    for line in lines:
        typer.echo(line, err=True)


# --- calibrate --------------------------------------------------------------------------------------------------
def calibrate_command(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_file, help="Profile JSON to write when "
                                         "finished (progress goes to -o.partial).")],
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="cpu or cuda.")] = Device.cpu,
    model: Annotated[
        Optional[str],
        typer.Option("--model", metavar="SOURCE", help="builtin:tiny (default; also 1b, 8b), "
                     "torchtitan:FAMILY/FLAVOR (e.g. torchtitan:llama3/debugmodel), or python:PKG.MODULE:FACTORY."),
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", help="Alias of --model builtin:NAME: tiny, 1b, 8b.")
    ] = None,
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="Hidden size (overrides the preset).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Attention heads; must divide --hidden.")] = None,
    ffn: Annotated[Optional[int], typer.Option("--ffn", help="SwiGLU inner size.")] = None,
    layers: Annotated[
        Optional[int], typer.Option("--layers", help="Layers in the whole model (any --model; torchtitan: the "
                                    "flavor's layers truncated, or extended with its last layer's kind).")
    ] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary size.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    mb_size: Annotated[Optional[int], typer.Option("--mb-size", help="Sequences per microbatch.")] = None,
    dtype: Annotated[
        Optional[DType], typer.Option("--dtype", case_sensitive=False, help="float32, bfloat16 or float16.")
    ] = None,
    stages: Annotated[
        Optional[int],
        typer.Option("--stages", help="With --check-stages: how many stages (torchtitan's default split) to "
                     "measure whole (default 4). The profile's blocks serve any stage count."),
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed repetitions before each measurement.")] = 3,
    reps: Annotated[int, typer.Option("--reps", help="Timed repetitions per measurement.")] = 20,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the unfinished profile in -o without repeating finished work.")
    ] = False,
    p2p: Annotated[
        bool,
        typer.Option("--p2p/--no-p2p", help="Measure p2p latency/bandwidth (two local processes without torchrun)."),
    ] = True,
    probe: Annotated[
        bool,
        typer.Option("--probe/--no-probe", help="Calibrate the runtime overheads with a short probe run of a fixed "
                     "reference schedule (1F1B, 2 local ranks)."),
    ] = True,
    check_stages: Annotated[
        bool, typer.Option("--check-stages", help="Also measure --stages stages whole (composition check).")
    ] = False,
    init_timeout: Annotated[
        float, typer.Option("--init-timeout", help="Seconds to wait for the other ranks to join.")
    ] = 60.0,
    override_limits: Annotated[
        bool, typer.Option("--allow-large", help="Run even when the memory or time estimate exceeds the limits.")
    ] = False,
    torchtitan_config: TorchtitanConfigOption = None,
) -> None:
    """Measure the model's blocks (embedding, layer, head), the per-stage overhead, p2p cost and the runtime's
    overheads on this machine; write a profile that serves any schedule and stage count."""
    from ppsim.calibrate.calibration import CalibrationOptions, check_limits

    for name, value, least in (("--warmup", warmup, 0), ("--reps", reps, 1)):
        if value < least:
            raise PPSimError(f"{name} {value}: must be at least {least}; e.g. {name} {max(least, 3)}")
    if stages is not None and stages < 1:
        raise PPSimError(f"--stages {stages}: must be at least 1; e.g. --stages 4")
    notes: list[str] = []  # printed once every refusal is behind: a failing command's stderr is its error line
    if stages is not None and not check_stages:  # the Slurm scripts pass it always: a warning, not a refusal
        notes.append(f"warning: --stages {stages} is used only with --check-stages (the profile's blocks serve any "
                     "stage count), so it is ignored")
    stages = 4 if stages is None else stages
    check_timeout("--init-timeout", init_timeout, least=1.0)
    overrides = job_overrides(ctx, torchtitan_config)
    check_output(output, "-o", suffix=".json")
    from ppsim.io import check_distinct

    check_distinct((("--torchtitan-config", torchtitan_config), ("-o", output)))  # an output never replaces an input
    sizes = dict(hidden=hidden, heads=heads, ffn=ffn, layers=layers, vocab=vocab, seq_len=seq_len, mb_size=mb_size,
                 dtype=None if dtype is None else dtype.value)
    if torchtitan_config is None:
        source = resolve_source(model, preset, device=device.value, **sizes)
    else:
        from ppsim.calibrate.models import ModelOptions
        from ppsim.calibrate.titan_job import calibration_source

        source, job_notes = calibration_source(torchtitan_config, overrides, model=model, preset=preset,
                                               options=ModelOptions(**sizes), device=device.value)
        notes += job_notes
    config = source.config
    opts = CalibrationOptions(
        output=output, config=config, num_stages=stages, device=device.value, warmup=warmup, reps=reps,
        resume=resume, p2p=p2p, probe=probe, check_stages=check_stages, init_timeout_s=init_timeout,
        override_limits=override_limits, source=source,
    )
    try:
        check_limits(opts)  # before torch: the estimate needs none
    except PPSimError as exc:
        if torchtitan_config is None or seq_len is not None or config.seq_len <= 128:
            raise
        raise PPSimError(f"{exc}; the job's training.seq_len is {config.seq_len}: e.g. --training.seq_len 128 "
                         "lowers it") from None
    if check_stages:  # after the estimate: the split takes time in the number of stages
        from ppsim.split import default_split

        default_split(config.layers, stages)
    warn(notes)
    from ppsim.calibrate.calibration import calibrate

    try:
        doc = calibrate(opts)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; finished measurements are in {progress_path(output)} ({output} is untouched); "
                   "continue with --resume", err=True)
        raise typer.Exit(code=130) from None
    if doc is not None:
        print_profile_summary(doc)
        typer.echo(str(output))


def resolve_source(model: str | None, preset: str | None, *, device: str = "cpu", **sizes: Any) -> ModelSource:
    """``--model`` (or its alias ``--preset``) with the model-size options, resolved without building anything."""
    from ppsim.calibrate.models import ModelOptions, parse_model_source

    return parse_model_source(model, ModelOptions(**sizes), device=device, preset=preset)


def resolve_config(preset: str, **overrides: Any) -> ModelConfig:
    from ppsim.model_config import get_preset

    base = get_preset(preset)
    changes = {k: v for k, v in overrides.items() if v is not None and getattr(base, k) != v}
    if not changes:
        return base
    return base.replace(preset="custom", **changes)


def check_output(path: Path, what: str, *, suffix: str | None = None) -> None:
    from ppsim.io import check_writable

    check_writable(path, option=what, example="profile.json" if suffix == ".json" else "run.json")
    if path.is_dir():
        raise PPSimError(f"{what} {path}: is a directory; give a file name")
    if suffix is not None and path.suffix.lower() != suffix:
        raise PPSimError(f"{what} {path}: a profile is JSON; use a name ending in {suffix}")


def print_profile_summary(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(stat: Any) -> str:
        if stat is None:
            return "-"
        return f"{stat['median'] * 1e3:.3g} \\[{stat['p10'] * 1e3:.3g}-{stat['p90'] * 1e3:.3g}]"

    wall = (doc.get("method") or {}).get("wall_s")
    name = (doc.get("source") or {}).get("source") or doc["model"]["preset"]
    table = Table(title=f"blocks of the {name} model on {doc['device_name']}"
                  + (f" ({wall:.1f} s)" if wall is not None else "") + "; ms: median \\[p10-p90]")
    for col in ("block", "F", "B", "I", "W", "FB", "activations", "freed by I"):
        table.add_column(col, justify="right")
    rows = dict(doc.get("blocks") or {})
    if doc.get("stage_overhead"):
        rows["per-stage overhead"] = doc["stage_overhead"]
    for name, block in rows.items():
        table.add_row(name, *(cell(block.get(op)) for op in ("F", "B", "I", "W", "FB")),
                      _fmt_bytes(block.get("activation_bytes")), _fmt_bytes(block.get("activation_bytes_freed_by_I")))
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=130)
    console.print(table)
    p = doc.get("p2p")
    if p is not None:
        console.print(f"p2p: alpha {p['alpha_s'] * 1e6:.1f} us, beta {p['beta_bytes_per_s'] / 1e9:.3g} GB/s "
                      f"(fit error {p['fit_rel_error']:.1%})")
    rt = doc.get("runtime")
    if rt:
        scale = ", ".join(f"{k} rank(s): x{v:.2f}" for k, v in rt["compute_scale"].items())
        handoff = "-" if rt.get("handoff_s") is None else f"{rt['handoff_s'] * 1e6:.0f} us"
        console.print(f"runtime (probe {rt['probe']['schedule']} on {rt['probe']['ranks']} ranks): compute scale "
                      f"{scale}; dispatch {rt['dispatch_s'] * 1e6:.0f} us per computation; hand-off {handoff}")
        syn = rt.get("synthetic")
        if syn:
            handoff = "-" if syn.get("handoff_s") is None else f"{syn['handoff_s'] * 1e6:.0f} us"
            console.print(f"runtime, synthetic stages: dispatch {syn['dispatch_s'] * 1e6:.0f} us, hand-off {handoff}")
    for note in doc.get("notes") or []:
        console.print(f"note: {note}")


def _fmt_bytes(n: Any) -> str:
    from ppsim.io import fmt_bytes

    return "-" if n is None else fmt_bytes(n)


# --- run --------------------------------------------------------------------------------------------------------
def run_command(
    ctx: typer.Context,
    schedule: Annotated[
        Optional[str],
        typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file "
                     "(required unless --torchtitan-config gives it)."),
    ] = None,
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
    profile_out: Annotated[
        Optional[Path],
        typer.Option("--profile-out", parser=output_file,
                     help="Without --profile: keep the calibration made first here (default: "
                     "next to -o as NAME.profile.json; an existing file is never replaced)."),
    ] = None,
    split: Annotated[
        Optional[str],
        typer.Option("--split", metavar="N,N,...", help="Layers per stage (per-block profile), as for simulate."),
    ] = None,
    layers_per_stage: Annotated[
        Optional[int],
        typer.Option("--layers-per-stage", help="torchtitan's pipeline_parallel_layers_per_stage, as for simulate."),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps (after the warm-up steps).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps.")] = 3,
    probes: Annotated[
        Optional[int],
        typer.Option("--probes", help="Steps interleaved with the timed ones for the post-hoc model "
                     "(explained_step_s; default: as many as --steps; 0: fit it on the warm-up steps)."),
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", parser=output_file, help="Write the run JSON here.")
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", parser=output_file,
                                     help="Measured timeline above the predicted one: .png/.svg/.pdf/.html.")
    ] = None,
    synthetic: Annotated[
        bool, typer.Option("--synthetic", help="Stages sleep their cost instead of computing (exact gradients).")
    ] = False,
    costs: Annotated[
        Optional[str],
        typer.Option("--costs", help='With --synthetic: per-op costs in units of --time-unit, e.g. "F=1,B=2,comm=0".'),
    ] = None,
    time_unit: Annotated[
        Optional[float], typer.Option("--time-unit", help="With --synthetic --costs: seconds per cost unit "
                                      "(default 0.01).")
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", metavar="SOURCE", help="Model to run (default: the profile's, else builtin:tiny): "
                     "builtin:NAME, torchtitan:FAMILY/FLAVOR or python:PKG.MODULE:FACTORY."),
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", help="Alias of --model builtin:NAME (tiny, 1b, 8b).")
    ] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Layer-count override of --model.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    mb_size: Annotated[Optional[int], typer.Option("--mb-size", help="Sequences per microbatch.")] = None,
    dtype: Annotated[
        Optional[DType], typer.Option("--dtype", case_sensitive=False, help="float32, bfloat16 or float16.")
    ] = None,
    executor: Annotated[
        Executor,
        typer.Option("--executor", case_sensitive=False,
                     help="Who builds the stages and the schedule: torchtitan (its pipeline helpers given ppsim's "
                     "CSV; auto for torchtitan models) or ppsim (ppsim's executor; auto otherwise)."),
    ] = Executor.auto,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the weights and the batch.", min=0,
                                      max=2**63 - 1)] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Stop the processes after this many seconds.")] = 600.0,
    override_limits: Annotated[
        bool, typer.Option("--allow-large", help="Run even beyond the work, rank and memory limits.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the run JSON instead of the table.")] = False,
    recompute: Annotated[
        Optional[str],
        typer.Option("--recompute", metavar="none|full|FILE.json", help="Recompute these (stage, microbatch) "
                     "forwards in their backward with torch.utils.checkpoint, as `simulate --recompute` models them "
                     "(default: none, or for -s FILE.csv the FILE.recompute.json beside it)."),
    ] = None,
    torchtitan_config: TorchtitanConfigOption = None,
) -> None:
    """Execute the schedule on R processes with torch's pipeline runtime; check gradients; compare with ppsim's
    before-run prediction."""
    for name, value, least in (("--ranks", ranks, 1), ("--mb", mb, 1), ("--stages-per-rank", stages_per_rank, 1),
                               ("--steps", steps, 1), ("--warmup", warmup, 0), ("--probes", probes, 0)):
        if value is not None and value < least:
            raise PPSimError(f"{name} {value}: must be at least {least}")
    check_ignored_run_options(synthetic=synthetic, profile=profile, costs=costs, time_unit=time_unit, preset=preset,
                              split=split, layers_per_stage=layers_per_stage, profile_out=profile_out)
    if time_unit is not None and not (math.isfinite(time_unit) and time_unit >= 1e-4):
        raise PPSimError(f"--time-unit {time_unit}: must be a finite number >= 0.0001")
    check_timeout("--timeout", timeout, least=1.0)
    for path, what in ((output, "-o"), (plot, "--plot"), (profile_out, "--profile-out")):
        if path is not None:
            check_output(path, what, suffix=".json" if what == "--profile-out" else None)
    overrides = job_overrides(ctx, torchtitan_config)
    if schedule is None and torchtitan_config is None:
        raise PPSimError("--schedule/-s is required (or --torchtitan-config MODULE:CONFIG or job.toml); e.g. -s 1F1B "
                         "-r 2 -m 4")
    save_calibration = calibration_path(output, profile_out, profile=profile, synthetic=synthetic)
    if plot is not None:
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise PPSimError(
                f"--plot {plot}: unknown extension {plot.suffix or '(none)'!r}; use one of {', '.join(PLOT_SUFFIXES)}"
            )
        if _plot_run is None:
            raise PPSimError("--plot: this ppsim was built without its figures (ppsim.viz); drop --plot")
    if costs is not None:
        from ppsim.costs import parse_costs

        parse_costs(costs)  # one-line errors before anything starts
    from ppsim.calibrate.models import ModelOptions
    from ppsim.calibrate.run import RunOptions, execute

    sizes = ModelOptions(layers=layers, seq_len=seq_len, mb_size=mb_size,
                         dtype=None if dtype is None else dtype.value)
    device = "cuda" if backend.value == "nccl" else "cpu"
    job = None
    if torchtitan_config is not None:
        from ppsim.calibrate.titan_job import run_inputs

        job = run_inputs(torchtitan_config, overrides, options=sizes, model=model, preset=preset, profile=profile,
                         schedule=schedule, num_ranks=ranks, num_microbatches=mb, stages_per_rank=stages_per_rank,
                         split=split, layers_per_stage=layers_per_stage, device=device,
                         allow_large=override_limits)
        warn(job.notes)
        schedule, ranks, mb, stages_per_rank = job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank
        model, preset, sizes, layers_per_stage = job.model, None, job.options, None
        split = None if synthetic and profile is None else job.split  # synthetic stages have no layers to split
    assert schedule is not None
    from ppsim.io import check_distinct

    check_distinct((("-s", schedule if schedule.lower().endswith(".csv") else None), ("--profile", profile),
                    ("-o", output), ("--plot", plot), ("--profile-out", save_calibration),
                    ("--torchtitan-config", torchtitan_config)))
    if profile is None:
        resolve_source(model, preset, device=device, **sizes.given())

    options = RunOptions(
        schedule=schedule, num_ranks=ranks, num_microbatches=mb, num_stages_per_rank=stages_per_rank,
        backend=backend.value, profile=profile, costs=costs, synthetic=synthetic,
        time_unit_s=0.01 if time_unit is None else time_unit, preset=preset, model=model, model_options=sizes,
        num_steps=steps, num_warmup=warmup, num_probes=probes, seed=seed, timeout_s=timeout,
        save_calibration=save_calibration,
        override_limits=override_limits, split=split, layers_per_stage=layers_per_stage, recompute=recompute,
        executor=executor.value,
    )
    try:
        report = execute(options)
    except PPSimError as exc:
        if job is None:
            raise
        raise job.in_job_terms(exc) from None
    if report is None:  # a torchrun rank other than 0
        return
    if profile is not None:  # the calibration's warning, repeated where its numbers are used
        from ppsim.profile import load_profile

        warn([line for line in [load_profile(profile).host_warning(str(profile))] if line])
    data = report.to_dict()
    text = json.dumps(data, indent=1, allow_nan=False)
    if json_out:  # the measurement first: a file that cannot be written never takes it with it
        typer.echo(text)
    else:
        print_run_summary(report)
    try:
        if output is not None:
            from ppsim.io import write_atomic

            write_atomic(output, text + "\n")
        if plot is not None and _plot_run is not None:
            title = (f"{data['schedule']}, {data['ranks']} ranks, {data['microbatches']} microbatches: measured "
                     f"{fmt_s(data['measured_step_s'])}, predicted {fmt_s(data['predicted_step_s'])} "
                     f"({data['step_error_pct']:+.1f}%)")
            _plot_run(report.measured_bars(), report.predicted_bars(), data["ranks"], title, plot)
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
    from ppsim.calibrate.run import profile_taken, writes_profile

    if path is not None and writes_profile() and (path.exists() or path.is_symlink()):
        raise PPSimError(profile_taken(path))
    return path


def print_run_summary(report: RunReport) -> None:
    from rich.console import Console
    from rich.table import Table

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
    for m in d["memory"]:
        pred = m["peak_activation_bytes_predicted"]
        err = m["peak_activation_error_pct"]
        table.add_row(f"rank {m['rank']} peak activations", _fmt_bytes(m["peak_activation_bytes_measured"]),
                      _fmt_bytes(pred), "" if err is None else f"{err:+.1f}%")
    ae = d["action_error"]
    table.add_row("action start |error| median / max", "", "",
                  f"{fmt_s(ae['start_median_abs_s'])} / {fmt_s(ae['start_max_abs_s'])}")
    Console().print(table)
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


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"
