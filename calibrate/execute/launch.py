"""Starting ranks: the one launch mechanism of `ppsim run` and `ppsim calibrate`.

- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank; :func:`init_world` joins the group.
- Without it, :func:`run_local` starts ``world`` worker processes on this host from a fork server that has torch
  imported already (cheap starts). They talk to the parent through one queue: progress messages, rank 0's result,
  or a rank's error.

No worker outlives the command, whatever ends it:

- each worker asks Linux to kill it when its parent (the fork server) dies (``PR_SET_PDEATHSIG``), and the fork
  server exits as soon as this process is gone, so a ``SIGKILL``\\ed ``ppsim`` takes its ranks with it;
- each worker also watches this process's pid (a thread) and exits when it disappears;
- workers run in their own process group, so a terminal's Ctrl-C reaches only this process, which then stops them;
- an error in any rank, a timeout, Ctrl-C or ``SIGTERM`` here terminate every worker (then kill, if needed).

torch is imported inside the functions only.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ppsim.errors import PPSimError, RankLostError

#: Modules the fork server imports once, so every worker starts with them loaded.
PRELOAD = ("torch", "torch.distributed", "ppsim.calibrate.models.transformer", "ppsim.calibrate.execute.executor",
           "ppsim.calibrate.measure.comm")
_extra_preload: list[str] = []


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (a torchtitan model's runner and family: about 8 s of imports each
    worker would otherwise repeat; a calibration's probes start six). Effective only before this process's first
    :func:`run_local` starts the fork server; a module that does not import is skipped by it."""
    _extra_preload.extend(m for m in modules if m not in _extra_preload)
_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29


# --- torchrun ---------------------------------------------------------------------------------------------------
#: What gloo and NCCL raise in a surviving rank when a peer process of the job is gone (crashed, killed, its node
#: unreachable): its sockets closed or reset, or the communicator aborted.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "remote process exited")


def peer_lost_line(exc: BaseException) -> str | None:
    """One line for an error that says a peer rank is gone (:data:`PEER_LOST`), naming its address where the
    backend gives it; ``None`` for any other error."""
    import re

    text = str(exc)
    marker = next((m for m in PEER_LOST if m in text), None)
    if marker is None:
        return None
    peer = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", text)
    return f"{marker.lower()}" + (f" (a rank at {peer.group(1)})" if peer else "")


@contextmanager
def peers_lost_in_one_line(rank: int, world: int, what: str) -> Iterator[None]:
    """Under torchrun, a peer rank that is gone makes this rank's next collective fail with a backend traceback;
    say it in one line (:class:`~ppsim.errors.RankLostError`, exit 1) naming the peer, and what to read."""
    try:
        yield
    except RuntimeError as exc:
        line = peer_lost_line(exc)
        if line is None or isinstance(exc, RankLostError):
            raise
        raise RankLostError(f"{what}: rank {rank} of {world} stopped: {line}; that rank crashed or its node went away "
                            "(its torchrun's log says why)") from None


