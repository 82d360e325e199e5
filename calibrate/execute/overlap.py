"""An overlapped F&B pair run for real on CPU ranks: its two halves at once, one compute stream between them.

DualPipe's point (DeepSeek-V3 report, figure 4) is that while one half of an ``OVERLAP_F_B`` pair waits for its
expert-parallel all-to-all, the other half computes. On a GPU that is two CUDA streams, one computing and one
communicating. On CPU ranks ppsim runs the pair's backward half on a second host thread (:class:`PairThread`) and
shares one :class:`ComputeStream` between the two threads: a half computes only while it holds the stream, and
gives it up for as long as it waits in a collective (:meth:`ComputeStream.waiting`). So the pair's halves never
compute at the same time (the second core of the host does not stand in for a second GPU), and what the overlap
gains is exactly the communication one half hides under the other's compute.

:class:`CommStats` counts what a step's all-to-alls cost the compute stream:

* outside a pair, every second in an all-to-all is exposed (the one thread waits);
* inside a pair, the exposed part is the pair's wall time less the time either half held the stream: the time
  both halves waited at once.

torch is not imported here; the runtime's glue is :func:`ppsim.calibrate.execute.torch_adapter.overlap_pairs`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class ComputeStream:
    """The one compute stream an overlapped pair's two threads share (a lock): outside pairs nobody takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.held_s = 0.0
        """Seconds the stream was held since :meth:`begin_pair` (both threads)."""

    def holding(self) -> bool:
        return getattr(self._local, "since", None) is not None

    def take(self) -> None:
        self._lock.acquire()
        self._local.since = time.perf_counter()

    def give(self) -> None:
        since = self._local.since
        self._local.since = None
        self.held_s += time.perf_counter() - since
        self._lock.release()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective: the stream is free for the other half while this thread waits (nothing changes for
        a thread that does not hold it)."""
        if not self.holding():
            yield
            return
        self.give()
        try:
            yield
        finally:
            self.take()


class CommStats:
    """One step's all-to-alls as the compute stream saw them (reset by :meth:`reset` at each step)."""

    def __init__(self, stream: ComputeStream) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.total_s = 0.0
        self.exposed_s = 0.0
        self.pairs_overlapped = 0
        self.pairs_in_turn = 0
        self._pair_start: float | None = None

    def call(self, seconds: float) -> None:
        """An all-to-all took ``seconds`` (inside a pair its exposure is the pair's, see :meth:`end_pair`)."""
        with self._lock:
            self.calls += 1
            self.total_s += seconds
            if self._pair_start is None:
                self.exposed_s += seconds

    def begin_pair(self) -> None:
        self._pair_start = time.perf_counter()
        self.stream.held_s = 0.0

    def end_pair(self) -> None:
        assert self._pair_start is not None
        wall = time.perf_counter() - self._pair_start
        self.exposed_s += max(0.0, wall - self.stream.held_s)
        self.pairs_overlapped += 1
        self._pair_start = None

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "total_s": self.total_s, "exposed_s": self.exposed_s,
                "pairs_overlapped": self.pairs_overlapped, "pairs_in_turn": self.pairs_in_turn}


class PairThread:
    """A pair's backward half on a second thread: ``prepare`` (waiting for its input, the stream free), then
    ``work`` holding the shared stream while it computes; :meth:`join` waits for it and re-raises what it raised.
    ``context`` is entered on the thread first (a dispatch mode that counts the step's live bytes is per thread).
    ``waited`` is the seconds ``prepare`` took."""

    def __init__(self, stream: ComputeStream, prepare: Callable[[], Any], work: Callable[[], Any],
                 context: Callable[[], Any]) -> None:
        self.stream = stream
        self.begin = self.end = self.waited = 0.0
        self._error: BaseException | None = None
        self._prepare, self._work, self._context = prepare, work, context
        self._thread = threading.Thread(target=self._run, name="ppsim-pair-backward", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._context():
                t0 = time.perf_counter()
                self._prepare()
                self.waited = time.perf_counter() - t0
                self.stream.take()
                try:
                    self.begin = time.perf_counter()
                    self._work()
                    self.end = time.perf_counter()
                finally:
                    self.stream.give()
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
