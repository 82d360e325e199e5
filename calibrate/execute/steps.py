"""The step loop and clock every runner shares: what a run is (:class:`ExecSpec`), what it measured
(:class:`Measurement`), the :class:`Runner` protocol, launching ranks, and one rank's timed steps.

A runner (ppsim's executor, :mod:`ppsim.calibrate.execute.executor`; torchtitan's helpers,
:mod:`ppsim.calibrate.torchtitan.runner`) builds a rank's stages and runtime, instruments the stages with a
:class:`Clock` (``torch_adapter.instrument_stage``) and hands them over as a :class:`RankRun` to
:func:`measure_rank`, which steps it and gathers every rank's measurement on rank 0. Processes are started by
:mod:`ppsim.calibrate.execute.launch` (:func:`launch_local`), or by torchrun (:func:`run_in_group`).

Timing hooks, all per process and cheap (two clock reads and a list append per computation): the start and end of
each computation (a forward ends after the runtime applied the loss on the last stage), how long the runtime waited
for a computation's input just before it, and when each receive was posted. Saved-tensor hooks record each rank's
peak saved-activation bytes on the last timed step.

Clock: ``time.perf_counter`` (CLOCK_MONOTONIC, shared by every process on a host; ranks on other hosts get their
offset measured by ping-pong with rank 0); on CUDA the computation bounds are CUDA events, converted to that clock.

torch is imported inside functions only (``ppsim`` itself must import without it).
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ppsim.calibrate.execute.numerics import GRAD_RTOL, LOSS_RTOL
from ppsim.errors import PPSimError
from ppsim.ir import Schedule

if TYPE_CHECKING:
    from ppsim.calibrate.execute.launch import RankContext
    from ppsim.calibrate.execute.numerics import ReferenceCheck
    from ppsim.calibrate.models import ModelSource
    from ppsim.calibrate.models.transformer import ModelConfig

DEFAULT_TIMEOUT_S = 600.0
RankBody = Callable[["ExecSpec", int, int, int], "Measurement | None"]
"""``body(spec, rank, world, local_rank)``: one rank's run inside its process group (each runner brings its own)."""


@dataclass(frozen=True)
class ExecSpec:
    """Everything a rank needs (picklable; no torch objects)."""

    schedule: Schedule
    model: ModelConfig
    """Shapes of the executed model (for synthetic stages: boundary shape, sequence, microbatch size, dtype)."""
    synthetic: bool = False
    sleep_s: tuple[tuple[float, ...], ...] | None = None
    """Synthetic only: per rank, the duration of each computation in execution order (pairs: F half, then B half)."""
    backend: str = "gloo"
    device: str = "cpu"
    num_steps: int = 5
    num_warmup: int = 2
    num_probes: int = 0
    """Extra steps interleaved with the timed ones (timed, probe, timed, probe, ...): measured like them but kept
    apart (a post-hoc model may be fitted on them; the prediction never uses them)."""
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    layer_counts: tuple[int, ...] | None = None
    """Layers per stage (the split the prediction composed); ``None``: the even split."""
    recompute: frozenset[tuple[int, int]] = frozenset()
    """(stage, microbatch) whose forward runs under ``torch.utils.checkpoint`` (recomputed in its backward)."""
    source: ModelSource | None = None
    """The executed model (``--model``); ``None``: the builtin model of ``model``."""
    dp_shard: int = 1
    """FSDP degree (torchtitan runner): each pipeline rank is ``dp_shard x tp`` processes."""
    tp: int = 1
    """Tensor-parallel degree (torchtitan runner)."""
    activation_checkpoint: str = "none"
    """torchtitan's checkpointing of each model part (``none``, ``selective``, ``full``; torchtitan runner)."""
    ep: int = 1
    """Expert-parallel degree (torchtitan runner), carved out of ``dp_shard x tp`` as torchtitan does: no
    processes of its own."""
    overlap: bool = False
    """With ``ep`` above 1 on CPU ranks: run each ``OVERLAP_F_B`` pair's halves at once, each one's all-to-alls under
    the other's compute (:mod:`ppsim.calibrate.execute.overlap`); ``False``: one after the other, as torch's runtime
    runs them."""
    timing_only: bool = False
    """Only the timed steps' times are read (the calibration's runtime probes): no untimed allocator-peak step, no
    gradients gathered, no reference check (each costs about a step or more, and a probe reads none of them)."""

    @property
    def world_size(self) -> int:
        """Processes: the pipeline's ranks times the FSDP and TP degrees."""
        return self.schedule.num_ranks * self.dp_shard * self.tp


