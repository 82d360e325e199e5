"""`simulate`/`plot`/`report --torchtitan-config MODULE:CONFIG`: the job's shapes, read once per command
(:class:`JobShapesOnce`, from :mod:`ppsim.calibrate.torchtitan.shapes`), each PP rank's memory for the whole job
(:func:`ppsim.job.memory.job_memory`) put into the simulated step (:func:`ppsim.job.memory.with_job_memory`), so
the table, the JSON, the figure and the verdict read one count; and the table that prints it. Needs no profile;
the step time does."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer

from ppsim.errors import DegreesError, JobMemoryError, PPSimError
from ppsim.job.degrees import Degrees
from ppsim.job.memory import PARTS, JobShapes, RankMemory, fmt_gib

if TYPE_CHECKING:
    from ppsim.cli.common import Inputs
    from ppsim.job.cache import JobCache
    from ppsim.result import SimResult


def job_config_context(torchtitan_config: object) -> Any:
    """Reading a config function with its hardware-bound converters set aside (their notes go on stderr)."""
    from ppsim.job.settings import is_registry_name

    if torchtitan_config is None or not is_registry_name(str(torchtitan_config)):
        return nullcontext()
    return _quiet_converters()


@contextmanager
def _quiet_converters() -> Iterator[None]:
    try:
        from ppsim.calibrate.torchtitan.config import converters_set_aside
    except ImportError:  # torchtitan missing: the job loader says so
        yield
        return
    with converters_set_aside():
        yield


@dataclass
class JobShapesOnce:
    """A config function's job shapes, built on first use and kept for the command (the step's FSDP collectives and
    the memory both read them)."""

    value: str
    overrides: tuple[str, ...]
    profile: Any = None
    cache: JobCache | None = None
    microbatch_size: int | None = None
    """Sequences per microbatch (the job's: without a pipeline, its local batch)."""
    _built: tuple[JobShapes, Degrees] | None = field(default=None, init=False, repr=False)

    def get(self) -> tuple[JobShapes, Degrees]:
        if self._built is None:
            self._built = self._cached() or self._build()
        return self._built

    def _cached(self) -> tuple[JobShapes, Degrees] | None:
        """From the job cache (:mod:`ppsim.job.cache`; keyed by the profile's bytes too), built there on a miss."""
        from ppsim.job.cache import torchtitan_owns

        if self.cache is None or not torchtitan_owns(self.value.split(":", 1)[0]):
            return None
        import hashlib
        import pickle

        try:
            profile = hashlib.sha256(pickle.dumps(self.profile)).hexdigest()
        except Exception:  # noqa: BLE001 -- a profile that does not pickle is read without the cache
            return None
        key = self.cache.key("shapes", job=self.value, overrides=list(self.overrides), profile=profile,
                             microbatch=self.microbatch_size)
        return self.cache.get_or_build("shapes", key, self._build)

    def _build(self) -> tuple[JobShapes, Degrees]:
        return _build_shapes(self.value, self.overrides, profile=self.profile, microbatch_size=self.microbatch_size)


def job_shapes_of(inputs: Inputs, torchtitan_config: object, overrides: Sequence[str]) -> JobShapesOnce | None:
    """The job's shapes (``None`` for a TOML job, whose model is not built, or a job without stage modules)."""
    from ppsim.job.settings import is_registry_name

    job = inputs.job
    if job is None or job.stage_modules is None or not is_registry_name(str(torchtitan_config)):
        return None
    return JobShapesOnce(str(torchtitan_config), tuple(overrides), inputs.cost_model.profile, inputs.job_cache,
                         job.microbatch_size)


def job_memory_of(inputs: Inputs, result: SimResult, shapes: JobShapesOnce | None, cap: int | None,
                  *, say: bool = True, allocator: str | None = None) -> list[RankMemory] | None:
    """Each PP rank's memory for a config function's job (``None`` for a TOML job: its model is not built)."""
    job = inputs.job
    if shapes is None or job is None or job.stage_modules is None:
        return None
    from ppsim.job.memory import job_memory

    try:
        job_shapes, degrees = shapes.get()
    except JobMemoryError as exc:
        if cap is not None or isinstance(exc, DegreesError):  # a verdict was asked for, or a mistake: say why
            raise
        typer.echo(f"memory: not counted, and the step has no FSDP or EP collectives (they need the job's shapes): "
                   f"{exc}", err=True)
        return None
    if say:
        _say_what_is_counted(inputs, result, job_shapes, degrees)
    mode = check_allocator(allocator)
    memory = job_memory(job_shapes, degrees=degrees, schedule=result.schedule, stage_modules=job.stage_modules,
                        recompute=result.recompute, cap_bytes=cap, with_events=mode is not None)
    if mode is None:
        return memory
    import dataclasses

    from ppsim.job.outside import check_cap_above_outside, reserved_per_rank

    reserved = reserved_per_rank(job_shapes, degrees=degrees, schedule=result.schedule,
                                 stage_modules=job.stage_modules, recompute=result.recompute, mode=mode, cap_bytes=cap,
                                 events=[m.events for m in memory])
    check_cap_above_outside(reserved)
    if say:
        for note in reserved[0].notes if reserved else ():
            typer.echo(f"memory: {note}", err=True)
        typer.echo(f"memory: reserved replays the caching allocator ({mode} segments); outside it: the CUDA context "
                   "and NCCL's buffers per communicator, stated defaults (docs/memory.md)", err=True)
    return [dataclasses.replace(m, reserved=r) for m, r in zip(memory, reserved)]


def check_allocator(mode: str | None) -> str | None:
    """``--allocator``'s value checked (one line naming the modes); ``None``: no replay (``none``; plot, report),
    the verdict on the tensors' peak."""
    if mode is None:
        return None
    from ppsim.job.allocator import MODES

    mode = mode.strip().lower()  # any case, as schedule and preset names
    if mode == "none":
        return None
    if mode not in MODES:
        raise JobMemoryError(f"--allocator {mode}: one of {', '.join(MODES)} (expandable: "
                             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan launches), or none "
                             "(the tensors' peak alone)")
    return mode


