"""Each pipeline rank's memory for a whole torchtitan job (PP x FSDP x TP), from the model's shapes, and the verdict
against a device's capacity. Plain data and arithmetic: the shapes come from ``ppsim.calibrate.torchtitan.shapes``
(which
builds the model on the meta device and shards it with torchtitan's own parallelize on a fake process group).

What a rank holds, as torchtitan 0.3.0 trains under PP (``parallelize_llama`` / ``apply_fsdp_to_decoder``, torch
2.13's FSDP2 and pipelining):

- **parameters**: each stage's TP-local tensors, FSDP-sharded over ``dp_shard`` x ``cp`` (``fully_shard`` pads dim 0
  to a multiple of the degree: ``ceil(rows / degree)`` rows per rank), stored in ``training.dtype`` (fp32 master);
  under EP the routed experts are EP-local (experts / ep) and sharded on ``efsdp`` (:attr:`BlockShapes.sparse`);
- **optimizer**: AdamW's two states per sharded element, in the master dtype;
- **gradients**: under PP the microbatches' gradients accumulate unsharded (``set_requires_gradient_sync(False)``
  until the last backward) in ``mixed_precision_reduce`` (fp32), from a stage's first weight gradient to its last
  backward, which reduce-scatters them into sharded master-dtype gradients held to the step's end;
- **other**: the gathered parameters (``mixed_precision_param``, bf16) of each stage, held from its first forward
  to its last backward (``reshard_after_forward`` is False under PP by default; ``"always"`` regathers per action),
  torch's p2p receive buffers (torch <= 2.14: one per microbatch and direction, made at set-up; torch >= 2.15
  allocates each just before its receive, :attr:`JobShapes.receives_just_in_time`), and the transient inside the
  action at the high point (a checkpointed layer's recomputed activations and the gradient workspace);
- **activations**: saved per (stage, microbatch) from its F to its backward, per layer kind from the shapes under
  the job's activation-checkpoint mode (``none``: every saved tensor; ``full``: each layer's input only), or only
  the stage's input for a (stage, microbatch) in ppsim's recompute set; each stage's output (torch's stage keeps it
  to the backward), and what a send to another rank holds until the runtime waits for it. Inside a backward the
  blocks run from the last, freeing their activations and making gradients as they go (:func:`_backward_step`).

The activation counts are a formula over the layer's shapes (documented in ``docs/memory.md``), not a trace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ppsim.errors import JobMemoryError
from ppsim.ir import ActionType, Schedule
from ppsim.job.allocator import AllocEvent
from ppsim.job.degrees import Degrees

if TYPE_CHECKING:
    from ppsim.result import SimResult

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float64": 8}
GIB = 2**30
PARTS = ("parameters", "gradients", "optimizer", "activations", "other")


@dataclass(frozen=True)
class BlockShapes:
    """One block (the embedding, a layer, or the head) as one rank holds it after tensor parallelism."""

    kind: str
    """``embedding``, ``head`` or a layer kind (e.g. ``layer`` or ``moe``)."""
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    """Each parameter's name (within the block) and TP-local shape."""
    saved_bytes: int
    """Activations saved per microbatch under the job's checkpoint mode (the backward's input)."""
    forward_transient_bytes: int = 0
    """Held only while its forward runs (a checkpointed layer's intermediates)."""
    backward_transient_bytes: int = 0
    """Held only while its backward runs (recomputed activations, the gradient workspace)."""
    weight_grad_stash_bytes: int = 0
    """Held from a split backward's I to its W: the gradients of the weights' outputs that W needs (torch's
    ``stage_backward_input`` keeps them for ``stage_backward_weight``)."""
    buffer_bytes: int = 0
    """The block's buffers (e.g. torchtitan 0.3.0's per-layer RoPE cache), held for the whole run."""
    sparse: frozenset[str] = frozenset()
    """The routed experts' tensors (``moe.routed_experts.inner_experts.*``, EP-local in ``tensors``: dim 0 is
    experts / ep), which torchtitan's ``apply_fsdp_to_decoder`` shards on the sparse FSDP mesh (``efsdp``) when
    EP > 1, on dim 1 instead of dim 0 where that mesh is larger than the local experts."""

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    def sharded_numel(self, dp_shard: int, efsdp: int | None = None) -> int:
        """Elements per rank after FSDP: dim 0 padded to a multiple of ``dp_shard`` (the dense FSDP mesh); the
        :attr:`sparse` tensors on ``efsdp`` (``None``: the dense mesh, EP 1), dim 1 where it exceeds dim 0."""
        total = 0
        for name, shape in self.tensors:
            if not shape:
                total += 1
                continue
            degree = (efsdp or dp_shard) if name in self.sparse else dp_shard
            dim = 1 if name in self.sparse and len(shape) > 1 and degree > shape[0] else 0
            total += -(-shape[dim] // degree) * math.prod(shape) // shape[dim]
        return total


@dataclass(frozen=True)
class JobShapes:
    """The job's model as one TP rank holds it, with the dtypes and activation sizes that decide its memory."""

    source: str
    blocks: Mapping[str, BlockShapes]
    """By module name: ``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head`` (torchtitan's stage module names)."""
    tp: int
    boundary_bytes: int
    """One microbatch's hidden state as a stage sends it (a p2p buffer): ``tokens / tp`` x dim under sequence
    parallelism, as torchtitan's trainer runs the pipeline (inside its SPMD context)."""
    master_dtype: str = "float32"
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    activation_checkpoint: str = "none"
    reshard_after_forward: bool = False
    notes: tuple[str, ...] = ()
    fsdp: bool = True
    """``fully_shard`` applied (torchtitan applies it even at ``dp_shard`` 1): each stage's parameters are gathered
    into a second, unsharded copy while it computes. False: the module's own parameters are used (a plain PP run)."""
    all_sends_held: bool = False
    """Every send to another rank is held to the step's end, as ppsim run's runtimes do on CPU/gloo (torch's
    ``_PipelineScheduleRuntime`` waits for its sends only then; ppsim's DualPipeV executor too): measured. False (the
    training job without a profile): not counted; on NCCL whether the allocator frees a sent block when the send
    completes or at its wait is not yet checked on a GPU."""
    fsdp_only_sharded: bool = False
    """``fully_shard`` applied only where ``dp_shard`` x ``tp`` > 1, as ``ppsim run`` applies it (torchtitan applies it
    always)."""
    optimizer_states: int = 2
    """Optimizer states per sharded element (AdamW: 2; a run without an optimizer step: 0)."""
    logits_bytes: int = 0
    """The last stage's output per microbatch (the logits), which torch's stage keeps from the forward to the
    backward like every stage's output (0: counted as ``boundary_bytes``)."""
    workspace_bytes: int = 0
    """What the device's libraries keep allocated through the step beyond any tensor (cuBLAS's workspace per thread
    that multiplies), as calibration measured it on the device (``method.workspace_bytes``); 0 where none is seen or
    no profile says (on CUDA torch's default is 32 MiB a thread on Hopper)."""
    receives_just_in_time: bool = False
    """torch >= 2.15's ``PipelineStage`` (pytorch/pytorch#193872): each receive buffer is allocated just before its
    receive and handed to the computation that consumes it, so nothing is held for the step: a received activation
    is the stage's input, held with the microbatch's activations from its F to its backward; a received gradient
    lives through the backward that consumes it. False: torch 2.13/2.14, which make one receive buffer per
    microbatch and direction when the schedule prepares the stage and keep them for the whole run."""
    moe_layers: tuple[str, ...] = ()
    """The MoE layers' module names (``layers.N``: those whose config has a ``moe``), for EP's all-to-alls
    (:mod:`ppsim.step.ep`); empty for a dense model."""
    moe_top_k: int = 0
    """Experts each token is routed to (the router's ``top_k``)."""
    moe_tokens: int = 0
    """Tokens of one microbatch entering one rank's dispatch: the microbatch's tokens / tp (torchtitan's EP shards
    the sequence over the TP ranks before it dispatches)."""
    dim: int = 0
    """The model's hidden size: what a dispatched or combined token carries, in ``param_dtype``."""
    cp_kv_bytes: int = 0
    """Under context parallelism: one rank's K and V of one layer and microbatch (``tokens / cp`` of them, TP-local,
    in ``param_dtype``), which each layer's attention all-gathers over the ``cp`` ranks (:mod:`ppsim.step.cp`); 0
    without CP."""


@dataclass(frozen=True)
class RankMemory:
    """One PP rank's high point: its parts (summing to ``peak_memory_bytes``) and the action it happens in."""

    rank: int
    parts: Mapping[str, int]
    during: str
    cap_bytes: int | None = None
    static_bytes: Mapping[str, int] = field(default_factory=dict)
    """Sharded parameters, optimizer and gradients, the gathered parameters and the p2p buffers, in bytes."""
    end_bytes: int = 0
    """Held after the rank's last action (between steps, before the optimizer frees the gradients)."""
    start_bytes: int = 0
    """Held before the rank's first action (parameters, optimizer state, buffers, the device's workspace)."""
    over_time: tuple[tuple[int, int], ...] = ()
    """Per action of the rank that computes, in its order: (what it changes when it ends, its high point above what
    was held before it): the same count as the peak, for the simulator's memory over time (:func:`with_job_memory`;
    actions that only communicate, such as FSDP's ``UNSHARD``, change nothing)."""
    events: tuple[AllocEvent, ...] = ()
    """The same count as tensors allocated and freed, each with its stream (:func:`memory_events`; empty unless
    asked for): per action their sum is ``over_time``'s change, and their running high point its high point."""
    reserved: Any = None
    """The caching allocator's replay of :attr:`events` and the bytes outside it
    (:class:`ppsim.job.outside.RankReserved`), where the command asked for it; None otherwise."""

    @property
    def peak_memory_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        """Against the cap: the allocator's reserved peak plus what lives outside it where the allocator was
        replayed (:attr:`reserved`), else the tensors' peak; ``None`` without a cap."""
        if self.reserved is not None and self.reserved.cap_bytes is not None:
            return bool(self.reserved.fits)
        return None if self.cap_bytes is None else self.peak_memory_bytes <= self.cap_bytes

    def verdict(self) -> str:
        """``fits, X GiB free`` or ``over by X GiB on rank r during <action>`` (empty without a cap), on reserved plus
        outside where the allocator was replayed (said in brackets), else on the tensors' peak."""
        res = self.reserved
        if res is not None and res.cap_bytes is not None:
            return self._reserved_verdict(res)
        if self.cap_bytes is None:
            return ""
        gap = (self.cap_bytes - self.peak_memory_bytes) / GIB
        if gap >= 0:
            return f"fits, {gap:.2f} GiB free"
        return f"over by {-gap:.2f} GiB on rank {self.rank} during {self.during}"

    def _reserved_verdict(self, res: Any) -> str:
        if res.trace.oom is not None:
            oom = res.trace.oom
            need = oom.reserved_bytes + oom.nbytes + res.outside_allocator_bytes - res.cap_bytes
            return (f"over by {max(need, 0) / GIB:.2f} GiB on rank {self.rank} during {self.during} (out of memory: "
                    f"the allocator could not reserve {oom.nbytes / GIB:.2f} GiB more at "
                    f"{oom.reserved_bytes / GIB:.2f} GiB reserved, + {res.outside_allocator_bytes / GIB:.2f} GiB "
                    "outside it)")
        gap = (res.cap_bytes - res.device_bytes) / GIB
        if gap >= 0:
            return f"fits, {gap:.2f} GiB free (reserved + outside)"
        return f"over by {-gap:.2f} GiB on rank {self.rank} during {self.during} (reserved + outside)"

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "peak_memory_bytes": self.peak_memory_bytes, "memory_parts": dict(self.parts),
                "fits": self.fits, "during": self.during, "verdict": self.verdict() or None,
                "held": dict(self.static_bytes), "end_bytes": self.end_bytes}


