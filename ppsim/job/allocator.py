"""A torch-free replica of the CUDA caching allocator's bookkeeping (torch's ``c10/cuda/CUDACachingAllocator.cpp``),
replaying a rank's tensor allocations and frees (:class:`AllocEvent`, from :func:`ppsim.job.memory.memory_events`)
to get what the allocator *reserves* from the device, which decides an out-of-memory, beside what the tensors
*allocate* (``max_memory_allocated``, ppsim's job count).

The rules, as torch 2.13's allocator applies them with its default settings (no ``max_split_size_mb``, no
``roundup_power2_divisions``, no garbage-collection threshold):

- a request is rounded up to a multiple of 512 bytes (:func:`round_size`, at least 512);
- requests of up to 1 MiB are served from the *small* pool, larger ones from the *large* pool; pools are per
  stream: a block freed on one stream is never reused by a request on another (FSDP2's all-gather and
  reduce-scatter buffers live on their own streams);
- a request is served by the best fit among the free blocks of its (pool, stream): the smallest that is large
  enough (lowest address on a tie);
- ``default`` mode: otherwise a new segment is ``cudaMalloc``'d: 2 MiB for a small request, 20 MiB for a request
  under 10 MiB, else the request rounded up to 2 MiB (:func:`segment_size`);
- ``expandable`` mode (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which torchtitan's launch script sets):
  each (pool, stream) has one growing address range, mapped in pages of 20 MiB (2 MiB for the small pool); a request
  no free block fits maps the pages it needs at the first unmapped gap whose run of free and unmapped space holds
  it (the range's end, unless ranges were unmapped in its middle), so the tail page's rest is reusable; best fit
  treats a free block that borders unmapped space as being as large as it could grow, so it is chosen last;
- a block larger than the request is split when the rest is more than 1 MiB (large pool) or at least 512 bytes
  (small pool); otherwise the whole block is handed out (and counted as allocated);
- a freed block merges with free neighbours of its segment;
- when a segment (or page) cannot be had within ``capacity_bytes``, the allocator frees its cache and retries:
  ``default``: every segment wholly free is ``cudaFree``'d; ``expandable``: every whole page inside a free block is
  unmapped (torch's ``release_cached_blocks``; ``release_available_cached_blocks`` runs first but does nothing
  without ``max_split_size_mb``). If the retry fails too, the replay stops there: out of memory at that event.

Not replicated: CUDA graphs' private pools, ``record_stream`` (a block used on another stream is held until an event
says that stream is done: FSDP2 avoids it), the events that delay a free across streams, and the allocator's own
per-block metadata.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MIN_BLOCK = 512
"""Every request rounds up to a multiple of this (``kMinBlockSize``)."""
SMALL_SIZE = 1 << 20
"""Requests of up to this go to the small pool (``kSmallSize``, 1 MiB)."""
SMALL_BUFFER = 2 << 20
"""A small-pool segment, and an expandable small pool's page (``kSmallBuffer``, 2 MiB)."""
MIN_LARGE_ALLOC = 10 << 20
"""Requests under this get a 20 MiB segment (``kMinLargeAlloc``, 10 MiB)."""
LARGE_BUFFER = 20 << 20
"""A segment for a 1-10 MiB request, and an expandable large pool's page (``kLargeBuffer``, 20 MiB)."""
ROUND_LARGE = 2 << 20
"""Larger segments round up to this (``kRoundLarge``, 2 MiB)."""

STREAMS = ("compute", "fsdp_all_gather", "fsdp_reduce_scatter", "p2p")
MODES = ("expandable", "default")


@dataclass(frozen=True)
class AllocEvent:
    """One tensor allocated (``nbytes`` > 0) or freed (``nbytes`` < 0, the same ``tag`` as its allocation)."""

    index: int
    """When, in the rank's order: the position of the action it happens in (-1: before the step's first action)."""
    nbytes: int
    """The tensor's bytes as requested (before the allocator rounds), signed."""
    stream: str
    """The stream it is allocated on: ``compute``, ``fsdp_all_gather``, ``fsdp_reduce_scatter`` or ``p2p``."""
    tag: str
    """Names the tensor: unique among the tensors alive at once; a free names its allocation's tag."""


