"""The builtin model (``--model builtin:NAME``): a decoder-only transformer of plain torch modules.

Embedding; ``layers`` blocks of (RMSNorm, causal self-attention via ``scaled_dot_product_attention``, RMSNorm,
SwiGLU MLP) with residuals; final RMSNorm and LM head. The loss (cross-entropy, mean) is applied outside the last
stage, as torch's pipeline runtime does with its ``loss_fn``.

Weights are seeded per component (embedding, each block, head), so a stage built alone and the unsplit model built
with the same seed hold identical weights, whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ppsim.errors import PPSimError
from ppsim.model_config import (  # noqa: F401 - re-exported: one model config for core and calibrate
    MODEL_FIELDS,
    PRESETS,
    TINY_VALUES,
    ModelConfig,
    get_preset,
    split_layers,
)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(config: ModelConfig) -> torch.dtype:
    return DTYPES[config.dtype]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden, config.ffn, bias=False)
        self.up = nn.Linear(config.hidden, config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class StageModule(nn.Module):
    """Layers ``[first, last)`` of the model; with the embedding if ``has_embedding`` (input: token ids
    ``(mb, seq)`` int64) and with final norm + LM head if ``has_head`` (output: logits ``(mb, seq, vocab)``)."""

    def __init__(
        self, config: ModelConfig, layers: tuple[int, int], *, has_embedding: bool, has_head: bool, seed: int = 0,
        layer_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_range = layers
        self.layer_ids = tuple(range(*layers)) if layer_ids is None else tuple(layer_ids)
        self.has_embedding = has_embedding
        self.has_head = has_head
        self.embedding = _seeded(seed, 0, lambda: nn.Embedding(config.vocab, config.hidden)) if has_embedding else None
        self.layers = nn.ModuleList(_seeded(seed, 1 + i, lambda: Block(config)) for i in self.layer_ids)
        if has_head:
            self.norm = _seeded(seed, config.layers + 1, lambda: nn.RMSNorm(config.hidden))
            self.head = _seeded(seed, config.layers + 2, lambda: nn.Linear(config.hidden, config.vocab, bias=False))
        else:
            self.norm = None
            self.head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _seeded(seed: int, component: int, make: Any) -> Any:
    """Build a module from its own RNG stream (seed, component) without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + component)
        module = make()
    if isinstance(module, nn.Embedding):
        with torch.no_grad():
            module.weight.mul_(0.02)  # N(0, 0.02): keeps the first residual stream small, like common LMs
    return module


def place_on_device(module: nn.Module, config: ModelConfig, device: str | torch.device) -> nn.Module:
    return module.to(device=torch.device(device), dtype=torch_dtype(config))


def build_stage(
    config: ModelConfig, num_stages: int, stage: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> StageModule:
    """Stage ``stage`` of ``num_stages`` alone (what one rank holds)."""
    ranges = split_layers(config.layers, num_stages)
    if not 0 <= stage < num_stages:
        raise PPSimError(f"stage {stage}: must be in 0..{num_stages - 1}")
    def make() -> StageModule:
        return StageModule(
            config, ranges[stage], has_embedding=stage == 0, has_head=stage == num_stages - 1, seed=seed
        )

    if torch.device(device).type == "meta":  # shapes only: skip allocation and initialisation
        with torch.device("meta"):
            return place_on_device(make(), config, device)  # type: ignore[return-value]
    return place_on_device(make(), config, device)  # type: ignore[return-value]


def build_stage_modules(
    config: ModelConfig, num_stages: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> list[torch.nn.Module]:
    """All stages of one model copy; stage 0 has the embedding, the last has final norm + LM head."""
    split_layers(config.layers, num_stages)  # raises before building anything
    return [build_stage(config, num_stages, s, seed=seed, device=device) for s in range(num_stages)]


def build_full_model(config: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The unsplit model with the same weights as :func:`build_stage_modules` (same seed)."""
    return build_stage(config, 1, 0, seed=seed, device=device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over all tokens (mean), computed in float32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_batch(config: ModelConfig, num_microbatches: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, ``(num_microbatches * mb_size, seq_len)`` int64 each, on CPU.

    torch's runtime splits dim 0 into ``num_microbatches`` chunks of ``mb_size``.
    """
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, config.vocab, (num_microbatches * config.mb_size, config.seq_len + 1), generator=gen)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def stage_input(
    config: ModelConfig, stage: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A representative input for one microbatch of ``stage``: token ids for stage 0, else a hidden state."""
    gen = torch.Generator().manual_seed(seed + 7919 * (stage + 1))
    if stage == 0:
        return torch.randint(0, config.vocab, (config.mb_size, config.seq_len), generator=gen).to(device)
    x = torch.randn(config.boundary_shape, generator=gen)
    return x.to(device=torch.device(device), dtype=torch_dtype(config))
