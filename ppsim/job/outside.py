"""What a rank's device holds outside torch's caching allocator, which an out-of-memory counts as much as the
allocator's reserved segments (:mod:`ppsim.job.allocator`): the CUDA context and NCCL's communicator buffers. Each is a
stated default with its source; a measured value replaces it (:func:`outside_allocator`'s ``measured``).

cuBLAS's workspace is *inside* the allocator (torch's ``aten/src/ATen/cuda/CublasHandlePool.cpp`` keeps one
``at::DataPtr`` per (handle, stream) taken from ``CUDACachingAllocator``; 32 MiB a handle on Hopper,
``CUBLAS_WORKSPACE_CONFIG`` ``:4096:2:16:8``), one handle per thread that multiplies (the forward's and autograd's
backward thread): calibration measured 64 MiB of allocator growth on an H100 (``method.workspace_bytes``). It is
therefore replayed as allocator events (:data:`CUBLAS_WORKSPACE_BYTES` x :data:`CUBLAS_HANDLES` where no profile
measured it), not counted here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ppsim.job.allocator import AllocatorTrace, AllocEvent, replay
from ppsim.job.degrees import Degrees

MiB = 1 << 20

CUDA_CONTEXT_BYTES = 500 * MiB
"""The CUDA context on an H100 with lazy module loading (``CUDA_MODULE_LOADING=LAZY``, the default from CUDA 11.7
and torch 1.13): about 500 MiB as ``nvidia-smi`` shows a process before its first tensor. Not measured by ppsim."""

NCCL_SIMPLE_BYTES = 1 << 22
"""NCCL's Simple-protocol buffer per connection (``NCCL_BUFFSIZE``, default ``DEFAULT_BUFFSIZE`` 4 MiB)."""
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
"""LL128's (``DEFAULT_LL128_BUFFSIZE``: 120 elements x 640 threads x 8 steps x 8 bytes = 4,915,200)."""
NCCL_LL_BYTES = 8 * 512 * 8 * 16
"""LL's (``DEFAULT_LL_BUFFSIZE``: 8 lines x 512 threads x 8 steps x 16 bytes = 524,288)."""
NCCL_CHANNELS = 16
"""Collective channels per communicator (NCCL chooses by topology; 16 is a typical ring count within an H100 node,
an assumption: ``NCCL_MAX_NCHANNELS`` caps it)."""
NCCL_P2P_CHANNELS_PER_PEER = 2
"""Channels a point-to-point peer connection uses (an assumption; Simple protocol only, per direction)."""
CUBLAS_WORKSPACE_BYTES = 32 * MiB
"""torch's default cuBLAS workspace per handle on Hopper (``CUBLAS_WORKSPACE_CONFIG`` ``:4096:8`` x 8 = 32 MiB)."""
CUBLAS_HANDLES = 2
"""Threads that multiply: the forward's and autograd's backward thread (each its own handle and workspace)."""

GIB = 1 << 30


@dataclass(frozen=True)
class OutsideTerm:
    name: str
    nbytes: int
    source: str
    """``default: ...`` (a stated default) or ``measured: ...``."""


@dataclass(frozen=True)
class OutsideAllocator:
    """A rank's bytes outside the caching allocator, term by term."""

    terms: tuple[OutsideTerm, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.terms)

    def to_dict(self) -> dict[str, dict[str, object]]:
        return {t.name: {"bytes": t.nbytes, "source": t.source} for t in self.terms}


def communicators(degrees: Degrees) -> list[tuple[str, int]]:
    """The process groups a rank's NCCL communicators serve, with their sizes (groups of one make none): FSDP's
    (``dp_shard`` x ``cp``), the sparse FSDP mesh under EP (``efsdp``), TP's, CP's (the K/V all-gathers), EP's,
    data-parallel replication's, and the world's default group (torchtitan's loss reduction and barriers)."""
    groups = [("fsdp", degrees.dp_shard * degrees.cp), ("tp", degrees.tp), ("cp", degrees.cp), ("ep", degrees.ep),
              ("dp_replicate", degrees.dp_replicate)]
    if degrees.ep > 1:
        groups.append(("efsdp", degrees.efsdp or 1))
    groups.append(("world", degrees.world_size))
    return [(name, size) for name, size in groups if size > 1]


