"""Execute a ppsim schedule with torch's pipeline runtime and time every computation (``ppsim run``).

One process per rank. Each rank builds its stages of the calibration model (or of the synthetic model), wraps them
in torch's ``PipelineStage`` and runs them in ``_PipelineScheduleRuntime`` with the order set directly from ppsim's
:class:`~ppsim.ir.Schedule` (the same order ppsim simulates, so ppsim-only schedules execute too). The runtime lowers
that compute-only order itself (it adds the sends and receives), and runs an overlapped pair as it always does: the
forward half, then the backward half.

Timing hooks, all per process and cheap (two clock reads and a list append per computation):

- the stage's ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` are wrapped to stamp the
  start and end of each computation (a forward ends after the runtime applied the loss on the last stage);
- the runtime's module-level ``_wait_batch_p2p`` is wrapped to measure how long the next computation waited for
  its input (the wait for a receive happens just before the computation that consumes it);
- the stage's ``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` are wrapped to stamp when each receive is posted (torch's
  lowering posts some receives only just before their consumer, and a transfer starts only once both sides posted).

Clock: ``time.perf_counter`` (CLOCK_MONOTONIC, shared by every process on a host; ranks on other hosts get their
offset measured by ping-pong with rank 0); on CUDA the computation bounds are CUDA events, converted to that clock.

Synthetic stages (``synthetic=True``): each stage is a tiny differentiable module (an embedding on the first stage,
an element-wise affine map on every stage, a small head on the last) whose boundary tensors keep the model's shape,
so communication is real; each computation sleeps until its cost has elapsed since it started, so its duration is
the cost and its gradients are exact.

Results are gathered to rank 0: per-step timings of every computation, the loss and the largest difference of every
parameter gradient from a single-process, non-pipelined reference on the same batch.

torch is imported inside functions only (``ppsim`` itself must import without it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ppsim.errors import PPSimError
from ppsim.ir import Schedule

if TYPE_CHECKING:
    from ppsim.calibrate.model import ModelConfig

#: Gradient tolerance: max |grad - grad_ref| over every parameter element must not exceed this fraction of the
#: largest reference gradient magnitude (float32; bfloat16/float16 models use the looser value).
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
#: Loss tolerance, relative to the reference loss.
LOSS_RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}

DEFAULT_TIMEOUT_S = 600.0
_SYNTHETIC_VOCAB = 32


def schedule_refusal(schedule: Schedule) -> str | None:
    """Why torch's runtime cannot execute ``schedule`` (``None`` when it can)."""
    if len(schedule.pipelines) > 1:
        return (
            f"{schedule.name} has {len(schedule.pipelines)} independent pipelines (model copies fed from both ends); "
            "torch's runtime cannot execute it (it would chain the two pipelines, sending stage "
            f"{schedule.pipelines[0][-1]}'s output into stage {schedule.pipelines[1][0]}); run DualPipeV instead, "
            "which places the same stages on half the ranks"
        )
    chain = schedule.pipelines[0]
    if tuple(chain) != tuple(range(schedule.num_stages)):
        return f"{schedule.name}: torch's runtime needs the stages to form the chain 0..{schedule.num_stages - 1}"
    return None


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
    apart, so a model fitted on the probes describes the machine at the same moments as the timed steps."""
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    parent_pid: int | None = None


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
    notes: tuple[str, ...] = field(default_factory=tuple)

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
        """Per timed step: last computation end minus first computation start over all ranks."""
        return tuple(max(c.end for c in step) - min(c.start for c in step) for step in self.steps)


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


# --- launching --------------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` job (the launcher set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(spec: ExecSpec) -> Measurement:
    """Run ``spec`` on ``spec.schedule.num_ranks`` local processes and return rank 0's gathered measurement.

    Processes start from a fork server that has torch imported already (cheap starts); they are always terminated
    when the run fails, times out or is interrupted. A rank's exception is re-raised here with its traceback text.
    """
    import multiprocessing as mp

    import torch.distributed as dist

    world = spec.schedule.num_ranks
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed.pipelining", "ppsim.calibrate.model", "ppsim.calibrate.executor"]
    )
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    queue = ctx.SimpleQueue()
    spec = dataclasses.replace(spec, parent_pid=os.getpid())
    procs = [
        ctx.Process(target=_spawned_rank, args=(rank, world, store.port, spec, queue), daemon=True)
        for rank in range(world)
    ]
    try:
        for p in procs:
            p.start()
        return _await_result(procs, queue, spec.timeout_s)
    finally:
        _stop(procs)
        del store


def _await_result(procs: list[Any], queue: Any, timeout_s: float) -> Measurement:
    deadline = time.monotonic() + timeout_s
    while True:
        while not queue.empty():
            kind, *payload = queue.get()
            if kind == "ok":
                return payload[0]
            rank, text, user = payload
            if user:
                raise PPSimError(text)
            raise RuntimeError(f"rank {rank} failed:\n{text}")
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            time.sleep(0.2)  # a failing rank reports before it exits; give the report a moment to arrive
            if queue.empty():
                rank, code = dead[0]
                raise RuntimeError(f"rank {rank} exited with code {code} before reporting (killed or crashed)")
            continue
        if all(p.exitcode == 0 for p in procs) and queue.empty():
            raise RuntimeError("every rank exited but rank 0 reported no result")
        if time.monotonic() > deadline:
            raise PPSimError(
                f"the run did not finish within {timeout_s:.0f} s; use fewer microbatches or steps, or a larger "
                "--timeout (processes were stopped)"
            )
        time.sleep(0.02)


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _spawned_rank(rank: int, world: int, port: int, spec: ExecSpec, queue: Any) -> None:
    """Entry point of one locally launched rank."""
    _watch_parent(spec.parent_pid)
    try:
        import torch.distributed as dist
        from datetime import timedelta

        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=spec.timeout_s))
        result = run_rank(spec, rank=rank, world=world, store=store)
        if rank == 0:
            queue.put(("ok", result))
    except BaseException as exc:  # report, then exit non-zero; the parent stops the other ranks
        queue.put(("error", rank, str(exc) if isinstance(exc, PPSimError) else traceback.format_exc(),
                   isinstance(exc, PPSimError)))
        os._exit(1)


def _watch_parent(parent_pid: int | None) -> None:
    """Exit this rank if the launching process disappears (so no rank outlives a killed `ppsim run`)."""
    if parent_pid is None:
        return
    import threading

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except OSError:
                os._exit(3)

    threading.Thread(target=watch, name="ppsim-parent-watch", daemon=True).start()


# --- one rank ---------------------------------------------------------------------------------------------------
def run_rank(spec: ExecSpec, *, rank: int, world: int, store: Any | None = None) -> Measurement | None:
    """Run ``spec`` as rank ``rank`` of ``world`` (initialises and tears down the process group).

    Returns the gathered :class:`Measurement` on rank 0 and ``None`` elsewhere. With ``store=None`` the process
    group is initialised from the environment (``torchrun``).
    """
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    if world != spec.schedule.num_ranks:
        raise PPSimError(
            f"{spec.schedule.name} has {spec.schedule.num_ranks} ranks but the job has {world} processes; "
            f"launch {spec.schedule.num_ranks} (torchrun --nproc-per-node) or pass -r {world}"
        )
    torch.set_num_threads(1)
    if spec.synthetic:
        _tighten_sleep()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if spec.device == "cuda":
        torch.cuda.set_device(local_rank)
    kwargs: dict[str, Any] = {"backend": spec.backend, "timeout": timedelta(seconds=spec.timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    dist.init_process_group(**kwargs)
    try:
        return _run_rank(spec, rank, world, local_rank)
    finally:
        dist.destroy_process_group()


def _tighten_sleep() -> None:
    """Ask Linux for 1 µs timer slack (default 50 µs), so sleeps end on time."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


