"""Ctrl-C during a measurement that Python cannot interrupt.

Python delivers Ctrl-C to the main thread between bytecodes, so while one long torch operation runs (a 70B block's
backward on a CPU without a fast bfloat16 path: minutes) the KeyboardInterrupt waits for it to return.
:func:`prompt_interrupt` watches for the signal from a helper thread (``signal.set_wakeup_fd``): when the main thread
has not taken the interrupt within :data:`GRACE_S`, it prints the command's one line, removes the temporary files and
the writer lock (:func:`ppsim.io.abandon_writes`; what was saved, the progress file, stays whole) and ends the process
with exit code 130. Used only around in-process measurement (no worker processes to clean up).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

GRACE_S = 3.0
"""How long the main thread has to take a Ctrl-C before the process ends without it."""


@contextlib.contextmanager
def prompt_interrupt(line: str, *, grace_s: float = GRACE_S) -> Iterator[None]:
    """Within the block, a Ctrl-C the main thread does not take within ``grace_s`` prints ``line`` and exits 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main interpreter, or wake-up fds unsupported here
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    taken, over = threading.Event(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(read_fd, taken, over, line, grace_s), daemon=True)
    watcher.start()
    try:
        yield
    except KeyboardInterrupt:
        taken.set()
        raise
    finally:
        over.set()
        signal.set_wakeup_fd(previous)
        os.write(write_fd, b"\0")  # wakes the watcher, which sees ``over``
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


def _watch(read_fd: int, taken: threading.Event, over: threading.Event, line: str, grace_s: float) -> None:
    while not over.is_set():
        data = os.read(read_fd, 64)
        if over.is_set():
            return
        if signal.SIGINT in data and not taken.wait(grace_s) and not over.is_set():
            from ppsim.io import abandon_writes

            abandon_writes()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            os._exit(130)
