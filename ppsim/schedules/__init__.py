"""The schedule library: one module per schedule, one registry.

Each module defines ``build(num_ranks, num_microbatches, num_stages_per_rank) -> Schedule`` and registers a
:class:`ScheduleSpec`. :func:`get_schedule` is the single entry point (case-insensitive names and aliases).
"""

from __future__ import annotations

import difflib
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ppsim.errors import ScheduleConfigError
from ppsim.ir import Schedule


@dataclass(frozen=True)
class ScheduleSpec:
    """A named schedule and what it can do.

    ``fixed_stages_per_rank`` is set for schedules whose placement fixes it (1 for GPipe/1F1B, 2 for V shapes and
    DualPipe); otherwise ``default_stages_per_rank`` applies and ``-v`` may change it (``min_stages_per_rank``+).
    """

    name: str
    build: Callable[..., Schedule]
    """``build(num_ranks, num_microbatches, num_stages_per_rank)``; registered, it checks the sizes first."""
    description: str
    constraints: str
    fixed_stages_per_rank: int | None = None
    default_stages_per_rank: int = 1
    min_stages_per_rank: int = 1
    aliases: tuple[str, ...] = ()
    torch_name: str | None = None
    """Name of the torch.distributed.pipelining schedule whose compute-only order this equals, if any."""

    @property
    def stages_per_rank_text(self) -> str:
        if self.fixed_stages_per_rank is not None:
            return str(self.fixed_stages_per_rank)
        return f">={self.min_stages_per_rank} (default {self.default_stages_per_rank})"


_REGISTRY: dict[str, ScheduleSpec] = {}
_Build = TypeVar("_Build", bound=Callable[..., Schedule])


def paused_gc(build: _Build) -> _Build:
    """Run a schedule builder with the cyclic garbage collector paused.

    A build allocates up to millions of Actions, none of them part of a reference cycle; the collector's repeated
    passes over them cost about a third of the build time.
    """

    @functools.wraps(build)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return build(*args, **kwargs)
        gc.disable()
        try:
            return build(*args, **kwargs)
        finally:
            gc.enable()

    return run  # type: ignore[return-value]



def checked_sizes(spec: ScheduleSpec, build: _Build) -> _Build:
    """``build`` refusing counts no schedule can use and a stages-per-rank ``spec`` does not allow: the one place
    sizes are checked (builders assume them)."""

    @functools.wraps(build)
    def run(num_ranks: int, num_microbatches: int, num_stages_per_rank: int | None = None) -> Schedule:
        if num_ranks < 1:
            raise ScheduleConfigError(f"--ranks {num_ranks}: {spec.name} needs at least 1 rank; pass -r 1 or more")
        if num_microbatches < 1:
            raise ScheduleConfigError(
                f"--mb {num_microbatches}: {spec.name} needs at least 1 microbatch; pass -m 1 or more"
            )
        return build(num_ranks, num_microbatches, resolve_stages_per_rank(spec, num_stages_per_rank))

    return run  # type: ignore[return-value]


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule to the registry; its builder checks sizes first and runs with the garbage collector paused."""
    spec = replace(spec, build=checked_sizes(spec, paused_gc(spec.build)))
    for key in (spec.name, *spec.aliases):
        assert key.lower() not in _REGISTRY, f"schedule name {key} registered twice"
        _REGISTRY[key.lower()] = spec
    return spec


def all_specs() -> list[ScheduleSpec]:
    """Every registered schedule once, in registration order."""
    _load_modules()
    seen: dict[str, ScheduleSpec] = {}
    for spec in _REGISTRY.values():
        seen.setdefault(spec.name, spec)
    return list(seen.values())


def get_spec(name: str) -> ScheduleSpec:
    _load_modules()
    spec = _REGISTRY.get(name.lower())
    if spec is None:
        names = [s.name for s in all_specs()]
        close = difflib.get_close_matches(name, names + [a for s in all_specs() for a in s.aliases], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ScheduleConfigError(
            f"unknown schedule {name!r}: {hint}choose one of {', '.join(names)} (see `ppsim list`) or pass a .csv file"
        )
    return spec


def resolve_stages_per_rank(spec: ScheduleSpec, num_stages_per_rank: int | None) -> int:
    """The stages per rank to build with, refusing a value the schedule cannot use."""
    if spec.fixed_stages_per_rank is not None:
        if num_stages_per_rank is not None and num_stages_per_rank != spec.fixed_stages_per_rank:
            raise ScheduleConfigError(
                f"--stages-per-rank {num_stages_per_rank}: {spec.name} always places "
                f"{spec.fixed_stages_per_rank} stage(s) per rank; drop -v or pass -v {spec.fixed_stages_per_rank}"
            )
        return spec.fixed_stages_per_rank
    v = spec.default_stages_per_rank if num_stages_per_rank is None else num_stages_per_rank
    if v < spec.min_stages_per_rank:
        raise ScheduleConfigError(
            f"--stages-per-rank {v}: {spec.name} needs at least {spec.min_stages_per_rank} stages per rank; "
            f"pass -v {spec.min_stages_per_rank} or more"
        )
    return v


def get_schedule(
    name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int | None = None
) -> Schedule:
    """Build a named schedule for ``num_ranks`` ranks and ``num_microbatches`` microbatches per step."""
    return get_spec(name).build(num_ranks, num_microbatches, num_stages_per_rank)


_LOADED = False


def _load_modules() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from ppsim.schedules import (  # noqa: F401  (import registers)
        dualpipe,
        dualpipev,
        gpipe,
        interleaved_1f1b,
        interleaved_zero_bubble,
        looped_bfs,
        one_f_one_b,
        v_half,
        v_min,
        zbh,
        zbv,
    )


def load_schedule(
    name_or_path: str,
    num_ranks: int | None,
    num_microbatches: int | None,
    num_stages_per_rank: int | None = None,
    *,
    num_pipelines: int = 1,
    allow_large: bool = False,
) -> Schedule:
    """A schedule by registry name, or read from a torch CSV file (anything ending in ``.csv``).

    :func:`ppsim.schedules.loading.load_schedule`: work bounded by :mod:`ppsim.limits`, a file's sizes read from it,
    the file validated.
    """
    from ppsim.schedules.loading import load_schedule as load

    return load(
        name_or_path,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_stages_per_rank=num_stages_per_rank,
        num_pipelines=num_pipelines,
        allow_large=allow_large,
    )
