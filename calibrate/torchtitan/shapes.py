"""A torchtitan job's model as one tensor-parallel rank holds it, without allocating it: the model is built on the
meta device with one layer of each kind, ``update_from_config`` fills torchtitan's sharding plan from the job, and
the model's own ``parallelize`` shards it on a fake process group (torch's ``"fake"`` backend, as torchtitan's
``init_fake_mode`` uses it), so every parameter's local shape is torchtitan's. The result is plain data
(:class:`ppsim.job.memory.JobShapes`) for :func:`ppsim.job.memory.job_memory`.

Hardware-bound model converters (float8, MX: they refuse without torchao or without SM89) are set aside while the
job is read (:func:`converters_set_aside`) and said in the notes: torchtitan 0.3.0's ``Float8Linear`` keeps its
weights in their dtype (no float8 all-gather), so the stored parameters are unchanged; its per-matmul float8 casts
are transient and not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ppsim.calibrate.torchtitan.checkpointing import mode_of
from ppsim.calibrate.torchtitan.config import converters_set_aside
from ppsim.errors import JobMemoryError
from ppsim.job.degrees import Degrees, check_degrees
from ppsim.job.memory import BlockShapes, JobShapes, receives_just_in_time


def trainer_config(value: str) -> Any:
    """The ``Trainer.Config`` of ``MODULE:CONFIG`` (converters set aside by the caller)."""
    from ppsim.calibrate.torchtitan.config import _call_config, _config_module, _parse_name

    module_name, config_name = _parse_name(value)
    return _call_config(value, _config_module(value, module_name), config_name)


def degrees_of(parallelism: Any) -> Degrees:
    """The job's degrees; ``data_parallel_shard_degree -1`` (fill the world) needs the world size, which a
    simulation does not know, so it is refused with the fix."""
    shard = int(parallelism["data_parallel_shard_degree"])
    if shard < 1:
        raise JobMemoryError(
            f"parallelism.data_parallel_shard_degree {shard} fills the world size, which ppsim cannot know here; "
            "pass --parallelism.data_parallel_shard_degree N (1 for no FSDP sharding)")
    return Degrees(pp=int(parallelism["pipeline_parallel_degree"]), tp=int(parallelism["tensor_parallel_degree"]),
                   dp_shard=shard, dp_replicate=int(parallelism["data_parallel_replicate_degree"]),
                   cp=int(parallelism["context_parallel_degree"]), ep=int(parallelism["expert_parallel_degree"]))


def job_shapes(value: str, settings: Any, *, notes: Sequence[str] = (),
               activation_checkpoint: str | None = None, profile: Any = None,
               as_run: bool = False, microbatch_size: int | None = None,
               local_cache: dict[Any, Any] | None = None) -> tuple[JobShapes, Degrees]:
    """The TP-local shapes of ``MODULE:CONFIG``'s model and the job's degrees, ``settings`` being its
    :class:`ppsim.job.settings.JobSettings` (overrides applied); ``activation_checkpoint`` (``none``/``full``) counts
    another checkpoint mode than the config's (``plan`` compares them). With a ``profile``, the training job with
    the activations the profile measured (``as_run``: the job as ``ppsim run`` executes it on the profile's device,
    to check a plan against runs) (:func:`profile_shapes`: its measured activations where it covers the job's
    microbatch), else as torchtitan trains it (mixed precision, AdamW, the activation formula).
    ``local_cache``: the parameters' local shapes and buffers kept by (TP, EP) degree between calls on the same job
    (``plan``'s candidates differ in their degrees and batch only; the model's parallelize is the expensive part)."""
    import torch

    with converters_set_aside() as set_aside:
        config = trainer_config(value)
    degrees = degrees_of(settings.parallelism)
    parallelism = dataclasses.replace(config.parallelism, **{k: v for k, v in settings.parallelism.items()
                                                              if hasattr(config.parallelism, k)})
    training = dataclasses.replace(config.training, **{k: v for k, v in settings.training.items()
                                                       if hasattr(config.training, k)})
    config.parallelism, config.training = parallelism, training  # not replace(): its checks are the loader's
    # sequences per microbatch: the job's (without a pipeline, the whole local batch: a gradient-accumulation step)
    mb_size = microbatch_size or parallelism.pipeline_parallel_microbatch_size
    model_cfg = config.model_spec.model
    layers = list(model_cfg.layers)
    attn = layers[0].attention
    experts = getattr(getattr(layers[-1], "moe", None), "num_experts", None)
    check_degrees(degrees, num_heads=attn.n_heads, num_kv_heads=getattr(attn, "n_kv_heads", None) or attn.n_heads,
                  num_layers=len(layers), num_experts=experts, seq_len=training.seq_len,
                  fix="pass --parallelism.KEY VALUE with a degree that divides it")
    ac = activation_checkpoint or mode_of(config.activation_checkpoint)
    moe_cfgs = [(i, cfg.moe) for i, cfg in enumerate(layers) if getattr(cfg, "moe", None) is not None]
    moe_fields = dict(moe_layers=tuple(f"layers.{i}" for i, _ in moe_cfgs),
                      moe_top_k=moe_cfgs[0][1].router.top_k if moe_cfgs else 0,
                      moe_tokens=training.seq_len * parallelism.pipeline_parallel_microbatch_size // degrees.tp
                      // degrees.cp,
                      dim=model_cfg.dim)
    if profile is not None:
        shapes = profile_shapes(profile, tp=degrees.tp, seq_len=training.seq_len,
                                mb_size=mb_size, activation_checkpoint=ac)
        if not as_run:  # the training job: its dtypes, its optimizer, fully_shard as torchtitan applies it
            shapes = _as_trained(shapes, training, parallelism, profile)
        ep_note = ([f"expert_parallel_degree {degrees.ep}: with --profile the routed experts are counted as the "
                    f"profile's model holds them, all {experts} a layer (an upper bound); without --profile they are "
                    "counted EP-local"] if degrees.ep > 1 else [])
        return dataclasses.replace(shapes, source=value, notes=(*notes, *dict.fromkeys(set_aside), *shapes.notes,
                                                                *ep_note), **moe_fields), degrees
    model_cfg.update_from_config(config=config)
    buffers: dict[str, int] = {}
    cache_key = (degrees.tp, degrees.ep)  # the local shapes do not depend on how far FSDP shards
    if local_cache is not None and cache_key in local_cache:
        local, kept = local_cache[cache_key]
        buffers.update(kept)
    else:
        local = _local_shapes(model_cfg, degrees.tp, buffers, ep=degrees.ep, dp_shard=degrees.fsdp)
        if local_cache is not None:
            local_cache[cache_key] = (local, dict(buffers))
    kinds: dict[tuple[tuple[str, tuple[int, ...]], ...], int] = {}
    kind_of = [kinds.setdefault(local[f"layers.{i}"], len(kinds)) for i in range(len(layers))]
    tokens = training.seq_len * mb_size // degrees.cp  # CP: each rank holds 1/cp of every sequence
    sp = degrees.tp > 1 and parallelism.enable_sequence_parallel
    dim = model_cfg.dim
    act_bytes = torch.empty((), dtype=getattr(torch, training.mixed_precision_param)).element_size()
    blocks: dict[str, BlockShapes] = {}
    functional = parallelism.spmd_backend != "spmd_types"  # collectives as _c10d_functional ops (SAC saves them)
    forced = getattr(config.activation_checkpoint, "force_recompute_mm_shapes_by_fqns", None)
    forced = ("moe.router.gate",) if forced is None else tuple(forced)  # SelectiveAC's default
    for i, k in enumerate(kind_of):
        tensors = local[f"layers.{i}"]
        moe = _moe_of(layers[i], tensors, ep=degrees.ep, tp=degrees.tp, sp=sp)
        block = _layer_block(f"layer{k}" if len(kinds) > 1 else "layer", tensors, tokens=tokens, dim=dim,
                             tp=degrees.tp, sp=sp, ac=ac, act_bytes=act_bytes,
                             heads=layers[i].attention.n_heads // degrees.tp, moe=moe, functional_comm=functional,
                             forced_recompute=forced, attention_stats=_attention_stats(layers[i].attention))
        block = _with_cp_kv(block, cp=degrees.cp, ac=ac, kv_bytes=tokens * kv_width(layers[i].attention, dim)
                            // degrees.tp * act_bytes)
        blocks[f"layers.{i}"] = dataclasses.replace(block, buffer_bytes=buffers.get(f"layers.{i}", 0),
                                                    sparse=frozenset(n for n, _ in tensors if n.startswith(_EXPERTS)))
    blocks["tok_embeddings"] = BlockShapes("embedding", local["tok_embeddings"], saved_bytes=tokens * 8)
    norm_tokens = tokens // degrees.tp if sp else tokens
    blocks["norm"] = BlockShapes("head", local["norm"], saved_bytes=norm_tokens * dim * act_bytes)
    vocab_local = local["lm_head"][0][1][0]
    # the loss as torchtitan computes it (cross_entropy_loss: F.cross_entropy(pred.float())): the head saves its input,
    # and the log-softmax saves its fp32 output for the backward; while it runs, the fp32 copy of the logits is held
    # beside the bf16 logits (the stage's output); its backward holds the nll-loss gradient and the log-softmax's
    # input gradient, both fp32 logits-sized, beside the saved log-softmax (as `run_shapes` counts a run's)
    logits_fp32 = tokens * vocab_local * 4
    blocks["lm_head"] = BlockShapes("head", local["lm_head"], saved_bytes=tokens * dim * act_bytes + logits_fp32,
                                    forward_transient_bytes=logits_fp32 if act_bytes < 4 else 0,
                                    backward_transient_bytes=2 * logits_fp32)
    extra = [f"activation_checkpoint {ac!r}" + (": counted as its policy saves (docs/memory.md)"
                                                 if ac == "selective" else "")]
    if ac == "none" and (len(kinds) > 1 or any(_linear_names(t) is None for t in kinds)):
        extra.append("a layer kind other than a dense attention+FFN block: without checkpointing its activations "
                     "count each linear's input and the routed experts' tensors only")
    if degrees.ep > 1:
        extra.append(f"expert_parallel_degree {degrees.ep}: each rank holds {experts // degrees.ep} of the {experts} "
                     f"routed experts of a MoE layer, FSDP-sharded on efsdp {degrees.efsdp} (dp_shard x cp x tp / ep);"
                     f" the dense weights on dp_shard x cp {degrees.fsdp}; all-to-all buffers at balanced routing "
                     "(tokens x top-k)")
    shapes = JobShapes(
        # a stage's output is its last layer's: sequence-sharded under SP (torchtitan's trainer runs the pipeline
        # inside its SPMD context, whose redistributions reduce-scatter each layer's output to seq / tp)
        source=value, blocks=blocks, tp=degrees.tp, boundary_bytes=norm_tokens * dim * act_bytes,
        logits_bytes=tokens * vocab_local * act_bytes,
        master_dtype=training.dtype, param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce, activation_checkpoint=ac,
        reshard_after_forward=parallelism.fsdp_reshard_after_forward == "always",
        receives_just_in_time=receives_just_in_time(torch.__version__),
        notes=tuple(notes) + tuple(dict.fromkeys(set_aside)) + tuple(extra), **moe_fields,
        cp_kv_bytes=tokens * kv_width(attn, dim) // degrees.tp * act_bytes if degrees.cp > 1 else 0,
    )
    return shapes, degrees


def _local_shapes(model_cfg: Any, tp: int, buffers: dict[str, int] | None = None, *, ep: int = 1,
                  dp_shard: int = 1) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """Per top-level block (``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``) its parameters' TP- and
    EP-local shapes, from torchtitan's own ``parallelize`` on a fake process group of ``tp`` ranks (with EP:
    ``dp_shard`` x ``tp`` ranks, ``dp_shard`` being the dense FSDP degree dp_shard x cp, out of which EP is
    carved)."""
    import torch
    import torch.distributed as dist

    with torch.device("meta"):
        model = model_cfg.build()
    if tp > 1 or ep > 1:
        from torchtitan.distributed.parallel_dims import ParallelDims

        if dist.is_initialized():
            raise JobMemoryError("a process group is already running in this process; read the job's shapes in a "
                                 "fresh process")
        shard = dp_shard if ep > 1 else 1
        dist.init_process_group("fake", rank=0, world_size=shard * tp)
        try:
            dims = ParallelDims(dp_replicate=1, dp_shard=shard, cp=1, tp=tp, pp=1, ep=ep, world_size=shard * tp,
                                spmd_backend="spmd_types")
            dims.build_mesh()
            model.parallelize(dims)
        finally:
            dist.destroy_process_group()
    if buffers is not None:  # each block's buffers (``buffers`` filled in place)
        buffers.update(_module_buffer_bytes(model))
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in model.named_parameters():
        t = getattr(p, "_local_tensor", p)
        parts = name.split(".")
        block = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        rest = ".".join(parts[2:] if parts[0] == "layers" else parts[1:])
        out.setdefault(block, []).append((rest, tuple(t.shape)))
    return {k: tuple(v) for k, v in out.items()}


def _linear_names(tensors: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]] | None:
    """A dense block's weights by role (qkv, wo, w1, w2, w3), or ``None`` for another kind."""
    found: dict[str, tuple[int, ...]] = {}
    for name, shape in tensors:
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if leaf in ("wqkv", "wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            found[leaf] = shape
    if not {"wo", "w1", "w2"} <= found.keys():
        return None
    return found


_EXPERTS = "moe.routed_experts.inner_experts."
"""The routed experts' parameter names in a layer (torchtitan's ``apply_fsdp_to_decoder`` puts exactly these on the
sparse FSDP mesh)."""


@dataclasses.dataclass(frozen=True)
class _Moe:
    """What a MoE layer's routing holds per microbatch, from its config and local shapes."""

    top_k: int
    topk_per_token: int
    """Elements of every ``topk`` the router makes per token: the top-k experts, and with node-limited routing the
    top 2 of each group and the top groups (each a float32 value and an int64 index)."""
    hidden: int
    """A routed expert's hidden dim (``w1_EFD``'s dim 1), EP-local."""
    ep: int
    expert_share: int
    """Tokens entering the experts per rank are the microbatch's / this (``tp`` under EP: sequence-sharded)."""
    router_share: int


def _moe_of(layer_cfg: Any, tensors: Sequence[tuple[str, tuple[int, ...]]], *, ep: int, tp: int, sp: bool
            ) -> _Moe | None:
    moe = getattr(layer_cfg, "moe", None)
    w1 = [shape for name, shape in tensors if name.startswith(_EXPERTS + "w1")]
    if moe is None or not w1:
        return None
    router = moe.router
    groups = router.num_expert_groups or 0
    limited = (router.num_limited_groups or 0) if groups else 0
    return _Moe(top_k=router.top_k, topk_per_token=router.top_k + 2 * groups + limited, hidden=w1[0][1], ep=ep,
                expert_share=tp if ep > 1 else 1, router_share=tp if ep > 1 and sp else 1)


def kv_width(attention_cfg: Any, dim: int) -> int:
    """Elements of one token's K and V together at TP 1, as the attention op takes them: MLA (DeepSeek-V3)
    ``n_heads x (qk_nope + qk_rope)`` and ``n_heads x v_head_dim``; GQA ``2 x n_kv_heads x head_dim``."""
    heads = attention_cfg.n_heads
    if getattr(attention_cfg, "qk_nope_head_dim", None):
        a = attention_cfg
        return heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) + heads * a.v_head_dim
    kv_heads = getattr(attention_cfg, "n_kv_heads", None) or heads
    head_dim = getattr(attention_cfg, "head_dim", None) or dim // heads
    return 2 * kv_heads * head_dim


