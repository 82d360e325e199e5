"""`ppsim calibrate`: option checks, then the one request (:class:`CalibrationOptions`), the library call, output.

Every option is checked here before torch is imported (a bad integer is refused at once); the model is resolved once,
here (:func:`resolve_model`), and travels in the request; the work is done by
:func:`ppsim.calibrate.measure.calibration.calibrate`.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import job_overrides, user_errors, warn
from ppsim.cli.options import (
    JOB_CONTEXT,
    ClusterOpt,
    DType,
    DTypeOpt,
    FfnOpt,
    HeadsOpt,
    HiddenOpt,
    LayersOpt,
    ModelOpt,
    PresetOpt,
    SeqLenOpt,
    TorchtitanConfigOpt,
    VocabOpt,
)
from ppsim.errors import PPSimError
from ppsim.io import check_distinct, output_file
from ppsim.limits import check_timeout

if TYPE_CHECKING:
    from ppsim.calibrate.models import ModelOptions, ModelSource


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


@app.command("calibrate", context_settings=JOB_CONTEXT)
@user_errors
def calibrate_cmd(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_file, help="Profile JSON to write when "
                                         "finished (progress goes to -o.partial).")],
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="cpu or cuda.")] = Device.cpu,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    ffn: FfnOpt = None,
    layers: LayersOpt = None,
    vocab: VocabOpt = None,
    seq_len: SeqLenOpt = None,
    mb_size: Annotated[Optional[str], typer.Option(
        "--mb-size", metavar="B[,B2...]", help="Sequences per microbatch; a list measures each (one profile: "
        "`plan` times every size it covers).")] = None,
    dtype: DTypeOpt = None,
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
    tp: Annotated[
        str, typer.Option("--tp", metavar="T[,T2...]", help="Tensor-parallel degree: measure each layer as "
                          "torchtitan shards it, on T local ranks (torchtitan models; the profile records T); a list "
                          "measures each degree into one profile.")
    ] = "1",
    ep: Annotated[
        int, typer.Option("--ep", metavar="E", help="Expert-parallel degree: measure each MoE layer as torchtitan "
                          "parallelises it, its routed experts split over E local ranks, each feeding its own "
                          "microbatch (the costs include the dispatch and combine all-to-alls); also the all-to-all "
                          "alone on E ranks. MoE torchtitan models; the profile records E.")
    ] = 1,
    activation_checkpoint: Annotated[
        str, typer.Option("--activation-checkpoint", metavar="none|selective|full",
                          help="Time each layer under torchtitan's activation checkpointing, wrapped as `ppsim run "
                          "--activation-checkpoint` wraps it (torchtitan models): B holds the backward's rerun; I "
                          "and W are not measured (schedules that split the backward are refused with the "
                          "profile). The profile records the mode.")
    ] = "none",
    torchtitan_config: TorchtitanConfigOpt = None,
    collectives: Annotated[
        bool, typer.Option("--collectives", help="Measure only the collectives (all-gather, reduce-scatter, "
                           "all-reduce, all-to-all, send/recv) at every placement: within a node 2..G ranks, across "
                           "2..N nodes 1..G ranks each. Run one torchrun per node (else two local processes); the "
                           "records go into -o (an existing profile keeps everything else).")
    ] = False,
    max_size: Annotated[
        Optional[str], typer.Option("--max-size", metavar="BYTES", help="With --collectives: the largest size "
                                    "timed (from 4 KiB, x4 each step; default 64MiB).")
    ] = None,
    cluster: ClusterOpt = None,
) -> None:
    """Measure the model's blocks (embedding, layer, head), the per-stage overhead, p2p cost and the runtime's
    overheads on this machine; write a profile that serves any schedule and stage count."""
    cluster_name = None
    if cluster is not None:
        from ppsim.cli.simulation import cluster_of

        found = cluster_of(cluster)  # a bad --cluster is one line before anything is measured
        cluster_name = None if found is None else found.name
    if collectives:
        _collectives_cmd(ctx, output=output, device=device.value, warmup=warmup, reps=reps, max_size=max_size,
                         init_timeout=init_timeout, model=model, preset=preset, cluster=cluster_name)
        return
    if max_size is not None:
        raise PPSimError(f"--max-size {max_size}: only with --collectives; add --collectives or drop --max-size")
    from ppsim.calibrate.measure.calibration import (
        CalibrationOptions,
        CalibrationPass,
        check_all_limits,
        decide_speed,
    )

    notes: list[str] = []  # printed once every refusal is behind: a failing command's stderr is its error line
    stages = _checked_stages(stages, check_stages=check_stages, warmup=warmup, reps=reps, notes=notes)
    check_timeout("--init-timeout", init_timeout, least=1.0)
    overrides = job_overrides(ctx, torchtitan_config)
    check_output(output, "-o", suffix=".json")
    check_distinct((("--torchtitan-config", torchtitan_config), ("-o", output)))  # an output never replaces an input
    degrees = int_list("--tp", tp, example="--tp 1,2")
    mb_sizes = None if mb_size is None else int_list("--mb-size", mb_size, example="--mb-size 1,2")
    sizes = model_options(hidden=hidden, heads=heads, ffn=ffn, layers=layers, vocab=vocab, seq_len=seq_len,
                          mb_size=None if mb_sizes is None else mb_sizes[0], dtype=dtype)
    if torchtitan_config is None:
        source = resolve_model(model, preset, sizes, device=device.value)
    else:
        from ppsim.calibrate.torchtitan.job import calibration_source

        source, job_notes = calibration_source(torchtitan_config, overrides, model=model, preset=preset,
                                               options=sizes, device=device.value)
        notes += job_notes
    config = source.config
    _check_tp(degrees, tp, source)
    _check_ep(ep, source, tp=degrees)
    _check_activation_checkpoint(activation_checkpoint, source)
    passes = tuple(CalibrationPass(t, b) for t in degrees for b in (mb_sizes or (config.mb_size,)))
    request = CalibrationOptions(
        output=output, config=config, num_stages=stages, device=device.value, warmup=warmup, reps=reps,
        resume=resume, p2p=p2p, probe=probe, check_stages=check_stages, init_timeout_s=init_timeout,
        override_limits=override_limits, source=source, tensor_parallel_degree=degrees[0], expert_parallel_degree=ep,
        activation_checkpoint=activation_checkpoint, passes=passes if len(passes) > 1 else (), cluster=cluster_name,
    )
    try:
        check_all_limits(request)  # memory before torch; then the dtype's speed here, which the time divides by
    except PPSimError as exc:
        if torchtitan_config is None or seq_len is not None or config.seq_len <= 128:
            raise
        raise PPSimError(f"{exc}; the job's training.seq_len is {config.seq_len}: e.g. --training.seq_len 128 "
                         "lowers it") from None
    if check_stages:  # after the estimate: the split takes time in the number of stages
        from ppsim.split import default_split

        default_split(config.layers, stages)
    request = decide_speed(request)  # measured already by check_limits (unless --allow-large)
    warn([*notes, *[line for line in [request.speed and request.speed.warning()] if line]])
    _calibrate(request)


def _collectives_cmd(ctx: typer.Context, *, output: Path, device: str, warmup: int, reps: int,
                     max_size: str | None, init_timeout: float, model: str | None, preset: str | None,
                     cluster: str | None = None) -> None:
    """``calibrate --collectives``: the collectives at every placement, written into ``-o`` as each placement
    finishes (so a Ctrl-C, exit 130, keeps them); defaults 1 warm-up and 5 timed repetitions."""
    from ppsim.io import parse_bytes

    def defaulted(name: str) -> bool:  # typer may vendor click: compare the source by its name
        return getattr(ctx.get_parameter_source(name), "name", "DEFAULT") in ("DEFAULT", "DEFAULT_MAP")

    if defaulted("warmup"):
        warmup = 1
    if defaulted("reps"):
        reps = 5
    _checked_stages(None, check_stages=False, warmup=warmup, reps=reps, notes=[])
    check_timeout("--init-timeout", init_timeout, least=1.0)
    check_output(output, "-o", suffix=".json")
    max_bytes = parse_bytes(max_size, option="--max-size") if max_size is not None else None
    if max_bytes is not None and max_bytes < 4:
        raise PPSimError(f"--max-size {max_size}: at least 4 bytes (one float); e.g. --max-size 64MiB")
    if max_bytes is not None and device == "cpu":
        _check_collective_memory(max_bytes, max_size)
    base = _collectives_base(output, model=model, preset=preset, device=device)
    from ppsim.calibrate.measure import collectives as coll

    max_bytes = max_bytes or coll.DEFAULT_MAX_BYTES
    found: list[Any] = []

    def save(timings: list[Any]) -> None:
        from ppsim.io import write_atomic

        found.extend(timings)
        doc = dict(base)
        if cluster is not None:
            doc["cluster"] = cluster  # the cluster these links were measured on
        doc["collectives"] = coll.merge_fits(base.get("collectives") or [], coll.to_fits(found))
        note = (f"collectives measured by `ppsim calibrate --collectives` ({warmup} warm-up + {reps} timed, up to "
                f"{max_bytes} bytes)")
        doc["notes"] = [*(n for n in doc.get("notes") or [] if not n.startswith("collectives measured by")), note]
        write_atomic(output, json.dumps(doc, indent=1) + "\n", option="-o")

    def log(line: str) -> None:
        typer.echo(line, err=True)

    from ppsim.calibrate.execute.launch import under_torchrun

    try:
        if under_torchrun():
            _collectives_torchrun(device=device, warmup=warmup, reps=reps, max_bytes=max_bytes,
                                  init_timeout=init_timeout, log=log, save=save)
        else:
            backend = "nccl" if device == "cuda" else "gloo"
            coll.measure_local(ranks=2, max_bytes=max_bytes, backend=backend, warmup=warmup, reps=reps,
                               timeout_s=max(init_timeout, 60.0) + 3600, log=log, on_placement=save)
    except KeyboardInterrupt:
        kept = f"kept the {len(found)} finished timings in {output}" if found else f"nothing written ({output})"
        typer.echo(f"interrupted; {kept}", err=True)
        raise typer.Exit(code=130) from None
    import os

    if os.environ.get("RANK", "0") == "0":
        typer.echo(str(output))


def _check_collective_memory(max_bytes: int, text: str | None) -> None:
    """``--max-size`` on CPU ranks: each of this host's ranks holds about two buffers of the largest size (an
    all_to_all's input and output); more than the host's memory is one line before anything starts."""
    import os

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "2") or 2)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    need = 2 * max_bytes * max(ranks, 1)
    if need > memory:
        from ppsim.io import fmt_bytes

        raise PPSimError(f"--max-size {text}: {max(ranks, 1)} local ranks hold about 2 x {fmt_bytes(max_bytes)} each "
                         f"({fmt_bytes(need)}), more than this host's {fmt_bytes(memory)}; give at most "
                         f"--max-size {fmt_bytes(memory // (4 * max(ranks, 1)))}")


def _collectives_torchrun(*, device: str, warmup: int, reps: int, max_bytes: int, init_timeout: float,
                          log: Any, save: Any) -> None:
    """This rank's part of ``--collectives`` under torchrun (rank 0 logs and writes)."""
    import torch
    import torch.distributed as dist

    from ppsim.calibrate.execute.launch import init_world, peers_lost_in_one_line
    from ppsim.calibrate.measure import collectives as coll

    dev: Any = "cpu"
    backend = "gloo"
    if device == "cuda":
        import os

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    torch.set_num_threads(1)
    world = init_world(backend=backend, timeout_s=init_timeout)
    try:
        with peers_lost_in_one_line(world.rank, world.world_size, "calibrate --collectives"):
            coll.measure_collectives(max_bytes=max_bytes, warmup=warmup, reps=reps, device=dev,
                                     log=log if world.rank == 0 else (lambda line: None),
                                     on_placement=save if world.rank == 0 else None)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _collectives_base(output: Path, *, model: str | None, preset: str | None, device: str) -> dict[str, Any]:
    """The profile ``--collectives`` writes into: ``-o`` as it is when it holds a profile, else a new one holding
    only collectives (incomplete: no blocks measured)."""
    import os

    if output.exists():
        from ppsim.profile import load_profile

        load_profile(output, allow_incomplete=True)  # a file that is no profile is refused, not replaced
        return dict(json.loads(output.read_text(encoding="utf-8")))
    import torch

    from ppsim.calibrate.measure.calibration import CalibrationOptions, new_document

    source = resolve_model(model, preset, model_options(), device=device)
    opts = CalibrationOptions(output=output, config=source.config, device=device, source=source, probe=False)
    doc = new_document(opts, device=torch.device(device), world_size=int(os.environ.get("WORLD_SIZE", "2")),
                       backend="nccl" if device == "cuda" else "gloo")
    doc["done"] = ["collectives"]
    doc["notes"] = [*doc.get("notes", []), "only collectives measured (calibrate --collectives): the blocks are "
                    "not; calibrate the model into its own profile"]
    return doc