def round_size(nbytes: int) -> int:
    """A request as the allocator sizes it: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def is_small(nbytes: int) -> bool:
    """Whether a (rounded) request goes to the small pool."""
    return nbytes <= SMALL_SIZE


def segment_size(nbytes: int) -> int:
    """The ``cudaMalloc`` a (rounded) request makes in ``default`` mode when no cached block fits."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def should_split(block_size: int, nbytes: int) -> bool:
    """Whether a free block of ``block_size`` handed to a request of ``nbytes`` is split (the rest stays free)."""
    rest = block_size - nbytes
    return rest >= MIN_BLOCK if is_small(nbytes) else rest > SMALL_SIZE


class OutOfMemory(Exception):  # noqa: N818 -- internal signal, turned into AllocatorTrace.oom
    pass


@dataclass(eq=False, slots=True)
class _Block:  # compared and hashed by identity: the free set holds the blocks themselves
    addr: int
    size: int
    state: str  # "free", "used" or "unmapped"


@dataclass
class _Segment:
    """One segment (``default``) or one pool's address range (``expandable``): its blocks in address order, with
    the free blocks and the unmapped ranges indexed (torch keeps its free blocks in a set per pool: a best fit looks
    at the few free blocks, not at every block handed out)."""

    pool: tuple[bool, str]  # (small, stream)
    blocks: list[_Block]
    expandable: bool
    page: int = 0
    base: int = 0
    free: set[_Block] = field(default_factory=set)
    unmapped: dict[int, _Block] = field(default_factory=dict)
    """The unmapped ranges by their address."""
    addrs: list[int] = field(default_factory=list)
    """``blocks``' addresses, in order: a block's index by bisection."""

    def __post_init__(self) -> None:
        self.reindex()

    def reindex(self) -> None:
        self.free = {b for b in self.blocks if b.state == "free"}
        self.unmapped = {b.addr: b for b in self.blocks if b.state == "unmapped"}
        self.addrs = [b.addr for b in self.blocks]

    def index(self, blk: _Block) -> int:
        return bisect_left(self.addrs, blk.addr)

    def replace(self, lo: int, hi: int, new: list[_Block]) -> None:
        """``blocks[lo:hi] = new``, keeping the indexes."""
        for b in self.blocks[lo:hi]:
            self.free.discard(b)
            if b.state == "unmapped":
                self.unmapped.pop(b.addr, None)
        self.blocks[lo:hi] = new
        self.addrs[lo:hi] = [b.addr for b in new]
        for b in new:
            if b.state == "free":
                self.free.add(b)
            elif b.state == "unmapped":
                self.unmapped[b.addr] = b

    def grows_by(self, blk: _Block) -> int:
        """The unmapped space right after ``blk`` (0 if none): what a free block could grow into."""
        nxt = self.unmapped.get(blk.addr + blk.size)
        return 0 if nxt is None else nxt.size

    def hand_out(self, blk: _Block, nbytes: int) -> None:
        """Mark a free block used for a request of ``nbytes``, splitting off the rest when torch would."""
        self.free.discard(blk)
        if should_split(blk.size, nbytes):
            rest = _Block(blk.addr + nbytes, blk.size - nbytes, "free")
            blk.size = nbytes
            i = self.index(blk) + 1
            self.blocks.insert(i, rest)
            self.addrs.insert(i, rest.addr)
            self.free.add(rest)
        blk.state = "used"

    def page_up(self, addr: int) -> int:
        return self.base + -(-(addr - self.base) // self.page) * self.page

    def page_down(self, addr: int) -> int:
        return self.base + (addr - self.base) // self.page * self.page

    def merge_around(self, blk: _Block) -> None:
        """Free a used block and merge it with its free neighbours (what :meth:`normalize` does, locally)."""
        blk.state = "free"
        self.free.add(blk)
        i = self.index(blk)
        if i + 1 < len(self.blocks) and self.blocks[i + 1].state == "free":
            nxt = self.blocks.pop(i + 1)
            del self.addrs[i + 1]
            self.free.discard(nxt)
            blk.size += nxt.size
        if i > 0 and self.blocks[i - 1].state == "free":
            self.free.discard(blk)
            del self.addrs[i]
            self.blocks[i - 1].size += self.blocks.pop(i).size

    def normalize(self) -> None:
        """Merge neighbouring free blocks (and neighbouring unmapped ranges)."""
        out: list[_Block] = []
        for b in self.blocks:
            if b.size == 0:
                continue
            if out and out[-1].state == b.state and b.state in ("free", "unmapped"):
                out[-1].size += b.size
            else:
                out.append(b)
        self.blocks = out
        self.reindex()


@dataclass(frozen=True)
class OomAt:
    """Where the replay ran out of memory: the event, its rounded request and what was reserved then."""

    event: int
    index: int
    nbytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class AllocatorTrace:
    """A replay's result: reserved and allocated bytes after each event, their peaks, and each pool's."""

    mode: str
    reserved: tuple[int, ...]
    """Reserved (segments, or mapped pages) after each event."""
    allocated: tuple[int, ...]
    """Allocated (blocks handed out, as the allocator sized them) after each event."""
    reserved_peak_bytes: int
    allocated_peak_bytes: int
    requested_peak_bytes: int
    """The tensors' own bytes at their peak (before rounding): what ppsim's job count adds up."""
    reserved_peak_event: int
    """The event at which reserved first reached its peak (-1: no event)."""
    pool_reserved_peak: Mapping[str, int] = field(default_factory=dict)
    """Each pool's reserved peak, by ``"small:STREAM"`` / ``"large:STREAM"``."""
    retries: int = 0
    """How many times the cache was freed to retry a request (only with a capacity)."""
    oom: OomAt | None = None

    @property
    def fragmentation_bytes(self) -> int:
        """What the allocator reserves beyond the tensors at their peak: reserved peak - requested peak (rounding,
        unsplit blocks, cached free blocks, other streams' pools, partly used pages)."""
        return self.reserved_peak_bytes - self.requested_peak_bytes

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "reserved_peak_bytes": self.reserved_peak_bytes,
                "allocated_peak_bytes": self.allocated_peak_bytes,
                "requested_peak_bytes": self.requested_peak_bytes, "pool_reserved_peak": dict(self.pool_reserved_peak),
                "retries": self.retries,
                "oom": None if self.oom is None else {"event": self.oom.event, "index": self.oom.index,
                                                      "nbytes": self.oom.nbytes,
                                                      "reserved_bytes": self.oom.reserved_bytes}}


