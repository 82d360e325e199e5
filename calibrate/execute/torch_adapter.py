"""Everything ppsim touches inside ``torch.distributed.pipelining`` that is not public API, in one place.

ppsim executes its own compute-only order with torch's ``_PipelineScheduleRuntime`` and times every computation, and
calibration runs each action the way the runtime does. That needs private names (``_PipelineScheduleRuntime``,
``_Action``, ``_prepare_schedule_with_comms``, ``_wait_batch_p2p``, ``_maybe_compute_loss``, the stage's
``*_one_chunk``, ``get_*_recv_ops``, ``backward_maybe_with_nosync`` and ``perform_reduce_grad`` methods,
``_backward.stage_backward*``). They change between torch releases,
so :func:`check` compares torch's version with the ones this adapter was written and tested against and names what
is missing; nothing else in ppsim imports these names.

torch is imported inside the functions only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ppsim.errors import PPSimError

#: torch releases (major.minor) this adapter was tested with (CI runs the torch tests on the first and the last).
TESTED = ("2.13", "2.14", "2.15")
#: Set to 1 to run with a newer, untested torch release anyway (a missing name is still refused).
OVERRIDE_ENV = "PPSIM_UNTESTED_TORCH"

_REQUIRED = {
    "torch.distributed.pipelining.schedules": ("_PipelineScheduleRuntime", "_Action", "_wait_batch_p2p"),
    "torch.distributed.pipelining._backward": ("stage_backward", "stage_backward_input", "stage_backward_weight"),
    "torch.distributed.pipelining": ("PipelineStage",),
}
_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "get_fwd_recv_ops",
                  "get_bwd_recv_ops", "backward_maybe_with_nosync", "perform_reduce_grad")
_checked = False


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``2.15.0+cpu`` -> ``(2, 15)``)."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _check_version(version: str) -> None:
    """An older release than the tested ones is refused; a newer one needs the override and gets one warning."""
    release = _release(version)
    names = ", ".join(TESTED)
    if release in {_release(t) for t in TESTED}:
        return
    if release < min(_release(t) for t in TESTED):
        raise PPSimError(f"torch {version}: ppsim's pipeline adapter (calibrate/execute/torch_adapter.py) needs torch "
                         f"{names} (it is tested with those); install one (pip install -c constraints.txt torch)")
    if os.environ.get(OVERRIDE_ENV) != "1":
        raise PPSimError(
            f"torch {version}: ppsim's pipeline adapter (calibrate/execute/torch_adapter.py) uses private "
            f"torch.distributed.pipelining internals and is tested with torch {names}; install one "
            f"(pip install -c constraints.txt torch) or set {OVERRIDE_ENV}=1 to try this release"
        )
    import multiprocessing

    # one line per run: from the launching process (not its local workers), or rank 0 under torchrun
    if multiprocessing.parent_process() is None and os.environ.get("RANK", "0") == "0":
        print(f"ppsim: warning: torch {version} is newer than the releases ppsim is tested with ({names}); running "
              f"it because {OVERRIDE_ENV}=1", file=sys.stderr)


def check() -> None:
    """Refuse (one line) a torch release this adapter does not know, or one lacking a name it needs."""
    global _checked
    if _checked:
        return
    import importlib

    import torch

    _check_version(torch.__version__)
    for module_name, names in _REQUIRED.items():
        module = importlib.import_module(module_name)
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise PPSimError(
                f"torch {torch.__version__}: {module_name} has no {', '.join(missing)}; ppsim's pipeline adapter "
                f"needs torch {', '.join(TESTED)}"
            )
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    missing = [m for m in _STAGE_METHODS if not hasattr(PipelineStage, m)]
    for name in ("_prepare_schedule_with_comms", "_maybe_compute_loss", "step"):
        if not hasattr(_PipelineScheduleRuntime, name):
            missing.append(name)
    if missing:
        raise PPSimError(f"torch {torch.__version__}: the pipeline runtime lacks {', '.join(missing)}; ppsim's "
                         f"pipeline adapter needs torch {', '.join(TESTED)}")
    _checked = True


# --- the runtime's backward functions (calibration times them directly) ----------------------------------------
def backward_functions() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch's ``(stage_backward, stage_backward_input, stage_backward_weight)``."""
    check()
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    return stage_backward, stage_backward_input, stage_backward_weight


