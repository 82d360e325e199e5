"""A small version-2 profile built in code (no file from outside the tests): embed, a layer, head."""

from __future__ import annotations

from ppsim.model_config import ModelConfig
from ppsim.profile import (
    Block,
    Method,
    P2PProfile,
    Probe,
    Profile,
    RuntimeOverheads,
    StageOverhead,
    StageProfile,
    Stat,
)

LAYER = {"F": 1e-3, "B": 2e-3, "I": 1.2e-3, "W": 0.8e-3, "FB": 2.7e-3}
EMBED = {"F": 0.2e-3, "B": 0.3e-3, "I": 0.1e-3, "W": 0.2e-3, "FB": 0.45e-3}
HEAD = {"F": 1.5e-3, "B": 3e-3, "I": 1.6e-3, "W": 1.4e-3, "FB": 4.2e-3}
OVERHEAD = {"F": 1e-4, "B": 2e-4, "I": 1e-4, "W": 1e-4, "FB": 2.5e-4}


def stat(value: float) -> Stat:
    return Stat.from_samples([value * (1 + 0.01 * k) for k in (-2, -1, 0, 1, 2)])


def block(times: dict[str, float], *, act: int, freed: int, params: int, out: int,
          measured: bool = True) -> Block:
    return Block(
        param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params, output_bytes=out,
        **{op: stat(t) if measured else None for op, t in times.items()},
        activation_bytes=act if measured else None, activation_bytes_freed_by_I=freed if measured else None,
    )


def make_v2_profile(num_layers: int = 8, *, runtime: bool = True, complete: bool = True,
                    stages: tuple[StageProfile, ...] = (), p2p: bool = True) -> Profile:
    model = ModelConfig(preset="custom", hidden=8, heads=2, ffn=16, layers=num_layers, vocab=32, seq_len=4,
                        mb_size=1, dtype="float32")
    boundary = model.boundary_bytes
    blocks = {
        "embed": block(EMBED, act=1000, freed=0, params=32 * 8 * 4, out=boundary),
        "layer": block(LAYER, act=5000, freed=2000, params=1000, out=boundary, measured=complete),
        "head": block(HEAD, act=7000, freed=3000, params=32 * 8 * 4 + 32, out=0),
    }
    rt = None
    if runtime:
        rt = RuntimeOverheads(
            compute_scale={1: 1.0, 2: 1.5}, dispatch_s=1e-3, handoff_s=4e-3, recv_posting="consumer",
            synthetic=RuntimeOverheads(compute_scale={1: 1.0}, dispatch_s=5e-4, handoff_s=1e-3,
                                       recv_posting="consumer"),
            probe=Probe(schedule="1F1B", ranks=2, microbatches=4, steps=5),
            samples={"dispatch_s": (0.9e-3, 1e-3, 1.1e-3), "compute_scale.2": (1.4, 1.5, 1.6)},
        )
    return Profile(
        created="2026-11-22T10:00:00Z", device="cpu", device_name="test cpu", torch_version="2.13.0", host="h",
        world_size=1, backend=None, model=model,
        stages=stages, num_stages=len(stages),
        p2p=P2PProfile(alpha_s=1e-4, beta_bytes_per_s=1e9, fit_rel_error=0.05, measured=True, samples=())
        if p2p else None,
        complete=complete, done=("embed.timings",),
        method=Method(warmup=1, reps=5, timer="perf_counter", threads_per_rank=1, wall_s=1.0),
        notes=("v2 fixture",),
        blocks=blocks, layout=("embed", *["layer"] * num_layers, "head"),
        stage_overhead=StageOverhead(**{op: stat(t) for op, t in OVERHEAD.items()}),
        runtime=rt,
    )


def make_v3_profile(*, complete: bool = True) -> Profile:
    """Version 3: a DeepSeek-V3-like model of 4 layers, a dense first layer and three MoE layers (MoE twice as
    expensive), with its ``source``."""
    import dataclasses

    from ppsim.profile import SourceInfo

    base = make_v2_profile(4, complete=complete)
    assert base.blocks is not None
    dense = base.blocks["layer"]
    moe = block({op: 2 * t for op, t in LAYER.items()}, act=9000, freed=3000, params=5000,
                out=base.model.boundary_bytes, measured=complete)
    blocks = {"embed": base.blocks["embed"], "layer.dense": dense, "layer.moe": moe, "head": base.blocks["head"]}
    source = SourceInfo(
        source="torchtitan:deepseek_v3/debugmodel", scheme="torchtitan", family="deepseek_v3", flavor="debugmodel",
        num_params=1234, attention="sdpa (FlexAttention has no CPU backward)",
        layer_kinds=("dense", "moe", "moe", "moe"), kinds={"dense": "feed-forward", "moe": "MoE"},
        options={"layers": 4, "seq_len": 4, "mb_size": 1},
    )
    return dataclasses.replace(base, blocks=blocks, layout=("embed", "layer.dense", *["layer.moe"] * 3, "head"),
                               source=source)