def int_list(option: str, text: str, *, example: str) -> tuple[int, ...]:
    """``1,2,4``: positive integers, each once (one line naming the value otherwise)."""
    values: list[int] = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise PPSimError(f"{option} {text}: {part.strip()!r} is not an integer; e.g. {example}") from None
        if value < 1:
            raise PPSimError(f"{option} {text}: must be at least 1 (got {value}); e.g. {example}" if "," in text
                             else f"{option} {value}: must be at least 1; e.g. {example.split(',')[0]}")
        if value in values:
            raise PPSimError(f"{option} {text}: {value} is given twice; list each value once, e.g. {example}")
        values.append(value)
    return tuple(values)


def _check_tp(degrees: tuple[int, ...], text: str, source: ModelSource) -> None:
    """``--tp``: above 1 a torchtitan model whose heads each degree divides."""
    if degrees == (1,):
        return
    if source.scheme != "torchtitan":
        raise PPSimError(f"--tp {text} with --model {source.text}: tensor-parallel measurement uses torchtitan's own "
                         "sharding plan; use a torchtitan:FAMILY/FLAVOR model or --tp 1")
    for tp in degrees:
        which = "" if len(degrees) == 1 else f"degree {tp} "
        if source.config.heads % tp:
            raise PPSimError(f"--tp {text}: {which}does not divide the {source.config.heads} attention heads of "
                             f"{source.text}; use a divisor of the head count")
        if source.config.seq_len % tp:  # sequence parallelism shards each layer's tokens over the TP ranks
            raise PPSimError(f"--tp {text}: {which}does not divide the sequence length {source.config.seq_len} "
                             "(sequence parallelism shards it); use a --seq-len that each degree divides")


