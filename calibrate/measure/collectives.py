"""Collectives timed at the placements jobs use: within one node and across nodes (``ppsim calibrate --collectives``).

Under ``torchrun`` (one torchrun per node), every rank calls :func:`measure_collectives`. The node of each rank is
torchrun's ``GROUP_RANK`` (else the host name); nodes are ordered by their lowest rank. The placements
(:func:`placements`):

* within one node: 2 .. G ranks of node 0 (G: the ranks per node, ``LOCAL_WORLD_SIZE``);
* across nodes: the first 1 .. G ranks of each of the first 2 .. N nodes (ranks taken node by node).

Each placement is one ``dist.new_group`` (created by every rank, in the same order); on it, at every size (4 KiB,
x4 each step, up to ``max_size``), each of all_gather, reduce_scatter, all_reduce, all_to_all
(:class:`ppsim.step.kinds.CollectiveKind`) is timed ``reps`` times after ``warmup`` untimed runs, sizes and kinds
interleaved within a repetition; send_recv (a ping-pong: one-way time is half the round trip) on the 2-rank
placements only. A barrier on the group starts every sample and a sample is the slowest member's time (a MAX
all-reduce over the group at the end of the placement). Sizes follow nccl-tests' "size", as
:mod:`ppsim.step.collectives` reads them: all_gather the whole output, reduce_scatter the whole input, all_reduce
the buffer, all_to_all each rank's whole buffer, send_recv the message.

The result is a list of :class:`Timing` (one per kind, placement and size, with every repetition's seconds);
:func:`to_samples` turns it into :class:`ppsim.step.collectives.Sample` (median seconds), which
:meth:`ppsim.step.collectives.Measured.from_samples` takes; :func:`to_fits` into profile records
(:class:`ppsim.profile.CollectiveFit`, with ``nodes``); :func:`samples_from_profile` reads a profile's records back
as samples.

Without torchrun, :func:`measure_local` runs the same on ``ranks`` local processes (one node) through
:func:`ppsim.calibrate.execute.launch.run_local`, which stops every process on every exit path.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ppsim.errors import PPSimError
from ppsim.step.kinds import ALL_KINDS, CollectiveKind

DEFAULT_MAX_BYTES = 64 << 20
"""Largest size timed on CPU by default (``--max-size``)."""
SMALLEST_BYTES = 4 << 10
PROGRESS_EVERY_S = 10.0
"""Rank 0 prints a progress line at most this often (and after every placement), so never 30 s without one."""

Log = Callable[[str], None]


def _quiet(line: str) -> None:
    return None


@dataclass(frozen=True)
class Placement:
    """A group of ``ranks`` ranks: ``per_node`` on each of ``nodes`` nodes."""

    nodes: int
    per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    def label(self) -> str:
        return f"{self.ranks} ranks on {self.nodes} node{'s' if self.nodes > 1 else ''}"


@dataclass(frozen=True)
class Timing:
    """One kind on one placement at one size: every timed repetition's seconds (the slowest member's)."""

    kind: CollectiveKind
    ranks: int
    nodes: int
    nbytes: int
    times: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def collective_sizes(max_bytes: int, *, smallest: int = SMALLEST_BYTES, factor: int = 4) -> list[int]:
    """``smallest`` bytes, x ``factor`` each step, up to ``max_bytes`` (which is included when not a step)."""
    if max_bytes < smallest:
        return [max_bytes]
    sizes = [smallest]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] < max_bytes:
        sizes.append(max_bytes)
    return sizes


def placements(nodes: int, per_node: int) -> list[Placement]:
    """Within one node 2 .. ``per_node`` ranks; across 2 .. ``nodes`` nodes, 1 .. ``per_node`` ranks on each."""
    out = [Placement(1, g) for g in range(2, per_node + 1)]
    out += [Placement(n, g) for n in range(2, nodes + 1) for g in range(1, per_node + 1)]
    return out


def kinds_for(placement: Placement, kinds: Sequence[CollectiveKind]) -> list[CollectiveKind]:
    """send_recv is a pair: only on 2-rank placements."""
    return [k for k in kinds if k is not CollectiveKind.SEND_RECV or placement.ranks == 2]


# --- the layout of the torchrun world --------------------------------------------------------------------------------
def node_key() -> str:
    """This process's node: torchrun's ``GROUP_RANK`` (the agent's rank), else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"group{group}" if group is not None else socket.gethostname()


def world_layout() -> list[list[int]]:
    """The world's ranks by node (nodes ordered by their lowest rank, ranks ascending); every rank calls it."""
    import torch.distributed as dist

    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return sorted(nodes.values(), key=min)


def members(layout: Sequence[Sequence[int]], placement: Placement) -> list[int]:
    """The group's ranks: the first ``per_node`` ranks of each of the first ``nodes`` nodes, node by node."""
    return [r for node in layout[:placement.nodes] for r in node[:placement.per_node]]


def layout_placements(layout: Sequence[Sequence[int]]) -> list[Placement]:
    """Every placement the layout holds (ranks per node: the smallest node's count)."""
    return placements(len(layout), min(len(node) for node in layout))


# --- timing ----------------------------------------------------------------------------------------------------------
def _ops(kind: CollectiveKind) -> Any:
    """The non-deprecated torch call of each kind (``all_gather_single`` where this torch has it)."""
    import torch.distributed as dist

    if kind is CollectiveKind.ALL_GATHER:
        return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if kind is CollectiveKind.REDUCE_SCATTER:
        return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    raise ValueError(kind)


def _time_placement(group: Any, group_ranks: Sequence[int], placement: Placement, kinds: Sequence[CollectiveKind],
                    sizes: Sequence[int], *, warmup: int, reps: int, device: Any,
                    tick: Callable[[CollectiveKind, int], None]) -> dict[tuple[CollectiveKind, int], list[float]]:
    """This member's seconds per (kind, size) on ``group``; each sample then becomes the group's slowest."""
    import torch
    import torch.distributed as dist

    g = placement.ranks
    me = group_ranks.index(dist.get_rank())
    cuda = torch.device(device).type == "cuda"
    all_gather, reduce_scatter = _ops(CollectiveKind.ALL_GATHER), _ops(CollectiveKind.REDUCE_SCATTER)
    bufs = {}
    for n in sizes:
        per = max(n // 4 // g, 1)
        bufs[n] = (torch.zeros(per, device=device), torch.zeros(per * g, device=device),
                   torch.zeros(per * g, device=device), torch.zeros(max(n, 1), dtype=torch.uint8, device=device))
    out: dict[tuple[CollectiveKind, int], list[float]] = {(k, n): [] for k in kinds for n in sizes}
    peer = group_ranks[1 - me] if me < 2 else None
    for i in range(warmup + reps):
        for n in sizes:
            shard, full, received, msg = bufs[n]
            for kind in kinds:
                dist.barrier(group=group)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if kind is CollectiveKind.ALL_GATHER:
                    all_gather(full, shard, group=group)
                elif kind is CollectiveKind.REDUCE_SCATTER:
                    reduce_scatter(shard, full, group=group)
                elif kind is CollectiveKind.ALL_REDUCE:
                    dist.all_reduce(full, group=group)
                elif kind is CollectiveKind.ALL_TO_ALL:
                    try:
                        dist.all_to_all_single(received, full, group=group)
                    except (RuntimeError, NotImplementedError, ValueError) as exc:
                        from ppsim.calibrate.measure.comm import all_to_all_unsupported

                        raise all_to_all_unsupported(dist.get_backend(), exc) from None
                else:  # send_recv: a ping-pong between the pair; one way is half the round trip
                    if me == 0:
                        dist.send(msg, peer, group=group)
                        dist.recv(msg, peer, group=group)
                    elif me == 1:
                        dist.recv(msg, peer, group=group)
                        dist.send(msg, peer, group=group)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    out[(kind, n)].append(dt / 2 if kind is CollectiveKind.SEND_RECV else dt)
                    tick(kind, n)
    keys = sorted(out, key=lambda kn: (kn[0].value, kn[1]))
    flat = torch.tensor([t for key in keys for t in out[key]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)  # each sample: the slowest member
    values = flat.tolist()
    result = {}
    for j, key in enumerate(keys):
        result[key] = values[j * reps:(j + 1) * reps]
    return result


def _factor(kind: CollectiveKind, ranks: int) -> float:
    """How many times the size crosses the slowest link, roughly, for the estimate."""
    return {CollectiveKind.ALL_REDUCE: 2 * (ranks - 1) / ranks, CollectiveKind.SEND_RECV: 2.0,
            CollectiveKind.ALL_TO_ALL: 1.5 * (ranks - 1) / ranks}.get(kind, (ranks - 1) / ranks)


def _probe(layout: Sequence[Sequence[int]], device: Any) -> tuple[float, float]:
    """(latency s, bytes/s) of the widest placement, from a 4 KiB and a 4 MiB all-gather on the whole world."""
    import torch
    import torch.distributed as dist

    g = dist.get_world_size()
    found = []
    for n in (4 << 10, 4 << 20):
        shard = torch.zeros(max(n // 4 // g, 1), device=device)
        full = torch.zeros(shard.numel() * g, device=device)
        best = math.inf
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            _ops(CollectiveKind.ALL_GATHER)(full, shard)
            best = min(best, time.perf_counter() - t0)
        found.append(best)
    alpha = found[0]
    beta = (4 << 20) * (g - 1) / g / max(found[1] - alpha, 1e-6)
    return alpha, beta


def estimate_s(places: Sequence[Placement], kinds: Sequence[CollectiveKind], sizes: Sequence[int], *,
               warmup: int, reps: int, alpha_s: float, bytes_per_s: float) -> float:
    """Rough seconds for the whole measurement (each sample: latency + the bytes over the probed bandwidth, plus
    a barrier)."""
    total = 0.0
    for p in places:
        for k in kinds_for(p, kinds):
            for n in sizes:
                total += (warmup + reps) * (2 * alpha_s + n * _factor(k, p.ranks) / bytes_per_s)
    return total


def measure_collectives(*, sizes: Sequence[int] | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                        kinds: Sequence[CollectiveKind] = ALL_KINDS, warmup: int = 1, reps: int = 5,
                        device: Any = "cpu", layout: Sequence[Sequence[int]] | None = None,
                        log: Log = _quiet,
                        on_placement: Callable[[list[Timing]], None] | None = None) -> list[Timing]:
    """Time ``kinds`` at every placement of the current (initialised) world and every size; every rank calls it.

    Returns the timings on rank 0 (an empty list elsewhere), ordered by placement, kind and size. ``log`` gets rank
    0's lines (the estimate first, then progress at least every :data:`PROGRESS_EVERY_S` s); ``on_placement`` gets
    rank 0's timings of each finished placement (to save them as they come: a Ctrl-C keeps those).
    """
    import torch.distributed as dist

    if reps < 1 or warmup < 0:
        raise PPSimError(f"reps {reps}, warmup {warmup}: need reps >= 1 and warmup >= 0")
    sizes = list(sizes) if sizes is not None else collective_sizes(max_bytes)
    layout = [list(n) for n in (layout if layout is not None else world_layout())]
    rank = dist.get_rank()
    places = layout_placements(layout)
    if not places:
        raise PPSimError(f"{dist.get_world_size()} rank(s) on {len(layout)} node(s): a collective needs a group of "
                         "at least 2 ranks; start 2 or more ranks (torchrun --nproc-per-node 2, or 2 nodes)")
    alpha, beta = _probe(layout, device)
    total = estimate_s(places, kinds, sizes, warmup=warmup, reps=reps, alpha_s=alpha, bytes_per_s=beta)
    started = time.monotonic()
    if rank == 0:
        log(f"collectives: {', '.join(k.value for k in kinds)} on {len(places)} placement(s) "
            f"({'; '.join(p.label() for p in places)}), {len(sizes)} sizes {_size(sizes[0])}..{_size(sizes[-1])}, "
            f"{warmup} warm-up + {reps} timed each; estimate {_duration(total)} (probe: {alpha * 1e6:.0f} us, "
            f"{beta / 1e6:.0f} MB/s)")
    results: list[Timing] = []
    last = [time.monotonic()]
    for index, place in enumerate(places):
        group_ranks = members(layout, place)
        group = dist.new_group(group_ranks)  # every rank creates every group, in one order
        here = kinds_for(place, kinds)
        count = [0]
        todo = reps * len(here) * len(sizes)

        def tick(kind: CollectiveKind, n: int, place: Placement = place, index: int = index, count: list[int] = count,
                 todo: int = todo) -> None:
            count[0] += 1
            now = time.monotonic()
            if rank == 0 and now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                log(f"collectives: placement {index + 1}/{len(places)} ({place.label()}): {count[0]}/{todo} "
                    f"samples, {kind.value} {_size(n)}; {_duration(now - started)} elapsed")

        if rank in group_ranks:
            times = _time_placement(group, group_ranks, place, here, sizes, warmup=warmup, reps=reps, device=device,
                                    tick=tick)
            if rank == 0:
                found = [Timing(k, place.ranks, place.nodes, n, tuple(times[(k, n)])) for k in here for n in sizes]
                results += found
                if on_placement is not None:
                    on_placement(found)
        dist.barrier()
        if rank == 0:
            last[0] = time.monotonic()
            log(f"collectives: placement {index + 1}/{len(places)} done ({place.label()}); "
                f"{_duration(last[0] - started)} elapsed")
    return results if rank == 0 else []


# --- conversions -----------------------------------------------------------------------------------------------------
def to_samples(timings: Sequence[Timing]) -> list[Any]:
    """:class:`ppsim.step.collectives.Sample` per timing (median seconds): what ``Measured.from_samples`` takes."""
    from ppsim.step.collectives import Sample

    return [Sample(t.kind, t.ranks, t.nodes, t.nbytes, t.seconds) for t in timings]


def to_fits(timings: Sequence[Timing]) -> list[Any]:
    """One :class:`ppsim.profile.CollectiveFit` per (kind, ranks, nodes), its samples sorted by size."""
    from ppsim.calibrate.measure.comm import fit_alpha_beta
    from ppsim.profile import CollectiveFit, P2PSample, Stat

    grouped: dict[tuple[CollectiveKind, int, int], list[Timing]] = {}
    for t in timings:
        grouped.setdefault((t.kind, t.ranks, t.nodes), []).append(t)
    fits = []
    for (kind, ranks, nodes), found in grouped.items():
        found.sort(key=lambda t: t.nbytes)
        samples = []
        for t in found:
            st = Stat.from_samples([max(x, 1e-9) for x in t.times])
            samples.append(P2PSample(bytes=t.nbytes, median_s=st.median, p10_s=st.p10, p90_s=st.p90))
        if len(samples) >= 2:
            alpha, beta, err = fit_alpha_beta([s.bytes for s in samples], [s.median_s for s in samples])
        else:
            s = samples[0]
            alpha, beta, err = 0.0, s.bytes / s.median_s if s.bytes else 1.0, 0.0
        fits.append(CollectiveFit(op=kind.value, group_size=ranks, nodes=nodes, alpha_s=alpha, beta_bytes_per_s=beta,
                                  fit_rel_error=err, samples=tuple(samples)))
    return fits


def samples_from_profile(profile: Any) -> list[Any]:
    """A profile's collective records as :class:`ppsim.step.collectives.Sample` (median seconds; ``nodes`` 1 for
    profiles written before it existed)."""
    from ppsim.step.collectives import Sample

    return [Sample(CollectiveKind.parse(c.op), c.group_size, c.nodes, s.bytes, s.median_s)
            for c in profile.collectives for s in c.samples]


def merge_fits(old: Sequence[dict[str, Any]], new: Sequence[Any]) -> list[dict[str, Any]]:
    """A profile's ``collectives`` list with ``new`` records replacing those of the same (op, ranks, nodes)."""
    keys = {(f.op, f.group_size, f.nodes) for f in new}
    kept = [d for d in old if (d.get("op"), d.get("group_size"), d.get("nodes", 1)) not in keys]
    return [*kept, *(f.to_dict() for f in new)]


# --- local processes (no torchrun) -----------------------------------------------------------------------------------
def _local_rank(ctx: Any, backend: str, sizes: list[int], warmup: int, reps: int, timeout_s: float,
                kinds: tuple[str, ...]) -> list[Timing]:
    """One of :func:`measure_local`'s processes: the whole group is one node."""
    import torch.distributed as dist

    from ppsim.calibrate.execute.launch import join_local_world

    device = join_local_world(ctx, backend=backend, timeout_s=timeout_s)
    try:
        found = measure_collectives(sizes=sizes, kinds=[CollectiveKind(k) for k in kinds], warmup=warmup, reps=reps,
                                    device=device, layout=[list(range(ctx.world_size))],
                                    log=lambda line: ctx.send(("log", line)),
                                    on_placement=lambda t: ctx.send(("placement", t)))
        dist.barrier()
        return found
    finally:
        dist.destroy_process_group()


def measure_local(*, ranks: int = 2, sizes: Sequence[int] | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                  kinds: Sequence[CollectiveKind] = ALL_KINDS, backend: str = "gloo", warmup: int = 1, reps: int = 5,
                  timeout_s: float = 600.0, log: Log = _quiet,
                  on_placement: Callable[[list[Timing]], None] | None = None) -> list[Timing]:
    """:func:`measure_collectives` on ``ranks`` local processes (one node); every process is stopped on every exit
    path (a Ctrl-C raises ``KeyboardInterrupt`` here after ``on_placement`` got what was finished)."""
    from ppsim.calibrate.execute.launch import run_local

    sizes = list(sizes) if sizes is not None else collective_sizes(max_bytes)

    def on_message(rank: int, message: Any) -> None:
        what, payload = message
        if what == "log":
            log(payload)
        elif on_placement is not None:
            on_placement(payload)

    try:
        return run_local(_local_rank, (backend, sizes, warmup, reps, timeout_s, tuple(k.value for k in kinds)),
                         world_size=ranks, timeout_s=timeout_s, what="collective measurement",
                         on_message=on_message)
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise PPSimError(f"collective measurement on {ranks} local {backend} processes failed "
                         f"({(lines[-1] if lines else type(exc).__name__)[:200]}); run it under torchrun") from None


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
