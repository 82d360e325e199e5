"""Per-stage measurements, done the way torch's pipeline runtime executes each action.

- ``F``: the stage's forward on one microbatch; on the last stage also the loss (the runtime computes the loss
  right after the last stage's forward, inside the F action).
- ``B``: full backward, torch's ``stage_backward`` (last stage: from the loss; others: from a received output grad).
- ``I`` / ``W``: torch's ``stage_backward_input`` then ``stage_backward_weight``. As in the runtime, the first stage
  (whose input, token ids, needs no gradient) skips the input pass at I and runs the full backward at W.
- ``FB``: one OVERLAP_F_B pair. torch's ``_PipelineScheduleRuntime`` runs the pair's F and then its B one after the
  other, so FB is timed as the forward of a new microbatch followed by the full backward of an earlier one.
- memory: saved-tensor hooks count the bytes autograd keeps for backward per microbatch (unique storages, weights
  excluded) and which of them are gone once I has run; on CUDA also the caching allocator's view.

Every timed sample is one action; ``warmup`` untimed repetitions come first. :meth:`StageBench.measure_timings`
(what `ppsim calibrate` uses) takes F, B, I, W and FB in turn within each repetition. CPU times use
``time.perf_counter``; CUDA
times use events recorded around the action on the current stream, read after a synchronisation.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppsim.calibrate.execute.torch_adapter import backward_functions
from ppsim.calibrate.models import ModelSource
from ppsim.calibrate.models.builtin import source_for
from ppsim.calibrate.models.transformer import DTYPES, ModelConfig, loss_fn, split_layers
from ppsim.errors import PPSimError
from ppsim.profile import MEASURED, OPS, WHOLE_BACKWARD_OPS, Block, Stat

Tick = Callable[[], None]
PassHook = Callable[[str], None]
"""Called with a pass's name (``F``, ``B``, ``I``, ``W``, ``F&B``) as it finishes, outside every timed interval."""


def _noop() -> None:
    return None


def _no_pass(name: str) -> None:
    return None


class Clock:
    """Times the sections of one action: ``marks = clock.run(fn)`` with ``fn`` calling ``mark()`` between sections."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @property
    def name(self) -> str:
        return "cuda_events" if self.cuda else "perf_counter"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def sections(self, fn: Callable[[Callable[[], None]], None],
                 finished: Callable[[int], None] | None = None) -> list[float]:
        """Run ``fn(mark)``; return the seconds of each section between marks (start and end are marked here).
        ``finished(k)`` runs once section ``k`` has ended, outside every timed interval (on CUDA: once it is
        queued, and the last once it has run)."""
        starts: list[Any] = []
        ends: list[Any] = []
        if self.cuda:
            def stamp() -> Any:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event

            self.sync()
        else:
            stamp = time.perf_counter

        def mark() -> None:
            ends.append(stamp())
            if finished is not None:
                finished(len(ends) - 1)
            starts.append(stamp())

        starts.append(stamp())
        fn(mark)
        ends.append(stamp())
        if self.cuda:
            ends[-1].synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(starts, ends)]
        else:
            times = [b - a for a, b in zip(starts, ends)]
        if finished is not None:
            finished(len(ends) - 1)
        return times


@dataclass
class _Forward:
    """What the runtime keeps between a microbatch's F and its backward (``fwd_cache`` plus the loss)."""

    outputs: tuple[torch.Tensor, ...]
    inputs: list[torch.Tensor]
    loss: torch.Tensor | None


@dataclass(frozen=True)
class MemoryResult:
    """A unit's measured memory: the profile's activation fields (:data:`ppsim.profile.MEASURED`), in its order."""

    activation_bytes: int
    activation_bytes_freed_by_I: int
    activation_bytes_allocator: int | None
    peak_bytes_allocator: int | None


assert tuple(f.name for f in dataclasses.fields(MemoryResult)) == MEASURED.unmeasured_ints + MEASURED.optional_ints, \
    "MemoryResult holds the profile's activation fields (ppsim.profile.Block)"


@dataclass(frozen=True)
class Unit:
    """A piece of the model measured alone: layers ``[first, last)`` (or the layers ``ids``, when given: e.g. one
    MoE layer of DeepSeek-V3), with the embedding and/or the head."""

    name: str
    layers: tuple[int, int]
    has_embedding: bool
    has_head: bool
    ids: tuple[int, ...] | None = None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(range(*self.layers)) if self.ids is None else self.ids

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


