"""How a model's layers are cut into pipeline stages: torchtitan's rules, reimplemented in plain Python.

A model is an embedding, ``L`` transformer layers and a head (final norm, LM head, loss). A *split* gives the number
of layers each of the ``S`` stages of one chain holds; stage 0 also holds the embedding and stage ``S - 1`` the head.

- **Default** (torchtitan's ``generate_llm_fqn_per_model_part``): the embedding weighs ``input_weight`` layers and
  the head ``output_weight`` layers (1 each by default). The ``L + input_weight + output_weight`` weighted layers are
  spread evenly over the stages, the first ``(L + iw + ow) % S`` stages taking one more; the first stage then gives
  ``input_weight`` of its share to the embedding and the last ``output_weight`` of its share to the head. With 8
  layers on 4 stages: weights ``3, 3, 2, 2`` -> layers ``2, 3, 2, 1``.
- **Layers per stage** ``K`` (torchtitan's ``pipeline_parallel_layers_per_stage``): ``S = ceil((L + iw + ow) / K)``,
  then the default spread; ``S`` must be the schedule's chain length.
- **Explicit** counts (``--split 3,4,4,3``): one count per stage, summing to ``L``; only the first and the last stage
  may hold no layer (embedding only, head only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ppsim.errors import CostError
from ppsim.limits import MAX_STAGES


class SplitError(CostError):
    """A split does not cover the model, or does not fit the schedule."""


@dataclass(frozen=True)
class SplitSpec:
    """What the user asked for: an explicit split, a layers-per-stage count, or neither (the default spread).

    ``input_weight`` / ``output_weight``: how many layers the embedding and the head count as (torchtitan's
    ``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers``, 1 by default).
    """

    split: tuple[int, ...] | None = None
    layers_per_stage: int | None = None
    input_weight: int = 1
    output_weight: int = 1

    def __post_init__(self) -> None:
        if self.split is not None and self.layers_per_stage is not None:
            raise SplitError(
                f"--split {format_split(self.split)} and --layers-per-stage {self.layers_per_stage} both given: "
                "each decides the split; pass only one"
            )
        if self.layers_per_stage is not None and not 1 <= self.layers_per_stage <= MAX_STAGES:
            raise SplitError(f"--layers-per-stage {self.layers_per_stage}: must be an integer in 1..{MAX_STAGES}; "
                             "e.g. --layers-per-stage 4")
        for name in ("input_weight", "output_weight"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_STAGES:
                raise SplitError(f"{name} {value}: must be an integer in 0..{MAX_STAGES}; torchtitan's default is 1")

    @property
    def is_default(self) -> bool:
        return self.split is None and self.layers_per_stage is None

    def describe(self) -> str:
        if self.split is not None:
            return f"explicit split {format_split(self.split)}"
        weights = f"embedding and head weigh {self.input_weight} and {self.output_weight} layers"
        if self.input_weight == self.output_weight == 1:
            weights = "embedding and head weigh one layer each"
        if self.layers_per_stage is not None:
            return f"torchtitan's split with {self.layers_per_stage} layers per stage ({weights})"
        return f"torchtitan's default split ({weights})"


def format_split(counts: Sequence[int]) -> str:
    return ",".join(str(c) for c in counts)


def parse_split(text: str) -> tuple[int, ...]:
    """``"3,4,4,3"`` -> ``(3, 4, 4, 3)``; anything else is one :class:`SplitError` line."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise SplitError(f"--split {text!r}: give one layer count per stage separated by commas, e.g. --split 3,4,4,3")
    if len(items) > MAX_STAGES:
        raise SplitError(f"--split lists {len(items)} stages, more than {MAX_STAGES}; give one count per stage")
    counts = []
    for item in items:
        if not (item.isascii() and item.isdigit()) or len(item) > 9:
            raise SplitError(f"--split {text if len(text) <= 60 else text[:57] + '...'!r}: {item[:20]!r} is not a "
                             "layer count (a whole number >= 0); e.g. --split 3,4,4,3")
        counts.append(int(item))
    return tuple(counts)