def _with_cp_kv(block: BlockShapes, *, cp: int, ac: str, kv_bytes: int) -> BlockShapes:
    """A layer under context parallelism (torchtitan 0.3.0's FlexAttention path, ``apply_cp_to_forward``): its
    attention all-gathers K and V over the ``cp`` ranks (``flex_cp_allgather``) and computes on the whole sequence's
    K/V, which flex attention saves for its backward. ``kv_bytes``: this rank's own K/V (``tokens / cp``). Without
    checkpointing the gathered K/V (``cp x kv_bytes``; the local ones they are made from counted beside them) are
    saved to the backward; under selective checkpointing (the gather is no op its policy saves) and full
    checkpointing they are regathered inside the backward: held while the layer's forward and backward run."""
    if cp <= 1:
        return block
    gathered = cp * kv_bytes
    if ac == "none":
        return dataclasses.replace(block, saved_bytes=block.saved_bytes + gathered)
    return dataclasses.replace(block, forward_transient_bytes=block.forward_transient_bytes + gathered,
                               backward_transient_bytes=block.backward_transient_bytes + gathered)


def _attention_stats(attention_cfg: Any) -> int:
    """float32 values per head and token that the attention op returns beside its output (all kept by SAC): flex
    attention's log-sum-exp and max scores (torch's ``flex_attention`` returns both), else a log-sum-exp."""
    inner = type(getattr(attention_cfg, "inner_attention", None)).__qualname__.lower()
    return 2 if "flex" in inner else 1