class _Clock:
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
        if cuda:
            import torch

            self._event = lambda: torch.cuda.Event(enable_timing=True)

    def reset(self) -> None:
        self.records = []
        self.posted = {}
        self.pending_wait = 0.0
        self._index = 0

    def begin(self, name: str) -> None:
        self._name = name
        self._begin_host = time.perf_counter()
        if self.cuda:
            ev = self._event()
            ev.record()
            self._begin = ev
        else:
            self._begin = self._begin_host

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
        self._index += 1


_ACTIVE_CLOCK: _Clock | None = None


def _timed_wait(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def wait(work: Any) -> None:
        t0 = time.perf_counter()
        original(work)
        if _ACTIVE_CLOCK is not None:
            _ACTIVE_CLOCK.pending_wait += time.perf_counter() - t0

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def _instrument_stage(stage: Any, clock: _Clock) -> None:
    """Wrap the stage's per-computation entry points (instance attributes shadow the class methods)."""
    index = stage.stage_index
    fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        clock.begin(f"{index}F{fwd_chunk_id}")
        return fwd(fwd_chunk_id, *args, **kwargs)  # finished by the runtime after the loss (_TimedRuntime)

    def backward_one_chunk(bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        clock.begin(f"{index}{'B' if full_backward else 'I'}{bwd_chunk_id}")
        out = bwd(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        clock.finish()
        return out

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False) -> Any:
        clock.begin(f"{index}W{bwd_chunk_id}")
        out = bwd_w(bwd_chunk_id, last_backward=last_backward)
        clock.finish()
        return out

    fwd_recv, bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops

    def get_fwd_recv_ops(fwd_chunk_id: int) -> Any:
        clock.posted[(index, fwd_chunk_id, "F")] = time.perf_counter()
        return fwd_recv(fwd_chunk_id)

    def get_bwd_recv_ops(bwd_chunk_id: int) -> Any:
        clock.posted[(index, bwd_chunk_id, "B")] = time.perf_counter()
        return bwd_recv(bwd_chunk_id)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    stage.get_fwd_recv_ops = get_fwd_recv_ops
    stage.get_bwd_recv_ops = get_bwd_recv_ops


def _runtime_class() -> type:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    class _TimedRuntime(_PipelineScheduleRuntime):
        """The runtime, finishing a forward's timing after the loss (called after every forward)."""

        ppsim_clock: _Clock

        def _maybe_compute_loss(self, stage: Any, output: Any, target_mbs: Any, mb_index: int,
                                loss_kwargs: Any = None) -> None:
            super()._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)
            self.ppsim_clock.finish()

    return _TimedRuntime


def build_modules(spec: ExecSpec, stages: Sequence[int], device: Any) -> dict[int, Any]:
    """The stage modules this rank holds (same weights as :func:`build_reference`)."""
    num_stages = spec.schedule.num_stages
    if spec.synthetic:
        cls = _synthetic_stage_class()
        return {
            s: cls(spec.model, s, num_stages, seed=spec.seed).to(device=device, dtype=_dtype(spec))
            for s in stages
        }
    from ppsim.calibrate.model import build_stage

    return {s: build_stage(spec.model, num_stages, s, seed=spec.seed, device=device) for s in stages}


def build_reference(spec: ExecSpec, device: Any) -> Any:
    """The unsplit model with the same weights as the stages."""
    if spec.synthetic:
        import torch

        cls = _synthetic_stage_class()
        n = spec.schedule.num_stages
        return torch.nn.Sequential(*(cls(spec.model, s, n, seed=spec.seed) for s in range(n))).to(
            device=device, dtype=_dtype(spec)
        )
    from ppsim.calibrate.model import build_full_model

    return build_full_model(spec.model, seed=spec.seed, device=device)


def reference_name(spec: ExecSpec, stage: int, local_name: str) -> str:
    """Name in :func:`build_reference`'s model of a stage module's parameter."""
    if spec.synthetic:
        return f"{stage}.{local_name}"
    from ppsim.calibrate.model import split_layers

    if local_name.startswith("layers."):
        _, idx, rest = local_name.split(".", 2)
        first = split_layers(spec.model.layers, spec.schedule.num_stages)[stage][0]
        return f"layers.{first + int(idx)}.{rest}"
    return local_name


def _dtype(spec: ExecSpec) -> Any:
    from ppsim.calibrate.model import DTYPES

    return DTYPES[spec.model.dtype]


def _synthetic_stage_class() -> type:
    global _SYNTHETIC_CLS
    if _SYNTHETIC_CLS is None:
        import torch
        from torch import nn

        class SyntheticStage(nn.Module):
            """A stage that costs (almost) nothing to compute: token embedding on the first stage, an element-wise
            affine map with a tanh on every stage, a small LM head on the last. Boundary tensors keep the model's
            ``(mb_size, seq_len, hidden)`` shape."""

            def __init__(self, config: Any, stage: int, num_stages: int, *, seed: int) -> None:
                super().__init__()
                gen = torch.Generator().manual_seed(seed * 1_000_003 + 17 * stage + 1)
                hidden = config.hidden
                self.embedding = (
                    nn.Parameter(torch.randn(config.vocab, hidden, generator=gen)) if stage == 0 else None
                )
                self.scale = nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=gen))
                self.shift = nn.Parameter(0.1 * torch.randn(hidden, generator=gen))
                self.head = (
                    nn.Parameter(torch.randn(config.vocab, hidden, generator=gen) / math.sqrt(hidden))
                    if stage == num_stages - 1
                    else None
                )

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.embedding is not None:
                    x = self.embedding[x]
                x = torch.tanh(x * self.scale + self.shift)
                if self.head is not None:
                    x = x @ self.head.t()
                return x

        _SYNTHETIC_CLS = SyntheticStage
    return _SYNTHETIC_CLS