@dataclass(frozen=True)
class CompTiming:
    """One measured computation (a single F, B, I or W; an overlapped pair gives two, forward half first)."""

    rank: int
    position: int
    """Index of the schedule action on its rank (``schedule.actions[rank][position]``)."""
    half: int
    """0 for a single computation or a pair's forward half, 1 for a pair's backward half."""
    name: str
    start: float
    end: float
    wait: float
    """Time spent waiting for this computation's input just before it started (receives)."""
    posted: float | None = None
    """When the receive of this computation's cross-rank input was posted (``None``: no such input)."""


@dataclass(frozen=True)
class MeasuredPeak:
    """One rank's memory during a step: saved activations (saved-tensor hooks: unique storages autograd keeps for
    backward, parameters excluded), and on CUDA the allocator's peak; parameters and gradients."""

    rank: int
    peak_activation_bytes: int
    param_bytes: int
    grad_bytes: int
    peak_allocated_bytes: int | None = None
    peak_allocated_during: str | None = None
    """The action (or ``after X``: the gap after it) the allocator-level peak happened in."""
    allocated_by_action: tuple[tuple[str, int], ...] = ()
    """Each action's and gap's allocator-level high point, in the order the rank ran them (CPU count only)."""
    peak_reserved_bytes: int | None = None
    """On CUDA: what the caching allocator reserved at its peak over that step (``max_memory_reserved``)."""


