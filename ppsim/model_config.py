"""The model a profile describes: shapes of a decoder-only transformer, as plain data (no torch).

One dataclass for every user: ``ppsim calibrate`` builds its torch modules from it, a profile stores it as its
``model`` object, and the stage composition (:mod:`ppsim.split`) reads its layer count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ppsim.errors import PPSimError
from ppsim.limits import MAX_MODEL_DIM, MAX_MODEL_LAYERS

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each dtype a model may use."""
MODEL_FIELDS = ("hidden", "heads", "ffn", "layers", "vocab", "seq_len", "mb_size")
MODEL_KEYS = ("preset", *MODEL_FIELDS, "dtype")
"""Keys of the profile's ``model`` object, in order."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model; ``preset`` names where they came from (``custom`` when options changed a preset).

    ``seq_len`` x ``mb_size`` tokens make one microbatch.
    """

    preset: str
    hidden: int
    heads: int
    ffn: int
    layers: int
    vocab: int
    seq_len: int
    mb_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in MODEL_FIELDS:
            value = getattr(self, name)
            opt = name.replace("_", "-")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PPSimError(f"--{opt} {value!r}: must be a positive integer; e.g. --{opt} {TINY_VALUES[name]}")
            if value > MAX_MODEL_DIM:
                raise PPSimError(f"--{opt} {_short(value)}: more than {MAX_MODEL_DIM:,}, the largest size torch can "
                                 f"index; e.g. --{opt} {TINY_VALUES[name]}")
        if self.layers > MAX_MODEL_LAYERS:
            raise PPSimError(f"--layers {self.layers:,}: more than {MAX_MODEL_LAYERS:,} layers, beyond any model "
                             f"(ppsim keeps an entry per layer); e.g. --layers {TINY_VALUES['layers']}")
        if self.hidden % self.heads:
            raise PPSimError(
                f"--hidden {self.hidden} with --heads {self.heads}: hidden must be divisible by heads; "
                f"e.g. --heads {_divisor_near(self.hidden, self.heads)}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise PPSimError(f"--dtype {self.dtype!r}: unknown dtype; use one of {', '.join(DTYPE_BYTES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def boundary_shape(self) -> tuple[int, int, int]:
        """Shape of the activation passed between stages for one microbatch."""
        return (self.mb_size, self.seq_len, self.hidden)

    @property
    def boundary_bytes(self) -> int:
        return self.mb_size * self.seq_len * self.hidden * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        """The profile's ``model`` object."""
        return {key: getattr(self, key) for key in MODEL_KEYS}

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


TINY_VALUES = {"hidden": 128, "heads": 4, "ffn": 352, "layers": 8, "vocab": 1024, "seq_len": 128, "mb_size": 4}

PRESETS: dict[str, ModelConfig] = {
    # Calibrates on a 2-core CPU in well under a minute.
    "tiny": ModelConfig(preset="tiny", dtype="float32", **TINY_VALUES),
    # Layer shapes of Llama-3.2-1B-class models (full multi-head attention; no grouped KV heads).
    "1b": ModelConfig(
        preset="1b", hidden=2048, heads=32, ffn=8192, layers=16, vocab=128256, seq_len=2048, mb_size=1,
        dtype="bfloat16",
    ),
    # Layer shapes of Llama-3-8B-class models.
    "8b": ModelConfig(
        preset="8b", hidden=4096, heads=32, ffn=14336, layers=32, vocab=128256, seq_len=4096, mb_size=1,
        dtype="bfloat16",
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise PPSimError(f"--preset {name!r}: unknown preset; use one of {', '.join(PRESETS)}") from None


def _divisor_near(n: int, target: int, *, window: int = 4096) -> int:
    """A divisor of ``n`` near ``target`` (the nearer, then the smaller), looked for within ``window`` of it: a
    hint, so bounded work even for a huge prime ``n`` (1 always divides)."""
    target = min(max(target, 1), n)
    for delta in range(window + 1):
        for d in (target - delta, target + delta):
            if 1 <= d <= n and n % d == 0:
                return d
    return 1


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layer ranges ``[first, last_exclusive)`` per stage, as even as possible; earlier stages take the extra
    layers (how version-1 profiles were measured; :mod:`ppsim.split` holds the split the simulator composes)."""
    if num_stages < 1:
        raise PPSimError(f"--stages {num_stages}: must be at least 1")
    if num_stages > num_layers:
        raise PPSimError(
            f"--stages {num_stages} with --layers {num_layers}: every stage needs at least one layer; "
            f"use --layers {num_stages} or more, or fewer stages"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges: list[tuple[int, int]] = []
    first = 0
    for s in range(num_stages):
        last = first + base + (1 if s < extra else 0)
        ranges.append((first, last))
        first = last
    return ranges