class CachingAllocator:
    """The allocator's state: segments per (pool, stream), reserved and allocated bytes."""

    def __init__(self, mode: str = "expandable", capacity_bytes: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"allocator mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.capacity = capacity_bytes
        self.segments: list[_Segment] = []
        self.reserved = 0
        self.allocated = 0
        self.retries = 0
        self.pool_reserved: dict[tuple[bool, str], int] = {}
        self.pool_peak: dict[tuple[bool, str], int] = {}
        self._next_addr = 0
        self._live: dict[int, tuple[_Segment, _Block]] = {}
        self._ids = 0

    # -- reserving ------------------------------------------------------------------------------------------------
    def _can_reserve(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _reserve(self, pool: tuple[bool, str], nbytes: int) -> None:
        self.reserved += nbytes
        now = self.pool_reserved[pool] = self.pool_reserved.get(pool, 0) + nbytes
        if now > self.pool_peak.get(pool, 0):
            self.pool_peak[pool] = now

    def _new_segment(self, pool: tuple[bool, str], nbytes: int) -> _Segment | None:
        if self.mode == "default":
            size = segment_size(nbytes)
            if not self._can_reserve(size):
                return None
            seg = _Segment(pool, [_Block(self._next_addr, size, "free")], expandable=False)
            self._next_addr += size
            self._reserve(pool, size)
        else:
            page = SMALL_BUFFER if pool[0] else LARGE_BUFFER
            span = 1 << 50  # the address range torch reserves (the device's memory and more): never the limit here
            seg = _Segment(pool, [_Block(self._next_addr, span, "unmapped")], expandable=True, page=page,
                           base=self._next_addr)
            self._next_addr += span
        self.segments.append(seg)
        return seg

    # -- finding a block ------------------------------------------------------------------------------------------
    def _best_fit(self, pool: tuple[bool, str], nbytes: int) -> tuple[_Segment, _Block] | None:
        best: tuple[tuple[int, int, int], _Segment, _Block] | None = None
        for seg in self.segments:
            if seg.pool != pool:
                continue
            for b in seg.free:
                if b.size >= nbytes:
                    key = (b.size + seg.grows_by(b), b.size, b.addr)
                    if best is None or key < best[0]:
                        best = (key, seg, b)
        return None if best is None else (best[1], best[2])

    def _expand(self, pool: tuple[bool, str], nbytes: int) -> tuple[_Segment, _Block] | None:
        """Map pages for ``nbytes`` in the pool's expandable range; the free block that holds them (or None)."""
        seg = next((s for s in self.segments if s.pool == pool), None) or self._new_segment(pool, nbytes)
        assert seg is not None
        tail = seg.blocks[-1]
        if len(seg.unmapped) == 1 and tail.state == "unmapped":
            # the common case, a stack growing at its end: map pages after the last block, which grow the free
            # block before them if there is one (what the loop below and :meth:`_map` answer, without the search)
            before = seg.blocks[-2] if len(seg.blocks) > 1 and seg.blocks[-2].state == "free" else None
            page_end = seg.page_up((tail.addr if before is None else before.addr) + nbytes)
            if not self._can_reserve(page_end - tail.addr):
                return None
            self._reserve(pool, page_end - tail.addr)
            rest = _Block(page_end, tail.addr + tail.size - page_end, "unmapped")
            if before is None:
                before = _Block(tail.addr, page_end - tail.addr, "free")
                seg.replace(len(seg.blocks) - 1, len(seg.blocks), [before, rest])
            else:
                before.size += page_end - tail.addr
                seg.replace(len(seg.blocks) - 1, len(seg.blocks), [rest])
            return seg, before
        for addr in sorted(seg.unmapped):
            i = seg.index(seg.unmapped[addr])
            start = i - 1 if i > 0 and seg.blocks[i - 1].state == "free" else i
            room, j = 0, start
            while j < len(seg.blocks) and seg.blocks[j].state in ("free", "unmapped") and room < nbytes:
                room += seg.blocks[j].size
                j += 1
            if room < nbytes:
                continue
            page_end = seg.page_up(seg.blocks[start].addr + nbytes)  # unmapped ranges are page-aligned
            to_map = sum(min(blk.addr + blk.size, page_end) - blk.addr for blk in seg.blocks[start:j]
                         if blk.state == "unmapped")
            if not self._can_reserve(to_map):
                return None
            first = seg.blocks[start - 1] if start > 0 else None
            self._map(seg, start, j, page_end)
            self._reserve(pool, to_map)
            return seg, seg.blocks[0 if first is None else seg.index(first) + 1]
        return None  # unreachable: the range's tail is unmapped and unbounded

    @staticmethod
    def _map(seg: _Segment, start: int, stop: int, page_end: int) -> None:
        """Map the unmapped blocks among ``seg.blocks[start:stop]`` up to ``page_end`` (free), merging the free
        blocks of that stretch and its neighbours; the rest of the list is untouched."""
        lo, hi = max(start - 1, 0), min(stop + 1, len(seg.blocks))
        rebuilt: list[_Block] = []
        for k in range(lo, hi):
            blk = seg.blocks[k]
            parts = [blk]
            if start <= k < stop and blk.state == "unmapped":
                upto = min(blk.addr + blk.size, page_end)
                parts = []
                if upto > blk.addr:
                    parts.append(_Block(blk.addr, upto - blk.addr, "free"))
                if blk.addr + blk.size > upto:
                    parts.append(_Block(upto, blk.addr + blk.size - upto, "unmapped"))
            for part in parts:
                if part.size and rebuilt and rebuilt[-1].state == part.state and part.state in ("free", "unmapped"):
                    rebuilt[-1].size += part.size
                elif part.size:
                    rebuilt.append(part)
        seg.replace(lo, hi, rebuilt)

    def _find(self, pool: tuple[bool, str], nbytes: int) -> tuple[_Segment, _Block] | None:
        hit = self._best_fit(pool, nbytes)
        if hit is not None:
            return hit
        if self.mode == "expandable":
            return self._expand(pool, nbytes)
        seg = self._new_segment(pool, nbytes)
        return None if seg is None else (seg, seg.blocks[0])

    # -- the public operations ------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: str) -> int:
        """Allocate ``nbytes`` on ``stream``; a handle for :meth:`free`. Raises :class:`OutOfMemory`."""
        size = round_size(nbytes)
        pool = (is_small(size), stream)
        hit = self._find(pool, size)
        if hit is None:  # torch: release the cache, then try once more
            self.retries += 1
            self.release_cached()
            hit = self._find(pool, size)
            if hit is None:
                raise OutOfMemory(size)
        seg, blk = hit
        seg.hand_out(blk, size)
        self.allocated += blk.size
        self._ids += 1
        self._live[self._ids] = (seg, blk)
        return self._ids

    def free(self, handle: int) -> None:
        seg, blk = self._live.pop(handle)
        self.allocated -= blk.size
        seg.merge_around(blk)

    def release_cached(self) -> None:
        """torch's ``release_cached_blocks``: free every wholly free segment; unmap every whole page of a free
        block in an expandable range."""
        kept: list[_Segment] = []
        for seg in self.segments:
            if not seg.expandable:
                if len(seg.blocks) == 1 and seg.blocks[0].state == "free":
                    self._reserve(seg.pool, -seg.blocks[0].size)
                    continue
                kept.append(seg)
                continue
            rebuilt: list[_Block] = []
            for blk in seg.blocks:
                lo, hi = seg.page_up(blk.addr), seg.page_down(blk.addr + blk.size)
                if blk.state != "free" or hi <= lo:
                    rebuilt.append(blk)
                    continue
                rebuilt += [_Block(blk.addr, lo - blk.addr, "free"), _Block(lo, hi - lo, "unmapped"),
                            _Block(hi, blk.addr + blk.size - hi, "free")]
                self._reserve(seg.pool, -(hi - lo))
            seg.blocks = rebuilt
            seg.normalize()  # drops the empty blocks, reindexes
            kept.append(seg)
        self.segments = kept


def replay(events: Iterable[AllocEvent], mode: str = "expandable", *,
           capacity_bytes: int | None = None) -> AllocatorTrace:
    """Replay ``events`` (in order) through the allocator in ``mode``; with ``capacity_bytes``, the device's memory
    the allocator may reserve (after what lives outside it), with torch's retry and its out-of-memory."""
    alloc = CachingAllocator(mode, capacity_bytes)
    live: dict[str, int] = {}
    requested = requested_peak = 0
    reserved: list[int] = []
    allocated: list[int] = []
    peak, peak_at, allocated_peak = 0, -1, 0
    oom: OomAt | None = None
    for n, ev in enumerate(events):
        if ev.nbytes >= 0:
            if ev.tag in live:
                raise ValueError(f"event {n}: tag {ev.tag!r} is already alive; tags of live tensors must differ")
            try:
                live[ev.tag] = alloc.malloc(ev.nbytes, ev.stream)
            except OutOfMemory:
                oom = OomAt(n, ev.index, round_size(ev.nbytes), alloc.reserved)
                break
            requested += ev.nbytes
        else:
            if ev.tag not in live:
                raise ValueError(f"event {n}: frees {ev.tag!r}, which is not alive")
            alloc.free(live.pop(ev.tag))
            requested += ev.nbytes
        reserved.append(alloc.reserved)
        allocated.append(alloc.allocated)
        requested_peak = max(requested_peak, requested)
        allocated_peak = max(allocated_peak, alloc.allocated)
        if alloc.reserved > peak:
            peak, peak_at = alloc.reserved, n
    return AllocatorTrace(mode=mode, reserved=tuple(reserved), allocated=tuple(allocated), reserved_peak_bytes=peak,
                          allocated_peak_bytes=allocated_peak, requested_peak_bytes=requested_peak,
                          reserved_peak_event=peak_at,
                          pool_reserved_peak={f"{'small' if s else 'large'}:{st}": b
                                              for (s, st), b in sorted(alloc.pool_peak.items())},
                          retries=alloc.retries, oom=oom)