def _check_ep(ep: int, source: ModelSource, *, tp: tuple[int, ...]) -> None:
    """``--ep``: above 1 a torchtitan MoE model whose routed experts it divides, at ``--tp 1``."""
    if ep < 1:
        raise PPSimError(f"--ep {ep}: must be at least 1; e.g. --ep 2")
    if ep == 1:
        return
    experts = None
    if source.scheme == "torchtitan":
        from ppsim.calibrate.models.torchtitan import num_experts

        experts = num_experts(source)
    if experts is None:
        raise PPSimError(f"--ep {ep} with --model {source.text}: a dense model has no routed experts to split; drop "
                         "--ep, or calibrate a MoE model (e.g. --model torchtitan:deepseek_v3/debugmodel)")
    if experts % ep:
        raise PPSimError(f"--ep {ep}: does not divide the {experts} routed experts of {source.text} (each rank holds "
                         f"experts / ep of them); use a divisor of {experts}")
    if tp != (1,):
        raise PPSimError(f"--ep {ep} with --tp {','.join(map(str, tp))}: a calibration measures one sharding at a "
                         "time; calibrate --ep and --tp in two runs")


def _check_activation_checkpoint(mode: str, source: ModelSource) -> None:
    """``--activation-checkpoint``: one of the modes; other than ``none``, a torchtitan model (its policy wraps the
    model's ``layers``, as ``run`` applies it)."""
    from ppsim.profile import AC_MODES

    if mode not in AC_MODES:
        raise PPSimError(f"--activation-checkpoint {mode}: one of {', '.join(AC_MODES)}")
    if mode != "none" and source.scheme != "torchtitan":
        raise PPSimError(f"--activation-checkpoint {mode} with --model {source.text}: torchtitan's checkpointing wraps "
                         "a torchtitan model's layers (as `ppsim run --activation-checkpoint` does); calibrate a "
                         "torchtitan model (--model torchtitan:FAMILY/FLAVOR) or drop --activation-checkpoint")


