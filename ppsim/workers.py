"""Independent, CPU-bound work on this host's cores: the one way ppsim's core (no torch) runs work in several
processes (``plan`` judging candidates' memory). Ranks that run torch are started by
``ppsim.calibrate.execute.launch``, not here.

Workers are forked from this process, so they start with everything it has built (a model's shapes, the request)
and only the items' positions and the results cross between processes. No worker outlives the work or the command:

- :meth:`ForkedMap.close` terminates them (the caller closes it when it stops reading, on an error, on Ctrl-C);
- workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: this process alone handles it);
- on Linux each worker asks to be sent SIGTERM when this process dies (``PR_SET_PDEATHSIG``), so a ``SIGKILL``\\ed
  ``ppsim`` takes its workers with it;
- a worker that dies (killed, out of memory) is an error here, never a wait for a result that cannot come.

Everything this process holds when the workers are forked is frozen for the garbage collector (``gc.freeze``)
while they start: a worker's collections then never walk the inherited objects (torch, torchtitan, the shapes),
whose pages they would otherwise touch and copy. On the 2-core VM that took the 671B/2048-GPU plan from 89 to 71 s
of user time and 9.8 to 5 s of system time, and from 1,129 to all 1,152 candidates judged in its 60 s
(``docs/plan.md``, the walk-through's table of the 671B plan).
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
"""How often a wait for a result checks that the workers are alive."""


class WorkerLost(RuntimeError):
    """A worker process ended without giving its result."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container or ``taskset`` limits it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def can_fork() -> bool:
    """Whether workers can be forked here (Linux and macOS; not Windows)."""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


class ForkedMap:
    """``task(item)`` for each of ``items`` on ``workers`` processes forked now (they inherit ``task`` and the
    items: nothing is pickled but the results); iterating gives the results in the items' order as they come.
    Each worker takes the next item when it is free, so a slow item holds up one worker only; the workers go on
    computing while the caller does something else between results."""

    def __init__(self, task: Callable[[Any], Any], items: Sequence[Any], workers: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._n = len(items)
        self._taken = ctx.Value("i", 0)
        self._results: Any = ctx.Queue()
        self._got: dict[int, Any] = {}
        self._next = 0
        self._procs = [ctx.Process(target=_serve, args=(task, items, self._taken, self._results), daemon=True,
                                   name=f"ppsim-worker{w}") for w in range(max(1, min(workers, self._n)))]
        freeze = gc.get_freeze_count() == 0  # a caller that froze objects itself keeps them frozen
        if freeze:
            gc.freeze()  # the workers inherit the objects frozen: their collections never walk them (below)
        try:
            for p in self._procs:
                p.start()
        except BaseException:
            self.close()
            raise
        finally:
            if freeze:
                gc.unfreeze()  # this process collects them as before (and frees them at exit)

    def __iter__(self) -> ForkedMap:
        return self

    def __next__(self) -> Any:
        if self._next >= self._n:
            raise StopIteration
        while self._next not in self._got:
            try:
                k, ok, value = self._results.get(timeout=POLL_S)
            except queue.Empty:
                lost = [p for p in self._procs if p.exitcode not in (None, 0)]
                if lost:
                    raise WorkerLost(f"a worker process ended without its result ({lost[0].name}, exit code "
                                     f"{lost[0].exitcode}: killed, or out of memory?)") from None
                continue
            if not ok:
                raise RuntimeError(f"a worker failed on item {k}:\n{value}")
            self._got[k] = value
        self._next += 1
        return self._got.pop(self._next - 1)

    def close(self) -> None:
        """Stop the workers (whatever they are doing) and reap them."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._results.close()
        self._results.cancel_join_thread()


def _serve(task: Callable[[Any], Any], items: Sequence[Any], taken: Any, results: Any) -> None:
    """A worker: take the next item's position, compute, put ``(position, ok, result or traceback)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: close() still ends the workers
        pass
    while True:
        with taken.get_lock():
            k = taken.value
            taken.value += 1
        if k >= len(items):
            return
        try:
            results.put((k, True, task(items[k])))
        except Exception:  # noqa: BLE001 -- the parent raises it, with this traceback
            results.put((k, False, traceback.format_exc()))
