"""The caching allocator's replica (ppsim.job.allocator): each rule on a hand-worked event list, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim.job.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    AllocEvent,
    CachingAllocator,
    replay,
    round_size,
    segment_size,
    should_split,
)

MiB = 1 << 20


def _ev(*ops: tuple[str, int] | tuple[str, int, str]) -> list[AllocEvent]:
    """``("a", bytes[, stream])`` allocates tensor a; ``("-a", 0)`` frees it."""
    sizes: dict[str, tuple[int, str]] = {}
    out = []
    for n, op in enumerate(ops):
        name, nbytes, *stream = op
        if name.startswith("-"):
            size, s = sizes.pop(name[1:])
            out.append(AllocEvent(n, -size, s, name[1:]))
        else:
            sizes[name] = (nbytes, stream[0] if stream else "compute")
            out.append(AllocEvent(n, nbytes, sizes[name][1], name))
    return out


def test_requests_round_up_to_512_bytes() -> None:
    assert [round_size(n) for n in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    t = replay(_ev(("a", 1), ("b", 513)), "default")
    assert t.allocated == (512, 1536)
    assert t.requested_peak_bytes == 514


def test_small_requests_share_2_mib_segments() -> None:
    # 1 MiB is still small: two of them fill one 2 MiB segment; a third needs another
    t = replay(_ev(("a", MiB), ("b", MiB), ("c", MiB)), "default")
    assert t.reserved == (SMALL_BUFFER, SMALL_BUFFER, 2 * SMALL_BUFFER)
    assert t.pool_reserved_peak == {"small:compute": 2 * SMALL_BUFFER}


def test_one_to_ten_mib_requests_get_20_mib_segments_and_larger_ones_round_to_2_mib() -> None:
    assert segment_size(MiB + 512) == LARGE_BUFFER and segment_size(10 * MiB - 512) == LARGE_BUFFER
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 1) == 12 * MiB
    # three 6 MiB tensors: the first segment (20 MiB) holds three (18 MiB)
    t = replay(_ev(("a", 6 * MiB), ("b", 6 * MiB), ("c", 6 * MiB), ("d", 6 * MiB)), "default")
    assert t.reserved == (20 * MiB, 20 * MiB, 20 * MiB, 40 * MiB)
    t = replay(_ev(("a", 11 * MiB)), "default")
    assert t.reserved == (12 * MiB,) and t.allocated == (12 * MiB,)  # the 1 MiB rest is not split off


def test_a_large_block_splits_only_when_more_than_1_mib_is_left() -> None:
    assert not should_split(12 * MiB, 11 * MiB) and should_split(12 * MiB + 512, 11 * MiB)
    assert should_split(MiB + 512, MiB) and not should_split(MiB, MiB)  # small: 512 B left is enough
    # a freed 12 MiB segment serves an 11 MiB request whole: allocated counts the whole block
    t = replay(_ev(("a", 12 * MiB), ("-a", 0), ("b", 11 * MiB)), "default")
    assert t.reserved[-1] == 12 * MiB and t.allocated[-1] == 12 * MiB
    # a freed 20 MiB segment split for 6 MiB keeps 14 MiB free for a second 6 MiB request
    t = replay(_ev(("a", 20 * MiB), ("-a", 0), ("b", 6 * MiB), ("c", 6 * MiB)), "default")
    assert t.reserved[-1] == 20 * MiB and t.allocated[-1] == 12 * MiB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request() -> None:
    t = replay(_ev(("a", 30 * MiB), ("b", 12 * MiB), ("-a", 0), ("-b", 0), ("c", 11 * MiB), ("d", 30 * MiB)),
               "default")
    assert t.reserved[-1] == 42 * MiB  # c took b's 12 MiB segment, d a's 30


def test_streams_never_share_blocks() -> None:
    t = replay(_ev(("a", 30 * MiB, "fsdp_all_gather"), ("-a", 0), ("b", 30 * MiB)), "default")
    assert t.reserved[-1] == 60 * MiB
    assert t.pool_reserved_peak == {"large:compute": 30 * MiB, "large:fsdp_all_gather": 30 * MiB}
    t = replay(_ev(("a", 30 * MiB, "fsdp_all_gather"), ("-a", 0), ("b", 30 * MiB, "fsdp_all_gather")), "default")
    assert t.reserved[-1] == 30 * MiB


def test_a_failed_segment_frees_the_cache_and_retries() -> None:
    events = _ev(("a", 40 * MiB), ("-a", 0), ("b", 50 * MiB))
    assert replay(events, "default").reserved[-1] == 90 * MiB  # no cap: the free 40 MiB stays cached
    t = replay(events, "default", capacity_bytes=64 * MiB)
    assert t.oom is None and t.retries == 1 and t.reserved[-1] == 50 * MiB
    t = replay(_ev(("a", 40 * MiB), ("b", 50 * MiB)), "default", capacity_bytes=64 * MiB)
    assert t.oom is not None and t.oom.event == 1 and t.oom.nbytes == 50 * MiB and t.oom.reserved_bytes == 40 * MiB
    # b's segment, with a block in use, is kept; a's, wholly free, is freed: 20 + 50 MiB
    ops = (("a", 20 * MiB), ("b", 6 * MiB), ("-a", 0), ("c", 50 * MiB))
    t = replay(_ev(*ops), "default", capacity_bytes=72 * MiB)
    assert t.oom is None and t.reserved == (20 * MiB, 40 * MiB, 40 * MiB, 70 * MiB)
    assert replay(_ev(*ops), "default", capacity_bytes=64 * MiB).oom is not None


def test_expandable_maps_20_mib_pages_and_reuses_the_tail_page() -> None:
    t = replay(_ev(("a", 6 * MiB), ("b", 6 * MiB), ("c", 6 * MiB), ("d", 6 * MiB)), "expandable")
    assert t.reserved == (20 * MiB, 20 * MiB, 20 * MiB, 40 * MiB)
    t = replay(_ev(("a", 11 * MiB), ("b", 11 * MiB)), "expandable")
    assert t.reserved == (20 * MiB, 40 * MiB)  # b: 9 MiB left in page 1, 2 MiB more in page 2
    assert t.allocated == (11 * MiB, 22 * MiB)
    t = replay(_ev(("a", 700 * 1024), ("b", 700 * 1024), ("c", 700 * 1024)), "expandable")
    assert t.reserved == (SMALL_BUFFER, SMALL_BUFFER, 2 * SMALL_BUFFER)


def test_expandable_grows_where_default_would_cache_a_segment_per_size() -> None:
    # default: 12 + 14 + 16 MiB segments; expandable: 42 MiB in 20 MiB pages = 60 MiB, then reused whole
    ops = (("a", 12 * MiB), ("-a", 0), ("b", 14 * MiB), ("-b", 0), ("c", 16 * MiB), ("-c", 0), ("d", 40 * MiB))
    assert replay(_ev(*ops), "default").reserved[-1] == (12 + 14 + 16 + 40) * MiB
    assert replay(_ev(*ops), "expandable").reserved[-1] == 40 * MiB


def test_expandable_retry_unmaps_free_pages() -> None:
    # a, b in pages 1-3 (a: 0-30, b: 30-50 MiB); free a: page 1 (0-20 MiB) lies wholly in the free block
    ops = (("a", 30 * MiB), ("b", 20 * MiB), ("-a", 0), ("c", 50 * MiB))
    assert replay(_ev(*ops), "expandable").reserved[-1] == 60 * MiB + 40 * MiB
    t = replay(_ev(*ops), "expandable", capacity_bytes=90 * MiB)
    assert t.oom is None and t.retries == 1
    assert t.reserved[-1] == 100 * MiB - 20 * MiB  # page 1 unmapped; c mapped at the end
    # the end of the range: freed pages there are unmapped and mapped again for the retried request
    t = replay(_ev(("a", 40 * MiB), ("-a", 0), ("b", 30 * MiB, "fsdp_all_gather")), "expandable",
               capacity_bytes=60 * MiB)
    assert t.oom is None and t.reserved[-1] == 40 * MiB


def test_tags_must_be_alive_to_be_freed() -> None:
    with pytest.raises(ValueError, match="not alive"):
        replay([AllocEvent(0, -5, "compute", "x")])
    with pytest.raises(ValueError, match="already alive"):
        replay([AllocEvent(0, 5, "compute", "x"), AllocEvent(0, 5, "compute", "x")])
    with pytest.raises(ValueError, match="mode"):
        CachingAllocator("greedy")


# --- properties ------------------------------------------------------------------------------------------------
SIZES = st.one_of(st.integers(1, 2 * MiB), st.integers(MiB, 12 * MiB), st.integers(10 * MiB, 80 * MiB))
OPS = st.lists(st.tuples(st.booleans(), SIZES, st.sampled_from(("compute", "fsdp_all_gather")), st.integers(0, 99)),
               min_size=1, max_size=60)


def _events(ops: list[tuple[bool, int, str, int]], *, free_all: bool = False) -> list[AllocEvent]:
    """Random allocations, and frees of a random live tensor (``pick`` among them)."""
    live: list[AllocEvent] = []
    out: list[AllocEvent] = []
    for n, (alloc, nbytes, stream, pick) in enumerate(ops):
        if alloc or not live:
            ev = AllocEvent(n, nbytes, stream, f"t{n}")
            live.append(ev)
        else:
            a = live.pop(pick % len(live))
            ev = AllocEvent(n, -a.nbytes, a.stream, a.tag)
        out.append(ev)
    if free_all:
        out += [AllocEvent(len(ops), -a.nbytes, a.stream, a.tag) for a in live]
    return out


@given(ops=OPS, mode=st.sampled_from(("default", "expandable")))
@settings(max_examples=150, deadline=None)
def test_reserved_holds_what_is_allocated_and_allocated_holds_the_rounded_tensors(ops: list, mode: str) -> None:
    events = _events(ops, free_all=True)
    t = replay(events, mode)
    live = 0
    for ev, reserved, allocated in zip(events, t.reserved, t.allocated):
        live += round_size(abs(ev.nbytes)) * (1 if ev.nbytes > 0 else -1)
        assert reserved >= allocated >= live
        assert reserved % SMALL_BUFFER == 0
    assert t.allocated[-1] == 0
    assert t.reserved == tuple(sorted(t.reserved))  # nothing is given back without a capacity's retry
    assert t.reserved_peak_bytes == max(t.reserved) >= t.allocated_peak_bytes >= t.requested_peak_bytes


@given(ops=OPS, mode=st.sampled_from(("default", "expandable")))
@settings(max_examples=100, deadline=None)
def test_streams_are_independent_allocators(ops: list, mode: str) -> None:
    events = _events(ops)
    alone = sum(replay([e for e in events if e.stream == s], mode).reserved[-1]
                for s in ("compute", "fsdp_all_gather") if any(e.stream == s for e in events))
    assert replay(events, mode).reserved[-1] == alone


@given(ops=OPS, mode=st.sampled_from(("default", "expandable")), cap=st.integers(30 * MiB, 400 * MiB))
@settings(max_examples=150, deadline=None)
def test_a_capacity_is_never_exceeded_and_an_oom_is_real(ops: list, mode: str, cap: int) -> None:
    events = _events(ops)
    t = replay(events, mode, capacity_bytes=cap)
    assert max(t.reserved, default=0) <= cap
    if t.oom is not None:  # the tensors alive then plus the request did not fit... or fragmentation did it
        assert len(t.reserved) == t.oom.event
    else:
        assert len(t.reserved) == len(events)


@given(ops=OPS)
@settings(max_examples=100, deadline=None)
def test_releasing_the_cache_after_freeing_everything_gives_all_back(ops: list) -> None:
    for mode in ("default", "expandable"):
        alloc = CachingAllocator(mode)
        handles = {}
        for ev in _events(ops, free_all=True):
            if ev.nbytes > 0:
                handles[ev.tag] = alloc.malloc(ev.nbytes, ev.stream)
            else:
                alloc.free(handles.pop(ev.tag))
        alloc.release_cached()
        assert alloc.allocated == 0 and alloc.reserved == 0