def under_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` job (the launcher set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def join_local_world(ctx: Any, *, backend: str, timeout_s: float) -> Any:
    """A local rank started by :func:`run_local` joins its world: one compute thread, its GPU under NCCL, the
    process group over the launcher's store. Returns the device its tensors go on."""
    import torch

    torch.set_num_threads(1)
    device: Any = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(ctx.rank)
        device = torch.device("cuda", ctx.rank)
    init_world(backend=backend, timeout_s=timeout_s, store=ctx.store(timeout_s), rank=ctx.rank,
               world_size=ctx.world_size)
    return device


def init_world(*, backend: str, timeout_s: float, init_method: str = "env://", store: Any = None,
               rank: int | None = None, world_size: int | None = None) -> World:
    """Join the process group (``torchrun``'s environment by default); a peer that never comes is a one-line error."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    else:
        kwargs["init_method"] = init_method
        if rank is not None:
            kwargs.update(rank=rank, world_size=world_size)
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the store and backends raise several unrelated types
        where = init_method if store is None else "local TCP store"
        if store is None and init_method == "env://":
            keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
            where = " ".join(f"{k}={os.environ.get(k, '?')}" for k in keys)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PPSimError(
            f"could not form the {backend} process group within {timeout_s:g} s ({where}: {first[:160]}); "
            "check that every rank started with the same rendezvous address and that the port is reachable, "
            "or raise --init-timeout"
        ) from None
    return World(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())), backend=backend,
    )


def available_memory_bytes() -> int | None:
    """This host's available memory (``MemAvailable``), ``None`` where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_name() -> str:
    """This host's CPU model (``/proc/cpuinfo``'s model name; else what ``platform`` knows), for ``device_name``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- local workers ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankContext:
    """What a local worker gets besides its own arguments: where it is and how to talk to the parent."""

    rank: int
    world_size: int
    store_port: int
    queue: Any

    def store(self, timeout_s: float) -> Any:
        """A client of the parent's TCP store (to form the process group with :func:`init_world`)."""
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.store_port, self.world_size, False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    def send(self, message: Any) -> None:
        """A message for the parent's ``on_message`` (progress, partial results)."""
        self.queue.put(("msg", self.rank, message))


def run_local(
    target: Callable[..., Any],
    args: Sequence[Any],
    *,
    world_size: int,
    timeout_s: float,
    what: str,
    on_message: Callable[[int, Any], None] | None = None,
) -> Any:
    """Run ``target(ctx, *args)`` in ``world_size`` local processes; return rank 0's return value.

    A rank's :class:`PPSimError` is raised here as it is; any other exception becomes a ``RuntimeError`` with the
    rank's traceback text. Every worker is stopped before this returns or raises (see the module docstring).
    """
    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_extra_preload])
    _start_forkserver_deaf_to_ctrl_c()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_worker, args=(target, tuple(args), rank, world_size, store.port, queue, os.getpid()),
                    daemon=True, name=f"ppsim-rank{rank}")
        for rank in range(world_size)
    ]
    interrupted = False
    try:
        with _terminate_raises():
            with _ctrl_c_deferred():  # a Ctrl-C mid-start would orphan a worker whose pid was not yet known
                for p in procs:
                    p.start()
            return _await(procs, queue, timeout_s, what, on_message)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the teardown below is bounded, whatever it meets
        interrupted = True
        exit_if_stuck()
        raise
    finally:
        stop(procs)
        del store
        if interrupted:
            cancel_exit_if_stuck()  # a caller that goes on after Ctrl-C is not ended later


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start the fork server with SIGINT blocked, a mask it keeps across its exec: a terminal's Ctrl-C goes to the
    whole foreground process group, and the server, still importing its preload, would die of it with a traceback
    (once its loop starts it ignores SIGINT itself). This process alone handles Ctrl-C and stops the workers (they
    inherit the server's mask). Blocked, not ignored, here: a Ctrl-C meanwhile stays pending and is raised as
    ``KeyboardInterrupt`` once the server is started (ignored, it was lost and the command ran on)."""
    blocked = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blocked else None
    try:
        _ensure_forkserver()
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _ensure_forkserver() -> None:
    """The fork server, whose socket lives in the temporary folder: a folder whose path is too long for a socket
    (AF_UNIX allows about 108 bytes) is one line naming it."""
    import tempfile
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except OSError as exc:
        if "AF_UNIX path too long" not in str(exc):
            raise
        raise PPSimError(f"TMPDIR {tempfile.gettempdir()}: too long a path for the local ranks' socket (AF_UNIX "
                         "allows about 108 bytes); set TMPDIR to a shorter folder, e.g. TMPDIR=/tmp") from None


@contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Record a Ctrl-C during the block and raise ``KeyboardInterrupt`` after it, not inside: raised within
    ``Process.start()`` it would orphan a worker whose pid was not yet stored, and that worker would fail noisily
    once this process is gone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


STUCK_EXIT_S = 15.0
"""Seconds an interrupted command may spend stopping its workers and exiting before it is ended outright."""
_WATCHDOG_SINK: Any = None


def exit_if_stuck(seconds: float = STUCK_EXIT_S) -> None:
    """Arm a watchdog that ends this process (exit code 1) after ``seconds``, from a C thread that needs no GIL
    (``faulthandler``): an interrupted command never hangs in a destructor or an exit handler. It prints nothing."""
    import faulthandler

    global _WATCHDOG_SINK
    if _WATCHDOG_SINK is None:
        _WATCHDOG_SINK = open(os.devnull, "w")  # noqa: SIM115 - the watchdog writes to it later
    faulthandler.dump_traceback_later(seconds, exit=True, file=_WATCHDOG_SINK)


def cancel_exit_if_stuck() -> None:
    """Disarm :func:`exit_if_stuck`."""
    import faulthandler

    faulthandler.cancel_dump_traceback_later()


def _exit_text(code: int) -> str:
    """``-9`` -> ``was killed by SIGKILL``; ``3`` -> ``exited with code 3``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


def _await(procs: list[Any], queue: Any, timeout_s: float, what: str,
           on_message: Callable[[int, Any], None] | None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        while not queue.empty():
            kind, rank, *payload = queue.get()
            if kind == "msg":
                if on_message is not None:
                    on_message(rank, payload[0])
                continue
            if kind == "ok":
                return payload[0]
            text, user = payload
            if user:
                raise PPSimError(text)
            lost = _killed_rank(procs, grace_s=1.0)  # a peer lost makes the survivors fail: name the cause
            if lost is not None:
                raise _lost(what, *lost)
            raise RuntimeError(f"rank {rank} failed:\n{text}")
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            time.sleep(0.2)  # a failing rank reports before it exits; give the report a moment to arrive
            if queue.empty():
                raise _lost(what, *dead[0])
            continue
        if all(p.exitcode == 0 for p in procs) and queue.empty():
            raise RuntimeError(f"{what}: every rank exited but rank 0 reported no result")
        if time.monotonic() > deadline:
            raise PPSimError(
                f"{what} did not finish within {timeout_s:.0f} s; use fewer microbatches or steps, or a larger "
                "--timeout (processes were stopped)"
            )
        time.sleep(0.01)


def _lost(what: str, rank: int, code: int) -> RankLostError:
    return RankLostError(f"{what}: rank {rank} {_exit_text(code)} before reporting (killed or crashed); the other "
                         "ranks were stopped")


def _killed_rank(procs: Sequence[Any], *, grace_s: float) -> tuple[int, int] | None:
    """A rank ended by a signal (its exit code negative), waiting up to ``grace_s`` for one to show: the cause when
    the others then fail on their lost connection to it."""
    deadline = time.monotonic() + grace_s
    while True:
        killed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
        if killed or time.monotonic() > deadline:
            return killed[0] if killed else None
        time.sleep(0.02)


def stop(procs: Sequence[Any]) -> None:
    """Terminate, then kill, every process still alive (never anything this command did not start)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=3)
        if p.is_alive():
            p.kill()
            p.join(timeout=3)


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """While workers run, SIGTERM ends this process through Python's exception path, so ``finally`` stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _worker(target: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int, port: int, queue: Any,
            parent_pid: int) -> None:
    """Entry point of one local worker."""
    _die_with_parent(parent_pid)
    try:
        result = target(RankContext(rank, world_size, port, queue), *args)
        if rank == 0:
            queue.put(("ok", rank, result))
    except BaseException as exc:  # report, then exit non-zero; the parent stops the other ranks
        user = isinstance(exc, PPSimError)
        queue.put(("error", rank, str(exc) if user else traceback.format_exc(), user))
        os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
    try:
        os.setpgid(0, 0)  # own process group: a terminal's Ctrl-C goes to the parent, which stops us
    except OSError:
        pass
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the fork server died before the line above took effect
        os._exit(3)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except OSError:
                os._exit(3)

    threading.Thread(target=watch, name="ppsim-parent-watch", daemon=True).start()


def prctl(option: int, value: int) -> bool:
    """Linux ``prctl(option, value)``; ``False`` where it does not exist."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tighten_sleep() -> None:
    """Ask Linux for 1 µs timer slack (default 50 µs), so sleeps end on time."""
    prctl(_PR_SET_TIMERSLACK, 1)