@dataclass(frozen=True)
class Measurement:
    """What a run measured, gathered on rank 0. Times are seconds on the common clock, relative to each step's
    earliest computation start."""

    steps: tuple[tuple[CompTiming, ...], ...]
    """Timed steps (warm-up and probes excluded); each holds every computation of every rank, rank by rank, in
    order."""
    step_walls: tuple[float, ...]
    """Per timed step: the longest time from a rank's entry into the runtime's step to its return."""
    warmup_steps: tuple[tuple[CompTiming, ...], ...]
    """The warm-up steps, timed like the others but excluded from the measurement."""
    probe_steps: tuple[tuple[CompTiming, ...], ...]
    """Steps interleaved with the timed ones, excluded from the measurement (see ``ExecSpec.num_probes``)."""
    loss: float
    ref_loss: float
    grad_max_abs_diff: float
    grad_ref_max_abs: float
    num_params_checked: int
    dtype: str
    device: str
    device_name: str
    backend: str
    torch_version: str
    hosts: tuple[str, ...]
    clock: str
    num_warmup: int
    synthetic: bool
    memory: tuple[MeasuredPeak, ...] = ()
    """Per rank, what it held (measured on the last timed step)."""
    comm: tuple[tuple[dict[str, float], ...], ...] = ()
    """Per timed step, per PP rank: its all-to-alls (``calls``, ``total_s``, ``exposed_s``, ``pairs_overlapped``,
    ``pairs_in_turn``; see :class:`~ppsim.calibrate.execute.overlap.CommStats`); empty when not counted."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    step_ends: tuple[float, ...] = ()
    """Per timed step, on the steps' clock: when the last rank returned from the runtime's step (after its last
    computation: the sends' completion and, under FSDP, the reduce-scatters torch's runtime issues after the last
    backward). Empty where not measured."""
    step_begins: tuple[float, ...] = ()
    """Per timed step, on the steps' clock: when the first rank called the runtime's step (at or before the first
    computation: under FSDP, the ``UNSHARD`` all-gathers torch's runtime starts there and the first forward waits
    for). Empty where not measured (the step then starts at its first computation)."""

    @property
    def grad_tolerance(self) -> float:
        return GRAD_RTOL.get(self.dtype, 1e-2) * max(self.grad_ref_max_abs, 1e-30)

    @property
    def grad_ok(self) -> bool:
        return self.grad_max_abs_diff <= self.grad_tolerance

    @property
    def loss_match(self) -> bool:
        return abs(self.loss - self.ref_loss) <= LOSS_RTOL.get(self.dtype, 1e-2) * max(abs(self.ref_loss), 1e-30)

    @property
    def step_spans(self) -> tuple[float, ...]:
        """Per timed step: from the first rank's call of the runtime's step (:attr:`step_begins`, else the first
        computation's start) to the end of the step on all ranks -- the last computation's end, or the last rank's
        return from the runtime's step where later (:attr:`step_ends`). The predicted step holds both: FSDP's
        all-gathers before the first forward and its reduce-scatters after the last backward."""
        ends = self.step_ends or (0.0,) * len(self.steps)
        begins = self.step_begins or (math.inf,) * len(self.steps)
        return tuple(max(max(c.end for c in step), end) - min(min(c.start for c in step), begin)
                     for step, end, begin in zip(self.steps, ends, begins))


def step_kinds(spec: ExecSpec) -> list[str]:
    """What each executed step is for: ``warmup`` first, then ``timed`` and ``probe`` steps alternating."""
    kinds = ["warmup"] * spec.num_warmup
    for i in range(max(spec.num_steps, spec.num_probes)):
        if i < spec.num_steps:
            kinds.append("timed")
        if i < spec.num_probes:
            kinds.append("probe")
    return kinds


def expected_computations(schedule: Schedule, rank: int) -> list[tuple[int, int, str]]:
    """``(position, half, name)`` of every computation ``rank`` runs, in execution order."""
    out: list[tuple[int, int, str]] = []
    for pos, action in enumerate(schedule.actions[rank]):
        for half, comp in enumerate(action.computations):
            out.append((pos, half, str(comp)))
    return out


# --- runners and launching -------------------------------------------------------------------------------------
class Runner(Protocol):
    """Who builds a rank's stages and schedule: ppsim's executor (:class:`~ppsim.calibrate.execute.executor.
    PpsimExecutor`) or torchtitan's helpers (:class:`~ppsim.calibrate.torchtitan.runner.TorchtitanRunner`). Both
    step through :func:`measure_rank` with a :class:`Clock`."""

    def launch(self, spec: ExecSpec) -> Measurement:
        """Run ``spec`` on ``spec.schedule.num_ranks`` local processes; rank 0's gathered measurement."""

    def run_rank(self, spec: ExecSpec, *, rank: int, world: int, store: Any | None = None) -> Measurement | None:
        """Run ``spec`` as rank ``rank`` of ``world`` (``store=None``: torchrun's environment); rank 0 returns the
        gathered measurement, the others ``None``."""


def launch_local(spec: ExecSpec, body: RankBody) -> Measurement:
    """Run ``spec`` on ``spec.schedule.num_ranks`` local processes, each running ``body`` once its process group is
    up; rank 0's gathered measurement."""
    from ppsim.calibrate.execute import launch as launcher

    return launcher.run_local(_local_rank, (spec, body), world_size=spec.world_size,
                              timeout_s=spec.timeout_s, what="the run")


def _local_rank(ctx: RankContext, spec: ExecSpec, body: RankBody) -> Measurement | None:
    import os

    os.environ["LOCAL_RANK"] = str(ctx.rank)  # not the launching torchrun rank's (a calibration probe under torchrun)
    if spec.device == "cpu":
        pin_to_rank_cores(spec, ctx.rank)
    return run_in_group(spec, rank=ctx.rank, world=ctx.world_size, store=ctx.store(spec.timeout_s), body=body)


def pin_to_rank_cores(spec: ExecSpec, rank: int) -> None:
    """Pin this local process to its pipeline copy's cores where the run's processes outnumber them and each PP rank
    has several (FSDP/TP peers; :func:`ppsim.step.sharing.core_plan`). torchtitan's mesh puts PP outermost: process
    ``rank`` is at FSDP/TP position ``rank % (dp_shard x tp)`` of its PP rank."""
    import os

    from ppsim.step.sharing import core_plan

    if not hasattr(os, "sched_setaffinity"):  # not Linux: the OS places the processes
        return
    allowed = sorted(os.sched_getaffinity(0))
    per_rank = spec.world_size // spec.schedule.num_ranks
    plan = core_plan(spec.schedule.num_ranks, per_rank, len(allowed))
    if plan is not None:
        os.sched_setaffinity(0, {allowed[i] for i in plan[rank % per_rank]})


#: set to 1 to keep torch's pipeline runtime's own error logs (each rank prints the schedule around a failed step)
RUNTIME_LOGS_ENV = "PPSIM_TORCH_LOGS"


def quiet_runtime_logs() -> None:
    """When a step fails (a peer lost, a timeout), torch's ``_PipelineScheduleRuntime`` logs the whole schedule on
    every surviving rank (about a hundred lines) before it raises; ppsim names the failure itself in one line, so
    those logs are kept back unless ``PPSIM_TORCH_LOGS=1``."""
    import logging
    import os

    if os.environ.get(RUNTIME_LOGS_ENV) != "1":
        logging.getLogger("torch.distributed.pipelining").setLevel(logging.CRITICAL)


def run_in_group(spec: ExecSpec, *, rank: int, world: int, store: Any | None, body: RankBody) -> Measurement | None:
    """Run ``body`` as rank ``rank`` of ``world`` inside its process group (initialised here and torn down after;
    ``store=None``: from the environment, as torchrun sets it). Rank 0 returns the gathered :class:`Measurement`,
    the others ``None``."""
    import os

    import torch
    import torch.distributed as dist

    from ppsim.calibrate.execute import launch, torch_adapter

    torch_adapter.check()
    if world != spec.world_size:
        degrees = f" x dp_shard {spec.dp_shard} x tp {spec.tp}" if spec.world_size != spec.schedule.num_ranks else ""
        raise PPSimError(
            f"{spec.schedule.name} has {spec.schedule.num_ranks} ranks{degrees} but the job has {world} processes; "
            f"launch {spec.world_size} (torchrun --nproc-per-node) or pass -r {world}"
        )
    torch.set_num_threads(1)
    quiet_runtime_logs()
    if spec.synthetic:
        launch.tighten_sleep()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if spec.device == "cuda":
        torch.cuda.set_device(local_rank)
    launch.init_world(backend=spec.backend, timeout_s=spec.timeout_s, store=store,
                      rank=rank if store is not None else None, world_size=world if store is not None else None)
    try:
        if store is not None:  # local ranks: the launcher names a lost rank itself
            return body(spec, rank, world, local_rank)
        with launch.peers_lost_in_one_line(rank, world, "the run"):
            return body(spec, rank, world, local_rank)
    finally:
        dist.destroy_process_group()


class Clock:
    """Stamps computations of one rank. Host clock on CPU; CUDA events (converted later) on GPU."""

    def __init__(self, sleep_s: Sequence[float] | None, cuda: bool) -> None:
        self.sleep_s = sleep_s
        self.cuda = cuda
        self.records: list[tuple[Any, Any, float, str]] = []
        self.posted: dict[tuple[int, int, str], float] = {}
        self.pending_wait = 0.0
        self._begin: Any = None
        self._begin_host = 0.0
        self._name = ""
        self._index = 0
        self.memory: _PeakSaved | None = None
        """The step's memory count, while one is taken: told of the forward outputs the runtime keeps."""
        self.live: Any = None
        """The allocator-level count (:func:`live_bytes_mode`), while one is taken: told where each action begins."""
        if cuda:
            import torch

            self._event = lambda: torch.cuda.Event(enable_timing=True)

    def outputs(self, key: tuple[int, int], tensors: list[Any]) -> None:
        if self.memory is not None:
            self.memory.keep(key, tensors)

    def reset(self) -> None:
        self.records = []
        self.posted = {}
        self.pending_wait = 0.0
        self._index = 0

    def begin(self, name: str) -> None:
        self._name = name
        if self.live is not None:
            self.live.mark(name)
        self._begin_host = time.perf_counter()
        if self.cuda:
            ev = self._event()
            ev.record()
            self._begin = ev
        else:
            self._begin = self._begin_host

    def post(self, stage: int, microbatch: int, kind: str) -> None:
        self.posted[(stage, microbatch, kind)] = time.perf_counter()

    def add_wait(self, seconds: float) -> None:
        self.pending_wait += seconds

    def finish(self) -> None:
        if self.sleep_s is not None:
            remaining = self._begin_host + self.sleep_s[self._index] - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        if self.cuda:
            end: Any = self._event()
            end.record()
        else:
            end = time.perf_counter()
        self.records.append((self._begin, end, self.pending_wait, self._name))
        self.pending_wait = 0.0
        if self.live is not None:
            self.live.mark(f"after {self._name}")
        self._index += 1

    def stamp(self, name: str, begin: float, end: float, wait: float) -> None:
        """A computation another host thread ran (an overlapped pair's backward half, CPU only), stamped after."""
        assert not self.cuda, "overlapped pairs run on CPU ranks only"
        self.records.append((begin, end, wait, name))
        if self.live is not None:
            self.live.mark(f"after {name}")
        self._index += 1



class _PeakSaved:
    """Saved-tensor hooks: the peak over a step of the bytes autograd keeps for backward, plus the forward outputs
    the pipeline runtime keeps (until the backward before torch 2.15, until the send since) (unique storages, the
    rank's parameters excluded)."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self.refs: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.held = 0
        self.peak = 0
        self.kept: dict[tuple[int, int], list[int]] = {}

    def keep(self, key: tuple[int, int], tensors: list[Any]) -> None:
        """The runtime now keeps ``tensors`` as the outputs of (stage, microbatch) ``key``."""
        for ptr in self.kept.pop(key, []):
            self._release(ptr)
        ptrs = []
        for tensor in tensors:
            for storage in _storages(tensor):
                if storage.data_ptr() not in self.param_storages and storage.nbytes() > 0:
                    ptrs.append(self._hold(storage))
        if ptrs:
            self.kept[key] = ptrs

    def _hold(self, storage: Any) -> int:
        ptr = storage.data_ptr()
        if self.refs.get(ptr, 0) == 0:
            self.nbytes[ptr] = storage.nbytes()
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return ptr

    def pack(self, tensor: Any) -> Any:
        held = [st for st in _storages(tensor) if st.data_ptr() not in self.param_storages and st.nbytes() > 0]
        if not held:
            return tensor
        box = _Box(tensor.detach())
        for storage in held:
            weakref.finalize(box, self._release, self._hold(storage))
        return box

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Box) else packed

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.held -= self.nbytes[ptr]


def _storages(tensor: Any) -> list[Any]:
    """The storages holding ``tensor``'s data: its own, or, for a wrapper subclass that has none (a functional
    collective's ``AsyncCollectiveTensor``, a DTensor: what an expert-parallel all-to-all saves), its inner
    tensors'."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        import torch

        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [st for t in inner if isinstance(t, torch.Tensor) for st in _storages(t)]
    return [tensor.untyped_storage()]


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def live_bytes_mode() -> Any:
    """A dispatch mode counting every live tensor's bytes on the CPU (unique storages) over a step; ``.peak`` after.

    It starts from the tensors alive when it is entered (found by the garbage collector: parameters, gradients,
    buffers, receive buffers, FSDP's shards) and adds each storage an operator returns while it runs, released when
    its last tensor dies (a finalizer on the storage). That is what the allocator holds for tensors; a kernel's own
    scratch outside tensors is not seen. A DTensor counts its local tensor. :meth:`mark` opens a new span (an action,
    or the gap after it); ``.spans`` then holds each span's name and high point, ``.during`` the span of ``.peak``."""
    import gc
    import warnings

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.held = 0
            self.peak = 0
            self.during = "the step's start"
            self.spans: list[list[Any]] = [[self.during, 0]]

        def mark(self, name: str) -> None:
            self.spans.append([name, self.held])

        def track(self, tensor: Any) -> None:
            local = getattr(tensor, "_local_tensor", tensor)
            if local.device.type != "cpu" or local.is_meta:
                return
            try:
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a wrapper without storage
                return
            key, size = id(storage), storage.nbytes()
            if size == 0 or key in self.sizes:
                return
            self.sizes[key] = size
            self.held += size
            span = self.spans[-1]
            span[1] = max(span[1], self.held)
            if self.held > self.peak:
                self.peak, self.during = self.held, span[0]
            weakref.finalize(storage, self._release, key)

        def _release(self, key: int) -> None:
            self.held -= self.sizes.pop(key, 0)

        def __enter__(self) -> Any:
            gc.collect()
            with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
                warnings.simplefilter("ignore")
                for obj in gc.get_objects():
                    if isinstance(obj, torch.Tensor):
                        self.track(obj)
            self.spans[0][1] = self.peak
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf)
            return out

    return LiveBytes()