def nccl_bytes(degrees: Degrees, *, pp_peers: int = 0, channels: int = NCCL_CHANNELS) -> list[OutsideTerm]:
    """NCCL's buffers per communicator: ``channels`` ring connections, each with the three protocols' buffers
    (9,633,792 bytes); the pipeline's point-to-point peers (``pp_peers``: the previous and next rank's) Simple
    buffers on :data:`NCCL_P2P_CHANNELS_PER_PEER` channels, send and receive. NVLS (NVLink SHARP) buffers and the
    tree's extra peers across nodes are not counted."""
    per_channel = NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES
    source = (f"default: {channels} channels x {per_channel:,} B (NCCL_BUFFSIZE 4 MiB + LL128 + LL buffers per "
              "ring connection; NCCL's DEFAULT_*BUFFSIZE)")
    terms = [OutsideTerm(f"nccl_{name}", channels * per_channel, source) for name, _ in communicators(degrees)]
    if pp_peers:
        terms.append(OutsideTerm("nccl_pp_p2p", pp_peers * NCCL_P2P_CHANNELS_PER_PEER * 2 * NCCL_SIMPLE_BYTES,
                                 f"default: {pp_peers} peers x {NCCL_P2P_CHANNELS_PER_PEER} channels x send and "
                                 "receive x NCCL_BUFFSIZE 4 MiB (Simple protocol only)"))
    return terms


def outside_allocator(degrees: Degrees, *, pp_peers: int = 0,
                      measured: Mapping[str, int] | None = None) -> OutsideAllocator:
    """A rank's bytes outside the allocator: the CUDA context and NCCL's buffers per communicator. ``measured``
    replaces a term by name (``cuda_context``, ``nccl`` for all of NCCL's, or one ``nccl_<group>``)."""
    measured = dict(measured or {})
    terms = [OutsideTerm("cuda_context", CUDA_CONTEXT_BYTES,
                         "default: H100, lazy module loading (about 500 MiB before the first tensor)")]
    if "nccl" in measured:
        terms.append(OutsideTerm("nccl", measured.pop("nccl"), "measured"))
    else:
        terms += nccl_bytes(degrees, pp_peers=pp_peers)
    out = [OutsideTerm(t.name, measured.pop(t.name), "measured") if t.name in measured else t for t in terms]
    out += [OutsideTerm(name, nbytes, "measured") for name, nbytes in measured.items()]
    return OutsideAllocator(tuple(out))


def pp_peers_of(schedule: object, rank: int) -> int:
    """The other ranks ``rank`` sends to or receives from in ``schedule`` (a :class:`ppsim.ir.Schedule`)."""
    peers = set()
    for s in schedule.stages_of(rank):  # type: ignore[attr-defined]
        for other in (schedule.prev_stage(s), schedule.next_stage(s)):  # type: ignore[attr-defined]
            if other is not None and schedule.stage_to_rank[other] != rank:  # type: ignore[attr-defined]
                peers.add(schedule.stage_to_rank[other])  # type: ignore[attr-defined]
    return len(peers)


@dataclass(frozen=True)
class RankReserved:
    """One rank's device memory as an out-of-memory judges it: the allocator's reserved peak (replayed) plus what
    lives outside it."""

    rank: int
    trace: AllocatorTrace
    outside: OutsideAllocator
    cap_bytes: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def reserved_peak_bytes(self) -> int:
        return self.trace.reserved_peak_bytes

    @property
    def outside_allocator_bytes(self) -> int:
        return self.outside.total_bytes

    @property
    def device_bytes(self) -> int:
        return self.reserved_peak_bytes + self.outside_allocator_bytes

    @property
    def fits(self) -> bool | None:
        if self.cap_bytes is None:
            return None
        return self.trace.oom is None and self.device_bytes <= self.cap_bytes


def with_workspace(events: tuple[AllocEvent, ...], workspace_bytes: int) -> tuple[AllocEvent, ...]:
    """``events`` with torch's default cuBLAS workspaces before the step where no profile measured them
    (``workspace_bytes`` 0): :data:`CUBLAS_HANDLES` x :data:`CUBLAS_WORKSPACE_BYTES`, inside the allocator."""
    if workspace_bytes:
        return events
    extra = tuple(AllocEvent(-1, CUBLAS_WORKSPACE_BYTES, "compute", f"cublas_workspace{k}")
                  for k in range(CUBLAS_HANDLES))
    return extra + events


