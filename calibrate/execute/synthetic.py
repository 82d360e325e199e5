"""Synthetic stages: real boundary tensors, computations that sleep their cost.

Each stage is a tiny differentiable module (a token embedding on the first stage, an element-wise affine map with a
tanh on every stage, a small LM head on the last) whose boundary tensors keep the model's ``(mb_size, seq_len,
hidden)`` shape, so communication is real. Every computation sleeps until its cost has elapsed since it started: its
duration is the cost, its gradients stay exact, and sleeping ranks need no core, so more ranks than cores work.

torch is imported inside the functions only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ppsim.limits import MAX_SLEEP_S

if TYPE_CHECKING:
    from ppsim.calibrate.models.transformer import ModelConfig
    from ppsim.costs import StageCosts
    from ppsim.ir import Schedule

SYNTHETIC_VOCAB = 32
_CLASS: type | None = None


def stage_class() -> type:
    """The synthetic stage module class (built on first use, so importing this module needs no torch)."""
    global _CLASS
    if _CLASS is None:
        import torch
        from torch import nn

        class SyntheticStage(nn.Module):
            def __init__(self, config: Any, stage: int, num_stages: int, *, seed: int) -> None:
                super().__init__()
                gen = torch.Generator().manual_seed(seed * 1_000_003 + 17 * stage + 1)
                hidden = config.hidden
                self.embedding = (
                    nn.Parameter(torch.randn(config.vocab, hidden, generator=gen)) if stage == 0 else None
                )
                self.scale = nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=gen))
                self.shift = nn.Parameter(0.1 * torch.randn(hidden, generator=gen))
                self.head = (
                    nn.Parameter(torch.randn(config.vocab, hidden, generator=gen) / math.sqrt(hidden))
                    if stage == num_stages - 1
                    else None
                )

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.embedding is not None:
                    x = self.embedding[x]
                x = torch.tanh(x * self.scale + self.shift)
                if self.head is not None:
                    x = x @ self.head.t()
                return x

        _CLASS = SyntheticStage
    return _CLASS


def synthetic_model(model: ModelConfig, num_stages: int) -> ModelConfig:
    """Shapes of the synthetic stages for ``model``: same boundary tensor, a small vocabulary, no layers to split."""
    return model.replace(
        preset="synthetic", heads=1, ffn=1, layers=num_stages, vocab=min(model.vocab, SYNTHETIC_VOCAB)
    )


def sleep_plan(schedule: Schedule, durations: Callable[[Any], tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """Per rank, the duration of each computation in execution order; ``durations(action)`` gives the durations of
    an action's computations (one for a single computation, forward and backward halves for a pair)."""
    plan: list[tuple[float, ...]] = []
    for row in schedule.actions:
        values: list[float] = []
        for action in row:
            parts = durations(action)
            assert len(parts) == len(action.computations)
            values.extend(parts)
        plan.append(tuple(values))
    return tuple(plan)


def cost_plan(schedule: Schedule, costs: StageCosts, time_scale: float) -> tuple[tuple[float, ...], ...]:
    """Per rank, the op cost in seconds of each computation in execution order (a pair's halves split in the cost
    model's forward share). Runtime overheads are not in it: a synthetic stage sleeps the op cost only."""

    def durations(action: Any) -> tuple[float, ...]:
        if action.sub_actions:
            f, b = action.sub_actions
            total, share = costs.pair_split(schedule, f.stage, b.stage, b.type)
            return (total * share * time_scale, total * (1 - share) * time_scale)
        return (costs.op_cost(schedule, action.stage, action.type) * time_scale,)

    return sleep_plan(schedule, durations)


def check_plan(plan: tuple[tuple[float, ...], ...], what: str) -> None:
    """Refuse sleeps that are not finite or longer than :data:`MAX_SLEEP_S` (one line, before any process starts)."""
    from ppsim.errors import PPSimError

    worst = max((x for row in plan for x in row), default=0.0)
    if not math.isfinite(worst) or worst > MAX_SLEEP_S:
        raise PPSimError(
            f"{what}: a synthetic computation would sleep {worst:g} s; the limit is {MAX_SLEEP_S:g} s per "
            "computation; use smaller costs or a smaller --time-unit"
        )
