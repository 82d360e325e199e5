"""A rank of the TP-unit check (tests/calibrate/test_calibrate_multi.py): one layer sharded at the running group's
degree, its forward run as calibration runs it, outside and inside torchtitan's SPMD context, its collectives counted
(a module of its own: spawned ranks import it by name)."""

from __future__ import annotations

from typing import Any


def forward_collectives(ctx: Any) -> dict[str, Any] | None:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from ppsim.calibrate.execute.launch import init_world
    from ppsim.calibrate.measure import harness
    from ppsim.calibrate.measure.tensor_parallel import rank_source, spmd_context, tp_stage_and_dims
    from ppsim.calibrate.models import ModelOptions, parse_model_source

    torch.set_num_threads(1)
    init_world(backend="gloo", timeout_s=60, store=ctx.store(60), rank=ctx.rank, world_size=ctx.world_size)
    counted: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if "c10d" in str(func):
                counted.append(str(func))
            return func(*args, **(kwargs or {}))

    try:
        source = parse_model_source("torchtitan:llama3/debugmodel", ModelOptions(seq_len=16, mb_size=1))
        module, dims = tp_stage_and_dims(source, (0,), has_embedding=False, has_head=False, tp=ctx.world_size,
                                         seed=0, device="cpu")
        local = rank_source(source, ctx.world_size)
        unit = harness.unit_of("layers1", (0,))
        bench = harness.StageBench(local.config, 4, 1, device=torch.device("cpu"), unit=unit, source=local,
                                   module=module)
        out: dict[str, Any] = {}
        for name, context in (("outside", contextlib.nullcontext()), ("inside", spmd_context(dims))):
            counted.clear()
            with context, Count():
                fwd = bench.forward()
                bench.backward(fwd)
            out[name] = len(counted)
            out[f"{name}_tokens"] = fwd.outputs[0].shape[1]
        dist.barrier()
        return out if ctx.rank == 0 else None
    finally:
        dist.destroy_process_group()