def unit_of(name: str, ids: tuple[int, ...], *, has_embedding: bool = False, has_head: bool = False) -> Unit:
    """A unit holding the layers ``ids`` (``layers`` records their span)."""
    span = (ids[0], ids[-1] + 1) if ids else (0, 0)
    contiguous = ids == tuple(range(*span))
    return Unit(name, span, has_embedding, has_head, None if contiguous else ids)


def stage_unit(config: ModelConfig, num_stages: int, stage: int) -> Unit:
    """Stage ``stage`` of the default split as a :class:`Unit`."""
    return Unit(f"stage{stage}", split_layers(config.layers, num_stages)[stage], stage == 0, stage == num_stages - 1)


def unit_static(config: ModelConfig, unit: Unit, source: ModelSource | None = None) -> Block:
    """``unit`` as the profile stores it before it is measured: its sizes, known without running anything (built on
    the meta device); its timings and activations ``None``."""
    source = source or source_for(config)
    module = source.build_stage(unit.layer_ids, has_embedding=unit.has_embedding, has_head=unit.has_head,
                                device="meta")
    param_bytes = sum(p.numel() * config.itemsize for p in module.parameters())
    # torch.optim.Adam keeps two state tensors (exp_avg, exp_avg_sq) shaped and typed like each parameter.
    return Block(param_bytes=param_bytes, grad_bytes=param_bytes, optimizer_bytes=2 * param_bytes,
                 output_bytes=0 if unit.has_head else config.boundary_bytes)