# --- the count -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    sharded: int
    """Elements per rank after TP and FSDP."""
    gathered: int
    """Elements per rank after TP (FSDP's all-gather)."""
    saved: int
    kept: int
    fwd_transient: int
    buffers: int
    stash: int
    output: int
    """The stage's output per microbatch, which torch's stage keeps (``fwd_cache``) from the forward to the
    backward: the boundary hidden state, or the last stage's logits."""
    sent_output: bool
    """Its output goes to another rank by a send held to the step's end (it outlives the backward)."""
    sent_grad: int
    """Bytes of its input gradient sent to another rank by a send held to the step's end, per backward."""
    recv_input: int
    """A received input held from the microbatch's F to its backward (just-in-time receives; 0 at set-up)."""
    recv_grad: int
    """A received output gradient held through the backward that consumes it (just-in-time receives; 0 at set-up)."""
    first: bool
    """No stage before it: its input needs no gradient, so torch's ``backward_one_chunk`` skips the split backward's
    I and its W runs the whole backward."""
    backward_high: tuple[int, int, int]
    """A full backward's high point as (this microbatch's saved activations still held, the stage's gradients made
    so far, transient), the stage's first backward: the blocks run backward from the last, each freeing its saved
    tensors and leaving its weights' gradients, so block ``j`` holds the saved tensors of blocks ``<= j``, the
    gradients of blocks ``>= j`` and its own transient (:func:`_backward_high`)."""
    accumulating_high: tuple[int, int, int]
    """The same once the stage holds its gradients (counted in the state): each weight's new gradient is made, then
    added into the held one."""
    input_high: int
    """A split backward's I over the held state (it frees nothing): the blocks run backward from the last, each
    adding its weighted outputs' gradients to the stash, so block ``j`` adds the stash of blocks ``>= j`` and its
    own transient."""
    weight_grad: int
    """The largest weight's new gradient (a split backward's W, once gradients are held)."""
    unit: int = 0
    """The largest ``fully_shard`` unit's elements (a block) as one rank gathers them."""
    kept_gathered: int = 0
    """Elements of the stage's units that stay gathered from their forward to their backward without a pipeline
    (the norm and the head: torchtitan does not reshard them after forward)."""
    saved_pieces: tuple[int, ...] = ()
    """Each block's saved bytes, in forward order (the tensors :func:`memory_events` allocates)."""
    numel_pieces: tuple[int, ...] = ()
    """Each block's elements as one TP rank holds them (gathered, unsharded gradients)."""
    sharded_pieces: tuple[int, ...] = ()
    """Each block's elements after FSDP (parameters, optimizer states, sharded gradients)."""
    buffer_pieces: tuple[int, ...] = ()
    kept_pieces: tuple[int, ...] = ()
    """The elements of the blocks in :attr:`kept_gathered`."""