def keeps_forward_outputs(runtime: Any = None) -> bool:
    """Whether the runtime keeps a stage's forward outputs until the backward. torch before 2.15 always does
    (``PipelineStage.fwd_cache``). 2.15 drops them when their send is waited for (``release_fwd_send_outputs`` at a
    ``WAIT_SEND_F``), but its lowering (``_add_wait_send``) places that wait right after the same microbatch's
    backward unless the schedule is built with ``max_outstanding_sends`` (a send budget that waits earlier); without
    one (ppsim's runtime, torchtitan 0.3.0's builder) the outputs live to the backward as before. The memory model
    follows it (``StageCosts.outputs_held_to_backward``)."""
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "release_fwd_send_outputs"):
        return True
    return getattr(runtime, "_max_outstanding_sends", None) is None


def held_outputs(stage: Any, microbatch: int) -> list[Any]:
    """The output tensors a stage that sends them keeps for ``microbatch`` right now (for the executor's memory
    count; the last stage's output, the logits the loss reads, is held to the backward by every release alike and
    is counted on neither side)."""
    if stage.is_last:
        return []
    cache = getattr(stage, "fwd_cache", None)
    if cache is not None:  # torch before 2.15: (outputs, inputs)
        entry = cache.get(microbatch)
        return [] if entry is None else [t for t in entry[0] if hasattr(t, "untyped_storage")]
    state = getattr(stage, "_forward_chunk_states", {}).get(microbatch)
    outputs = [] if state is None else state.live_outputs
    return [t for t in outputs if t is not None and hasattr(t, "untyped_storage")]


# --- executing an order -----------------------------------------------------------------------------------------
def pipeline_stage(module: Any, stage: int, num_stages: int, device: Any) -> Any:
    check()
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, stage, num_stages, device)