def _say_what_is_counted(inputs: Inputs, result: SimResult, shapes: JobShapes, degrees: Degrees) -> None:
    for note in shapes.notes:
        typer.echo(f"memory: {note}", err=True)
    typer.echo(f"memory: counts pp {degrees.pp} x tp {degrees.tp} x dp_shard {degrees.dp_shard} x dp_replicate "
               f"{degrees.dp_replicate}" + (f" x cp {degrees.cp}" if degrees.cp > 1 else "")
               + (f", ep {degrees.ep} carved out of dp_shard x cp x tp" if degrees.ep > 1 else "")
               + f" ({degrees.world_size} devices; the step time is the pipeline's, with FSDP's "
               "exposed collectives where a profile times it"
               + ("; EP's all-to-alls in it, exposed where no overlapped F&B pair hides them" if degrees.ep > 1
                  else "") + "); "
               f"parameters {shapes.master_dtype}, gathered {shapes.param_dtype}, gradients reduced in "
               f"{shapes.reduce_dtype}" + ("" if inputs.cost_model.profile is not None else
                                           "; activations from the formula (no --profile)"), err=True)
    if not result.costs.has_memory and inputs.cost_model.profile is None:
        typer.echo("memory: no --profile, so the step time above uses unit costs (F=1, B=2): memory needs only "
                   "the shapes, the step time needs `ppsim calibrate`'s profile", err=True)


def with_job(results: list[SimResult], inputs: Inputs, shapes: JobShapesOnce | None,
             cap: int | None, *, allocator: str | None = None) -> tuple[list[SimResult], list[RankMemory] | None]:
    """``results`` with a config function's job memory in each (the first one's memory returned for its table;
    ``allocator``: the caching allocator's mode to replay for the verdict, ``None`` none); unchanged for any other
    job."""
    from ppsim.job.memory import with_job_memory

    first: list[RankMemory] | None = None
    out = []
    for i, result in enumerate(results):
        memory = job_memory_of(inputs, result, shapes, cap, say=i == 0, allocator=allocator)
        if memory is None:
            return results, None
        first = first if first is not None else memory
        out.append(with_job_memory(result, memory))
    if inputs.job_cache is not None and inputs.job_cache.warning:
        typer.echo(f"warning: {inputs.job_cache.warning}", err=True)
    return out, first


def _build_shapes(value: str, overrides: tuple[str, ...], *, profile: Any,
                  microbatch_size: int | None = None) -> tuple[JobShapes, Degrees]:
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes

    with _quiet_converters():
        settings = read_job_settings(value, overrides)
    try:
        return job_shapes(value, settings, profile=profile, microbatch_size=microbatch_size)
    except (PPSimError, KeyboardInterrupt):
        raise
    except Exception as exc:  # torchtitan's own refusal of this model or these degrees
        raise JobMemoryError(f"--torchtitan-config {value}: torchtitan could not build and shard the job's model on "
                             f"the meta device ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"
                             "); change the degrees it names") from None


def with_memory(per_run: dict[str, Any], memory: list[RankMemory] | None) -> dict[str, Any]:
    """``simulate --json``'s dict with each rank's parts, fit and high point from the job's shapes (its
    ``peak_memory_bytes`` is already the same count: :func:`with_job`)."""
    if memory is None:
        return per_run
    for row, mem in zip(per_run["per_rank"], memory):
        assert row["peak_memory_bytes"] == mem.peak_memory_bytes, "one count of the job's memory"
        res = mem.reserved
        row.update(memory_parts=dict(mem.parts), fits=mem.fits,
                   memory_during=mem.during, memory_verdict=mem.verdict() or None, memory_held=dict(mem.static_bytes),
                   reserved_peak_bytes=None if res is None else res.reserved_peak_bytes,
                   outside_allocator_bytes=None if res is None else res.outside_allocator_bytes)
        if res is not None:
            row.update(allocator=res.trace.to_dict(), outside_allocator=res.outside.to_dict())
    return per_run


def print_memory(memory: list[RankMemory] | None, cap_text: str | None, cap: int | None) -> None:
    if memory is None:
        return
    from rich.table import Table

    from ppsim.cli.common import console

    read = "" if cap is None else f" — cap {cap_text} read as {cap} bytes ({fmt_gib(cap)})"
    table = Table(title=f"memory per PP rank (GiB) at its high point{read}")
    replayed = any(m.reserved is not None for m in memory)
    extra = ("reserved", "outside") if replayed else ()
    for col in ("rank", *PARTS, "peak", *extra, "during", "verdict"):
        table.add_column(col, justify="left" if col in ("during", "verdict") else "right")
    for m in memory:
        said = m.verdict() or "-"
        res = m.reserved
        cells = () if not replayed else (("-", "-") if res is None else
                                         (f"{res.reserved_peak_bytes / 2**30:.2f}",
                                          f"{res.outside_allocator_bytes / 2**30:.2f}"))
        fits = m.fits if res is None else res.fits
        table.add_row(str(m.rank), *(f"{m.parts[p] / 2**30:.2f}" for p in PARTS), f"{m.peak_memory_bytes / 2**30:.2f}",
                      *cells, m.during, f"[bold red]{said}[/]" if fits is False else said)
    console().print(table)
