"""Factories for `--model python:toy_factory:NAME` in tests/calibrate/test_models.py (run from tests/data)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, wide: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, wide)
        self.down = nn.Linear(wide, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Toy(nn.Module):
    """torchtitan's layout: tok_embeddings, layers, norm, lm_head; layer 2 is wider (a second kind)."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, 32), Block(dim, 32), Block(dim, 64), Block(dim, 32)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


class Named(nn.Module):
    """Other names, given explicitly by the factory."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.blocks = nn.Sequential(Block(16, 32), Block(16, 32))
        self.head = nn.Linear(16, 64)


def make_toy() -> nn.Module:
    return Toy()


def make_named() -> tuple[nn.Module, dict[str, str | None]]:
    return Named(), {"embedding": "wte", "layers": "blocks", "norm": None, "head": "head"}


def make_flat() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))


def make_number() -> int:
    return 3


NOT_CALLABLE = 42