@dataclass
class RankRun:
    """What one rank built and steps: its stage modules by stage, the runtime running its order, the clock its
    stages are instrumented with, the batch, and how its gradients are named in the unsplit model."""

    parts: dict[int, Any]
    runtime: Any
    clock: Clock
    tokens: Any
    targets: Any
    has_first: bool
    has_last: bool
    grad_name: Callable[[int, str], str]
    pp_rank: int | None = None
    """This process's pipeline rank (``None``: its global rank; FSDP/TP runs have ``dp_shard x tp`` per PP rank)."""
    primary: bool = True
    """The process whose times, loss and gradients stand for its PP rank (FSDP and TP coordinate 0)."""
    comm_stats: Any = None
    """What this rank's all-to-alls cost each step (:class:`~ppsim.calibrate.execute.overlap.CommStats`), if counted."""


def checkpoint_chosen(spec: ExecSpec, stages: Sequence[Any], modules: Sequence[Any]) -> None:
    """``run --recompute``: the chosen (stage, microbatch) forwards of this rank run under checkpointing."""
    for st, module in zip(stages, modules):
        chosen = frozenset(m for s, m in spec.recompute if s == st.stage_index)
        if chosen:
            _checkpoint_forwards(st, module, chosen)


def measure_rank(spec: ExecSpec, rank: int, world: int, device: Any, run: RankRun, *,
                 reference: Callable[[dict[str, Any]], Any] | None = None) -> Measurement | None:
    """Step ``run`` through the warm-up, timed and probe steps of ``spec`` (every computation stamped, the last
    timed step's saved activations counted), then gather every rank's times, gradients, loss and memory on rank 0
    and assemble them (``reference``: how the gradients are checked; default the executor's)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from ppsim.calibrate.execute import torch_adapter

    schedule, clock, cuda = spec.schedule, run.clock, spec.device == "cuda"
    pp_rank = rank if run.pp_rank is None else run.pp_rank
    tokens, targets = run.tokens.to(device), run.targets.to(device)
    args = (tokens,) if run.has_first else ()
    kwargs: dict[str, Any] = {"target": targets} if run.has_last else {}
    modules = list(run.parts.values())
    expected = [e[2] for e in expected_computations(schedule, pp_rank)]
    kinds = step_kinds(spec)
    last_timed = max(i for i, k in enumerate(kinds) if k == "timed")
    # parameters and buffers (a RoPE table) live as long as the module: not activations
    saved = _PeakSaved(
        {_local(t).untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}
    )
    per_step: list[list[tuple[float, float, float, float | None]]] = []
    step_walls: list[float] = []
    step_ends: list[float] = []
    step_begins: list[float] = []
    comm: list[dict[str, float]] = []
    losses: list[Any] = []
    with torch_adapter.timed_receive_waits(clock.add_wait):
        for step in range(len(kinds)):
            for m in modules:
                m.zero_grad(set_to_none=True)
            losses = []
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            clock.reset()
            base_event = None
            if cuda:
                base_event = torch.cuda.Event(enable_timing=True)
                base_event.record()
            if run.comm_stats is not None:
                run.comm_stats.reset()
            hooks = (torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if step == last_timed
                     else contextlib.nullcontext())
            clock.memory = saved if step == last_timed else None
            t0 = time.perf_counter()
            with hooks:
                run.runtime.step(*args, losses=losses, return_outputs=False, **kwargs)
            clock.memory = None
            if cuda:
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            names = [r[3] for r in clock.records]
            if names != expected:
                raise RuntimeError(f"rank {rank} ran {names} but the schedule orders {expected} (ppsim bug)")
            per_step.append(_host_times(clock.records, t0, base_event, _posted_times(clock.posted, names)))
            step_walls.append(t1 - t0)
            step_begins.append(t0)
            step_ends.append(t1)  # on CUDA after the synchronisation: the host time the step's work ended
            if run.comm_stats is not None:
                comm.append(run.comm_stats.as_dict())
        spans: tuple[tuple[str, int], ...] = ()
        peak_allocated: int | None = None
        peak_reserved: int | None = None
        during: str | None = None
        if not spec.timing_only:
            losses = []
            peak_allocated, during, spans = _allocator_peak_step(run, modules, device, cuda, args, kwargs, losses)
            if cuda:  # the same step's reserved peak (reset with the allocated one before it)
                peak_reserved = int(torch.cuda.max_memory_reserved(device))

    grads = {} if spec.timing_only else {
        run.grad_name(s, name): _full_grad(p.grad) for s, mod in run.parts.items()
        for name, p in mod.named_parameters() if p.grad is not None}
    params = [p for m in modules for p in m.parameters()]
    memory = MeasuredPeak(
        rank=pp_rank, peak_activation_bytes=saved.peak,
        param_bytes=sum(_local(p).numel() * p.element_size() for p in params),
        grad_bytes=sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        peak_allocated_bytes=peak_allocated, peak_allocated_during=during, allocated_by_action=spans,
        peak_reserved_bytes=peak_reserved,
    )
    loss = float(torch.stack([x.detach().float() for x in losses]).mean()) if run.has_last else None
    offset = _clock_offset(rank, world, device)
    payload = {
        "rank": pp_rank,
        "primary": run.primary,
        "times": [
            [(a - offset, b - offset, w, None if p is None else p - offset) for a, b, w, p in step]
            for step in per_step
        ],
        "walls": step_walls,
        "ends": [t - offset for t in step_ends],
        "begins": [t - offset for t in step_begins],
        "comm": comm,
        "grads": grads,
        "loss": loss,
        "memory": memory,
        "host": socket.gethostname(),
    }
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    return _assemble(spec, gathered, device, reference=reference)


def _allocator_peak_step(run: RankRun, modules: Sequence[Any], device: Any, cuda: bool, args: tuple[Any, ...],
                         kwargs: dict[str, Any], losses: list[Any]
                         ) -> tuple[int, str | None, tuple[tuple[str, int], ...]]:
    """One more step, untimed, for the allocator-level peak: on CUDA ``max_memory_allocated`` (the model caches
    dropped first, so the process holds the job alone); on CPU every live tensor's bytes (:func:`live_bytes_mode`).
    Its gradients and losses replace the last timed step's (same batch, same weights). Returns the peak, and on CPU
    the action it happened in and each action's high point."""
    import gc

    import torch
    import torch.distributed as dist

    from ppsim.calibrate.models import drop_cached_models

    drop_cached_models()
    for m in modules:
        m.zero_grad(set_to_none=True)
    gc.collect()
    dist.barrier()
    run.clock.reset()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run.runtime.step(*args, losses=losses, return_outputs=False, **kwargs)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)), None, ()
    mode = live_bytes_mode()
    run.clock.live = mode
    try:
        with mode:
            run.runtime.step(*args, losses=losses, return_outputs=False, **kwargs)
    finally:
        run.clock.live = None
    return int(mode.peak), mode.during, tuple((name, int(high)) for name, high in mode.spans)


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (a plain tensor as it is)."""
    return getattr(tensor, "_local_tensor", tensor)


def _full_grad(grad: Any) -> Any:
    """The whole gradient on the CPU in float32: an FSDP or TP gradient (a DTensor) gathered from its shards (a
    collective: every rank of its mesh calls it in the same order)."""
    import torch

    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return full.detach().to("cpu", torch.float32)


def _checkpoint_forwards(stage: Any, module: Any, microbatches: frozenset[int]) -> None:
    """Run the forward of ``microbatches`` on this stage under ``torch.utils.checkpoint`` (non-reentrant): autograd
    keeps only the stage's inputs and recomputes the forward when the backward (B, or I) first needs it."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward
    active = [False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if active[0]:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    module.forward = forward
    one_chunk = stage.forward_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        active[0] = fwd_chunk_id in microbatches
        try:
            return one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            active[0] = False

    stage.forward_one_chunk = forward_one_chunk


def _posted_times(posted: dict[tuple[int, int, str], float], names: list[str]) -> list[float | None]:
    """Per recorded computation, when its cross-rank input's receive was posted (F: activation, B/I: gradient)."""
    from ppsim.ir import parse_action

    out: list[float | None] = []
    for name in names:
        comp = parse_action(name)
        assert comp is not None and comp.microbatch is not None
        kind = "F" if comp.type.value == "F" else "B"
        out.append(posted.get((comp.stage, comp.microbatch, kind)) if comp.type.value != "W" else None)
    return out


def _host_times(
    records: list[tuple[Any, Any, float, str]], t0: float, base_event: Any, posted: list[float | None]
) -> list[tuple[float, float, float, float | None]]:
    if base_event is None:
        return [(a, b, w, p) for (a, b, w, _), p in zip(records, posted)]
    # CUDA events: milliseconds since the step's base event, recorded at host time t0
    return [
        (t0 + base_event.elapsed_time(a) / 1e3, t0 + base_event.elapsed_time(b) / 1e3, w, p)
        for (a, b, w, _), p in zip(records, posted)
    ]


def _clock_offset(rank: int, world: int, device: Any) -> float:
    """This rank's clock minus rank 0's: 0 on one host; across hosts, from the ping-pong with the shortest round trip
    (rank 0 stamps send and receive, the peer stamps in between)."""
    import torch
    import torch.distributed as dist

    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) == 1:
        return 0.0
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    if rank == 0:
        for peer in range(1, world):
            samples: list[tuple[float, float]] = []
            for _ in range(16):
                t1 = time.perf_counter()
                dist.send(buf, dst=peer)
                dist.recv(buf, src=peer)
                t2 = time.perf_counter()
                samples.append((t2 - t1, float(buf.item()) - (t1 + t2) / 2))
            dist.send(torch.tensor([min(samples)[1]], dtype=torch.float64, device=device), dst=peer)
        return 0.0
    for _ in range(16):
        dist.recv(buf, src=0)
        buf.fill_(time.perf_counter())
        dist.send(buf, dst=0)
    dist.recv(buf, src=0)
    return float(buf.item())