def receives_just_in_time(torch_version: str) -> bool:
    """Whether torch ``torch_version``'s ``PipelineStage`` allocates each receive buffer just before its receive
    (2.15 on, pytorch/pytorch#193872) rather than one per microbatch and direction at set-up (2.13, 2.14):
    :attr:`JobShapes.receives_just_in_time`."""
    release = torch_version.split("+")[0].split(".")[:2]
    try:
        return (int(release[0]), int("".join(ch for ch in release[1] if ch.isdigit()) or 0)) >= (2, 15)
    except (IndexError, ValueError):
        return False


def _backward_high(blocks: Sequence[BlockShapes], grads: Sequence[int],
                   transients: Sequence[int]) -> tuple[int, int, int]:
    """(saved, gradients, transient) at the block where a full backward peaks; ``grads[j]``: block ``j``'s gradients
    made by this backward; ``transients[j]``: what else it holds while block ``j`` runs."""
    high, prefix = (0, 0, 0), 0
    for j, block in enumerate(blocks):
        prefix += block.saved_bytes
        here = (prefix, sum(grads[j:]), max(block.backward_transient_bytes, transients[j]))
        if sum(here) > sum(high):
            high = here
    return high


def _stage_of(shapes: JobShapes, modules: Sequence[str], dp_shard: int, *, first: bool = False,
              last: bool = False, sent: tuple[bool, bool] = (False, False), efsdp: int | None = None) -> _Stage:
    missing = [m for m in modules if m not in shapes.blocks]
    if missing:
        raise JobMemoryError(f"stage modules {', '.join(missing[:3])} are not in {shapes.source}'s model; the job's "
                           "module lists must name its modules")
    blocks = [shapes.blocks[m] for m in modules]
    grad_bytes = DTYPE_BYTES[shapes.param_dtype]  # a new gradient has its parameter's (gathered) dtype
    new = [max((math.prod(shape) for _, shape in b.tensors), default=0) * grad_bytes for b in blocks]
    held = [b.numel * DTYPE_BYTES[shapes.reduce_dtype] for b in blocks]  # accumulated unsharded (FSDP: reduce dtype)
    none = [0] * len(blocks)
    return _Stage(
        sharded=sum(b.sharded_numel(dp_shard, efsdp) for b in blocks), gathered=sum(b.numel for b in blocks),
        saved=sum(b.saved_bytes for b in blocks), kept=shapes.boundary_bytes,
        fwd_transient=max((b.forward_transient_bytes for b in blocks), default=0),
        buffers=sum(b.buffer_bytes for b in blocks), stash=sum(b.weight_grad_stash_bytes for b in blocks),
        output=shapes.logits_bytes if last and shapes.logits_bytes else shapes.boundary_bytes, first=first,
        sent_output=sent[0], sent_grad=shapes.boundary_bytes if sent[1] else 0,
        recv_input=shapes.boundary_bytes if shapes.receives_just_in_time and not first else 0,
        recv_grad=shapes.boundary_bytes if shapes.receives_just_in_time and not last else 0,
        backward_high=_backward_high(blocks, held, none), accumulating_high=_backward_high(blocks, none, new),
        input_high=max((sum(b.weight_grad_stash_bytes for b in blocks[j:]) + blocks[j].backward_transient_bytes
                        for j in range(len(blocks))), default=0),
        weight_grad=max(new, default=0), unit=max((b.numel for b in blocks), default=0),
        kept_gathered=sum(b.numel for m, b in zip(modules, blocks) if m in ("norm", "lm_head", "output")),
        saved_pieces=tuple(b.saved_bytes for b in blocks), numel_pieces=tuple(b.numel for b in blocks),
        sharded_pieces=tuple(b.sharded_numel(dp_shard, efsdp) for b in blocks),
        buffer_pieces=tuple(b.buffer_bytes for b in blocks),
        kept_pieces=tuple(b.numel for m, b in zip(modules, blocks) if m in ("norm", "lm_head", "output")),
    )