class StageBench:
    """One stage module (or unit) with a representative microbatch, ready to run the runtime's actions on it."""

    def __init__(
        self, config: ModelConfig, num_stages: int, stage: int, *, device: torch.device, seed: int = 0,
        unit: Unit | None = None, source: ModelSource | None = None, random_weights: bool = False,
        module: torch.nn.Module | None = None, fresh_grads: bool = False,
    ) -> None:
        self.fresh_grads = fresh_grads
        self.ops: tuple[str, ...] = OPS
        """What :meth:`timing_rep` times (under activation checkpointing the split backward is left out)."""
        """Drop the gradients before every backward (one gradient copy alive, its accumulation add not timed):
        calibration at size when the accumulation's transient copy does not fit."""
        if unit is None:
            unit = stage_unit(config, num_stages, stage)
        source = source or source_for(config)
        self.source = source
        self.config = config
        self.stage = stage
        self.unit = unit
        self.is_first = unit.has_embedding
        self.is_last = unit.has_head
        self.device = device
        self.clock = Clock(device)
        self.module = module if module is not None else source.build_stage(
            unit.layer_ids, has_embedding=unit.has_embedding, has_head=unit.has_head, seed=seed, device=device,
            random_weights=random_weights)
        self.input = source.stage_input(first=unit.has_embedding, salt=0 if unit.has_embedding else max(stage, 1),
                                        seed=seed, device=device)
        gen = torch.Generator().manual_seed(seed + 104729 * (stage + 1))
        if self.is_last:
            self.targets = torch.randint(0, config.vocab, (config.mb_size, config.seq_len), generator=gen).to(device)
            self.output_grad = None
        else:
            self.targets = None
            self.output_grad = (
                torch.randn(config.boundary_shape, generator=gen).to(device=device, dtype=DTYPES[config.dtype]) * 1e-3
            )

    # --- the runtime's actions ----------------------------------------------------------------------------------
    def forward(self) -> _Forward:
        if self.is_first:
            inp = self.input  # token ids: no gradient
        else:
            inp = self.input.detach().requires_grad_(True)  # like the runtime's receive buffer
        out = self.module(inp)
        loss = loss_fn(out, self.targets) if self.is_last else None
        return _Forward(outputs=(out,), inputs=[inp], loss=loss)

    def _backward_args(self, fwd: _Forward) -> tuple[Any, Any]:
        if self.is_last:
            return fwd.loss, None
        return fwd.outputs, (self.output_grad,)

    def _release_outputs(self, fwd: _Forward) -> None:
        # The runtime detaches the last stage's outputs after its backward (they are only kept to be returned).
        if self.is_last and not self.is_first:
            for t in fwd.outputs:
                if not t._is_view():
                    t.detach_()

    def backward(self, fwd: _Forward) -> None:
        if self.fresh_grads:
            self.module.zero_grad(set_to_none=True)
        outputs, grads = self._backward_args(fwd)
        stage_backward, _, _ = backward_functions()
        stage_backward(outputs, grads, fwd.inputs)
        self._release_outputs(fwd)

    def backward_input(self, fwd: _Forward) -> list[dict[str, Any]] | None:
        if self.is_first:
            return None  # the runtime skips the input pass of the first stage and runs the full backward at W
        outputs, grads = self._backward_args(fwd)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        _, stage_backward_input, _ = backward_functions()
        _, param_groups = stage_backward_input(list(outputs), grads, fwd.inputs, self.module.parameters())
        self._release_outputs(fwd)
        return param_groups

    def backward_weight(self, fwd: _Forward, param_groups: list[dict[str, Any]] | None) -> None:
        if self.is_first:
            self.backward(fwd)
        else:
            if self.fresh_grads:
                self.module.zero_grad(set_to_none=True)
            _, _, stage_backward_weight = backward_functions()
            stage_backward_weight(self.module.parameters(), param_groups or [])

    def checkpoint(self, mode: str) -> int:
        """Wrap the unit's blocks with torchtitan's ``mode`` policy exactly as ``ppsim run --activation-checkpoint``
        wraps a model part (:func:`ppsim.calibrate.torchtitan.checkpointing.apply_ac`), so F, B and FB are timed
        under it; I and W are then not timed (torch reruns a checkpointed region for each backward, so a split
        backward would rerun it twice: ``run`` refuses such schedules). Returns the blocks wrapped."""
        from ppsim.calibrate.torchtitan.checkpointing import apply_ac

        if mode == "none":
            return 0
        self.ops = WHOLE_BACKWARD_OPS
        return apply_ac(self.module, mode)

    # --- measurements -------------------------------------------------------------------------------------------
    def _loop(self, rep: Callable[[], list[float]], *, warmup: int, reps: int, tick: Tick) -> list[list[float]]:
        self.module.zero_grad(set_to_none=True)
        gc.collect()
        for _ in range(warmup):
            rep()
        results = []
        for _ in range(reps):
            results.append(rep())
            tick()
        self.clock.sync()
        return results

    def measure_timings(self, *, warmup: int, reps: int, tick: Tick = _noop) -> dict[str, list[float]]:
        """F, B, I, W and FB samples taken in turn within every repetition (see :meth:`timing_rep`)."""
        return measure_interleaved([self], warmup=warmup, reps=reps, tick=tick)[0]

    def start_timings(self, on_pass: PassHook = _no_pass) -> None:
        self.module.zero_grad(set_to_none=True)
        gc.collect()
        self._pending: _Forward | None = self.forward()
        on_pass("F")

    def stop_timings(self) -> None:
        self._pending = None
        self.clock.sync()

    def timing_rep(self, on_pass: PassHook = _no_pass) -> list[float]:
        """One repetition: F(a), B(a); an untimed F(b), then I(b), W(b); then the pair F(c) + B(pending), after
        which c is pending (one microbatch's activations stay alive across repetitions, as in a pipeline's steady
        state). Taking the five in turn means a burst of load elsewhere on the machine lands on all of them alike,
        so their ratios (I + W against B, FB against F + B) stay meaningful. Returns the times of :attr:`ops`
        (under activation checkpointing no I and W)."""
        fwd: list[_Forward] = []

        def forward_backward(mark: Callable[[], None]) -> None:
            fwd.append(self.forward())
            mark()
            self.backward(fwd[0])

        f, b = self.clock.sections(forward_backward, lambda k: on_pass(("F", "B")[k]))
        split_times: list[float] = []
        if "I" in self.ops:
            split = self.forward()

            def input_weight(mark: Callable[[], None]) -> None:
                groups = self.backward_input(split)
                mark()
                self.backward_weight(split, groups)

            split_times = self.clock.sections(input_weight, lambda k: on_pass(("I", "W")[k]))

        def pair(mark: Callable[[], None]) -> None:
            new = self.forward()
            assert self._pending is not None
            self.backward(self._pending)
            self._pending = new

        (fb,) = self.clock.sections(pair, lambda k: on_pass("F&B"))
        return [f, b, *split_times, fb]

    def measure_memory(self) -> MemoryResult:
        """Activation bytes of one microbatch and the part I releases (see module docstring)."""
        self.module.zero_grad(set_to_none=True)
        gc.collect()
        tracker = _SavedTracker(self.module)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            fwd = self.forward()
        held = tracker.held_bytes()
        groups = self.backward_input(fwd)
        gc.collect()
        freed = held - tracker.held_bytes()
        self.backward_weight(fwd, groups)
        del fwd, groups
        alloc_held = alloc_peak = None
        if self.device.type == "cuda":
            self.clock.sync()
            gc.collect()
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fwd = self.forward()
            self.clock.sync()
            alloc_held = max(0, torch.cuda.memory_allocated(self.device) - base)
            self.backward(fwd)
            del fwd
            self.clock.sync()
            alloc_peak = max(0, torch.cuda.max_memory_allocated(self.device) - base)
        self.module.zero_grad(set_to_none=True)
        return MemoryResult(
            activation_bytes=held, activation_bytes_freed_by_I=max(0, freed),
            activation_bytes_allocator=alloc_held, peak_bytes_allocator=alloc_peak,
        )