_SYNTHETIC_CLS: type | None = None


def synthetic_model(model: ModelConfig, num_stages: int) -> ModelConfig:
    """Shapes of the synthetic stages for ``model``: same boundary tensor, a small vocabulary, no layers to split."""
    return model.replace(
        preset="synthetic", heads=1, ffn=1, layers=num_stages, vocab=min(model.vocab, _SYNTHETIC_VOCAB)
    )


def _run_rank(spec: ExecSpec, rank: int, world: int, local_rank: int) -> Measurement | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as torch_schedules
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _Action

    from ppsim.calibrate.model import loss_fn, make_batch

    global _ACTIVE_CLOCK
    schedule = spec.schedule
    cuda = spec.device == "cuda"
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    my_stages = schedule.stages_of(rank)
    modules = build_modules(spec, my_stages, device)
    sleep_s = spec.sleep_s[rank] if spec.synthetic and spec.sleep_s is not None else None
    clock = _Clock(sleep_s, cuda)
    stages = [PipelineStage(modules[s], s, schedule.num_stages, device) for s in my_stages]
    for st in stages:
        _instrument_stage(st, clock)
    runtime = _runtime_class()(stages, n_microbatches=schedule.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    runtime.ppsim_clock = clock
    order = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(schedule.actions)}
    runtime.pipeline_order = order
    runtime._prepare_schedule_with_comms(order)

    tokens, targets = make_batch(spec.model, schedule.num_microbatches, seed=spec.seed)
    tokens, targets = tokens.to(device), targets.to(device)
    first, last = 0 in my_stages, schedule.num_stages - 1 in my_stages
    args = (tokens,) if first else ()
    kwargs: dict[str, Any] = {"target": targets} if last else {}

    expected = expected_computations(schedule, rank)
    original_wait = torch_schedules._wait_batch_p2p
    torch_schedules._wait_batch_p2p = _timed_wait(original_wait)
    _ACTIVE_CLOCK = clock
    per_step: list[list[tuple[float, float, float]]] = []
    step_walls: list[float] = []
    losses: list[Any] = []
    try:
        for step in range(len(step_kinds(spec))):
            for m in modules.values():
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
            t0 = time.perf_counter()
            runtime.step(*args, losses=losses, return_outputs=False, **kwargs)
            if cuda:
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            names = [r[3] for r in clock.records]
            if names != [e[2] for e in expected]:
                raise RuntimeError(
                    f"rank {rank} ran {names} but the schedule orders {[e[2] for e in expected]} (ppsim bug)"
                )
            per_step.append(_host_times(clock.records, t0, base_event, _posted_times(clock.posted, names)))
            step_walls.append(t1 - t0)
    finally:
        torch_schedules._wait_batch_p2p = original_wait
        _ACTIVE_CLOCK = None

    grads = {
        reference_name(spec, s, name): p.grad.detach().to("cpu", torch.float32)
        for s, mod in modules.items()
        for name, p in mod.named_parameters()
        if p.grad is not None
    }
    num_params = {s: sum(1 for _ in mod.parameters()) for s, mod in modules.items()}
    loss = float(torch.stack([x.detach().float() for x in losses]).mean()) if last else None
    offset = _clock_offset(rank, world, device)
    payload = {
        "rank": rank,
        "times": [
            [(a - offset, b - offset, w, None if p is None else p - offset) for a, b, w, p in step]
            for step in per_step
        ],
        "walls": step_walls,
        "grads": grads,
        "num_params": sum(num_params.values()),
        "loss": loss,
        "host": socket.gethostname(),
    }
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    return _assemble(spec, gathered, device)


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