def _forward_linears(tensors: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's 2-D weights in the order its forward multiplies by them: registration order, except that a gated
    FFN (``w1``, ``w2``, ``w3`` under one prefix) runs ``w2(silu(w1(x)) * w3(x))``: w1, w3, w2."""
    linears = [(n, s) for n, s in tensors if len(s) == 2 and n.endswith(".weight")]
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in linears:
        if name.endswith("w2.weight"):
            w3 = name[: -len("w2.weight")] + "w3.weight"
            if any(n == w3 for n, _ in linears):
                continue  # placed after its w3
        out.append((name, shape))
        if name.endswith("w3.weight"):
            w2 = name[: -len("w3.weight")] + "w2.weight"
            out.extend((n, s) for n, s in linears if n == w2)
    return out


def _sac_saved_bytes(tensors: Sequence[tuple[str, tuple[int, ...]]], *, tokens: int, norm_tokens: int, dim: int,
                     sp: bool, tp: int, act_bytes: int, heads: int, moe: _Moe | None, functional_comm: bool,
                     forced_recompute: Sequence[str] = ("moe.router.gate",), attention_stats: int = 1) -> int:
    """What torchtitan 0.3.0's ``SelectiveAC`` keeps of one layer per microbatch (``docs/memory.md``): the
    checkpoint's input; the output of every second matmul in forward order, counting from the first (a matmul of
    the shape of a linear named in ``force_recompute_mm_shapes_by_fqns``, by default the router gate, is
    recomputed and not counted); the attention's output and its float32 statistics per head
    and token (``attention_stats``: flex attention's log-sum-exp and max scores; flex/varlen attention are in the
    save list); the router's ``topk`` outputs; and, where the collectives are
    ``_c10d_functional`` ops (not the default ``spmd_types`` backend, whose collectives are c10d ops outside the
    list), the reduce-scatters' and the EP all-to-alls' outputs. Grouped matmuls (``_grouped_mm``) are not in the
    list: the routed experts are recomputed."""
    elements, count = norm_tokens * dim, 0
    linears = _forward_linears(tensors)
    forced = {shape for name, shape in linears if any(f in name for f in forced_recompute)}
    for name, shape in linears:
        if shape in forced:
            continue
        count += 1
        if count % 2:
            elements += tokens * shape[0]
        if functional_comm and sp and tp > 1 and name.rsplit(".", 2)[-2] in ("wo", "w2"):
            elements += norm_tokens * dim  # the reduce-scatter's output
    total = elements * act_bytes
    wo = [shape for name, shape in tensors if name.endswith("attention.wo.weight")]
    if wo:
        total += tokens * wo[0][1] * act_bytes + tokens * heads * 4 * attention_stats
    if moe is not None:
        total += tokens // moe.router_share * moe.topk_per_token * (4 + 8)
        if moe.ep > 1 and functional_comm:
            total += 2 * tokens // moe.expert_share * moe.top_k * dim * act_bytes
    return total


def _layer_block(kind: str, tensors: tuple[tuple[str, tuple[int, ...]], ...], *, tokens: int, dim: int, tp: int,
                 sp: bool, ac: str, act_bytes: int, heads: int = 0, moe: _Moe | None = None,
                 functional_comm: bool = False, forced_recompute: Sequence[str] = ("moe.router.gate",),
                 attention_stats: int = 1) -> BlockShapes:
    """A transformer layer's saved activations per microbatch, from its local shapes (``docs/memory.md``):
    without checkpointing, each norm's input (sequence-sharded under SP), each linear's input (shared inputs
    once), the fused q/k/v projection (kept alive by v, a view of it), the rotated q and k, the attention output,
    and the gated FFN's w1 and w3 outputs and their SiLU (a MoE layer: each linear's input and the routed experts'
    tensors); with full checkpointing, only the layer's input, the rest being recomputed inside its backward;
    with selective checkpointing, what its policy saves (:func:`_sac_saved_bytes`). A MoE layer under EP also
    holds, while it computes forward or backward, the all-to-all's send and receive buffers."""
    norm_tokens = tokens // tp if sp else tokens
    roles = None if moe is not None else _linear_names(tensors)
    num_norms = sum(1 for name, shape in tensors if "norm" in name and len(shape) == 1)
    a2a = 0
    if roles is None:  # each 2-D weight's input
        elements = sum(tokens * shape[1] for _, shape in tensors if len(shape) == 2)
        if moe is not None:  # the routed tokens (tokens x top-k at balance) through the grouped FFN
            routed = tokens // moe.expert_share * moe.top_k
            elements += routed * (dim + 4 * moe.hidden) + routed * dim * 4 // act_bytes  # + combine's fp32 copy
            a2a = 2 * routed * dim * act_bytes if moe.ep > 1 else 0  # dispatch's send and receive buffers
    else:
        qkv_out = roles["wqkv"][0] if "wqkv" in roles else sum(roles[k][0] for k in ("wq", "wk", "wv") if k in roles)
        ffn = roles["w1"][0]
        elements = tokens * (dim + roles["wo"][1] + dim + roles["w2"][1])  # linear inputs: qkv, wo, w1/w3, w2
        q_out = roles["wo"][1]
        rotated = q_out + (qkv_out - q_out) // 2  # RoPE makes new q and k; v stays a view of the projection
        elements += tokens * (qkv_out + rotated + (3 if "w3" in roles else 1) * ffn)
    elements += num_norms * norm_tokens * dim
    full = elements * act_bytes
    workspace = 2 * tokens * dim * act_bytes
    if ac == "full":
        return BlockShapes(kind, tensors, saved_bytes=norm_tokens * dim * act_bytes,
                           forward_transient_bytes=full + a2a, backward_transient_bytes=full + workspace + a2a)
    if ac == "selective":
        saved = _sac_saved_bytes(tensors, tokens=tokens, norm_tokens=norm_tokens, dim=dim, sp=sp, tp=tp,
                                 act_bytes=act_bytes, heads=heads, moe=moe, functional_comm=functional_comm,
                                 forced_recompute=forced_recompute, attention_stats=attention_stats)
        return BlockShapes(kind, tensors, saved_bytes=saved, forward_transient_bytes=full + a2a,
                           backward_transient_bytes=full + workspace + a2a)
    if moe is not None:  # the formula above is coarse for a MoE layer; without checkpointing autograd keeps at
        # least every tensor SAC's policy saves (each saved op output is the next op's saved input)
        full = max(full, _sac_saved_bytes(tensors, tokens=tokens, norm_tokens=norm_tokens, dim=dim, sp=sp, tp=tp,
                                          act_bytes=act_bytes, heads=heads, moe=moe, functional_comm=functional_comm,
                                          forced_recompute=forced_recompute, attention_stats=attention_stats))
    return BlockShapes(kind, tensors, saved_bytes=full, forward_transient_bytes=a2a,
                       backward_transient_bytes=workspace + a2a)