class _Held:
    """What a saved-tensor hook hands to autograd; it dies when autograd releases the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _SavedTracker:
    """Counts unique storages autograd saves for backward, excluding the module's parameters and buffers."""

    def __init__(self, module: torch.nn.Module) -> None:
        from ppsim.calibrate.execute.steps import _storages  # a wrapper subclass (DTensor: EP, TP) counts its inner

        self.storages = _storages
        # parameters and buffers (a RoPE table) live as long as the module: not activations
        self.param_storages = {st.data_ptr() for t in (*module.parameters(), *module.buffers())
                               for st in _storages(t)}
        self.refs: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> Any:
        held = [st for st in self.storages(tensor) if st.data_ptr() not in self.param_storages and st.nbytes() > 0]
        if not held:
            return tensor
        box = _Held(tensor.detach())  # no grad_fn: a saved output must not keep its own node alive
        for storage in held:
            ptr = storage.data_ptr()
            self.refs[ptr] = self.refs.get(ptr, 0) + 1
            self.nbytes[ptr] = storage.nbytes()
            weakref.finalize(box, self._release, ptr)
        return box

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1

    def held_bytes(self) -> int:
        return sum(self.nbytes[p] for p, n in self.refs.items() if n > 0)


def measure_interleaved(benches: list[StageBench], *, warmup: int, reps: int, tick: Tick = _noop,
                        progress: BlockProgress | None = None) -> list[dict[str, list[float]]]:
    """Time several benches with their repetitions interleaved (rep 1 of each, then rep 2 of each, ...), so that
    load elsewhere on the machine lands on all of them alike and differences between them (a K-layer unit against a
    1-layer one) stay meaningful. Returns each bench's F, B, I, W and FB samples. ``progress`` hears every pass."""
    progress = progress or BlockProgress([b.unit.name for b in benches], warmup=warmup, reps=reps,
                                         ops=benches[0].ops if benches else OPS)
    for bench in benches:
        progress.at(bench.unit.name, "the first forward")
        bench.start_timings(progress.passed)
    for w in range(warmup):
        for bench in benches:
            progress.at(bench.unit.name, f"warm-up {w + 1}/{warmup}")
            bench.timing_rep(progress.passed)
    results: list[list[list[float]]] = [[] for _ in benches]
    for r in range(reps):
        for k, bench in enumerate(benches):
            progress.at(bench.unit.name, f"repetition {r + 1}/{reps}")
            results[k].append(bench.timing_rep(progress.passed))
        tick()
    for bench in benches:
        bench.stop_timings()
    return [{op: [r[j] for r in res] for j, op in enumerate(bench.ops)} for bench, res in zip(benches, results)]


def measure_benches(benches: list[StageBench], *, warmup: int, reps: int, activation_checkpoint: str = "none",
                    tick: Tick = _noop, progress: BlockProgress | None = None, phase: PassHook = _no_pass
                    ) -> tuple[list[dict[str, list[float]]], list[MemoryResult]]:
    """Each bench's timings (:func:`measure_interleaved`) and memory (:meth:`StageBench.measure_memory`). Under
    ``activation_checkpoint`` (``selective``/``full``) the memory is measured first, on the unit as it is (what a
    microbatch saves without checkpointing: the job's mode is applied to it by ``ppsim.job.memory``, whose formula
    counts what the policy saves), then every bench's blocks are wrapped (:meth:`StageBench.checkpoint`) and timed:
    F, B and FB only. ``phase`` hears ``timings`` and ``memory`` as each begins (what an error names)."""

    def timings() -> list[dict[str, list[float]]]:
        phase("timings")
        return measure_interleaved(benches, warmup=warmup, reps=reps, tick=tick, progress=progress)

    def memories() -> list[MemoryResult]:
        phase("memory")
        return [bench.measure_memory() for bench in benches]

    if activation_checkpoint == "none":
        timed = timings()
        return timed, memories()
    held = memories()
    for bench in benches:
        bench.checkpoint(activation_checkpoint)
    return timings(), held