def _assemble(spec: ExecSpec, gathered: list[dict[str, Any]], device: Any) -> Measurement:
    import torch

    from ppsim.calibrate.model import loss_fn, make_batch

    schedule = spec.schedule
    gathered = sorted(gathered, key=lambda g: g["rank"])
    steps: list[tuple[CompTiming, ...]] = []
    kinds = step_kinds(spec)
    for i in range(len(kinds)):
        t_min = min(t[0] for g in gathered for t in g["times"][i])
        row: list[CompTiming] = []
        for g in gathered:
            r = g["rank"]
            for (pos, half, name), (a, b, w, p) in zip(expected_computations(schedule, r), g["times"][i]):
                row.append(CompTiming(r, pos, half, name, a - t_min, b - t_min, w, None if p is None else p - t_min))
        steps.append(tuple(row))
    walls = [max(g["walls"][i] for g in gathered) for i in range(len(kinds))]
    grads: dict[str, Any] = {}
    for g in gathered:
        grads.update(g["grads"])
    loss = next(g["loss"] for g in gathered if g["loss"] is not None)

    # single-process, non-pipelined reference on the same batch: mean of the microbatch losses
    ref = build_reference(spec, device)
    tokens, targets = make_batch(spec.model, schedule.num_microbatches, seed=spec.seed)
    m = schedule.num_microbatches
    ref_loss = 0.0
    for tok, tgt in zip(tokens.to(device).chunk(m), targets.to(device).chunk(m)):
        mb_loss = loss_fn(ref(tok), tgt) / m
        mb_loss.backward()
        ref_loss += float(mb_loss.detach())
    ref_grads = {n: p.grad.detach().to("cpu", torch.float32) for n, p in ref.named_parameters() if p.grad is not None}
    missing = sorted(set(ref_grads) ^ set(grads))
    if missing:
        raise RuntimeError(f"parameters without a pipelined or reference gradient: {missing[:5]} (ppsim bug)")
    diff = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    notes: list[str] = []
    if spec.device == "cuda":
        name = torch.cuda.get_device_name(device)
        clock = "cuda_events"
    else:
        name = _cpu_name()
        clock = "perf_counter"
    hosts = tuple(g["host"] for g in gathered)
    if len(set(hosts)) > 1:
        notes.append("ranks on several hosts: clocks aligned by ping-pong with rank 0")
    return Measurement(
        steps=tuple(st for st, k in zip(steps, kinds) if k == "timed"),
        step_walls=tuple(w for w, k in zip(walls, kinds) if k == "timed"),
        warmup_steps=tuple(st for st, k in zip(steps, kinds) if k == "warmup"),
        probe_steps=tuple(st for st, k in zip(steps, kinds) if k == "probe"),
        loss=loss,
        ref_loss=ref_loss,
        grad_max_abs_diff=diff,
        grad_ref_max_abs=scale,
        num_params_checked=len(ref_grads),
        dtype=spec.model.dtype,
        device=spec.device,
        device_name=name,
        backend=spec.backend,
        torch_version=torch.__version__,
        hosts=hosts,
        clock=clock,
        num_warmup=spec.num_warmup,
        synthetic=spec.synthetic,
        notes=tuple(notes),
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


# --- synthetic costs --------------------------------------------------------------------------------------------
def sleep_plan(schedule: Schedule, durations: Callable[[Any], tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """Per rank, the duration of each computation in execution order; ``durations(action)`` gives the durations of
    an action's computations (one for a single computation, forward and backward halves for a pair)."""
    plan: list[tuple[float, ...]] = []
    for row in schedule.actions:
        values: list[float] = []
        for action in row:
            parts = durations(action)
            assert len(parts) == len(action.computations)
            values.extend(parts)
        plan.append(tuple(values))
    return tuple(plan)