def stage_numels(shapes: JobShapes, stage_modules: Sequence[Sequence[str]]) -> list[int]:
    """Each stage's parameter elements as one TP rank holds them unsharded (what FSDP all-gathers)."""
    return [_stage_of(shapes, mods, 1).gathered for mods in stage_modules]


def job_memory(shapes: JobShapes, *, degrees: Degrees, schedule: Schedule,
               stage_modules: Sequence[Sequence[str]], recompute: AbstractSet[tuple[int, int]] = frozenset(),
               cap_bytes: int | None = None, with_events: bool = False,
               until_over: bool = False, buffered: int | None = None) -> list[RankMemory]:
    """Each PP rank's high point over ``schedule``'s order (its actions as the rank runs them), with its parts.

    ``stage_modules[s]``: stage ``s``'s module names (torchtitan's split), in forward order; ``recompute``: the
    (stage, microbatch) pairs whose activations are recomputed in their backward (only the stage's input is kept);
    ``with_events``: each rank's :attr:`RankMemory.events` too; ``until_over``: stop after the first rank over
    ``cap_bytes`` (the job does not fit whatever the others hold: ``plan`` judging thousands of candidates), so the
    list may end before the last rank; ``buffered``: the microbatches whose receive buffers are held from the
    step's start (default the schedule's: a shorter order judged for a longer one, ``plan``'s steady state)."""
    if len(stage_modules) != schedule.num_stages:
        raise JobMemoryError(f"the job splits the model into {len(stage_modules)} stages, the schedule has "
                           f"{schedule.num_stages}; the split must give each stage its modules")
    stages = [_stage_of(shapes, mods, degrees.fsdp, first=schedule.prev_stage(s) is None,
                        last=schedule.next_stage(s) is None, sent=_sends_held(shapes, schedule, s),
                        efsdp=degrees.efsdp)
              for s, mods in enumerate(stage_modules)]
    out = []
    for r in range(schedule.num_ranks):
        out.append(_rank_memory(shapes, schedule, stages, r, recompute, cap_bytes, degrees, with_events,
                                buffered=schedule.num_microbatches if buffered is None else buffered))
        if until_over and out[-1].fits is False:
            break
    return out


