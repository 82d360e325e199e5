"""ppsim.workers: forked workers give results in order, surface a failure or a lost worker as an error (never a
wait), and end with their map."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ppsim.workers import ForkedMap, WorkerLost, available_cores, can_fork

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs fork (Linux, macOS)")


def test_results_come_in_the_items_order_whatever_order_they_finish_in() -> None:
    def task(x: int) -> int:
        time.sleep(0.05 if x % 3 == 0 else 0.0)  # some items finish after later ones
        return x * x

    pool = ForkedMap(task, list(range(12)), 2)
    try:
        assert list(pool) == [x * x for x in range(12)]
    finally:
        pool.close()


def test_the_task_is_inherited_not_pickled() -> None:
    unpicklable = lambda x: x + offset  # noqa: E731 -- a closure over a local: pickle refuses it
    offset = 7
    pool = ForkedMap(unpicklable, [1, 2, 3], 3)
    try:
        assert list(pool) == [8, 9, 10]
    finally:
        pool.close()


def test_workers_never_collect_what_they_inherit_and_this_process_still_does() -> None:
    """The inherited objects are frozen in the workers (their collections would touch and copy every inherited
    page), and not left frozen here (this process frees them as before)."""
    import gc

    assert gc.get_freeze_count() == 0
    pool = ForkedMap(lambda _: gc.get_freeze_count(), [0, 1], 2)
    try:
        frozen_in_workers = list(pool)
    finally:
        pool.close()
    assert all(n > 1000 for n in frozen_in_workers)  # this test process's objects: pytest, the modules, ...
    assert gc.get_freeze_count() == 0


def test_objects_a_caller_froze_itself_stay_frozen() -> None:
    import gc

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pool = ForkedMap(lambda x: x, [0, 1], 2)
        pool.close()
        assert gc.get_freeze_count() > 0.9 * frozen  # still frozen (a few freed since: they leave the count)
    finally:
        gc.unfreeze()


def test_a_task_that_raises_is_an_error_with_its_traceback() -> None:
    def task(x: int) -> int:
        if x == 2:
            raise ValueError("bad item two")
        return x

    pool = ForkedMap(task, [0, 1, 2, 3], 2)
    try:
        with pytest.raises(RuntimeError, match="bad item two"):
            list(pool)
    finally:
        pool.close()


def test_a_worker_killed_mid_item_is_an_error_not_a_hang() -> None:
    def task(x: int) -> int:
        if x == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return x

    pool = ForkedMap(task, [0, 1, 2], 1)
    try:
        with pytest.raises(WorkerLost, match="exit code -9"):
            list(pool)
    finally:
        pool.close()


def test_close_ends_every_worker_even_mid_item() -> None:
    pool = ForkedMap(lambda x: time.sleep(60), [0, 1], 2)
    procs = list(pool._procs)
    pool.close()
    assert all(not p.is_alive() for p in procs)


def test_available_cores_is_at_least_one() -> None:
    assert available_cores() >= 1
