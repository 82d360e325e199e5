"""The overlapped pair's machinery (calibrate/execute/overlap.py): one compute stream between two host threads, and
what a step's all-to-alls cost it. Time is a fake clock here, so every number is exact."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest

from ppsim.calibrate.execute import overlap
from ppsim.calibrate.execute.overlap import CommStats, ComputeStream, PairThread


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(overlap.time, "perf_counter", fake)
    return fake


def test_outside_a_pair_every_second_in_an_all_to_all_is_exposed(clock: FakeClock) -> None:
    stats = CommStats(ComputeStream())
    stats.call(0.25)
    stats.call(0.5)
    assert stats.as_dict() == {"calls": 2, "total_s": 0.75, "exposed_s": 0.75, "pairs_overlapped": 0,
                               "pairs_in_turn": 0}


def test_inside_a_pair_only_the_time_neither_half_computes_is_exposed(clock: FakeClock) -> None:
    """Forward computes 1 s, waits 3 s in its all-to-all, during which the backward computes 2 s and then waits
    for its own all-to-all 0.5 s past the forward's return: the pair is 4.5 s long, 3.5 s of it computing, so 1 s is
    exposed (0.5 s both waiting + 0.5 s after), of 3.5 s in calls."""
    stream = ComputeStream()
    stats = CommStats(stream)
    stats.begin_pair()
    stream.take()  # forward half
    clock.now = 1.0
    stream.give()  # forward's all-to-all: the stream is free
    stream.held_s += 2.0  # the backward half computed 2 s on the other thread meanwhile
    clock.now = 4.0
    stats.call(3.0)
    stream.take()
    clock.now = 4.5
    stats.call(0.5)  # the backward's all-to-all
    stream.give()
    stats.end_pair()
    d = stats.as_dict()
    assert d["total_s"] == 3.5 and d["pairs_overlapped"] == 1
    assert d["exposed_s"] == pytest.approx(4.5 - (1.0 + 0.5 + 2.0))


def test_waiting_frees_the_stream_only_for_a_thread_that_holds_it() -> None:
    stream = ComputeStream()
    with stream.waiting():  # not holding: nothing to give
        assert not stream.holding()
    stream.take()
    with stream.waiting():
        assert not stream.holding()
        other = threading.Thread(target=lambda: (stream.take(), stream.give()))
        other.start()
        other.join(timeout=10)
        assert not other.is_alive()  # it could take the stream while this thread waited
    assert stream.holding()
    stream.give()


def test_the_two_halves_never_compute_at_once() -> None:
    """The backward thread computes only while the forward half waits in a collective."""
    stream = ComputeStream()
    inside: list[str] = []
    overlapping: list[bool] = []

    def compute(name: str) -> None:
        overlapping.append(bool(inside))
        inside.append(name)
        for _ in range(1000):
            pass
        inside.remove(name)

    stream.take()
    pair = PairThread(stream, prepare=lambda: None, work=lambda: compute("B"), context=nullcontext)
    compute("F")
    with stream.waiting():  # the forward's all-to-all: the backward half runs now
        pair_done = threading.Event()
        threading.Thread(target=lambda: (pair._thread.join(), pair_done.set())).start()
        assert pair_done.wait(timeout=10)
    compute("F")
    stream.give()
    pair.join()
    assert overlapping == [False, False, False]


def test_an_error_on_the_backward_thread_reaches_the_joining_thread() -> None:
    stream = ComputeStream()

    def fail() -> None:
        raise ValueError("boom")

    pair = PairThread(stream, prepare=lambda: None, work=fail, context=nullcontext)
    with pytest.raises(ValueError, match="boom"):
        pair.join()
    assert not stream.holding()

