"""Layer costs for the published runs ppsim is checked against at scale (bench/bench_published.py, docs/scale.md).

No profile was measured for Llama 3.1 8B, nor for Llama 3 405B at TP 8, nor for DeepSeek-V3. The two committed H100
profiles (``docs/data/llama3_70b_h100_s8192.profile.json`` and ``..._405b_...``: one H100 80GB HBM3, seq 8192,
microbatch 1, tensor parallel degree 1, no activation checkpointing, eager bf16, sdpa attention) are rescaled here,
each rule stated where it is applied:

* **FLOPs per layer** (``layer_flops``): torchtitan's MFU count, ``2 x parameters + 4 x dim x seq`` per token for a
  layer's forward. A derived layer's F, B, I, W and FB are the measured layer's times times the ratio of FLOPs per
  microbatch (tokens x FLOPs per token), i.e. the measured layer's achieved TFLOP/s is kept. The head (final norm,
  output projection and loss) scales by ``dim x vocab`` per token, the embedding by ``dim`` per token.
* **TP** (``tp``): a layer's FLOPs are divided by TP; torchtitan's sequence-parallel TP adds 4 collectives per layer
  and direction (an all-gather before attention and before the feed-forward, a reduce-scatter after each) of the
  microbatch's ``tokens x dim`` bf16 activations over the TP group within one node, priced by ppsim's NCCL model
  (``ppsim.step.collectives.predict`` on the given cluster), added to F and to B and I (the backward's input half).
  The head's and the embedding's TP collectives are not added (each is one all-gather/reduce-scatter, under 1 %).
* **Selective activation checkpointing** (``selective``): torchtitan's per-op policy (``SelectiveAC``, op mode)
  saves every matmul's output except every second one in a block, so of a Llama layer's seven matmuls (wq, wk, wv,
  wo, w1, w3, w2) the 2nd, 4th and 6th (wk, wo, w3) are rerun in the backward: B gains F x (their FLOPs / the
  layer's forward FLOPs); I and W are not measured under a checkpoint mode (null, as ``calibrate`` records them).
  The elementwise ops it also reruns are not counted.
* **Bytes**: parameters, gradients and optimizer state scale by the parameter count; activations and outputs by
  tokens x dim (a rough rule: the profiles' activation bytes only judge memory, which these figures do not use).

Nothing here is fitted to a published figure: every ratio is a shape ratio, every added collective is the cluster
model's price. This module imports ppsim only (no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ppsim.model_config import ModelConfig
from ppsim.profile import Block, Profile, SourceInfo, Stat


@dataclass(frozen=True)
class LlamaShape:
    """A Llama 3 flavor's shapes (torchtitan's ``llama3`` model registry)."""

    flavor: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256

    @property
    def layer_params(self) -> int:
        head_dim = self.dim // self.heads
        attn = self.dim * (self.dim + 2 * self.kv_heads * head_dim) + self.dim * self.dim
        return attn + 3 * self.dim * self.ffn + 2 * self.dim  # wq, wk, wv, wo; w1, w2, w3; two RMSNorm weights

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.dim + self.dim

    def layer_flops(self, seq: int) -> float:
        """One layer's forward FLOPs per token as torchtitan counts them for MFU."""
        return 2.0 * self.layer_params + 4.0 * self.dim * seq

    def recomputed_flops(self) -> float:
        """Per token, the matmuls torchtitan's selective (op) policy reruns in a layer's backward: wk, wo, w3."""
        head_dim = self.dim // self.heads
        return 2.0 * (self.dim * self.kv_heads * head_dim + self.dim * self.dim + self.dim * self.ffn)