def memory_events(shapes: JobShapes, *, degrees: Degrees, schedule: Schedule,
                  stage_modules: Sequence[Sequence[str]],
                  recompute: AbstractSet[tuple[int, int]] = frozenset(),
                  buffered: int | None = None) -> list[tuple[AllocEvent, ...]]:
    """Each PP rank's tensors over the step, allocated and freed with their streams, from :func:`job_memory`'s
    own count (for :func:`ppsim.job.allocator.replay`; ``buffered`` as there)."""
    return [m.events for m in job_memory(shapes, degrees=degrees, schedule=schedule, stage_modules=stage_modules,
                                         recompute=recompute, with_events=True, buffered=buffered)]


def _sends_held(shapes: JobShapes, schedule: Schedule, stage: int) -> tuple[bool, bool]:
    """Whether ``stage``'s output and its input gradient go to another rank by a send held to the step's end."""
    if not shapes.all_sends_held:
        return False, False
    rank = schedule.stage_to_rank[stage]
    nxt, prev = schedule.next_stage(stage), schedule.prev_stage(stage)
    return (nxt is not None and schedule.stage_to_rank[nxt] != rank,
            prev is not None and schedule.stage_to_rank[prev] != rank)


class _EventLog:
    """The walk's byte counts as tensors (:class:`AllocEvent`): each part of the state (``act`` per stage and
    microbatch, ``gathered``, ``accum`` and ``grads`` per stage, the action's ``transient``) is a list of live
    tensors; each change of a part's bytes frees (the current stage's and microbatch's first, the latest first) or
    allocates tensors (a block's share each where the change is a stage's whole count, else one), frees before
    allocations, so the running total never passes the count's own high point."""

    STREAM = {"act": "compute", "gathered": "fsdp_all_gather", "accum": "compute", "grads": "fsdp_reduce_scatter",
              "transient": "compute"}

    def __init__(self, dtypes: tuple[int, int, int], no_pipeline: bool) -> None:
        self.master, self.param, self.reduce = dtypes
        self.no_pipeline = no_pipeline
        self.events: list[AllocEvent] = []
        self.live: dict[str, list[tuple[str, str, int, str]]] = {c: [] for c in (*self.STREAM, "setup")}
        self.level = dict.fromkeys(self.STREAM, 0)
        self.index, self.stage = -1, 0
        self.microbatch: int | None = 0
        self.st: _Stage | None = None
        self._n = 0
        self._blocks: dict[tuple[int, str], tuple[int, ...]] = {}

    def alloc(self, part: str, key: str, nbytes: int, stream: str) -> None:
        if nbytes <= 0:
            return
        self._n += 1
        tag = f"{part}:{key}#{self._n}"
        self.live[part].append((key, tag, nbytes, stream))
        self.events.append(AllocEvent(self.index, nbytes, stream, tag))

    def _key(self, part: str) -> str:
        return f"s{self.stage}mb{self.microbatch}" if part == "act" else f"s{self.stage}"

    def _free(self, part: str, amount: int) -> list[tuple[str, str, int, str]]:
        """Free ``amount`` bytes of ``part``; what a partly freed tensor leaves, to allocate again."""
        chunks, key = self.live[part], self._key(part)
        again = []
        for own in (True, False):  # the key's tensors first, then the others; each the latest first
            i = len(chunks) - 1
            while i >= 0 and amount > 0:
                k, tag, nbytes, stream = chunks[i]
                if (k == key) is own:
                    self.events.append(AllocEvent(self.index, -nbytes, stream, tag))
                    del chunks[i]
                    if nbytes > amount:
                        again.append((part, k, nbytes - amount, stream))
                    amount -= nbytes
                i -= 1
        return again

    def _per_block(self, part: str) -> tuple[int, ...]:
        """The current stage's bytes of ``part`` block by block (made once per stage and part)."""
        st = self.st
        if st is None:
            return ()
        key = (id(st), part)
        if key not in self._blocks:
            kept = st.kept_pieces if self.no_pipeline else st.numel_pieces
            self._blocks[key] = (st.saved_pieces if part == "act"
                                 else tuple(n * self.param for n in kept) if part == "gathered"
                                 else tuple(n * self.reduce for n in st.numel_pieces) if part == "accum"
                                 else tuple(n * self.master for n in st.sharded_pieces))
        return self._blocks[key]

    def _pieces(self, part: str, amount: int) -> list[int]:
        per = self._per_block(part)
        taken, total = [], 0
        for p in per:
            if p and total + p <= amount:
                taken.append(p)
                total += p
        return [amount - total, *taken]

    def move(self, target: Mapping[str, int], parts: Sequence[tuple[int, str]] = ()) -> None:
        """Bring each part to ``target`` (bytes); ``parts``: the transient's tensors on other streams."""
        allocs: list[tuple[str, str, int, str]] = []
        for part in self.STREAM:
            change = target[part] - self.level[part]
            if part == "transient":
                if change:
                    allocs += self._free(part, self.level[part])
                    rest = target[part]
                    for nbytes, stream in parts:
                        take = min(nbytes, rest)
                        allocs.append((part, "t", take, stream))
                        rest -= take
                    allocs.append((part, "t", rest, "compute"))
            elif change < 0:
                allocs += self._free(part, -change)
            elif change > 0:
                allocs += [(part, self._key(part), p, self.STREAM[part]) for p in self._pieces(part, change)]
            self.level[part] = target[part]
        for a in allocs:
            self.alloc(*a)

    def levels(self, state: Mapping[str, int], *, act: int = 0, grads: int = 0, transient: int = 0) -> dict[str, int]:
        return {"act": state["act"] + act, "gathered": state["gathered"],
                "accum": state["accum"] + (0 if self.no_pipeline else grads),
                "grads": state["grads"] + (grads if self.no_pipeline else 0), "transient": transient}