# --- a `ppsim run`'s model -------------------------------------------------------------------------------------
_CANONICAL = {"embedding": "tok_embeddings", "head": "lm_head", "output": "lm_head"}
"""ppsim's builtin and older torchtitan block names -> torchtitan 0.3.0's stage module names."""


def _as_trained(shapes: JobShapes, training: Any, parallelism: Any, profile: Any) -> JobShapes:
    """``profile_shapes``' count turned back into the training job's: torchtitan's master, gathered and reduce dtypes,
    AdamW's two states, ``fully_shard`` on every stage, sends not held (as without a profile); the profile's measured
    activations (and device workspace) stay, in the profile's dtype (said when it is not the job's)."""
    notes = [n for n in shapes.notes if not n.startswith("counted as `ppsim run`")]
    notes.append(f"counted as torchtitan trains the job ({training.dtype} parameters, AdamW, fully_shard on every "
                 f"stage), with the profile's device ({profile.device}) for what it measured")
    if profile.model.dtype != training.mixed_precision_param:
        notes.append(f"the profile measured activations in {profile.model.dtype}; the job computes in "
                     f"{training.mixed_precision_param}: counted as measured (calibrate with --dtype "
                     f"{training.mixed_precision_param} to match)")
    return dataclasses.replace(
        shapes, master_dtype=training.dtype, param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce, optimizer_states=2, fsdp=True, fsdp_only_sharded=False,
        all_sends_held=False, reshard_after_forward=parallelism.fsdp_reshard_after_forward == "always",
        notes=tuple(notes))


