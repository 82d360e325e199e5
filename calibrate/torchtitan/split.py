"""torchtitan's own stage split and rank placement, where torchtitan is installed.

``ppsim.split`` reimplements torchtitan's rules in plain Python for installs without it; where torchtitan is
installed, the stages' module names come from its ``_get_pipeline_metadata`` / ``_generate_llm_fqn_per_model_part``
(or the job's ``module_fqns_per_model_part``) and the rank-to-stage mapping from
``_get_pp_rank_to_stage_indices_mapping`` (``torchtitan/distributed/pipeline_parallel.py``), so a torchtitan job is
cut and placed exactly as torchtitan cuts and places it. ``tests/job/test_titan_split.py`` pins that the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

from ppsim.errors import PPSimError
from ppsim.split import SplitError

TORCHTITAN_EXTRA = 'pip install "ppsim[torchtitan]"'


class TorchtitanMissingError(PPSimError):
    """torchtitan (the optional extra) is not installed."""


def import_torchtitan(what: str) -> ModuleType:
    """``torchtitan.distributed.pipeline_parallel``, or one line naming the extra to install."""
    try:
        from torchtitan.distributed import pipeline_parallel
    except ImportError as exc:
        raise TorchtitanMissingError(
            f"{what} needs torchtitan, which is not installed ({exc.name or exc}); {TORCHTITAN_EXTRA}"
        ) from None
    return pipeline_parallel


def stage_module_names(
    num_stages: int, num_layers: int, *, input_weight: int = 1, output_weight: int = 1
) -> tuple[tuple[str, ...], ...]:
    """Module names per stage as torchtitan's ``_generate_llm_fqn_per_model_part`` cuts an LLM."""
    pp = import_torchtitan("torchtitan's split")
    try:
        parts = pp._generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight, output_weight)
    except ValueError as exc:
        raise SplitError(f"{num_stages} stages for {num_layers} layers (embedding weighs {input_weight}, head "
                         f"{output_weight}): torchtitan refuses it ({exc}); use fewer stages") from None
    return tuple(tuple(part) for part in parts)


def pipeline_metadata(parallelism: Any, *, num_ranks: int, num_layers: int) -> tuple[int, int, int, int]:
    """``(num_virtual_stages, num_layers, input_weight, output_weight)`` from torchtitan's
    ``_get_pipeline_metadata`` for a ``ParallelismConfig`` (or anything with its pipeline fields)."""
    pp = import_torchtitan("torchtitan's split")
    dims = SimpleNamespace(pp=num_ranks)
    model = SimpleNamespace(layers=[None] * num_layers)
    try:
        return tuple(pp._get_pipeline_metadata(dims, parallelism, model))
    except ValueError as exc:
        raise SplitError(f"torchtitan refuses the pipeline: {str(exc).splitlines()[0]}") from None


def rank_stage_indices(schedule: str, *, num_ranks: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Stage indices per rank as torchtitan places them (``_get_pp_rank_to_stage_indices_mapping``) for a torch
    schedule name (``pipeline_parallel_schedule``)."""
    pp = import_torchtitan("torchtitan's stage placement")
    return tuple(tuple(pp._get_pp_rank_to_stage_indices_mapping(rank, num_ranks, schedule, num_stages))
                 for rank in range(num_ranks))


def layers_per_part(parts: Sequence[Sequence[str]]) -> tuple[int, ...]:
    """How many ``layers.N`` modules each part holds."""
    return tuple(sum(1 for name in part if name.startswith("layers.")) for part in parts)


def torch_schedule_names() -> tuple[str, ...]:
    """Every schedule name torch's ``get_schedule_class`` (which torchtitan uses) accepts, probed with the names
    ppsim maps plus torch's abstract CSV-only ones."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from ppsim.schedules import all_specs

    candidates = [s.torch_name for s in all_specs() if s.torch_name] + ["PipelineScheduleSingle",
                                                                        "PipelineScheduleMulti"]
    known = []
    for name in candidates:
        try:
            get_schedule_class(name)
        except ValueError:
            continue
        known.append(name)
    return tuple(known)