def _rank_memory(shapes: JobShapes, schedule: Schedule, stages: list[_Stage], rank: int,
                 recompute: AbstractSet[tuple[int, int]], cap_bytes: int | None, degrees: Degrees,
                 with_events: bool = False, *, buffered: int) -> RankMemory:
    master, param, reduce = (DTYPE_BYTES[d] for d in (shapes.master_dtype, shapes.param_dtype, shapes.reduce_dtype))
    if not shapes.fsdp or (shapes.fsdp_only_sharded and degrees.dp_shard * degrees.tp == 1):
        param = 0  # no gathered copy: the stored parameters are computed with
    own = schedule.stages_of(rank)
    sharded = sum(stages[s].sharded for s in own)
    m = buffered  # the receive buffers held from the start: one per microbatch and direction
    module_buffers = sum(stages[s].buffers for s in own)
    directions = [(schedule.prev_stage(s) is not None) + (schedule.next_stage(s) is not None) for s in own]
    buffers = module_buffers + (0 if shapes.receives_just_in_time else
                                sum(m * shapes.boundary_bytes * d for d in directions))
    # a first stage's I does nothing (torch skips it; its W is the whole backward)
    # communication actions (FSDP's UNSHARD/REDUCE_GRAD in a lowered step) hold nothing of their own here
    # (the action itself is the label: written out only for the high point, :func:`_label`)
    comps: list[tuple[Any, Any]] = []
    owner: list[int] = []
    skip_i = {s for s, st in enumerate(stages) if st.first}
    for pos, a in enumerate(schedule.actions[rank]):
        if a.is_compute:
            for c in a.computations:
                if not (c.stage in skip_i and c.type is ActionType.I):
                    comps.append((c, a))
                    owner.append(pos)
    backward = (ActionType.B, ActionType.W)
    firsts: dict[tuple[int, ActionType], int] = {}
    lasts: dict[tuple[int, ActionType], int] = {}
    first_grads: dict[int, int] = {}
    for i, (c, _) in enumerate(comps):
        kind = ActionType.B if c.type in backward or c.type is ActionType.I else c.type
        firsts.setdefault((c.stage, kind), i)
        lasts[(c.stage, kind)] = i
        if c.type in backward:
            first_grads.setdefault(c.stage, i)
    # ``sent``: the part of ``act`` held by sends, released when they are waited for at the step's end
    state = {"act": 0, "gathered": 0, "accum": 0, "grads": 0, "sent": 0}
    best: tuple[int, dict[str, int], str] = (-1, {}, "")
    high = 0  # the most held inside the action being walked
    no_pipeline = degrees.pp == 1 and param > 0
    log = _EventLog((master, param, reduce), no_pipeline) if with_events else None
    if log is not None:  # what is held before the step: one tensor per block and state, each receive buffer
        for s in own:
            for b, n in enumerate(stages[s].sharded_pieces):
                for k in range(1 + shapes.optimizer_states):
                    log.alloc("setup", f"s{s}b{b}" + (f"state{k}" if k else "param"), n * master, "compute")
            for b, n in enumerate(stages[s].buffer_pieces):
                log.alloc("setup", f"s{s}b{b}buffer", n, "compute")
        if not shapes.receives_just_in_time:
            for s, d in zip(own, directions):
                for k in range(m * d):
                    log.alloc("setup", f"s{s}recv{k}", shapes.boundary_bytes, "compute")
        log.alloc("setup", "workspace", shapes.workspace_bytes, "compute")

    fixed = (1 + shapes.optimizer_states) * sharded * master + buffers + shapes.workspace_bytes

    def consider(transient: int, extra_act: int, label: Any, extra_grads: int = 0,
                 parts: Sequence[tuple[int, str]] = ()) -> None:
        nonlocal best, high
        if log is not None:
            log.move(log.levels(state, act=extra_act, grads=extra_grads, transient=transient), parts)
        total = (fixed + state["accum"] + state["grads"] + extra_grads + state["act"] + extra_act + state["gathered"]
                 + transient)
        if total > high:
            high = total
        if total > best[0]:  # the parts only for a new high point (the same sum, part by part)
            best = (total, {"parameters": sharded * master, "gradients": state["accum"] + state["grads"] + extra_grads,
                            "optimizer": shapes.optimizer_states * sharded * master,
                            "activations": state["act"] + extra_act,
                            "other": state["gathered"] + buffers + transient + shapes.workspace_bytes}, label)

    def held() -> int:  # what the rank holds between computations
        return fixed + state["gathered"] + state["accum"] + state["grads"] + state["act"]

    start = held()
    over_time = [[0, 0] for _ in schedule.actions[rank]]  # per action: (change when it ends, its high - before)
    computes = [a.is_compute for a in schedule.actions[rank]]
    before = start
    for i, (c, label) in enumerate(comps):
        pos = owner[i]
        if i == 0 or owner[i - 1] != pos:  # the action's first computation
            before, high = held(), 0
        if log is not None:
            log.index, log.stage, log.microbatch, log.st = pos, c.stage, c.microbatch, stages[c.stage]
        _walk_one(shapes, stages, c, i, label, state=state, consider=consider, recompute=recompute,
                  dtypes=(master, param, reduce), firsts=firsts, lasts=lasts, first_grads=first_grads,
                  no_pipeline=no_pipeline)
        if log is not None:
            log.move(log.levels(state))
        over_time[pos] = [held() - before, max(high, held()) - before]
    consider(0, 0, "the step's end")
    end = ((2 + shapes.optimizer_states) * sharded * master + buffers + state["gathered"] + state["accum"]
           + state["act"] - state["sent"])
    static = {"parameters": sharded * master, "optimizer": shapes.optimizer_states * sharded * master,
              "gradients": sharded * master, "gathered_parameters": sum(stages[s].gathered for s in own) * param,
              "p2p_buffers": buffers - module_buffers, "module_buffers": module_buffers}
    return RankMemory(rank=rank, parts=best[1], during=str(best[2]), cap_bytes=cap_bytes, static_bytes=static,
                      end_bytes=end, start_bytes=start,
                      over_time=tuple((d, p) for (d, p), c in zip(over_time, computes) if c),
                      events=() if log is None else tuple(log.events))