def profile_shapes(profile: Any, *, tp: int, seq_len: int, mb_size: int, activation_checkpoint: str = "none"
                   ) -> JobShapes:
    """The job as ``ppsim run`` executes it on the device ``profile`` was measured on (what ``plan`` and ``simulate
    --torchtitan-config --profile`` judge): the profile's model at ``seq_len`` x ``mb_size`` tokens per microbatch
    and ``tp``, in the profile's dtype (no mixed precision, no optimizer state: a run takes no optimizer step),
    ``fully_shard`` only where FSDP or TP shards (``JobShapes.fsdp_only_sharded``), and the saved activations the
    profile measured per block where it covers the shape (same tokens per microbatch and TP, no activation
    checkpointing), else the formula (said in the notes)."""
    from ppsim.calibrate.models import ModelOptions, parse_model_source

    info = profile.source
    if info is None:
        raise JobMemoryError("the profile names no model source (a version-3 profile does); re-run `ppsim calibrate`"
                             " to judge memory from it")
    options = {k: v for k, v in dict(info.options).items() if k in ModelOptions.__dataclass_fields__}
    options.update(seq_len=seq_len, mb_size=mb_size, dtype=profile.model.dtype)
    source = parse_model_source(info.source, ModelOptions(**options), device=profile.device)
    covers = (seq_len * mb_size == profile.model.seq_len * profile.model.mb_size
              and tp == profile.tensor_parallel_degree and activation_checkpoint == "none")
    shapes = run_shapes(source, tp=tp, fsdp=True, profile=profile if covers else None, ac=activation_checkpoint)
    note = (f"counted as `ppsim run` holds the job on the profile's device ({profile.device}, {profile.model.dtype}, "
            "no optimizer state, fully_shard only where FSDP or TP shards)")
    if not covers:
        note += (f"; activations from the formula: the profile measured {profile.model.seq_len * profile.model.mb_size}"
                 f" tokens per microbatch at TP {profile.tensor_parallel_degree} without checkpointing, not "
                 f"{seq_len * mb_size} at TP {tp} with activation_checkpoint {activation_checkpoint!r}")
    return dataclasses.replace(shapes, fsdp_only_sharded=True, notes=(*shapes.notes, note))