def _assemble(spec: ExecSpec, gathered: list[dict[str, Any]], device: Any, *,
              reference: Callable[[dict[str, Any]], ReferenceCheck] | None = None) -> Measurement:
    """Rank 0: the gathered payloads as one :class:`Measurement`, gradients checked by ``reference`` (default: the
    non-pipelined reference of :mod:`ppsim.calibrate.execute.numerics`)."""
    import torch

    from ppsim.calibrate.execute.launch import cpu_name
    from ppsim.calibrate.execute.numerics import ReferenceCheck, check_against_reference

    schedule = spec.schedule
    worst: dict[int, MeasuredPeak] = {}
    for g in gathered:  # each PP rank's worst device among its FSDP/TP replicas
        mem = g["memory"]
        if mem.peak_allocated_bytes is not None and (
                mem.rank not in worst or mem.peak_allocated_bytes > (worst[mem.rank].peak_allocated_bytes or 0)):
            worst[mem.rank] = mem
    gathered = sorted((g for g in gathered if g["primary"]), key=lambda g: g["rank"])
    for g in gathered:
        if g["rank"] in worst:
            w = worst[g["rank"]]
            g["memory"] = dataclasses.replace(g["memory"], peak_allocated_bytes=w.peak_allocated_bytes,
                                              peak_allocated_during=w.peak_allocated_during,
                                              allocated_by_action=w.allocated_by_action,
                                              peak_reserved_bytes=w.peak_reserved_bytes)
    steps: list[tuple[CompTiming, ...]] = []
    kinds = step_kinds(spec)
    # each step's clock starts when the first rank called the runtime's step (FSDP's gathers start there)
    origin = [min(min(t[0] for g in gathered for t in g["times"][i]), min(g["begins"][i] for g in gathered))
              for i in range(len(kinds))]
    for i, t_min in enumerate(origin):
        row: list[CompTiming] = []
        for g in gathered:
            r = g["rank"]
            for (pos, half, name), (a, b, w, p) in zip(expected_computations(schedule, r), g["times"][i]):
                row.append(CompTiming(r, pos, half, name, a - t_min, b - t_min, w, None if p is None else p - t_min))
        steps.append(tuple(row))
    walls = [max(g["walls"][i] for g in gathered) for i in range(len(kinds))]
    ends = [max(g["ends"][i] for g in gathered) - origin[i] for i in range(len(kinds))]
    begins = [min(g["begins"][i] for g in gathered) - origin[i] for i in range(len(kinds))]
    grads: dict[str, Any] = {}
    for g in gathered:
        grads.update(g["grads"])
    # one rank per chain holds its last stage (DualPipe: two), each chain the same number of microbatches
    chain_losses = [g["loss"] for g in gathered if g["loss"] is not None]
    loss = sum(chain_losses) / len(chain_losses)
    ref = ReferenceCheck(ref_loss=loss, grad_max_abs_diff=0.0, grad_ref_max_abs=0.0, num_params_checked=0) \
        if spec.timing_only else reference(grads) if reference is not None else check_against_reference(
        spec.model, schedule.num_stages, schedule.num_microbatches, grads, synthetic=spec.synthetic, seed=spec.seed,
        device=device, source=spec.source)
    notes: list[str] = []
    if spec.device == "cuda":
        name = torch.cuda.get_device_name(device)
        clock = "cuda_events"
    else:
        name = cpu_name()
        clock = "perf_counter"
    hosts = tuple(g["host"] for g in gathered)
    if len(set(hosts)) > 1:
        notes.append("ranks on several hosts: clocks aligned by ping-pong with rank 0")
    return Measurement(
        steps=tuple(st for st, k in zip(steps, kinds) if k == "timed"),
        step_walls=tuple(w for w, k in zip(walls, kinds) if k == "timed"),
        step_ends=tuple(e for e, k in zip(ends, kinds) if k == "timed"),
        step_begins=tuple(b for b, k in zip(begins, kinds) if k == "timed"),
        warmup_steps=tuple(st for st, k in zip(steps, kinds) if k == "warmup"),
        probe_steps=tuple(st for st, k in zip(steps, kinds) if k == "probe"),
        loss=loss,
        ref_loss=ref.ref_loss,
        grad_max_abs_diff=ref.grad_max_abs_diff,
        grad_ref_max_abs=ref.grad_ref_max_abs,
        num_params_checked=ref.num_params_checked,
        dtype=spec.model.dtype,
        device=spec.device,
        device_name=name,
        backend=spec.backend,
        torch_version=torch.__version__,
        hosts=hosts,
        clock=clock,
        num_warmup=spec.num_warmup,
        synthetic=spec.synthetic,
        memory=tuple(g["memory"] for g in gathered),
        comm=_timed_comm(gathered, kinds),
        notes=tuple(notes),
    )


def _timed_comm(gathered: list[dict[str, Any]], kinds: Sequence[str]) -> tuple[tuple[dict[str, float], ...], ...]:
    """Per timed step, each PP rank's all-to-all counts (empty when the ranks did not count them)."""
    if not all(g["comm"] for g in gathered):
        return ()
    return tuple(tuple(g["comm"][i] for g in gathered) for i, k in enumerate(kinds) if k == "timed")