def _walk_one(shapes: JobShapes, stages: list[_Stage], c: Any, i: int, label: Any, *, state: dict[str, int],
              consider: Any, recompute: AbstractSet[tuple[int, int]], dtypes: tuple[int, int, int],
              no_pipeline: bool,
              firsts: Mapping[tuple[int, ActionType], int], lasts: Mapping[tuple[int, ActionType], int],
              first_grads: Mapping[int, int]) -> None:
    """One computation ``c`` (the rank's ``i``-th) of the walk: its high points (``consider``), then what it keeps."""
    master, param, reduce = dtypes
    st, s, rc = stages[c.stage], c.stage, (c.stage, c.microbatch) in recompute
    saved = st.kept if rc else st.saved
    if no_pipeline:
        _no_pipeline_step(st, c.type, rc=rc, dtypes=dtypes, state=state, consider=consider, label=label,
                          first=i == firsts[(s, ActionType.F)], first_backward=i == first_grads.get(s),
                          last=i == lasts[(s, ActionType.B)])
        return
    if c.type is ActionType.F:
        if i == firsts[(s, ActionType.F)] or shapes.reshard_after_forward:
            state["gathered"] += st.gathered * param
        received = 0 if rc else st.recv_input  # a recomputed pair's kept input is the received one
        consider(st.fwd_transient, saved + received, label)
        state["act"] += saved + received + st.output
        if shapes.reshard_after_forward:
            state["gathered"] -= st.gathered * param
        return
    _backward_step(shapes, st, c.type, rc=rc, dtypes=(master, param, reduce), state=state, consider=consider,
                   label=label, first=i == first_grads.get(s), last=i == lasts[(s, ActionType.B)],
                   accumulating=i != first_grads.get(s, i))