def run_shapes(source: Any, *, tp: int = 1, fsdp: bool = False, profile: Any = None, ac: str = "none", ep: int = 1,
               dp_shard: int = 1) -> JobShapes:
    """The shapes of what ``ppsim run`` executes (a :class:`~ppsim.calibrate.models.ModelSource` at its microbatch
    shape and dtype, no mixed precision, no optimizer step), for :func:`ppsim.job.memory.job_memory`.

    Parameters: the model built on the meta device (``tp`` > 1: torchtitan's parallelize on a fake process group,
    as :func:`job_shapes`). Saved activations per block: the profile's ``activation_bytes`` (what this device's
    kernels save, measured by ``ppsim calibrate`` before the run) when ``profile`` has blocks of this shape, else
    the formula of :func:`_layer_block` (which counts what flash attention saves, not CPU math attention), under
    checkpoint mode ``ac`` (``none``/``full``). ``ep`` > 1 (a MoE model, EP carved out of ``dp_shard`` x ``tp``): the
    routed experts EP-local and FSDP-sharded on ``efsdp``, each MoE layer's routing and all-to-all buffers counted
    as :func:`job_shapes` counts them."""
    import torch

    cfg = source.config
    tokens, dim = cfg.seq_len * cfg.mb_size, cfg.hidden
    act_bytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    layer_cfgs: list[Any] = []
    if tp > 1 or ep > 1:
        from ppsim.calibrate.models.torchtitan import ep_parallelism, prepared_config

        buffers: dict[str, int] = {}
        model_cfg = prepared_config(source, ep_parallelism(ep, tp))  # the sharding plan: TP-local shapes
        layer_cfgs = list(model_cfg.layers)
        local = _local_shapes(model_cfg, tp, buffers, ep=ep, dp_shard=dp_shard)
    else:
        local, buffers = _meta_shapes(source), _buffer_bytes(source)
    local = {_CANONICAL.get(k, k): v for k, v in local.items()}
    # a profile measures activations without checkpointing: under it, the formula's count of what the policy saves
    measured = _profile_activations(profile, source.num_layers) if profile is not None and ac == "none" else None
    # inside a layer's backward, beyond the formula's workspace: the FFN's three ffn-wide gradients, or (CPU math
    # attention) one gradient of the attention probabilities, whichever is larger
    probs = cfg.mb_size * (cfg.heads // tp) * cfg.seq_len ** 2 if source.device == "cpu" else 0
    layer_extra = max(3 * tokens * (cfg.ffn // tp), probs) * act_bytes
    blocks: dict[str, BlockShapes] = {}
    for i in range(source.num_layers):
        tensors = local[f"layers.{i}"]
        moe = _moe_of(layer_cfgs[i], tensors, ep=ep, tp=tp, sp=tp > 1) if ep > 1 else None
        block = _layer_block("layer", tensors, tokens=tokens, dim=dim, tp=tp, sp=tp > 1, ac=ac,
                             act_bytes=act_bytes, heads=cfg.heads // tp, moe=moe,
                             functional_comm=tp > 1 or ep > 1)  # the runner's partial_dtensor collectives
        if moe is not None:
            block = dataclasses.replace(block, sparse=frozenset(n for n, _ in tensors if n.startswith(_EXPERTS)))
        block = dataclasses.replace(block, buffer_bytes=buffers.get(f"layers.{i}", 0),
                                    backward_transient_bytes=block.backward_transient_bytes + layer_extra,
                                    weight_grad_stash_bytes=_output_grad_bytes(local[f"layers.{i}"], tokens,
                                                                               act_bytes))
        if measured is not None:
            block = dataclasses.replace(block, saved_bytes=measured[f"layers.{i}"])
        blocks[f"layers.{i}"] = block
    vocab_local = local["lm_head"][0][1][0]
    head_saved = tokens * (dim + vocab_local) * act_bytes if measured is None else measured["lm_head"]
    blocks["tok_embeddings"] = BlockShapes("embedding", local["tok_embeddings"],
                                           saved_bytes=tokens * 8 if measured is None else measured["tok_embeddings"])
    blocks["norm"] = BlockShapes("head", local.get("norm", ()),
                                 saved_bytes=0 if measured is not None else tokens * dim * act_bytes)
    # the loss's and the log-softmax's logits-sized gradients (fp32); each weight's new gradient before it is added
    # into the held one is ppsim.job.memory's
    blocks["lm_head"] = BlockShapes("head", local["lm_head"], saved_bytes=head_saved,
                                    backward_transient_bytes=2 * tokens * vocab_local * 4,
                                    weight_grad_stash_bytes=_output_grad_bytes(local["lm_head"], tokens, act_bytes))
    blocks["norm"] = dataclasses.replace(blocks["norm"], weight_grad_stash_bytes=_output_grad_bytes(
        local.get("norm", ()), tokens, act_bytes))
    blocks["tok_embeddings"] = dataclasses.replace(blocks["tok_embeddings"], weight_grad_stash_bytes=(
        _output_grad_bytes(local["tok_embeddings"], tokens, act_bytes, embedding=True)))
    where = ("the profile's measured activation bytes per block" if measured is not None else
             "the activation formula" + (" (the profile does not cover this shape)" if profile is not None else ""))
    workspace = _workspace_bytes(profile)
    notes = (f"activations from {where}",
             *([f"device workspace {workspace / 2**20:.1f} MiB (cuBLAS, as calibrated)"] if workspace else []))
    return JobShapes(source=source.text, blocks=blocks, tp=tp, boundary_bytes=tokens * dim * act_bytes,
                     logits_bytes=tokens * vocab_local * act_bytes, all_sends_held=True, master_dtype=cfg.dtype,
                     receives_just_in_time=receives_just_in_time(torch.__version__),
                     param_dtype=cfg.dtype, reduce_dtype=cfg.dtype, fsdp=fsdp, optimizer_states=0, notes=notes,
                     workspace_bytes=workspace, **_moe_fields(layer_cfgs, tokens=tokens, tp=tp, dim=dim, ep=ep))


def _moe_fields(layer_cfgs: Sequence[Any], *, tokens: int, tp: int, dim: int, ep: int) -> dict[str, Any]:
    """The MoE layers' names, top-k and per-rank dispatch tokens for EP's all-to-alls (:mod:`ppsim.step.ep`); none at
    ``ep`` 1."""
    moe_cfgs = [(i, cfg.moe) for i, cfg in enumerate(layer_cfgs) if getattr(cfg, "moe", None) is not None]
    if ep <= 1 or not moe_cfgs:
        return {}
    return dict(moe_layers=tuple(f"layers.{i}" for i, _ in moe_cfgs), moe_top_k=moe_cfgs[0][1].router.top_k,
                moe_tokens=tokens // tp, dim=dim)


def _workspace_bytes(profile: Any) -> int:
    """The device libraries' workspace calibration measured (``method.workspace_bytes``; 0 without one)."""
    method = None if profile is None else profile.method
    return int(getattr(method, "workspace_bytes", None) or 0)


def _output_grad_bytes(tensors: Sequence[tuple[str, tuple[int, ...]]], tokens: int, act_bytes: int, *,
                       embedding: bool = False) -> int:
    """The gradients of a block's weighted outputs per microbatch (a linear's or a norm's ``shape[0]`` outputs per
    token, an embedding's width): what a split backward's I keeps for its W."""
    widths = [shape[1] if embedding else shape[0] for name, shape in tensors if name.endswith("weight") and shape]
    return tokens * sum(widths) * act_bytes


def _meta_shapes(source: Any) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """Per top-level block, its parameters' shapes, from the unsplit model on the meta device."""
    model = source.build_full(device="meta")
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in model.named_parameters():
        block, rest = _block_of(name)
        out.setdefault(block, []).append((rest, tuple(p.shape)))
    return {k: tuple(v) for k, v in out.items()}


def _block_of(name: str) -> tuple[str, str]:
    """``layers.3.attention.wo.weight`` -> (``layers.3``, ``attention.wo.weight``); ``norm.weight`` -> (``norm``,
    ``weight``)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2]), ".".join(parts[2:])
    return parts[0], ".".join(parts[1:])


def _buffer_bytes(source: Any) -> dict[str, int]:
    """Per top-level block, its buffers' bytes, from the unsplit model on the meta device."""
    return _module_buffer_bytes(source.build_full(device="meta"))


def _module_buffer_bytes(model: Any) -> dict[str, int]:
    """Per top-level block (torchtitan's stage module names), the bytes of its buffers (e.g. torchtitan 0.3.0's
    per-layer RoPE cache), a DTensor's local part."""
    out: dict[str, int] = {}
    for name, b in model.named_buffers():
        block = _CANONICAL.get(_block_of(name)[0], _block_of(name)[0])
        local = getattr(b, "_local_tensor", b)
        out[block] = out.get(block, 0) + local.numel() * local.element_size()
    return out


def _profile_activations(profile: Any, num_layers: int) -> dict[str, int] | None:
    """Saved bytes per microbatch by stage module name from a version-2 profile's blocks and layout (``None``
    without blocks, without measured activations, or for another layer count)."""
    blocks, layout = getattr(profile, "blocks", None), getattr(profile, "layout", ())
    if not blocks or len(layout) != num_layers + 2:
        return None
    sizes = [blocks[kind].activation_bytes for kind in layout]
    if any(b is None for b in sizes):
        return None
    out = {f"layers.{i}": int(sizes[i + 1]) for i in range(num_layers)}
    out.update(tok_embeddings=int(sizes[0]), lm_head=int(sizes[-1]))
    return out
