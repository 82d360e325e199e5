"""How fast this device multiplies matrices in the calibration's dtype: the speed the calibration's estimate uses.

A dtype's speed is not a constant of the device kind: a CPU without AVX512-BF16 or AMX runs a bfloat16 matmul on a
scalar path about 100x slower than float32 (an AMD EPYC: a 32 x 8192 @ 8192 x 8192 product in 15 s against 0.17 s),
so an estimate from a fixed FLOP rate is wrong by that much. Before estimating, :func:`measure_speed` times one small
product of the model's shape (the microbatch's tokens by the hidden size, a few columns; well under a second) in the
chosen dtype, and in float32 where that differs, on the chosen device and with the calibration's threads (one on CPU).

torch is imported inside the functions only.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from ppsim.model_config import ModelConfig

BUDGET_S = 0.04
"""How long the timed product should take (the best of three, after a short product that sizes it)."""
ACHIEVED = 0.5
"""The share of the matmul speed a calibration achieves over its whole work (attention, element-wise ops, autograd;
the builtin 1b model at 1x64 in bfloat16, 16 layers: measured 114 s where 3.5e12 FLOPs at the probe's 70 GFLOP/s
would be 50 s, on a busy 2-core host)."""
SLOW_RATIO = 5.0
"""A dtype this many times slower than float32 on the device gets a warning."""
MAX_ROWS = {"cpu": 256, "cuda": 4096}
MAX_COLS = {"cpu": 4096, "cuda": 8192}


@dataclass(frozen=True)
class MatmulSpeed:
    """The measured matmul speed of ``dtype`` on ``device`` (and float32's, where ``dtype`` is another)."""

    device: str
    dtype: str
    flops_per_s: float
    float32_flops_per_s: float | None = None

    @property
    def work_flops_per_s(self) -> float:
        """The speed the estimate divides the calibration's FLOPs by (:data:`ACHIEVED` of the matmul's)."""
        return ACHIEVED * self.flops_per_s

    @property
    def slowdown(self) -> float:
        """How many times slower than float32 ``dtype`` multiplies (1 where not measured)."""
        if not self.float32_flops_per_s:
            return 1.0
        return self.float32_flops_per_s / self.flops_per_s

    def describe(self) -> str:
        return f"{self.dtype} matmuls at {gflops(self.flops_per_s)} on {self.device}"

    def warning(self) -> str | None:
        """One line when ``dtype`` is far slower than float32 here, naming both speeds and the faster dtype."""
        if self.slowdown <= SLOW_RATIO or self.float32_flops_per_s is None:
            return None
        return (f"warning: {self.dtype} runs {self.slowdown:,.0f}x slower than float32 on this {self.device} "
                f"({gflops(self.flops_per_s)} against {gflops(self.float32_flops_per_s)} in a matmul of the model's "
                f"shape: no fast {self.dtype} path here); --dtype float32 calibrates faster, or calibrate on a device "
                f"with {self.dtype} support")


def gflops(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e9:,.3g} GFLOP/s"


def probe_shape(config: ModelConfig, device: str) -> tuple[int, int, int]:
    """``(rows, inner, most columns)`` of the probe's product: the microbatch's tokens by the hidden size, times
    up to the wider of hidden and FFN sizes (counts from the model, capped so the probe stays small)."""
    kind = "cuda" if device == "cuda" else "cpu"
    rows = max(1, min(config.mb_size * config.seq_len, MAX_ROWS[kind]))
    inner = max(1, min(config.hidden, MAX_COLS[kind]))
    cols = max(1, min(max(config.hidden, config.ffn), MAX_COLS[kind]))
    return rows, inner, cols


def measure_speed(config: ModelConfig, device: str) -> MatmulSpeed:
    """The matmul speed of ``config.dtype`` on ``device`` (and of float32 where the dtype is another)."""
    rows, inner, cols = probe_shape(config, device)
    speed = matmul_flops_per_s(device, config.dtype, rows, inner, cols)
    reference = None if config.dtype == "float32" else matmul_flops_per_s(device, "float32", rows, inner, cols)
    return MatmulSpeed(device=device, dtype=config.dtype, flops_per_s=speed, float32_flops_per_s=reference)


@functools.lru_cache(maxsize=16)
def matmul_flops_per_s(device: str, dtype: str, rows: int, inner: int, cols: int) -> float:
    """FLOP/s of a ``rows x inner @ inner x n`` product, ``n <= cols`` chosen so it takes about :data:`BUDGET_S`;
    on CPU with one thread (the calibration's), on CUDA on this process's GPU."""
    import torch

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else torch.device("cpu")
    dt = getattr(torch, dtype)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        a = torch.full((rows, inner), 0.5, device=dev, dtype=dt)  # the values do not change a matmul's speed

        def seconds(b: torch.Tensor, times: int) -> float:
            best = float("inf")
            for _ in range(times):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                a @ b
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                best = min(best, time.perf_counter() - start)
            return max(best, 1e-9)

        n = min(4, cols)
        b = torch.full((inner, n), 0.25, device=dev, dtype=dt)
        a @ b  # the first product pays the library's set-up
        n = int(min(cols, max(n, n * BUDGET_S / seconds(b, 1))))
        b = torch.full((inner, n), 0.25, device=dev, dtype=dt)
        return 2.0 * rows * inner * n / seconds(b, 3)  # the best of three: a busy host's bursts left out
    finally:
        torch.set_num_threads(threads)