def _checked_stages(stages: int | None, *, check_stages: bool, warmup: int, reps: int, notes: list[str]) -> int:
    """``--stages`` (default 4) after the counts' checks; a ``--stages`` without ``--check-stages`` adds a warning to
    ``notes`` (printed once the calibration starts)."""
    for name, value, least in (("--warmup", warmup, 0), ("--reps", reps, 1)):
        if value < least:
            raise PPSimError(f"{name} {value}: must be at least {least}; e.g. {name} {max(least, 3)}")
    if stages is not None and stages < 1:
        raise PPSimError(f"--stages {stages}: must be at least 1; e.g. --stages 4")
    if stages is not None and not check_stages:  # the Slurm scripts pass it always: a warning, not a refusal
        notes.append(f"warning: --stages {stages} is used only with --check-stages (the profile's blocks serve any "
                     "stage count), so it is ignored")
    return 4 if stages is None else stages


def _calibrate(request: Any) -> None:
    """The library call and its output (a Ctrl-C keeps what was measured)."""
    from ppsim.calibrate.measure.calibration import calibrate, interrupted_line

    try:
        doc = calibrate(request)
    except KeyboardInterrupt:
        typer.echo(interrupted_line(request.output), err=True)
        raise typer.Exit(code=130) from None
    if doc is not None:
        print_profile_summary(doc)
        typer.echo(str(request.output))