def default_split(
    num_layers: int, num_stages: int, *, input_weight: int = 1, output_weight: int = 1
) -> tuple[int, ...]:
    """Layers per stage as torchtitan spreads them (see the module docstring); one :class:`SplitError` line when
    the model cannot be cut into ``num_stages`` stages that way."""
    if num_stages < 1:
        raise SplitError(f"{num_stages} stages: a chain needs at least one stage")
    if num_stages == 1:
        return (num_layers,)
    weighted = num_layers + input_weight + output_weight
    base, extra = divmod(weighted, num_stages)
    what = (f"{num_layers} layers + embedding ({input_weight}) + head ({output_weight}) = {weighted} weighted layers")
    if base == 0:
        raise SplitError(f"{num_stages} stages for {what}: every stage needs at least one; "
                         f"use at most {weighted} stages or a model with more layers")
    if input_weight > base or output_weight > base:
        raise SplitError(f"{num_stages} stages for {what}: the embedding or head weighs more than the "
                         f"{base} layers a stage gets; use fewer stages or an explicit --split")
    shares = [base + (1 if s < extra else 0) for s in range(num_stages)]
    shares[0] -= input_weight
    shares[-1] -= output_weight
    return tuple(shares)


def stages_for_layers_per_stage(num_layers: int, layers_per_stage: int, *, input_weight: int = 1,
                                output_weight: int = 1) -> int:
    """torchtitan's stage count for ``pipeline_parallel_layers_per_stage``: ``ceil((L + iw + ow) / K)``."""
    return math.ceil((num_layers + input_weight + output_weight) / layers_per_stage)


def resolve_split(
    spec: SplitSpec, num_layers: int, num_stages: int, *, schedule: str = "the schedule"
) -> tuple[int, ...]:
    """Layer counts per stage for a chain of ``num_stages`` stages, from what the user asked."""
    if spec.split is not None:
        check_split(spec.split, num_layers)
        if len(spec.split) != num_stages:
            raise SplitError(
                f"--split {format_split(spec.split)} gives {len(spec.split)} stages but {schedule} has "
                f"{num_stages} stages per chain; give {num_stages} counts summing to {num_layers}, e.g. --split "
                f"{_example(num_layers, num_stages, spec)}"
            )
        return spec.split
    if spec.layers_per_stage is not None:
        weighted = num_layers + spec.input_weight + spec.output_weight
        derived = stages_for_layers_per_stage(num_layers, spec.layers_per_stage, input_weight=spec.input_weight,
                                              output_weight=spec.output_weight)
        if derived != num_stages:
            fits = [k for k in range(1, weighted + 1) if math.ceil(weighted / k) == num_stages]
            fix = (f"use --layers-per-stage {fits[0]}" + (f" (up to {fits[-1]})" if len(fits) > 1 else "")
                   if fits else "drop --layers-per-stage or pick a schedule with that many stages")
            raise SplitError(
                f"--layers-per-stage {spec.layers_per_stage} cuts {num_layers} layers + embedding + head "
                f"({weighted} weighted) into {derived} stages but {schedule} has {num_stages} stages per chain; {fix}"
            )
    return default_split(num_layers, num_stages, input_weight=spec.input_weight, output_weight=spec.output_weight)


def check_split(counts: Sequence[int], num_layers: int) -> None:
    """An explicit split must cover the model's layers exactly; a middle stage cannot be empty."""
    shown = format_split(counts)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if not counts:
        raise SplitError(f"--split is empty; give one layer count per stage summing to {num_layers}")
    if sum(counts) != num_layers:
        raise SplitError(
            f"--split {shown} covers {sum(counts)} layers but the model has {num_layers}; give counts summing to "
            f"{num_layers}, e.g. --split {_example(num_layers, len(counts), SplitSpec())}"
        )
    for i, c in enumerate(counts[1:-1], start=1):
        if c == 0:
            raise SplitError(f"--split {shown}: stage {i} holds no layer; only the first stage (embedding) and the "
                             "last (head) may be empty of layers")


def stage_blocks(layout: Sequence[str], counts: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """Block names per stage: ``layout`` is ``[embed, layer..., head]``; stage 0 adds the embedding, the last stage
    the head."""
    layers = list(layout[1:-1])
    if sum(counts) != len(layers):
        raise SplitError(f"split {format_split(counts)} covers {sum(counts)} layers but the profile has {len(layers)}")
    out: list[tuple[str, ...]] = []
    first = 0
    for s, c in enumerate(counts):
        names = layers[first:first + c]
        if s == 0:
            names = [layout[0], *names]
        if s == len(counts) - 1:
            names = [*names, layout[-1]]
        out.append(tuple(names))
        first += c
    return tuple(out)


def _example(num_layers: int, num_stages: int, spec: SplitSpec) -> str:
    try:
        return format_split(default_split(num_layers, num_stages, input_weight=spec.input_weight,
                                          output_weight=spec.output_weight))
    except SplitError:
        base, extra = divmod(num_layers, max(num_stages, 1))
        return format_split([base + (1 if s < extra else 0) for s in range(num_stages)])