def reserved_per_rank(shapes: object, *, degrees: Degrees, schedule: object, stage_modules: object,
                      recompute: object = frozenset(), mode: str = "expandable", cap_bytes: int | None = None,
                      measured: Mapping[str, int] | None = None,
                      events: Sequence[tuple[AllocEvent, ...]] | None = None,
                      until_over: bool = False, buffered: int | None = None) -> list[RankReserved]:
    """Each PP rank's replayed reserved peak (:func:`ppsim.job.memory.memory_events` through
    :func:`ppsim.job.allocator.replay` in ``mode``, within what the cap leaves beside the outside terms) and its
    outside-the-allocator bytes; ``until_over``: stop after the first rank that does not fit the cap; ``buffered``:
    as :func:`ppsim.job.memory.job_memory`'s."""
    from ppsim.job.memory import memory_events

    if events is None:  # ``events``: each rank's, where the caller's own count kept them (with_events=True)
        events = memory_events(shapes, degrees=degrees, schedule=schedule,  # type: ignore[arg-type]
                               stage_modules=stage_modules, recompute=recompute,  # type: ignore[arg-type]
                               buffered=buffered)
    workspace = getattr(shapes, "workspace_bytes", 0)
    out = []
    # ranks whose events are alike replay once: by capacity and length first, the events compared only then
    replayed: dict[tuple[int | None, int], list[tuple[tuple[AllocEvent, ...], tuple[object, ...] | None,
                                                     AllocatorTrace]]] = {}
    for rank, evs in enumerate(events):
        outside = outside_allocator(degrees, pp_peers=pp_peers_of(schedule, rank), measured=measured)
        capacity = None if cap_bytes is None else max(0, cap_bytes - outside.total_bytes)
        notes = () if workspace else (f"cuBLAS workspace: {CUBLAS_HANDLES} x {CUBLAS_WORKSPACE_BYTES // MiB} MiB "
                                      "(torch's default on Hopper, no profile measured it) replayed in the allocator",)
        stream = with_workspace(evs, workspace)
        trace = _replayed(replayed.setdefault((capacity, len(stream)), []), stream, mode, capacity)
        if trace.oom is not None:  # the same event of this rank's own order
            trace = dataclasses.replace(trace, oom=dataclasses.replace(trace.oom, index=stream[trace.oom.event].index))
        out.append(RankReserved(rank, trace, outside, cap_bytes, notes))
        if until_over and out[-1].fits is False:
            break
    return out


def _replayed(alike: list[tuple[tuple[AllocEvent, ...], tuple[object, ...] | None, AllocatorTrace]],
              stream: tuple[AllocEvent, ...], mode: str, capacity: int | None) -> AllocatorTrace:
    """``stream``'s replay, or the one of an earlier rank's stream of the same length and capacity alike in
    :func:`_shape_of` (``alike``: those streams, their shapes made when first compared, and their traces)."""
    shape = None
    for k, (other, other_shape, trace) in enumerate(alike):
        if other_shape is None:
            other_shape = _shape_of(other)
            alike[k] = (other, other_shape, trace)
        shape = shape or _shape_of(stream)
        if other_shape == shape:
            return trace
    trace = replay(stream, mode, capacity_bytes=capacity)
    alike.append((stream, shape, trace))
    return trace


def _shape_of(events: Sequence[AllocEvent]) -> tuple[tuple[int, str, int], ...]:
    """The events without their actions' positions, tags renamed by first appearance: two ranks alike in this replay
    alike (the allocator sees sizes, streams and order only)."""
    ids: dict[str, int] = {}
    return tuple((e.nbytes, e.stream, ids.setdefault(e.tag, len(ids))) for e in events)


def check_cap_above_outside(reserved: Sequence[RankReserved]) -> None:
    """Refuse (one line) a cap that what lives outside the allocator alone fills on some rank: no tensor could be
    allocated, so the question asked cannot be the one meant."""
    from ppsim.errors import JobMemoryError

    for r in reserved:
        if r.cap_bytes is not None and r.outside_allocator_bytes >= r.cap_bytes:
            raise JobMemoryError(
                f"--memory-cap {r.cap_bytes / 2**30:.2f} GiB: below what lives outside the caching allocator on rank "
                f"{r.rank} ({r.outside_allocator_bytes / 2**30:.2f} GiB: the CUDA context and NCCL's buffers), so no "
                f"tensor fits at all; give the device's memory (e.g. --memory-cap 80GiB), or --allocator none to "
                "judge the tensors alone")
