"""`simulate --torchtitan-config MODULE:CONFIG`: each PP rank's memory for the whole job (PP x FSDP x TP) from the
model's shapes (:mod:`ppsim.calibrate.torchtitan.shapes`, :func:`ppsim.memory.job_memory`), and the verdict per rank
against ``--memory-cap``. Needs no profile; the step time does."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import typer

from ppsim.errors import PPSimError
from ppsim.memory import PARTS, Degrees, DegreesError, JobMemoryError, JobShapes, RankMemory, fmt_gib

if TYPE_CHECKING:
    from ppsim.cli.common import Inputs
    from ppsim.result import SimResult


def job_config_context(torchtitan_config: object) -> Any:
    """Reading a config function with its hardware-bound converters set aside (their notes go on stderr)."""
    from ppsim.torchtitan import is_registry_name

    if torchtitan_config is None or not is_registry_name(str(torchtitan_config)):
        return nullcontext()
    return _quiet_converters()


@contextmanager
def _quiet_converters() -> Iterator[None]:
    try:
        from ppsim.calibrate.torchtitan.shapes import converters_set_aside
    except ImportError:  # torchtitan missing: the job loader says so
        yield
        return
    with converters_set_aside():
        yield


def job_memory_of(inputs: Inputs, result: SimResult, torchtitan_config: object, overrides: Sequence[str],
                  cap: int | None) -> list[RankMemory] | None:
    """Each PP rank's memory for a config function's job (``None`` for a TOML job: its model is not built)."""
    from ppsim.torchtitan import is_registry_name

    job = inputs.job
    if job is None or not is_registry_name(str(torchtitan_config)) or job.stage_modules is None:
        return None
    from ppsim.memory import job_memory

    try:
        shapes, degrees = _shapes_of(str(torchtitan_config), overrides, profile=inputs.cost_model.profile)
    except JobMemoryError as exc:
        if cap is not None or isinstance(exc, DegreesError):  # a verdict was asked for, or a mistake: say why
            raise
        typer.echo(f"memory: not counted: {exc}", err=True)
        return None
    for note in shapes.notes:
        typer.echo(f"memory: {note}", err=True)
    typer.echo(f"memory: counts pp {degrees.pp} x tp {degrees.tp} x dp_shard {degrees.dp_shard} x dp_replicate "
               f"{degrees.dp_replicate}" + (f" x cp {degrees.cp}" if degrees.cp > 1 else "")
               + (f", ep {degrees.ep} carved out of dp_shard x cp x tp" if degrees.ep > 1 else "")
               + f" ({degrees.world_size} devices; the step time is the pipeline's, with FSDP's "
               "exposed collectives where a profile times it); "
               f"parameters {shapes.master_dtype}, gathered {shapes.param_dtype}, gradients reduced in "
               f"{shapes.reduce_dtype}" + ("" if inputs.cost_model.profile is not None else
                                           "; activations from the formula (no --profile)"), err=True)
    if degrees.cp > 1:  # its FSDP sharding is counted (the dense mesh is dp_shard x cp), its activations not
        typer.echo(f"memory: parallelism.context_parallel_degree = {degrees.cp}: the dense weights are FSDP-sharded "
                   "on dp_shard x cp; the rank's activations are held for the whole sequence (an upper bound)",
                   err=True)
    if not result.costs.has_memory and inputs.cost_model.profile is None:
        typer.echo("memory: no --profile, so the step time above uses unit costs (F=1, B=2): memory needs only "
                   "the shapes, the step time needs `ppsim calibrate`'s profile", err=True)
    return job_memory(shapes, degrees=degrees, schedule=result.schedule, stage_modules=job.stage_modules,
                      recompute=result.recompute, cap_bytes=cap)


_SHAPES: dict[tuple[str, tuple[str, ...], int], tuple[JobShapes, Degrees]] = {}


def _shapes_of(value: str, overrides: Sequence[str], *, profile: Any = None) -> tuple[JobShapes, Degrees]:
    """The job's shapes, built once per command (the step's FSDP collectives and the memory both read them)."""
    key = (value, tuple(overrides), id(profile))
    if key not in _SHAPES:
        _SHAPES.clear()  # one job per command: keep only the latest
        _SHAPES[key] = _build_shapes(value, tuple(overrides), profile=profile)
    return _SHAPES[key]


def _build_shapes(value: str, overrides: tuple[str, ...], *, profile: Any) -> tuple[JobShapes, Degrees]:
    from ppsim.calibrate.torchtitan.shapes import job_shapes
    from ppsim.calibrate.torchtitan.config import read_job_settings

    with _quiet_converters():
        settings = read_job_settings(value, overrides)
    try:
        return job_shapes(value, settings, profile=profile)
    except (PPSimError, KeyboardInterrupt):
        raise
    except Exception as exc:  # torchtitan's own refusal of this model or these degrees
        raise JobMemoryError(f"--torchtitan-config {value}: torchtitan could not build and shard the job's model on "
                             f"the meta device ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                             "); change the degrees it names") from None


def with_memory(per_run: dict[str, Any], memory: list[RankMemory] | None) -> dict[str, Any]:
    """``simulate --json``'s dict with each rank's peak, parts and fit from the job's shapes."""
    if memory is None:
        return per_run
    for row, mem in zip(per_run["per_rank"], memory):
        row.update(peak_memory_bytes=mem.peak_memory_bytes, memory_parts=dict(mem.parts), fits=mem.fits,
                   memory_during=mem.during, memory_verdict=mem.verdict() or None,
                   memory_held=dict(mem.static_bytes))
    return per_run


def print_memory(memory: list[RankMemory] | None, cap_text: str | None, cap: int | None) -> None:
    if memory is None:
        return
    from rich.table import Table

    from ppsim.cli.common import console

    read = "" if cap is None else f" — cap {cap_text} read as {cap} bytes ({fmt_gib(cap)})"
    table = Table(title=f"memory per PP rank (GiB) at its high point{read}")
    for col in ("rank", *PARTS, "peak", "during", "verdict"):
        table.add_column(col, justify="left" if col in ("during", "verdict") else "right")
    for m in memory:
        verdict = m.verdict() or "-"
        table.add_row(str(m.rank), *(f"{m.parts[p] / 2**30:.2f}" for p in PARTS), f"{m.peak_memory_bytes / 2**30:.2f}",
                      m.during, f"[bold red]{verdict}[/]" if m.fits is False else verdict)
    console().print(table)
