"""Numerics of a run: the non-pipelined reference and the tolerances the pipelined gradients must meet.

The reference is the unsplit model with the same weights (same seed) on the same batch, one microbatch at a time,
each microbatch's loss divided by the number of microbatches (what torch's runtime does with ``scale_grads``).

torch is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppsim.calibrate.models import ModelSource
    from ppsim.model_config import ModelConfig

#: Gradient tolerance: max |grad - grad_ref| over every parameter element must not exceed this fraction of the
#: largest reference gradient magnitude (float32; bfloat16/float16 models use the looser value).
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
#: Loss tolerance, relative to the reference loss.
LOSS_RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


@dataclass(frozen=True)
class ReferenceCheck:
    ref_loss: float
    grad_max_abs_diff: float
    grad_ref_max_abs: float
    num_params_checked: int


def stage_ranges(model: ModelConfig, num_stages: int, counts: Sequence[int] | None) -> list[tuple[int, int]]:
    """Layer ranges ``[first, last)`` per stage: from layer counts per stage (the split the prediction composed),
    or the even split of a version-1 profile."""
    if counts is None:
        from ppsim.model_config import split_layers

        return split_layers(model.layers, num_stages)
    ranges, first = [], 0
    for n in counts:
        ranges.append((first, first + n))
        first += n
    return ranges


def _source(model: ModelConfig, source: ModelSource | None) -> ModelSource:
    if source is not None:
        return source
    from ppsim.calibrate.models.builtin import source_for

    return source_for(model)


def stage_ids(model: ModelConfig, num_stages: int, stage: int, counts: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(range(*stage_ranges(model, num_stages, counts)[stage]))


def build_modules(model: ModelConfig, num_stages: int, stages: Sequence[int], *, synthetic: bool, seed: int,
                  device: Any, counts: Sequence[int] | None = None,
                  source: ModelSource | None = None) -> dict[int, Any]:
    """The stage modules one rank holds (same weights as :func:`build_reference`), built by the model source."""
    if synthetic:
        from ppsim.calibrate.execute.synthetic import stage_class
        from ppsim.calibrate.models.transformer import DTYPES

        cls = stage_class()
        return {s: cls(model, s, num_stages, seed=seed).to(device=device, dtype=DTYPES[model.dtype]) for s in stages}
    src = _source(model, source)
    return {
        s: src.build_stage(stage_ids(model, num_stages, s, counts), has_embedding=s == 0,
                           has_head=s == num_stages - 1, seed=seed, device=device)
        for s in stages
    }


def build_reference(model: ModelConfig, num_stages: int, *, synthetic: bool, seed: int, device: Any,
                    source: ModelSource | None = None) -> Any:
    """The unsplit model with the same weights as the stages."""
    if synthetic:
        import torch

        from ppsim.calibrate.execute.synthetic import stage_class
        from ppsim.calibrate.models.transformer import DTYPES

        cls = stage_class()
        return torch.nn.Sequential(*(cls(model, s, num_stages, seed=seed) for s in range(num_stages))).to(
            device=device, dtype=DTYPES[model.dtype]
        )
    return _source(model, source).build_full(seed=seed, device=device)


def reference_name(model: ModelConfig, num_stages: int, stage: int, local_name: str, *, synthetic: bool,
                   counts: Sequence[int] | None = None, source: ModelSource | None = None) -> str:
    """Name in :func:`build_reference`'s model of a stage module's parameter."""
    if synthetic:
        return f"{stage}.{local_name}"
    return _source(model, source).reference_name(stage_ids(model, num_stages, stage, counts), local_name)


def check_against_reference(model: ModelConfig, num_stages: int, num_microbatches: int, grads: dict[str, Any], *,
                            synthetic: bool, seed: int, device: Any,
                            source: ModelSource | None = None) -> ReferenceCheck:
    """Run the reference and compare ``grads`` (reference parameter name -> pipelined gradient, float32 on CPU)."""
    from ppsim.calibrate.models.transformer import loss_fn, make_batch

    ref = build_reference(model, num_stages, synthetic=synthetic, seed=seed, device=device, source=source)
    tokens, targets = make_batch(model, num_microbatches, seed=seed)
    return compare_with_reference(ref, loss_fn, tokens.to(device), targets.to(device), num_microbatches, grads,
                                  summed=False)


def compare_with_reference(ref: Any, loss_fn: Any, tokens: Any, targets: Any, num_microbatches: int,
                           grads: dict[str, Any], *, summed: bool) -> ReferenceCheck:
    """Run the unsplit model ``ref`` one microbatch at a time and compare its gradients with ``grads`` (reference
    parameter name -> pipelined gradient, float32 on CPU). ``summed``: each microbatch's loss backward unscaled (a
    schedule with ``scale_grads=False``, torchtitan's: the sum over microbatches); else scaled by 1/M (torch's
    default: the mean). ``ref_loss`` is the mean microbatch loss either way."""
    import torch

    m = num_microbatches
    losses = []
    for tok, tgt in zip(tokens.chunk(m), targets.chunk(m)):
        loss = loss_fn(ref(tok), tgt)
        (loss if summed else loss / m).backward()
        losses.append(float(loss.detach()))
    ref_grads = {n: p.grad.detach().to("cpu", torch.float32) for n, p in ref.named_parameters() if p.grad is not None}
    missing = sorted(set(ref_grads) ^ set(grads))
    if missing:
        raise RuntimeError(f"parameters without a pipelined or reference gradient: {missing[:5]} (ppsim bug)")
    diff = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    return ReferenceCheck(ref_loss=sum(losses) / m, grad_max_abs_diff=diff, grad_ref_max_abs=scale,
                          num_params_checked=len(ref_grads))
