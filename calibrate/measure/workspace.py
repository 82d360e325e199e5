"""The device libraries' own allocations that an allocator peak counts but no tensor of the model holds.

On CUDA, cuBLAS takes a workspace from torch's caching allocator for each (thread, stream) handle the first time that
thread multiplies matrices: the forward runs on the calling thread and the backward on autograd's device thread, so a
training step holds two (on an H100 with torch 2.11's default ``CUBLAS_WORKSPACE_CONFIG``: 32 MiB each, 64 MiB in all,
seen by ``torch.cuda.max_memory_allocated``). Calibration measures it on the device, so a prediction made before a run
counts it without assuming a library's default. On CPU, ppsim's live-tensor measure sees no such allocation: nothing.
"""

from __future__ import annotations

from typing import Any


def allocator_workspace_bytes(device: Any, dtype: Any) -> int | None:
    """Bytes the allocator holds after one matmul forward and its backward beyond the tensors involved (the library
    workspaces a step keeps), measured with the workspaces released first; ``None`` on a device without a caching
    allocator (CPU)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return None
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch.cuda.synchronize(device)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    before = torch.cuda.memory_allocated(device)
    y = x @ w
    y.sum().backward()  # the backward's matmuls run on autograd's device thread: its own handle and workspace
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before
    tensors = sum(t.untyped_storage().nbytes() for t in (y, x.grad, w.grad) if t is not None)
    del x, w, y
    return max(0, held - tensors)