class ChainBackward:
    """One stage module's FSDP bookkeeping and backward passes the way torch's runtime does them, for an executor
    that walks its own order (ppsim's two-chain executor): the units' all-gathers started at the step's start
    (torch's ``UNSHARD``), each backward through ``PipelineStage.backward_maybe_with_nosync`` (under FSDP the
    gradients accumulate unsharded across microbatches), and ``perform_reduce_grad`` after the stage's last backward
    (torch's ``REDUCE_GRAD``), whatever the torch release does inside them; a module without FSDP gets the plain
    ``stage_backward*`` passes. ``group``: the pipeline's process group (the stage only reads its size)."""

    def __init__(self, module: Any, position: int, length: int, device: Any, group: Any = None) -> None:
        check()
        from torch.distributed.pipelining import PipelineStage

        self.stage = PipelineStage(module, position, length, device, group=group)
        self.stage.has_backward = True  # what a schedule with a loss sets: torch 2.15 reduces only then
        self._unshards: list[Any] = []

    def begin_step(self) -> None:
        """Before the step's first action: every FSDP unit's all-gather started, as the ``UNSHARD`` torch's runtime
        puts at the start of a step for the stages a rank holds (``_add_unshard_reshard``); torch 2.15 finalizes
        FSDP's backward by hand (its forward sets this)."""
        from torch.distributed.fsdp import FSDPModule

        module = self.stage.submod
        if hasattr(module, "set_manual_backward_finalization") and isinstance(module, FSDPModule):
            module.set_manual_backward_finalization(True)
        self._unshards = [m.unshard(async_op=True) for m in module.modules() if isinstance(m, FSDPModule)]

    def ready(self) -> None:
        """Before a computation: the all-gathers :meth:`begin_step` started are done."""
        for handle in self._unshards:
            handle.wait()
        self._unshards = []

    def full(self, output: Any, output_grads: Any, inputs: Any) -> Any:
        kwargs = {"stage_output": output, "output_grads": output_grads, "input_values": inputs}
        return self.stage.backward_maybe_with_nosync("full", kwargs)[0]

    def input_only(self, output: Any, output_grads: Any, inputs: Any) -> tuple[Any, Any]:
        kwargs = {"stage_output": output, "output_grads": output_grads, "input_values": inputs}
        return self.stage.backward_maybe_with_nosync("input", kwargs)

    def weight_only(self, param_groups: Any) -> None:
        self.stage.backward_maybe_with_nosync("weight", {"param_groups": param_groups})

    def end_step(self) -> None:
        """After this stage's last backward of the step (where torch's runtime puts ``REDUCE_GRAD``): FSDP's
        reduce-scatter, and its units resharded (nothing without FSDP)."""
        from torch.distributed.fsdp import FSDPModule

        self.stage.perform_reduce_grad(1)
        for m in self.stage.submod.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def runtime(stages: Sequence[Any], *, num_microbatches: int, loss_fn: Callable[..., Any],
            after_forward: Callable[[], None], order: dict[int, Sequence[str]]) -> Any:
    """torch's ``_PipelineScheduleRuntime`` running ``order`` (action strings per rank) as its compute-only order,
    lowered by torch itself (sends and receives added by ``_prepare_schedule_with_comms``). ``after_forward`` is
    called after every forward, once the loss (on the last stage) is applied."""
    check()
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

    class _TimedRuntime(_PipelineScheduleRuntime):
        # torch 2.13 passes loss_kwargs, earlier releases do not: forward whatever the runtime passes.
        def _maybe_compute_loss(self, *args: Any, **kwargs: Any) -> None:
            super()._maybe_compute_loss(*args, **kwargs)
            after_forward()

    rt = _TimedRuntime(list(stages), n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    actions = {r: [_Action.from_str(a) for a in row] for r, row in order.items()}
    rt.pipeline_order = actions
    rt._prepare_schedule_with_comms(actions)
    return rt


@contextmanager
def timed_receive_waits(on_wait: Callable[[float], None]) -> Iterator[None]:
    """While inside, every wait of the runtime for a batch of receives reports its duration to ``on_wait``."""
    check()
    import torch.distributed.pipelining.schedules as schedules

    original = schedules._wait_batch_p2p

    def wait(work: Any) -> None:
        t0 = time.perf_counter()
        original(work)
        on_wait(time.perf_counter() - t0)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def instrument_stage(stage: Any, *, begin: Callable[[str], None], finish: Callable[[], None],
                     posted: Callable[[int, int, str], None],
                     outputs: Callable[[tuple[int, int], list[Any]], None] | None = None) -> None:
    """Wrap the stage's per-computation entry points (instance attributes shadow the class methods): ``begin(name)``
    before each computation, ``finish()`` after a backward (a forward is finished by the runtime's
    ``after_forward``), ``posted(stage, microbatch, "F"|"B")`` when a receive is posted; ``outputs((stage,
    microbatch), tensors)`` each time the forward outputs the stage keeps change (after a forward, a backward, and
    on torch 2.15 the release after the send)."""
    index = stage.stage_index
    fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    kept = outputs or (lambda key, tensors: None)

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        begin(f"{index}F{fwd_chunk_id}")
        out = fwd(fwd_chunk_id, *args, **kwargs)
        kept((index, fwd_chunk_id), held_outputs(stage, fwd_chunk_id))
        return out

    def backward_one_chunk(bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        begin(f"{index}{'B' if full_backward else 'I'}{bwd_chunk_id}")
        out = bwd(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        kept((index, bwd_chunk_id), held_outputs(stage, bwd_chunk_id))
        finish()
        return out

    release = getattr(stage, "release_fwd_send_outputs", None)
    if release is not None:  # torch 2.15
        def release_fwd_send_outputs(fwd_chunk_id: int) -> None:
            release(fwd_chunk_id)
            kept((index, fwd_chunk_id), held_outputs(stage, fwd_chunk_id))

        stage.release_fwd_send_outputs = release_fwd_send_outputs

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False) -> Any:
        begin(f"{index}W{bwd_chunk_id}")
        out = bwd_w(bwd_chunk_id, last_backward=last_backward)
        finish()
        return out

    fwd_recv, bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops

    def get_fwd_recv_ops(fwd_chunk_id: int) -> Any:
        posted(index, fwd_chunk_id, "F")
        return fwd_recv(fwd_chunk_id)

    def get_bwd_recv_ops(bwd_chunk_id: int) -> Any:
        posted(index, bwd_chunk_id, "B")
        return bwd_recv(bwd_chunk_id)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    stage.get_fwd_recv_ops = get_fwd_recv_ops
    stage.get_bwd_recv_ops = get_bwd_recv_ops


def overlap_pairs(runtime: Any, stages: Sequence[Any], pairs: dict[tuple[int, int], tuple[int, int]], *,
                  stream: Any, stats: Any, stamp: Callable[[str, float, float, float], None],
                  outputs: Callable[[tuple[int, int], list[Any]], None] | None,
                  context: Callable[[], Any], enabled: Callable[[], bool] = lambda: True) -> None:
    """Run each ``OVERLAP_F_B`` pair's halves at once (:mod:`ppsim.calibrate.execute.overlap`). torch's runtime
    runs a pair's forward sub-action, then its backward; ``pairs`` maps the forward half ``(stage, microbatch)`` to
    the backward half's. When the forward half starts, its backward half starts on a second thread (torch's own
    ``backward_one_chunk``, with the loss and last-backward flag the runtime is about to pass, after waiting for the
    gradient the runtime has posted a receive for); when the runtime then calls the backward half, it waits for that
    thread instead of running it again. A pair whose gradient receive is not posted yet runs in turn
    (``stats.pairs_in_turn``). Call after :func:`instrument_stage` (the forward keeps its stamps; the backward half
    is stamped by ``stamp(name, begin, end, receive_wait)``). While ``enabled()`` is false the pairs run in turn
    (not counted in ``stats``)."""
    from ppsim.calibrate.execute.overlap import PairThread

    by_index = {st.stage_index: st for st in stages}
    started: dict[tuple[int, int], Any] = {}
    kept = outputs or (lambda key, tensors: None)
    forward_halves = {f[0] for f in pairs}
    backward_halves = {b[0] for b in pairs.values()}

    def start_backward(sb: int, mbb: int) -> bool:
        st = by_index[sb]
        works: Any = []
        if not st.is_last and sb + 1 not in by_index:  # its gradient comes from another rank
            works = runtime.bwd_recv_ops.get((sb, mbb))
            if works is None:
                stats.pairs_in_turn += 1
                return False
            # the thread waits for the receive; the runtime then finds nothing left to wait for (a gloo receive
            # waited for twice would wait for a second message)
            runtime.bwd_recv_ops[(sb, mbb)] = []
        loss = runtime._maybe_get_loss(st, mbb)
        last = runtime.backward_counter[sb] + 1 == runtime._n_microbatches
        raw = type(st).backward_one_chunk

        def wait() -> None:
            for w in works:
                w.wait()

        stats.begin_pair()
        stream.take()
        started[(sb, mbb)] = PairThread(
            stream, wait, lambda: raw(st, mbb, loss=loss, full_backward=True, last_backward=last), context)
        return True

    def forward_wrapper(index: int, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            partner = pairs.get((index, fwd_chunk_id))
            if partner is None or not enabled() or not start_backward(*partner):
                return inner(fwd_chunk_id, *args, **kwargs)
            try:
                return inner(fwd_chunk_id, *args, **kwargs)
            except BaseException:
                stream.give()
                started.pop(partner).join()
                raise

        return forward_one_chunk

    def backward_wrapper(index: int, st: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
        def backward_one_chunk(bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> Any:
            thread = started.pop((index, bwd_chunk_id), None)
            if thread is None:
                return inner(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
            stream.give()  # the forward half (and its loss) is done
            thread.join()
            stats.end_pair()
            stamp(f"{index}B{bwd_chunk_id}", thread.begin, thread.end, thread.waited)
            kept((index, bwd_chunk_id), held_outputs(st, bwd_chunk_id))
            return None

        return backward_one_chunk

    for index, st in by_index.items():
        if index in forward_halves:
            st.forward_one_chunk = forward_wrapper(index, st.forward_one_chunk)
        if index in backward_halves:
            st.backward_one_chunk = backward_wrapper(index, st, st.backward_one_chunk)