def _no_pipeline_step(st: _Stage, kind: ActionType, *, rc: bool, dtypes: tuple[int, int, int],
                      state: dict[str, int], consider: Any, label: Any, first: bool, first_backward: bool,
                      last: bool) -> None:
    """One F or B of a job without a pipeline (``pipeline_parallel_degree`` 1, FSDP applied), as torchtitan's FSDP2
    defaults run it: each ``fully_shard`` unit (the embedding, each layer) is gathered for its forward and again for
    its backward, then resharded (the norm and head stay gathered from their forward to their backward), and each
    unit's gradient is reduce-scattered in its post-backward, so only the sharded gradients accumulate. A unit's
    gathered copy lives while it
    computes, with the next one's prefetched beside it (FSDP2's implicit prefetch): two of the largest unit. Its
    backward also holds that unit's unsharded gradient in the reduce dtype until the reduce-scatter; the sharded
    gradients (master dtype) are there from the first backward to the optimizer step, and later microbatches add
    into them. The norm and head stay gathered from the first forward to the last backward."""
    master, param, reduce = dtypes
    saved = st.kept if rc else st.saved
    units = 2 * st.unit * param
    gathering = ((st.unit * param, "fsdp_all_gather"),) * 2  # the unit computing and the next, prefetched
    if kind is ActionType.F:
        if first:
            state["gathered"] += st.kept_gathered * param
        consider(st.fwd_transient + units, saved, label, parts=gathering)
        state["act"] += saved + st.output
        return
    assert kind is ActionType.B, f"a job without a pipeline runs full backwards (1F1B on one rank), not {kind}"
    grads = st.sharded * master if first_backward else 0
    held, _, transient = st.backward_high
    recomputed = st.saved - st.kept if rc else 0
    consider(transient + units + st.unit * reduce + recomputed, held - saved, label, grads,
             parts=(*gathering, (st.unit * reduce, "compute")))
    state["act"] -= saved + st.output
    state["grads"] += grads
    if last:
        state["gathered"] -= st.kept_gathered * param


def _backward_step(shapes: JobShapes, st: _Stage, kind: ActionType, *, rc: bool, dtypes: tuple[int, int, int],
                   state: dict[str, int], consider: Any, label: Any, first: bool, last: bool,
                   accumulating: bool) -> None:
    """One B, I or W of stage ``st``: its high point (``consider``), then what it frees or keeps for W.

    A sent output or input gradient stays to the step's end where the runtime waits for its sends only then
    (:func:`_sends_held`). A full backward (B, or a first stage's W) holds the other microbatches' activations plus
    the stage's :attr:`_Stage.backward_high` (a recomputed pair first rebuilds all its saved tensors); an I frees
    nothing and adds
    what W needs (every weighted output's gradient, ``stash``; a recomputed pair's rebuilt activations); a W adds one
    weight's new gradient, then frees the saved tensors and the stash. ``dtypes``: the master, gathered and reduce
    dtypes' bytes."""
    master, param, reduce = dtypes
    if shapes.reshard_after_forward:  # every backward regathers its stage's parameters
        state["gathered"] += st.gathered * param
    saved = st.kept if rc else st.saved
    recomputed = st.saved - st.kept if rc else 0
    received = 0 if rc else st.recv_input
    if kind is ActionType.B or (kind is ActionType.W and st.first):
        held, grads, transient = st.accumulating_high if accumulating else st.backward_high
        # the first one's gradients counted as they come; a just-in-time received gradient lives through it
        consider(transient + st.recv_grad, held - saved, label, grads)
        state["act"] -= saved + received + (0 if st.sent_output else st.output) - st.sent_grad
        state["sent"] += (st.output if st.sent_output else 0) + st.sent_grad
        state["accum"] += st.gathered * reduce if first else 0
    elif kind is ActionType.I:
        consider(st.input_high - st.stash + recomputed + st.recv_grad, st.stash, label)
        state["act"] += st.stash + recomputed - (0 if st.sent_output else st.output) + st.sent_grad
        state["sent"] += (st.output if st.sent_output else 0) + st.sent_grad
    else:  # W: autograd.grad makes a parameter group's gradients, then each is added into the held one
        state["accum"] += st.gathered * reduce if first else 0
        consider(st.weight_grad if accumulating else 0, 0, label)
        state["act"] -= saved + received + st.stash + recomputed
    if kind is not ActionType.I and last:
        state["accum"] -= st.gathered * reduce
        state["grads"] += st.sharded * master
        state["gathered"] -= st.gathered * param
    elif shapes.reshard_after_forward:
        state["gathered"] -= st.gathered * param


def fmt_gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def with_job_memory(result: SimResult, memory: Sequence[RankMemory]) -> SimResult:
    """``result`` with its memory over time, per-rank peaks and cap flags from ``memory`` (:func:`job_memory` of
    the same order; the simulated step may hold communication actions besides, FSDP's ``UNSHARD``/``REDUCE_GRAD``,
    which change nothing), so a job's figure, table and verdict read one count."""
    import numpy as np

    delta: list[int] = []
    plus: list[int] = []
    for m, row in zip(memory, result.schedule.actions):
        entries = iter(m.over_time)
        for action in row:
            d, p = next(entries, (0, 0)) if action.is_compute else (0, 0)
            delta.append(d)
            plus.append(p)
    cap = next((m.cap_bytes for m in memory), None)
    return result.with_memory(static_bytes=[m.start_bytes for m in memory], byte_delta=np.array(delta, dtype=np.int64),
                              byte_plus=np.array(plus, dtype=np.int64), cap_bytes=cap)