PROGRESS_AFTER_S = 5.0
"""A block measured for longer than this reports its passes."""
PROGRESS_EVERY_S = 2.0
"""At most one progress line this often (a pass that takes longer gets its own line)."""
PASS_WEIGHT = {"F": 1.0, "B": 2.0, "I": 2.0, "W": 1.0, "F&B": 3.0}
"""A pass's share of a repetition's time, for the estimate left (a backward costs two forwards; I follows an
untimed forward)."""


class BlockProgress:
    """Once a block's measurement has run :data:`PROGRESS_AFTER_S`, one line per finished pass on ``log`` (at most
    one each :data:`PROGRESS_EVERY_S`): the unit, the pass and its repetition, the time so far and the estimate left
    (each pass left at the time it took last; one not seen yet at the time so far per :data:`PASS_WEIGHT`)."""

    def __init__(self, units: list[str], *, warmup: int, reps: int, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, ops: tuple[str, ...] = OPS) -> None:
        self.log, self.clock = log, clock
        passes = [name for name in PASS_WEIGHT if name.replace("F&B", "FB") in ops]  # none of I, W under checkpointing
        self.left = {(unit, name): warmup + reps + (name == "F") for unit in units for name in passes}
        self.took: dict[tuple[str, str], float] = {}
        self.done = 0.0
        self.started = self.last = self.pass_started = clock()
        self.where = ("", "")

    def at(self, unit: str, phase: str) -> None:
        self.where = (unit, phase)

    def passed(self, name: str) -> None:
        now = self.clock()
        took, self.pass_started = now - self.pass_started, now
        key = (self.where[0], name)
        self.took[key] = took
        self.left[key] = max(0, self.left.get(key, 1) - 1)
        self.done += PASS_WEIGHT[name]
        elapsed = now - self.started
        if self.log is None or elapsed < PROGRESS_AFTER_S or (now - self.last < PROGRESS_EVERY_S
                                                              and took < PROGRESS_EVERY_S):
            return
        self.last = now
        unit, phase = self.where
        self.log(f"  {unit}: {name} of {phase} done in {_span(took)}; {_span(elapsed)} so far, about "
                 f"{_span(self.seconds_left(elapsed))} left")

    def seconds_left(self, elapsed: float) -> float:
        per_weight = elapsed / self.done if self.done else 0.0
        return sum(n * self.took.get(key, per_weight * PASS_WEIGHT[key[1]]) for key, n in self.left.items())


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def oom_error(config: ModelConfig, stage: int, what: str) -> PPSimError:
    shape = f"microbatch {config.mb_size}x{config.seq_len}, hidden {config.hidden}, ffn {config.ffn}"
    return PPSimError(
        f"out of memory measuring {what} of stage {stage} ({shape}, {config.dtype}): "
        "lower --mb-size or --seq-len, or raise --stages so each stage holds fewer layers"
    )


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and (
        "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower()
    )


def unit_fields(opts: Any, unit: Any, samples: dict[str, list[float]], mem: Any, *,
                param_bytes: int | None = None) -> dict[str, Any]:
    """A measured unit's entry in the profile's ``units``; ``param_bytes``: what one rank holds (tensor
    parallelism), else the unit's parameters."""
    static = unit_static(opts.config, unit, opts.model_source)
    held = static.param_bytes if param_bytes is None else param_bytes
    return {
        "layers": list(unit.layers), "has_embedding": unit.has_embedding, "has_head": unit.has_head,
        **({"layer_ids": list(unit.ids)} if unit.ids is not None else {}),
        **{op: Stat.from_samples(samples[op]).to_dict() if op in samples else None for op in OPS},
        **dataclasses.asdict(mem),
        "param_bytes": held, "grad_bytes": held, "optimizer_bytes": 2 * held, "output_bytes": static.output_bytes,
    }