def model_options(*, dtype: DType | None = None, **sizes: int | None) -> ModelOptions:
    """The model-size options as one value (checked: each a positive integer)."""
    from ppsim.calibrate.models import ModelOptions

    return ModelOptions(**sizes, dtype=None if dtype is None else dtype.value)


def resolve_model(model: str | None, preset: str | None, sizes: ModelOptions, *, device: str = "cpu") -> ModelSource:
    """``--model`` (or its alias ``--preset``) with the model-size options, resolved without building anything: the
    one place the command line's model is resolved."""
    from ppsim.calibrate.models import parse_model_source

    return parse_model_source(model, sizes, device=device, preset=preset)


def check_output(path: Path, what: str, *, suffix: str | None = None) -> None:
    """An output ``calibrate`` or ``run`` writes: writable, not a folder, with ``suffix`` when given."""
    from ppsim.io import check_writable

    check_writable(path, option=what, example="profile.json" if suffix == ".json" else "run.json")  # a folder too
    if suffix is not None and path.suffix.lower() != suffix:
        raise PPSimError(f"{what} {path}: a profile is JSON; use a name ending in {suffix}")


def print_profile_summary(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from ppsim.cli.output import console as uncut_console

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
                      fmt_bytes(block.get("activation_bytes")), fmt_bytes(block.get("activation_bytes_freed_by_I")))
    console = uncut_console(stderr=True)  # piped: every table whole
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
    for entry in doc.get("entries") or []:  # the other passes (--tp x --mb-size): their layers in a line
        layers = ", ".join(f"{name} F {cell(block.get('F'))}, B {cell(block.get('B'))}"
                           for name, block in (entry.get("blocks") or {}).items() if name.startswith("layer"))
        console.print(f"tp {entry['tensor_parallel_degree']} x microbatch size {entry['mb_size']}: {layers} "
                      "(ms: median \\[p10-p90])")
    for note in doc.get("notes") or []:
        console.print(f"note: {note}")


def fmt_bytes(n: Any) -> str:
    """Bytes for a table cell; ``-`` for none."""
    from ppsim.io import fmt_bytes as fmt

    return "-" if n is None else fmt(n)
