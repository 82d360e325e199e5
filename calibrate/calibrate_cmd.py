"""`ppsim calibrate`: measure a profile (docs/calibration.md). torch is imported inside the functions only, so
``ppsim --help`` stays fast and works without torch."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ppsim.errors import PPSimError
from ppsim.profile import Method, ModelInfo, Profile, StageProfile, Stat, load_profile, save_profile

if TYPE_CHECKING:
    from ppsim.calibrate.comm import World
    from ppsim.calibrate.model import ModelConfig

MEASUREMENTS = ("timings", "memory")
"""Per stage, in order; done keys read ``stage{s}.timings`` (F, B, I, W, FB taken in turn) and ``stage{s}.memory``,
plus ``p2p``."""


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclasses.dataclass(frozen=True)
class Options:
    output: Path
    config: ModelConfig
    num_stages: int
    device: str
    warmup: int
    reps: int
    resume: bool
    p2p: bool
    init_timeout_s: float
    seed: int = 0


def calibrate_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="Profile JSON to write (atomically, as it goes).")],
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="cpu or cuda.")] = Device.cpu,
    preset: Annotated[str, typer.Option("--preset", help="Model shapes: tiny (CPU, default), 1b, 8b.")] = "tiny",
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="Hidden size (overrides the preset).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Attention heads; must divide --hidden.")] = None,
    ffn: Annotated[Optional[int], typer.Option("--ffn", help="SwiGLU inner size.")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Transformer blocks in the whole model.")] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary size.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    mb_size: Annotated[Optional[int], typer.Option("--mb-size", help="Sequences per microbatch.")] = None,
    dtype: Annotated[
        Optional[DType], typer.Option("--dtype", case_sensitive=False, help="float32, bfloat16 or float16.")
    ] = None,
    stages: Annotated[
        int,
        typer.Option(
            "--stages",
            help="Stages of one model copy; must equal the schedule's chain length "
            "(1F1B: ranks; Interleaved: ranks x stages-per-rank; DualPipeV: 2 x ranks; DualPipe: ranks).",
        ),
    ] = 4,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed repetitions before each measurement.")] = 3,
    reps: Annotated[int, typer.Option("--reps", help="Timed repetitions per measurement.")] = 20,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the unfinished profile in -o without repeating finished work.")
    ] = False,
    p2p: Annotated[
        bool,
        typer.Option("--p2p/--no-p2p", help="Measure p2p latency/bandwidth (two local processes without torchrun)."),
    ] = True,
    init_timeout: Annotated[
        float, typer.Option("--init-timeout", help="Seconds to wait for the other ranks to join.")
    ] = 60.0,
) -> None:
    """Measure per-stage F, B, I, W, overlapped F&B, memory and p2p cost on this machine; write a profile."""
    config = resolve_config(
        preset, hidden=hidden, heads=heads, ffn=ffn, layers=layers, vocab=vocab, seq_len=seq_len, mb_size=mb_size,
        dtype=None if dtype is None else dtype.value,
    )
    for name, value, least in (("--warmup", warmup, 0), ("--reps", reps, 1)):
        if value < least:
            raise PPSimError(f"{name} {value}: must be at least {least}; e.g. {name} {max(least, 3)}")
    if stages < 1:
        raise PPSimError(f"--stages {stages}: must be at least 1; e.g. --stages 4")
    if not init_timeout > 0:
        raise PPSimError(f"--init-timeout {init_timeout}: must be a positive number of seconds; e.g. 60")
    from ppsim.calibrate.model import split_layers

    split_layers(config.layers, stages)
    opts = Options(
        output=output, config=config, num_stages=stages, device=device.value, warmup=warmup, reps=reps,
        resume=resume, p2p=p2p, init_timeout_s=init_timeout,
    )
    try:
        profile = calibrate(opts)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; finished measurements are in {output}; continue with --resume", err=True)
        raise typer.Exit(code=130) from None
    if profile is not None:
        print_summary(profile)
        typer.echo(str(output))


def resolve_config(preset: str, **overrides: Any) -> ModelConfig:
    from ppsim.calibrate.model import get_preset

    base = get_preset(preset)
    changes = {k: v for k, v in overrides.items() if v is not None and getattr(base, k) != v}
    if not changes:
        return base
    return base.replace(preset="custom", **changes)


# --- the calibration ------------------------------------------------------------------------------------------------
def calibrate(opts: Options, *, log: Callable[[str], None] | None = None) -> Profile | None:
    """Run (or resume) a calibration; returns the finished profile on the writing rank, ``None`` on other ranks."""
    import torch

    from ppsim.calibrate import comm

    started = time.perf_counter()
    distributed = comm.torchrun_world_size() >= 2
    writer = int(os.environ.get("RANK", "0")) == 0 if distributed else True
    if writer:
        _check_writable(opts.output)
    if opts.device == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
        raise PPSimError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__}); "
                         "use --device cpu or run on a machine with a GPU")
    world: World | None = None
    if distributed:
        world = comm.init_world(backend="nccl" if opts.device == "cuda" else "gloo", timeout_s=opts.init_timeout_s)
    threads = torch.get_num_threads()
    try:
        return _calibrate(opts, world, started=started, writer=writer, log=log)
    finally:
        torch.set_num_threads(threads)  # measured with one thread per rank; leave the caller's setting as it was
        if world is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _calibrate(opts: Options, world: World | None, *, started: float, writer: bool,
               log: Callable[[str], None] | None) -> Profile | None:
    import torch

    from ppsim.calibrate import comm

    rank, world_size = (world.rank, world.world_size) if world else (0, 1)
    if opts.device == "cuda":
        local = world.local_rank if world else 0
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")

    fresh = new_profile(opts, device=device, world_size=world_size, backend=world.backend if world else None)
    previous: Profile | None = None
    if writer and opts.resume:
        previous = resume_profile(opts, fresh, log=log or _stderr)
    recorder = Recorder(previous or fresh, opts.output, writer=writer)
    if world is not None:
        recorder.profile = _broadcast(recorder.profile)
    if recorder.profile.complete:
        if writer:
            (log or _stderr)(f"{opts.output} is already complete; nothing to resume")
        return recorder.profile if writer else None
    prior_wall = (recorder.profile.method.wall_s or 0.0) if recorder.profile.method else 0.0
    recorder.save()

    done = set(recorder.profile.done)
    todo = {s: [m for m in MEASUREMENTS if f"stage{s}.{m}" not in done] for s in range(opts.num_stages)}
    sizes = comm.p2p_sizes(opts.config.boundary_bytes)
    want_p2p = opts.p2p and "p2p" not in done
    with Progress(enabled=writer, log=log) as progress:
        mine = [s for s in range(opts.num_stages) if s % world_size == rank]
        tasks = {s: progress.add(f"stage {s}", sum(1 if m == "memory" else opts.reps for m in todo[s]))
                 for s in mine if todo[s]}
        p2p_task = progress.add("p2p", p2p_reps(opts.reps)) if want_p2p else None
        for round_start in range(0, opts.num_stages, world_size):
            stage = round_start + rank
            updates: list[tuple[str, int, dict[str, Any]]] = []
            if stage < opts.num_stages and todo[stage]:
                bench = _build_bench(opts, stage, device)
                for m in todo[stage]:
                    key = f"stage{stage}.{m}"
                    progress.describe(tasks[stage], f"stage {stage}: {m}")
                    fields = _measure(bench, m, opts, stage, tick=lambda s=stage: progress.advance(tasks[s]))
                    progress.finished(f"stage {stage} {m}: {_describe(fields)}")
                    if world is None:
                        recorder.apply(key, stage, fields)
                    else:
                        updates.append((key, stage, fields))
                del bench
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if world is not None:
                for other, batch in enumerate(_all_gather(updates)):
                    for key, s, fields in batch:
                        recorder.apply(key, s, fields)
                        if other != rank:
                            progress.finished(f"stage {s} {key.split('.')[1]} (rank {other}): {_describe(fields)}")
        notes = list(recorder.profile.notes)
        if want_p2p:
            tick = (lambda: progress.advance(p2p_task)) if p2p_task is not None else (lambda: None)
            result = _measure_p2p(opts, world, sizes, device, tick=tick, notes=notes)
            recorder.update(p2p=result, notes=tuple(notes))
            recorder.apply("p2p", None, {})
            if result is not None:
                progress.finished(f"p2p: alpha {result.alpha_s * 1e6:.1f} us, beta {result.beta_bytes_per_s / 1e9:.3g} "
                                  f"GB/s, fit error {result.fit_rel_error:.1%}")
        elif not opts.p2p and recorder.profile.p2p is None:
            note = "p2p not measured (--no-p2p): the simulator treats cross-rank hand-offs as free"
            if note not in notes:
                recorder.update(notes=(*notes, note))
    if not writer:
        return None
    method = dataclasses.replace(recorder.profile.method, wall_s=prior_wall + time.perf_counter() - started) \
        if recorder.profile.method else None
    recorder.update(complete=True, method=method)
    recorder.save()
    return recorder.profile


def _build_bench(opts: Options, stage: int, device: Any) -> Any:
    from ppsim.calibrate import harness

    try:
        return harness.StageBench(opts.config, opts.num_stages, stage, device=device, seed=opts.seed)
    except Exception as exc:
        if harness.is_oom(exc):
            raise harness.oom_error(opts.config, stage, "the weights") from None
        raise


def _measure(bench: Any, measurement: str, opts: Options, stage: int, *, tick: Callable[[], None]) -> dict[str, Any]:
    from ppsim.calibrate import harness

    try:
        if measurement == "timings":
            samples = bench.measure_timings(warmup=opts.warmup, reps=opts.reps, tick=tick)
            return {op: Stat.from_samples(values) for op, values in samples.items()}
        mem = bench.measure_memory()
        tick()
        return dataclasses.asdict(mem)
    except Exception as exc:
        if harness.is_oom(exc):
            raise harness.oom_error(opts.config, stage, measurement) from None
        raise


def _measure_p2p(opts: Options, world: World | None, sizes: list[int], device: Any, *,
                 tick: Callable[[], None], notes: list[str]) -> Any:
    import torch

    from ppsim.calibrate import comm

    if world is not None:
        result = comm.measure_pairs(world, sizes, warmup=opts.warmup, reps=p2p_reps(opts.reps), device=device,
                                    tick=tick)
        if result is not None:
            worst = max(result.pairs, key=lambda p: p.alpha_s + max(sizes) / p.beta_bytes_per_s)
            count = f"{len(result.pairs)} neighbouring rank pair" + ("s" if len(result.pairs) > 1 else "")
            notes.append(f"p2p measured under torchrun over {count} ({world.backend}); "
                         f"alpha and beta are the slowest pair's ({worst.src}->{worst.dst})")
        return result
    if opts.device == "cuda":
        if torch.cuda.device_count() < 2:
            notes.append("p2p not measured: one GPU and no torchrun; run under torchrun with 2+ ranks "
                         "(see docs/calibration.md) to measure it")
            return None
        backend = "nccl"
    else:
        backend = "gloo"
    result = comm.measure_local_pair(sizes, backend=backend, warmup=opts.warmup, reps=p2p_reps(opts.reps),
                                     timeout_s=opts.init_timeout_s, tick=tick)
    notes.append(f"p2p measured between two local {backend} processes on one host (no torchrun)")
    if result.fit_rel_error > 0.3:
        notes.append(f"p2p fit error {result.fit_rel_error:.0%}: timings were noisy (a busy machine?); "
                     "see p2p.samples")
    return result


def p2p_reps(reps: int) -> int:
    """Exchanges are cheap next to stage measurements: take at least 30 per size."""
    return max(reps, 30)


def _broadcast(profile: Profile) -> Profile:
    import torch.distributed as dist

    box = [profile]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- the profile as it grows ------------------------------------------------------------------------------------------
def new_profile(opts: Options, *, device: Any, world_size: int, backend: str | None) -> Profile:
    import torch

    from ppsim.calibrate import harness

    stages = []
    for s in range(opts.num_stages):
        st = harness.stage_static(opts.config, opts.num_stages, s)
        stages.append(StageProfile(
            stage=s, layers=st.layers, has_embedding=st.has_embedding, has_head=st.has_head,
            param_bytes=st.param_bytes, grad_bytes=st.grad_bytes, optimizer_bytes=st.optimizer_bytes,
            output_bytes=st.output_bytes,
        ))
    cuda = device.type == "cuda"
    return Profile(
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        device=opts.device,
        device_name=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        torch_version=torch.__version__,
        host=socket.gethostname(),
        world_size=world_size,
        backend=backend,
        model=ModelInfo(**opts.config.to_dict()),
        num_stages=opts.num_stages,
        stages=tuple(stages),
        p2p=None,
        complete=False,
        done=(),
        method=Method(warmup=opts.warmup, reps=opts.reps, timer="cuda_events" if cuda else "perf_counter",
                      threads_per_rank=None if cuda else 1),
        notes=(),
    )


def resume_profile(opts: Options, fresh: Profile, *, log: Callable[[str], None]) -> Profile | None:
    """The unfinished profile in ``opts.output`` if it was measured with the same options."""
    if not opts.output.exists():
        log(f"--resume: {opts.output} does not exist yet; starting a new calibration")
        return None
    old = load_profile(opts.output, allow_incomplete=True)
    theirs = {"model": old.model, "stages": old.num_stages, "device": old.device,
              "warmup": old.method.warmup if old.method else None, "reps": old.method.reps if old.method else None}
    ours = {"model": fresh.model, "stages": fresh.num_stages, "device": fresh.device,
            "warmup": opts.warmup, "reps": opts.reps}
    diff = [k for k in ours if theirs[k] != ours[k]]
    if diff:
        k = diff[0]
        raise PPSimError(
            f"--resume: {opts.output} was measured with {k} {_show(theirs[k])}, not {_show(ours[k])}; "
            "repeat the original options, or drop --resume to start over"
        )
    return old


def _show(value: Any) -> str:
    if isinstance(value, ModelInfo):
        return ",".join(f"{k}={v}" for k, v in value.to_dict().items())
    return str(value)


class Recorder:
    """Holds the profile being measured; the writing rank saves it after every finished measurement."""

    def __init__(self, profile: Profile, path: Path, *, writer: bool) -> None:
        self.profile = profile
        self.path = path
        self.writer = writer

    def save(self) -> None:
        if self.writer:
            save_profile(self.profile, self.path)

    def update(self, **changes: Any) -> None:
        self.profile = dataclasses.replace(self.profile, **changes)

    def apply(self, key: str, stage: int | None, fields: dict[str, Any]) -> None:
        stages = self.profile.stages
        if stage is not None:
            stages = tuple(dataclasses.replace(st, **fields) if st.stage == stage else st for st in stages)
        self.update(stages=stages, done=(*self.profile.done, key))
        self.save()


# --- output ----------------------------------------------------------------------------------------------------------
class Progress:
    """rich progress bars on a terminal; one line per finished measurement otherwise (logs, CI, Slurm)."""

    def __init__(self, *, enabled: bool, log: Callable[[str], None] | None) -> None:
        self.enabled = enabled
        self.log = log or _stderr
        self.bars: Any = None
        if enabled and log is None:
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress

                self.bars = RichProgress(
                    TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console,
                )

    def __enter__(self) -> Progress:
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bars is not None:
            self.bars.stop()

    def add(self, description: str, total: int) -> Any:
        return self.bars.add_task(description, total=total) if self.bars is not None else None

    def describe(self, task: Any, description: str) -> None:
        if self.bars is not None and task is not None:
            self.bars.update(task, description=description)

    def advance(self, task: Any) -> None:
        if self.bars is not None and task is not None:
            self.bars.advance(task)

    def finished(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bars is not None:
            self.bars.console.log(line)
        else:
            self.log(line)


def _describe(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if isinstance(value, Stat):
            parts.append(f"{key} {_ms(value.median)} (p10-p90 {value.p10 * 1e3:.3g}-{value.p90 * 1e3:.3g})")
        elif key == "activation_bytes" or (key == "activation_bytes_freed_by_I" and value is not None):
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def print_summary(profile: Profile) -> None:
    from rich.console import Console
    from rich.table import Table

    from ppsim.io import fmt_bytes

    wall = profile.method.wall_s if profile.method else None
    table = Table(title=f"{profile.num_stages} stages of the {profile.model.preset} model on {profile.device_name}"
                  + (f" ({wall:.1f} s)" if wall is not None else "") + "; ms: median \\[p10-p90]")
    for col in ("stage", "F", "B", "I", "W", "FB", "activations", "freed by I"):
        table.add_column(col, justify="right")
    for st in profile.stages:
        cells = []
        for op in ("F", "B", "I", "W", "FB"):
            stat = getattr(st, op)
            cells.append("-" if stat is None else f"{stat.median * 1e3:.3g} [{stat.p10 * 1e3:.3g}-{stat.p90 * 1e3:.3g}]"
                         .replace("[", "\\["))
        act, freed = st.activation_bytes, st.activation_bytes_freed_by_I
        table.add_row(str(st.stage), *cells, "-" if act is None else fmt_bytes(act),
                      "-" if freed is None else fmt_bytes(freed))
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=130)
    console.print(table)
    if profile.p2p is not None:
        p = profile.p2p
        console.print(f"p2p: alpha {p.alpha_s * 1e6:.1f} us, beta {p.beta_bytes_per_s / 1e9:.3g} GB/s "
                      f"(fit error {p.fit_rel_error:.1%})")
    for note in profile.notes:
        console.print(f"note: {note}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _check_writable(path: Path) -> None:
    from ppsim.io import check_writable

    check_writable(path, example="profile.json")
    if path.suffix.lower() != ".json":
        raise PPSimError(f"-o {path}: a profile is JSON; use a name ending in .json")