LLAMA3 = {
    "8B": LlamaShape("8B", dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "70B": LlamaShape("70B", dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "405B": LlamaShape("405B", dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
}
OPS = ("F", "B", "I", "W", "FB")


def _stat(value: float) -> Stat:
    return Stat.from_samples([value])


def _scaled(block: Block, factor: float, *, byte_factor: float, act_factor: float, add: dict[str, float] | None = None,
            drop: tuple[str, ...] = ()) -> Block:
    """``block`` with every time times ``factor`` (plus ``add[op]`` seconds), bytes rescaled, ``drop`` ops null."""
    add = add or {}
    times = {}
    for op in OPS:
        stat = getattr(block, op)
        times[op] = None if stat is None or op in drop else _stat(stat.median * factor + add.get(op, 0.0))
    params = round(block.param_bytes * byte_factor)
    return dataclasses.replace(
        block, **times, param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params,
        output_bytes=round(block.output_bytes * act_factor),
        activation_bytes=None if block.activation_bytes is None else round(block.activation_bytes * act_factor),
        activation_bytes_freed_by_I=None if block.activation_bytes_freed_by_I is None
        else round(block.activation_bytes_freed_by_I * act_factor),
        activation_bytes_allocator=None, peak_bytes_allocator=None)


def tp_collective_seconds(shape: LlamaShape, tokens: int, tp: int, cluster_name: str) -> float:
    """One direction of one layer's sequence-parallel TP collectives (2 all-gathers + 2 reduce-scatters of the
    microbatch's ``tokens x dim`` bf16 activations over ``tp`` ranks in one node), by ppsim's model of the cluster."""
    if tp <= 1:
        return 0.0
    from ppsim.step.cluster import load_cluster
    from ppsim.step.collectives import Span, predict
    from ppsim.step.kinds import CollectiveKind

    cluster = load_cluster(cluster_name)
    nbytes = tokens * shape.dim * 2
    return sum(2 * predict(kind, nbytes, Span(tp, 1), cluster).seconds
               for kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER))


def derive_llama(measured: Profile, target: str, *, mb_size: int = 1, tp: int = 1, selective: bool = False,
                 cluster: str = "h100") -> Profile:
    """The profile ``measured`` (a Llama 3 flavor at TP 1, microbatch 1) rescaled to flavor ``target`` at
    microbatch ``mb_size``, TP ``tp`` and, if ``selective``, torchtitan's selective checkpointing (module
    docstring)."""
    assert measured.blocks is not None and measured.tensor_parallel_degree == 1
    src_flavor = (measured.source.flavor if measured.source else None) or measured.model.preset.rsplit("/", 1)[-1]
    src, dst = LLAMA3[src_flavor], LLAMA3[target]
    seq = measured.model.seq_len
    tokens_ratio = mb_size / measured.model.mb_size
    layer = dst.layer_flops(seq) / src.layer_flops(seq) * tokens_ratio / tp
    head = dst.dim / src.dim * tokens_ratio / tp
    embed = dst.dim / src.dim * tokens_ratio
    act = dst.dim / src.dim * tokens_ratio / tp
    comm = tp_collective_seconds(dst, mb_size * seq, tp, cluster)
    blocks = dict(measured.blocks)
    lay = blocks["layer"]
    add = {"F": comm, "B": comm, "I": comm, "FB": 2 * comm}
    drop: tuple[str, ...] = ()
    if selective:
        assert lay.F is not None
        rerun = lay.F.median * layer * dst.recomputed_flops() / dst.layer_flops(seq)
        add = {"F": comm, "B": comm + rerun, "FB": 2 * comm + rerun}
        drop = ("I", "W")
    out = {
        "layer": _scaled(lay, layer, byte_factor=dst.layer_params / src.layer_params / tp, act_factor=act, add=add,
                         drop=drop),
        "embed": _scaled(blocks["embed"], embed, byte_factor=dst.dim / src.dim / tp, act_factor=dst.dim / src.dim
                         * tokens_ratio, drop=drop),
        "head": _scaled(blocks["head"], head, byte_factor=dst.dim / src.dim / tp, act_factor=act, drop=drop),
    }
    model = ModelConfig(preset=f"torchtitan:llama3/{target}", hidden=dst.dim, heads=dst.heads, ffn=dst.ffn,
                        layers=dst.layers, vocab=dst.vocab, seq_len=seq, mb_size=mb_size, dtype=measured.model.dtype)
    source = SourceInfo(
        source=f"torchtitan:llama3/{target}", scheme="torchtitan", family="llama3", flavor=target,
        num_params=dst.num_params, attention=measured.source.attention if measured.source else "sdpa",
        layer_kinds=("layer",) * dst.layers, kinds={"layer": f"GQAttention ({dst.heads} heads) + feed-forward "
                                                             f"({dst.ffn})"},
        options={"seq_len": seq, "mb_size": mb_size, "dtype": measured.model.dtype})
    rule = (f"derived by bench/published_profiles.py from {measured.model.preset} measured on {measured.device_name} "
            f"(TP 1, microbatch {measured.model.mb_size}): layer times x {layer:.6f} (FLOPs per layer and microbatch, "
            f"2 x params + 4 x dim x seq per token, {dst.layer_flops(seq) / 1e6:.1f} vs "
            f"{src.layer_flops(seq) / 1e6:.1f} MFLOP/token, x {tokens_ratio:g} tokens, / TP {tp}); head x {head:.6f}, "
            f"embedding x {embed:.6f}")
    notes = [rule]
    if tp > 1:
        notes.append(f"TP {tp}: {comm * 1e3:.3f} ms of sequence-parallel collectives per layer and direction (2 "
                     f"all-gathers + 2 reduce-scatters of {mb_size * seq} x {dst.dim} bf16 within one node, ppsim's "
                     f"NCCL model of cluster {cluster}) added to F, B and I")
    if selective:
        notes.append(f"selective checkpointing: B += F x {dst.recomputed_flops() / dst.layer_flops(seq):.4f} (wk, wo, "
                     "w3 rerun: torchtitan's op policy recomputes every second matmul); I and W not available")
    return dataclasses.replace(
        measured, created="derived", host="derived", model=model, source=source, blocks=out,
        layout=("embed", *["layer"] * dst.layers, "head"), tensor_parallel_degree=tp, entries=(), stages=(),
        num_stages=0, notes=tuple(notes), activation_checkpoint="selective" if selective else "none")


# --- DeepSeek-V3 from FLOPs at a stated MFU ------------------------------------------------------------------------
def block_flops_per_token(block: object, *, top_k: int, dim: int, seq: int, layer: bool) -> float:
    """A block's forward FLOPs per token as torchtitan counts them for MFU: 2 x the parameters a token uses (a MoE
    layer's routed experts: ``top_k`` of them; ``block``'s sparse tensors hold the EP-local experts on dim 0), plus,
    for a layer, ``4 x dim x seq`` for attention (the same rule as ``ppsim.plan.layer_flops_per_token``)."""
    import math

    params = 0.0
    for name, shape in block.tensors:  # type: ignore[attr-defined]
        numel: float = math.prod(shape)
        if name in block.sparse and shape:  # type: ignore[attr-defined]
            numel = numel * top_k / shape[0]
        params += numel
    return 2 * params + (4.0 * dim * seq if layer else 0.0)


def deepseek_from_flops(shapes: object, *, seq: int, mb_size: int, peak_flops: float, mfu: float, ep: int,
                        all_to_all_s: float, source: str = "torchtitan:deepseek_v3/671B") -> Profile:
    """A profile of DeepSeek-V3 whose blocks take their FLOPs (:func:`block_flops_per_token`) at ``mfu`` of
    ``peak_flops``: F = tokens x FLOPs / (peak x MFU), B = 2 F split as I = W = F, FB = F + B. Written as measured
    at EP ``ep`` (what ``calibrate --ep`` records, and what a job at that degree accepts): each MoE layer's F, B and
    I hold its two all-to-alls of ``all_to_all_s`` each, FB four; ``ppsim.step.ep`` then takes out what the
    schedule hides. ``shapes``: the job's :class:`ppsim.job.memory.JobShapes` (EP-local)."""
    from ppsim.model_config import ModelConfig
    from ppsim.profile import Block

    tokens = seq * mb_size
    rate = peak_flops * mfu
    blocks_by_name = shapes.blocks  # type: ignore[attr-defined]
    moe = set(shapes.moe_layers)  # type: ignore[attr-defined]
    top_k, dim = shapes.moe_top_k, shapes.dim  # type: ignore[attr-defined]
    layers = sorted((n for n in blocks_by_name if n.startswith("layers.")), key=lambda n: int(n.split(".")[1]))

    def timed(flops: float, params: int, comm: float = 0.0) -> Block:
        f = tokens * flops / rate
        act = 34 * tokens * dim  # a layer's saved activations, Korthikanti et al.'s 34 x tokens x dim bytes (rough)
        times = {"F": f + 2 * comm, "B": 2 * f + 2 * comm, "I": f + 2 * comm, "W": f, "FB": 3 * f + 4 * comm}
        return Block(param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params, output_bytes=tokens * dim * 2,
                     activation_bytes=act, activation_bytes_freed_by_I=0,
                     **{op: _stat(t) for op, t in times.items()})

    first_dense = next(n for n in layers if n not in moe)
    first_moe = next(n for n in layers if n in moe)
    flops = {n: block_flops_per_token(blocks_by_name[n], top_k=top_k, dim=dim, seq=seq, layer=True)
             for n in (first_dense, first_moe)}
    head = block_flops_per_token(blocks_by_name["lm_head"], top_k=top_k, dim=dim, seq=seq, layer=False)
    blocks = {
        "embed": timed(0.0, blocks_by_name["tok_embeddings"].numel * 2),
        "layer.dense": timed(flops[first_dense], blocks_by_name[first_dense].numel * 2),
        "layer.moe": timed(flops[first_moe], blocks_by_name[first_moe].numel * 2, all_to_all_s),
        "head": dataclasses.replace(timed(head, blocks_by_name["lm_head"].numel * 2), output_bytes=0),
    }
    kinds = tuple("moe" if n in moe else "dense" for n in layers)
    model = ModelConfig(preset=source, hidden=dim, heads=128, ffn=18432, layers=len(layers), vocab=129280,
                        seq_len=seq, mb_size=mb_size, dtype="bfloat16")
    info = SourceInfo(source=source, scheme="torchtitan", family="deepseek_v3", flavor=source.rsplit("/", 1)[-1],
                      num_params=671_000_000_000, attention="sdpa", layer_kinds=kinds,
                      kinds={"dense": "MLA + feed-forward", "moe": "MLA + MoE"},
                      options={"seq_len": seq, "mb_size": mb_size, "dtype": "bfloat16"})
    note = (f"derived by bench/published_profiles.py from FLOPs: dense layer {flops[first_dense] / 1e9:.4f}, MoE layer "
            f"{flops[first_moe] / 1e9:.4f}, head {head / 1e9:.4f} GFLOP per token forward at {mfu:.0%} of "
            f"{peak_flops / 1e12:.0f} TFLOP/s; B = 2F (I = W = F); MoE layers hold 2 all-to-alls of "
            f"{all_to_all_s * 1e3:.3f} ms in F, B and I (EP {ep}, ppsim's model of the cluster)")
    from ppsim.profile import Method, StageOverhead

    zero = _stat(0.0)
    return Profile(created="derived", device="cuda", device_name="H800 (FLOPs at a stated MFU)",
                   torch_version="n/a", host="derived", world_size=1, backend=None, model=model, complete=True,
                   done=("units",), method=Method(warmup=0, reps=1, timer="flops", threads_per_rank=None, wall_s=0.0),
                   notes=(note,), blocks=blocks, layout=("embed", *[f"layer.{k}" for k in kinds], "head"),
                   stage_overhead=StageOverhead(F=zero, B=zero, I=zero, W=zero, FB=zero), source=info,
                   expert_parallel_degree=ep)
