"""`ppsim calibrate`'s library side: measure the model's blocks, the per-stage overhead, p2p and the runtime probe;
write the profile as it goes; resume a killed calibration.

What is measured (docs/calibration.md):

1. **Units**, each built alone as a stage would be and timed the way torch's runtime runs each action
   (:mod:`ppsim.calibrate.measure.harness`): the embedding alone, 1 layer, ``K`` layers (``K = min(4, layers)``), the
   head
   alone (final norm, LM head, loss). From them: a layer's cost ``L = (T_K - T_1) / (K - 1)``, the fixed per-stage
   overhead ``O = T_1 - L`` (what a stage costs beyond its blocks: hooks, the receive buffer, the output detach;
   clamped at 0), the embedding ``T_embed - O`` and the head ``T_head - O``. Per-repetition samples are combined,
   so every block keeps a median and a spread. Activation bytes and bytes freed by I are composed the same way.
2. **Stages** are composed from the blocks by ``ppsim.costs`` for any schedule and split; ``--check-stages`` also
   measures ``--stages`` stages of the default split whole (kept as the profile's ``stages``) and notes the error.
3. **p2p** latency and bandwidth (:mod:`ppsim.calibrate.measure.comm`).
4. **Runtime probe** (:mod:`ppsim.calibrate.measure.runtime_model`): a fixed reference schedule (1F1B, 2 local ranks, 8
   microbatches) executed under torch's runtime, first with the real model split in two, then with synthetic stages
   sleeping the same costs; fitted into the profile's ``runtime`` section (compute scale, dispatch per
   computation, hand-off time, the receive-posting rule; ``runtime.synthetic`` for synthetic stages).

The profile is a version-3 ``ppsim.profile`` (``source``, ``blocks``, ``layout``, ``stage_overhead``, ``runtime``,
``p2p``,
docs/profile.md) plus ``units`` (the raw unit measurements); it is rewritten atomically after every finished
measurement and ``done`` lists what is finished (``units``, ``p2p``, ``runtime.real``, ``runtime.synthetic``,
``runtime.shared``: the FSDP probe), so
``--resume`` skips it.

torch is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.errors import PPSimError
from ppsim.io import exclusive_writer, progress_path
from ppsim.limits import (  # work and memory limits (``--allow-large`` lifts them)
    MAX_CALIBRATION_S,
    MAX_REAL_RANKS_PER_CORE,
    MEMORY_SHARE,
)
from ppsim.profile import WHOLE_BACKWARD_OPS, HostLoad, Stat, load_profile
from ppsim.step.kinds import CollectiveKind

if TYPE_CHECKING:
    from ppsim.calibrate.execute.launch import World
    from ppsim.calibrate.measure.speed import MatmulSpeed
    from ppsim.calibrate.models import ModelSource
    from ppsim.model_config import ModelConfig

OPS = ("F", "B", "I", "W", "FB")
#: Layers in the multi-layer unit (fewer when the model has fewer).
K_LAYERS = 4
CPU_FLOPS = 2e10
GPU_FLOPS = 1e14
"""The FLOP rates an estimate falls back on where the device's speed is not measured (:mod:`.speed` measures it)."""
PROBE_STEPS = 4
PROBE_WARMUP = 2


@dataclass(frozen=True)
class CalibrationPass:
    """One (tensor-parallel degree, microbatch size) the blocks are measured at (``--tp 1,2 --mb-size 1,2``: each
    pair, the first the profile's own blocks, the others its ``entries``)."""

    tensor_parallel_degree: int
    mb_size: int

    @property
    def done_key(self) -> str:
        """Its key in the profile's ``done`` (the first pass's is ``units``)."""
        return f"units.tp{self.tensor_parallel_degree}.mb{self.mb_size}"

    def describe(self) -> str:
        return f"tp {self.tensor_parallel_degree}, microbatch size {self.mb_size}"


@dataclass(frozen=True)
class CalibrationOptions:
    output: Path
    config: ModelConfig
    num_stages: int = 4
    device: str = "cpu"
    warmup: int = 3
    reps: int = 20
    resume: bool = False
    p2p: bool = True
    probe: bool = True
    check_stages: bool = False
    init_timeout_s: float = 60.0
    seed: int = 0
    override_limits: bool = False
    source: ModelSource | None = None
    """The model (``--model``); ``None``: the builtin model of ``config``."""
    tensor_parallel_degree: int = 1
    """T > 1: each unit measured as torchtitan shards it, on T local ranks (:mod:`.tensor_parallel`)."""
    expert_parallel_degree: int = 1
    """E > 1: each unit holding a MoE layer measured with its routed experts split over E local ranks, as torchtitan
    parallelises it (:mod:`.tensor_parallel`); the all-to-all also measured on E ranks."""
    at_size: bool | None = None
    """Measure one block at a time, each materialised alone from a meta-device build (calibration at size);
    ``None``: when a torchtitan model's whole-model calibration would not fit this device's memory."""
    speed: MatmulSpeed | None = None
    """The matmul speed of the dtype on the device (:func:`decide_speed`); ``None``: not measured yet."""
    activation_checkpoint: str = "none"
    """torchtitan's activation checkpointing (``none``/``selective``/``full``): each measured unit's blocks wrapped
    with its policy as ``ppsim run --activation-checkpoint`` wraps a model part, so F, B and FB hold the backward's
    rerun; I and W not measured (:func:`ppsim.calibrate.measure.harness.measure_benches`)."""
    cluster: str | None = None
    """The cluster this calibration runs on (``--cluster``), recorded in the profile."""
    passes: tuple[CalibrationPass, ...] = ()
    """Every pass (``--tp`` x ``--mb-size``), the first at ``tensor_parallel_degree`` and ``config.mb_size``;
    empty: that one alone."""

    @property
    def all_passes(self) -> tuple[CalibrationPass, ...]:
        return self.passes or (CalibrationPass(self.tensor_parallel_degree, self.config.mb_size),)

    def for_pass(self, chosen: CalibrationPass) -> CalibrationOptions:
        """The options of one pass beyond the first: its degree and microbatch size, the blocks only (p2p, the
        collectives, the runtime probe and ``--check-stages`` are the first pass's)."""
        if chosen == self.all_passes[0]:
            return self
        config, source = dataclasses.replace(self.config, mb_size=chosen.mb_size), self.source
        if source is not None and chosen.mb_size != self.config.mb_size:
            from ppsim.calibrate.models import parse_model_source

            source = parse_model_source(source.text, dataclasses.replace(source.options, mb_size=chosen.mb_size),
                                        device=source.device)
            config = source.config
        return dataclasses.replace(self, config=config, source=source,
                                   tensor_parallel_degree=chosen.tensor_parallel_degree, passes=(), p2p=False,
                                   probe=False, check_stages=False, at_size=None)

    @property
    def model_source(self) -> ModelSource:
        if self.source is not None:
            return self.source
        from ppsim.calibrate.models.builtin import source_for

        return source_for(self.config, device=self.device)


# --- limits (no torch needed) -----------------------------------------------------------------------------------
def estimate(config: ModelConfig | ModelSource, *, device: str, reps: int, warmup: int, probe: bool = False,
             check_stages: bool = False, at_size: bool = False, flops_per_s: float | None = None) -> tuple[float, int]:
    """``(seconds, bytes)``: a rough estimate of the calibration's work and of its memory (the units measured at
    once; a torchtitan or factory model is also built whole once, to cut the units from); with ``probe``, the
    runtime probe too (the whole model on two ranks, with its non-pipelined reference); with ``check_stages``, the
    whole model measured stage by stage. ``at_size``: one block alive at a time (:func:`at_size_estimate`).
    ``flops_per_s``: the device's measured speed in the dtype (:func:`flops_rate`); default a fixed rate."""
    if at_size:
        from ppsim.calibrate.models import ModelSource

        assert isinstance(config, ModelSource)
        return at_size_estimate(config, device=device, reps=reps, warmup=warmup, probe=probe,
                                flops_per_s=flops_per_s).total
    from ppsim.calibrate.models import ModelSource

    if isinstance(config, ModelSource):
        source = config
    else:
        from ppsim.calibrate.models.builtin import source_for

        source = source_for(config, device=device)
    config = source.config
    est = source.estimate
    tokens = config.mb_size * config.seq_len
    item = config.itemsize
    layer_params = max(1, est.largest_layer_param_bytes // item)
    # per token: 2 flops per parameter forward; attention scores 4 * seq * hidden
    layer_flops = 2 * tokens * layer_params + 4 * tokens * config.seq_len * config.hidden
    head_flops = 2 * tokens * max(1, est.head_param_bytes // item)
    num_layers = 1 + num_common_layers(source) + len(source.kinds) - 1  # the layers of every unit
    # per repetition: F, B, (F), I, W, FB ~ 3 forwards and 2.5 backwards (2x forward each) of the units' layers
    per_rep = 8 * (num_layers * layer_flops + 2 * head_flops)
    flops = (warmup + reps) * per_rep
    model_flops = config.layers * layer_flops + head_flops  # one forward of the whole model, one microbatch
    if check_stages:
        flops += (warmup + reps) * 8 * model_flops
    unit_weights = num_layers * est.largest_layer_param_bytes + est.embed_param_bytes + est.head_param_bytes
    weights = 4 * unit_weights  # weights, grads and two optimizer-sized temporaries
    if source.scheme != "builtin":
        weights += est.param_bytes  # the whole model, built once to cut the units from
    if check_stages:
        weights += 4 * est.param_bytes
    activations = 3 * (num_layers * est.layer_activation_bytes + est.head_activation_bytes)
    need = weights + activations
    if probe and config.layers >= 2:
        from ppsim.calibrate.measure import runtime_model as rm

        ranks, microbatches = rm.probe_shape(False)
        steps = PROBE_STEPS + PROBE_WARMUP + 1  # and the reference
        flops += steps * microbatches * 3 * model_flops
        need = max(need, source.run_bytes(num_ranks=ranks, num_microbatches=microbatches, synthetic=False))
    return flops / (flops_per_s or default_rate(device)), need


def default_rate(device: str) -> float:
    return GPU_FLOPS if device == "cuda" else CPU_FLOPS


def flops_rate(opts: CalibrationOptions) -> float:
    """The FLOP rate the estimates divide by: the measured one (:attr:`CalibrationOptions.speed`) or the default."""
    return opts.speed.work_flops_per_s if opts.speed is not None else default_rate(opts.device)


def decide_speed(opts: CalibrationOptions) -> CalibrationOptions:
    """``opts`` with the dtype's matmul speed measured on the device (a fraction of a second; once per process and
    shape), unless known already or the device is absent (CUDA without a GPU: refused later, in one line)."""
    if opts.speed is not None:
        return opts
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        return opts
    from ppsim.calibrate.measure.speed import measure_speed

    return dataclasses.replace(opts, speed=measure_speed(opts.config, opts.device))


def speed_note(opts: CalibrationOptions, seconds: float) -> str:
    """For a refusal over the time limit: the speed measured, and what float32 would take where it is far faster."""
    speed = opts.speed
    if speed is None:
        return ""
    note = f" (at the {gflops(speed.flops_per_s)} of {speed.dtype} matmuls measured on this {speed.device}"
    if speed.warning() is not None:
        note += (f", against {gflops(speed.float32_flops_per_s or 0)} in float32: --dtype float32 would take about "
                 f"{_duration(seconds / speed.slowdown)}")
    return note + ")"


def gflops(flops_per_s: float) -> str:
    from ppsim.calibrate.measure.speed import gflops as fmt

    return fmt(flops_per_s)


def _duration(seconds: float) -> str:
    return _hours(seconds) if seconds >= 3600 else f"{seconds / 60:.1f} min"


@dataclass(frozen=True)
class AtSizeEstimate:
    """What calibration at size holds and takes: one block (embedding, one layer of a kind, head) alive at a time
    with its gradients, the largest weight's transient gradient and its activations; the runtime probe on a
    truncated copy (:func:`probe_source`)."""

    block: str
    """The block that needs the most memory."""
    weight_bytes: int
    """Its parameters."""
    need_bytes: int
    """Its parameters, gradients, the largest transient gradient and three microbatches' activations."""
    activation_bytes: int
    seconds: float
    probe_bytes: int
    """The runtime probe's run of the truncated copy (0: no probe; negative: too large here, skipped)."""

    @property
    def total(self) -> tuple[float, int]:
        return self.seconds, self.need_bytes


def at_size_estimate(source: ModelSource, *, device: str, reps: int, warmup: int, probe: bool,
                     flops_per_s: float | None = None) -> AtSizeEstimate:
    """The blocks are measured one at a time: memory is the largest block's, time the sum of the blocks'."""
    config, est = source.config, source.estimate
    tokens, item = config.mb_size * config.seq_len, config.itemsize
    largest = est.largest_tensor_bytes or est.largest_layer_param_bytes // 2
    parts = [("embedding", est.embed_param_bytes, tokens * config.hidden * item, est.embed_param_bytes),
             ("layer", est.largest_layer_param_bytes, est.layer_activation_bytes, largest),
             ("head", est.head_param_bytes, est.head_activation_bytes, est.head_param_bytes)]

    def need(weights: int, acts: int, largest: int) -> int:
        # weights, gradients, and the largest weight's transient gradient: one in the dtype while a repetition's
        # gradient is accumulated, one in float32 where a half-precision backward computes in it (the CPU
        # embedding backward; 70B bf16 measured 9.04 GiB peak against 9.8 GiB estimated)
        transient = min(largest, weights) * (1 + 4 // item) if item < 4 else min(largest, weights)
        return 2 * weights + transient + 3 * acts

    block, weights, acts, biggest = max(parts, key=lambda part: need(*part[1:]))
    layer_params = max(1, est.largest_layer_param_bytes // item)
    layer_flops = 2 * tokens * layer_params + 4 * tokens * config.seq_len * config.hidden
    head_flops = 2 * tokens * max(1, est.head_param_bytes // item)
    flops = (warmup + reps) * 8 * (len(source.kinds) * layer_flops + 2 * head_flops)
    probe_bytes = 0
    if probe and config.layers >= 2:
        from ppsim.calibrate.measure import runtime_model as rm

        small = probe_source(source)
        ranks, microbatches = rm.probe_shape(False)
        probe_bytes = small.run_bytes(num_ranks=ranks, num_microbatches=microbatches, synthetic=False)
        have = device_memory_bytes(device)
        if have is not None and probe_bytes > MEMORY_SHARE * have:
            probe_bytes = -probe_bytes  # skipped (run_probes says so): no time
        else:
            flops += (PROBE_STEPS + PROBE_WARMUP + 1) * microbatches * 3 * (small.num_layers * layer_flops + head_flops)
    return AtSizeEstimate(block=block, weight_bytes=weights, need_bytes=need(weights, acts, biggest),
                          activation_bytes=acts, seconds=flops / (flops_per_s or default_rate(device)),
                          probe_bytes=probe_bytes)


def probe_source(source: ModelSource) -> ModelSource:
    """The truncated copy the runtime probe runs at size: the model's first layers, two of each kind (the layers
    up to the last kind's first, plus one), same shapes."""
    from ppsim.calibrate.models import parse_model_source

    first = max(source.layer_kinds.index(k) for k in source.kinds)
    wanted = min(source.num_layers, max(2, first + 2))
    if wanted == source.num_layers:
        return source
    return parse_model_source(source.text, dataclasses.replace(source.options, layers=wanted), device=source.device)


def device_memory_bytes(device: str) -> int | None:
    """Memory a calibration may use on ``device`` (CPU: available now; CUDA: the GPU's free memory)."""
    if device == "cpu":
        from ppsim.calibrate.execute.launch import available_memory_bytes

        return available_memory_bytes()
    try:
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None
    except RuntimeError:
        return None


def decide_at_size(opts: CalibrationOptions) -> CalibrationOptions:
    """``opts`` with :attr:`CalibrationOptions.at_size` settled: asked, ``--tp`` above 1, or a torchtitan model
    whose weights do not fit this device whole."""
    if opts.at_size is not None:
        return opts
    if opts.tensor_parallel_degree > 1 or opts.expert_parallel_degree > 1:
        return dataclasses.replace(opts, at_size=True)  # sharded units are materialised one at a time
    source = opts.model_source
    at_size = False
    if source.scheme == "torchtitan":
        # the whole model's weights (with gradients and two optimizer-sized copies, as the estimate counts them)
        # are what does not fit; a small model with long sequences is refused as before
        have = device_memory_bytes(opts.device)
        at_size = have is not None and 4 * source.estimate.param_bytes > MEMORY_SHARE * have
    return dataclasses.replace(opts, at_size=at_size)


def estimate_line(opts: CalibrationOptions, done: Sequence[str] = ()) -> str:
    """The estimate ``calibrate`` prints first: memory alive at once, and time (every phase's but those ``done``,
    :func:`phase_estimates`)."""
    return _estimate_text(opts, sum(seconds for _, seconds in phase_estimates(opts, done=done)))


def _estimate_text(opts: CalibrationOptions, seconds: float | None) -> str:
    """:func:`estimate_line` with the time given (``None``: the units and the probe as :func:`estimate` counts
    them)."""
    opts = decide_speed(decide_at_size(opts))
    source = opts.model_source
    have = device_memory_bytes(opts.device)
    avail = "" if have is None else f"; {have / 2**30:.1f} GiB available"
    rate = "" if opts.speed is None else f" ({opts.speed.describe()})"
    if opts.at_size:
        est = at_size_estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                               flops_per_s=flops_rate(opts))
        probe = "" if not est.probe_bytes else (
            f"; runtime probe on a {probe_source(source).num_layers}-layer copy: about "
            f"{abs(est.probe_bytes) / 2**30:.3g} GiB" + (" (too large here: skipped)" if est.probe_bytes < 0 else ""))
        return (f"estimate: at size, one block at a time from a meta-device build (the whole model, "
                f"{source.estimate.param_bytes / 2**30:,.4g} GiB, is never materialised): the largest, the {est.block} "
                f"({est.weight_bytes / 2**30:.3g} GiB of weights), needs about {est.need_bytes / 2**30:.3g} GiB with "
                f"its gradients and activations (microbatch {opts.config.mb_size}x{opts.config.seq_len}){probe}; "
                f"about {_duration(est.seconds if seconds is None else seconds)} on {opts.device}{rate}{avail}")
    units_s, need = estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                             check_stages=opts.check_stages, flops_per_s=flops_rate(opts))
    seconds = units_s if seconds is None else seconds
    return f"estimate: about {need / 2**30:.3g} GiB, about {_duration(seconds)} on {opts.device}{rate}{avail}"


#: One local worker's start, in seconds of one idle core, before it measures: the fork from the forkserver (torch
#: preloaded), the imports beyond it, the model built whole and cut into its stages, the gloo group formed. Measured on
#: this project's 2-core host: a torchtitan flavor's imports and build took 8.6 s and 5.3 s there under load; the
#: builtin model and the communication workers import nothing heavy beyond torch.
WORKER_START_S = {"builtin": 2.0, "python": 4.0, "torchtitan": 4.0}
COMM_WORKER_START_S = 1.5
#: The fork server's own start with a torchtitan model's imports (:func:`preload_workers`), once, in the first phase
#: that starts workers.
TITAN_PRELOAD_S = 6.0
#: Loopback gloo between local processes (the p2p and collective phases' estimate): a message's fixed cost (a
#: barrier is one) and bandwidth; p2p measured alpha 60-90 us and beta 1.7-3.1 GB/s here, busy cores double alpha.
LOOPBACK_ALPHA_S = 2e-4
LOOPBACK_BYTES_PER_S = 1.5e9
#: A heartbeat line at least this often inside every phase (:class:`PhaseProgress`).
HEARTBEAT_S = 30.0


def unit_seconds(opts: CalibrationOptions) -> float:
    """The estimated time of one pass's units (its probe left out)."""
    opts = decide_at_size(opts)
    if opts.at_size:
        return at_size_estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup,
                                probe=False, flops_per_s=flops_rate(opts)).seconds
    return estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=False,
                    check_stages=opts.check_stages, flops_per_s=flops_rate(opts))[0]


def _workers_start_s(processes: int, per_process_s: float, cores: int) -> float:
    """Wall time for ``processes`` local workers to start at once on ``cores`` cores."""
    return per_process_s * processes / max(1, min(processes, cores))


def _loopback_s(sizes: list[int], exchanges: float) -> float:
    return sum(exchanges * (LOOPBACK_ALPHA_S + n / LOOPBACK_BYTES_PER_S) for n in sizes)


def comm_phases(opts: CalibrationOptions) -> list[tuple[str, float]]:
    """The p2p and collective phases' estimates (two local processes each; a third with ``--ep`` above 2)."""
    from ppsim.calibrate.measure import comm
    from ppsim.step.sharing import host_cores

    cores = host_cores()
    start = _workers_start_s(2, COMM_WORKER_START_S, cores)
    p2p_reps = opts.warmup + max(opts.reps, 30)
    # a ping-pong: two messages per exchange
    p2p = start + _loopback_s(comm.p2p_sizes(opts.config.boundary_bytes), 2 * p2p_reps)
    largest = min(COLLECTIVE_MAX_BYTES, max(1 << 20, opts.model_source.estimate.largest_layer_param_bytes))
    sizes = comm.collective_sizes(largest)
    reps = opts.warmup + max(opts.reps, 10)
    collectives = start + _loopback_s(sizes, 3 * 2 * reps)  # three ops, each after a barrier
    ep = opts.expert_parallel_degree
    if ep > 2:
        collectives += _workers_start_s(ep, COMM_WORKER_START_S, cores) + _loopback_s(sizes, 2 * reps * ep / 2)
    return [("p2p", p2p), ("collectives", collectives)]


def probe_phases(opts: CalibrationOptions) -> list[tuple[str, float]]:
    """The runtime probes' estimates: each probe's workers started (:data:`WORKER_START_S`), then
    ``PROBE_WARMUP + PROBE_STEPS`` steps of the reference 1F1B; a step is its ranks' computation (F and B, about 3
    forwards, of the whole model per microbatch at the units' FLOP rate) spread over the pipeline's fill and drain,
    or over the host's cores where the processes outnumber them; the synthetic probe's ranks sleep their costs."""
    from ppsim.calibrate.measure import runtime_model as rm
    from ppsim.step.sharing import host_cores

    source = opts.model_source
    if opts.at_size:
        source = probe_source(source)
    config, est = source.config, source.estimate
    if config.layers < rm.PROBE_RANKS:
        return []
    cores = host_cores()
    tokens, item = config.mb_size * config.seq_len, config.itemsize
    layer_flops = (2 * tokens * max(1, est.largest_layer_param_bytes // item)
                   + 4 * tokens * config.seq_len * config.hidden)
    model_flops = config.layers * layer_flops + 2 * tokens * max(1, est.head_param_bytes // item)
    per_microbatch = 3 * model_flops / flops_rate(opts)  # F + B of the whole model, one microbatch
    steps = PROBE_WARMUP + PROBE_STEPS

    def step_s(ranks: int, microbatches: int, dp: int = 1, *, sleeps: bool = False) -> float:
        per_rank = microbatches * per_microbatch / ranks
        pipelined = per_rank * (microbatches + ranks - 1) / microbatches
        if sleeps:
            return pipelined
        return max(pipelined, dp * microbatches * per_microbatch / max(1, min(ranks * dp, cores)))

    start = WORKER_START_S.get(source.scheme, WORKER_START_S["python"])
    ranks, microbatches = rm.probe_shape(False)
    phases = [("runtime probe (real)", _workers_start_s(ranks, start, cores) + steps * step_s(ranks, microbatches))]
    s_ranks, s_microbatches = rm.probe_shape(True)
    phases.append(("runtime probe (synthetic)", _workers_start_s(s_ranks, WORKER_START_S["builtin"], cores)
                   + steps * step_s(s_ranks, s_microbatches, sleeps=True)))
    dp = shared_probe_dp_shard(opts)
    if opts.device == "cpu" and source.scheme == "torchtitan" and ranks * dp > cores:
        phases.append(("runtime probe (FSDP)", _workers_start_s(ranks * dp, start, cores)
                       + steps * step_s(ranks, microbatches, dp)))
    return phases


#: Each phase's key in a profile's ``done`` (a resumed calibration skips those; the passes' units by their own key).
PHASE_DONE = {"p2p": "p2p", "collectives": "collectives", "runtime probe (real)": "runtime.real",
              "runtime probe (synthetic)": "runtime.synthetic", "runtime probe (FSDP)": "runtime.shared"}


def phase_estimates(opts: CalibrationOptions, *, done: Sequence[str] = ()) -> list[tuple[str, float]]:
    """Every phase ``calibrate`` will run, in order, with its estimated seconds: each pass's units, p2p and the
    collectives, each runtime probe; those in ``done`` (a ``--resume``) left out."""
    opts = decide_speed(decide_at_size(opts))
    passes = opts.all_passes
    phases = [("units" if len(passes) == 1 else f"units, pass {i}/{len(passes)} ({p.describe()})",
               unit_seconds(opts.for_pass(p))) for i, p in enumerate(passes, start=1)
              if ("units" if i == 1 else p.done_key) not in done]
    workers = len(phases)  # the first phase that starts local workers starts the fork server
    if opts.p2p:
        phases += comm_phases(opts)
    if opts.probe:
        phases += probe_phases(opts)
    phases = [(name, seconds) for name, seconds in phases if PHASE_DONE.get(name) not in done]
    if opts.model_source.scheme == "torchtitan" and len(phases) > workers:
        name, seconds = phases[workers]
        phases[workers] = (name, seconds + TITAN_PRELOAD_S)
    return phases


def phase_lines(phases: list[tuple[str, float]]) -> list[str]:
    """The phases' estimates as ``calibrate`` prints them, one line each."""
    return [f"  {name}: about {_span(seconds)}" for name, seconds in phases]


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return _duration(seconds)


class PhaseProgress:
    """One phase of a calibration, with a line at least every ``every`` seconds while it runs: the phase's own lines
    (:meth:`log`) count, and where none came for that long a heartbeat names the phase, its time so far and its
    estimate (a daemon thread, :meth:`tick`). On a normal end, one line with the time it took against its estimate.
    ``log=None``: silent (the ranks that do not write)."""

    def __init__(self, name: str, estimate_s: float | None, log: Callable[[str], None] | None, *,
                 clock: Callable[[], float] = time.monotonic, every: float = HEARTBEAT_S) -> None:
        self.name, self.estimate_s, self._log, self.clock, self.every = name, estimate_s, log, clock, every
        self.started = self.last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def log(self, line: str) -> None:
        self.last = self.clock()
        if self._log is not None:
            self._log(line)

    def _about(self) -> str:
        return "" if self.estimate_s is None else f" (estimate {_span(self.estimate_s)})"

    def tick(self) -> float:
        """A heartbeat if none of the phase's lines came for ``every`` seconds; the seconds until the next is due."""
        now = self.clock()
        if now - self.last >= self.every:
            self.log(f"  {self.name}: {_span(now - self.started)} so far{self._about()}")
        return max(0.05, self.last + self.every - self.clock())

    def _beat(self) -> None:
        while not self._stop.wait(self.tick()):
            pass

    def __enter__(self) -> PhaseProgress:
        self.started = self.last = self.clock()
        if self._log is not None:
            self._thread = threading.Thread(target=self._beat, name=f"ppsim-progress-{self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_type is None:
            self.log(f"  {self.name} done in {_span(self.clock() - self.started)}{self._about()}")


def pass_seconds(opts: CalibrationOptions) -> float:
    """The estimated time of one pass (its runtime probe too, where it runs one)."""
    opts = decide_at_size(opts)
    if opts.at_size:
        return at_size_estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup,
                                probe=opts.probe, flops_per_s=flops_rate(opts)).seconds
    return estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                    check_stages=opts.check_stages, flops_per_s=flops_rate(opts))[0]


def estimate_lines(opts: CalibrationOptions, done: Sequence[str] = ()) -> list[str]:
    """What ``calibrate`` prints first: the estimate, with several passes each pass's, then every phase it will
    run with its own estimate (:func:`phase_estimates`; a resumed one's ``done`` left out) and their total."""
    passes = opts.all_passes
    opts = decide_speed(opts)
    phases = phase_estimates(opts, done=done)
    total = sum(seconds for _, seconds in phases)
    every = f"every phase, about {_duration(total)} in all:" if phases else "every phase is done already"
    if len(passes) == 1:
        return [estimate_line(opts, done) if done else estimate_line(opts), every, *phase_lines(phases)]
    return [f"estimate: {len(passes)} passes (--tp x --mb-size), about {_duration(total)} in all",
            *(f"  pass {i}/{len(passes)} ({p.describe()}): "
              f"{_estimate_text(opts.for_pass(p), unit_seconds(opts.for_pass(p)))}"
              for i, p in enumerate(passes, start=1)), every, *phase_lines(phases)]


def check_all_limits(opts: CalibrationOptions) -> None:
    """Every pass's limits (:func:`check_limits`), then the passes' time together."""
    passes = opts.all_passes
    for chosen in passes:
        check_limits(opts.for_pass(chosen))
    if len(passes) == 1 or opts.override_limits:
        return
    opts = decide_speed(opts)
    seconds = sum(pass_seconds(opts.for_pass(p)) for p in passes)
    if seconds > MAX_CALIBRATION_S:
        raise PPSimError(
            f"calibrating {len(passes)} passes (--tp x --mb-size) of {opts.model_source.text} on {opts.device} would "
            f"take about {_hours(seconds)}{speed_note(opts, seconds)} (limit {MAX_CALIBRATION_S / 3600:g} h); measure "
            "fewer degrees or sizes per job, lower --reps, calibrate on a GPU, or pass --allow-large")


def check_limits(opts: CalibrationOptions) -> None:
    """Refuse, in one line with the estimate, a calibration this machine cannot hold or finish in an hour (or
    whose options cannot go together)."""
    opts = decide_at_size(opts)
    if opts.at_size and opts.check_stages:  # not liftable: nothing would measure the stages
        why = (f"--tp {opts.tensor_parallel_degree} measures" if opts.tensor_parallel_degree > 1 else
               f"--ep {opts.expert_parallel_degree} measures" if opts.expert_parallel_degree > 1 else
               "this model does not fit whole, so it is measured")
        raise PPSimError(f"--check-stages: {why} at size, one block at a time, and never builds a stage whole to "
                         "check the composition against; drop --check-stages")
    if opts.override_limits:
        return
    from ppsim.calibrate.models import fmt_count
    from ppsim.step.sharing import host_cores

    cores = host_cores()
    for option, ranks in (("--tp", opts.tensor_parallel_degree), ("--ep", opts.expert_parallel_degree)):
        if opts.device == "cpu" and ranks > MAX_REAL_RANKS_PER_CORE * cores:
            raise PPSimError(f"{option} {ranks}: {ranks} computing processes on {cores} CPU core(s) (limit "
                             f"{MAX_REAL_RANKS_PER_CORE} per core); timings would say little; use a smaller "
                             f"{option}, calibrate on a larger host, or pass --allow-large")
    source = opts.model_source
    if opts.at_size:
        return check_at_size(opts)
    _, need = estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                       check_stages=opts.check_stages)
    shape = (f"{fmt_count(source.num_params)} parameters ({source.estimate.param_bytes / 2**30:.3g} GiB), "
             f"{opts.config.layers:,} layers, hidden {opts.config.hidden}, vocab {opts.config.vocab}, "
             f"microbatch {opts.config.mb_size}x{opts.config.seq_len}")
    name = source.text if source.scheme != "builtin" else opts.config.preset
    whole = " (the runtime probe runs the whole model: --no-probe skips it)" if opts.probe else ""
    have = device_memory_bytes(opts.device) if opts.device == "cpu" else None
    if have is not None and need > MEMORY_SHARE * have:
        raise PPSimError(
            f"calibrating the {name} model ({shape}) needs about {need / 2**30:,.4g} GiB but "
            f"{have / 2**30:.1f} GiB is available{whole}; lower --layers, --seq-len or --mb-size, use a smaller "
            "model, or pass --allow-large"
        )
    opts = decide_speed(opts)  # memory first: a refusal of it needs no torch
    seconds, _ = estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                          check_stages=opts.check_stages, flops_per_s=flops_rate(opts))
    if seconds > MAX_CALIBRATION_S:
        raise PPSimError(
            f"calibrating the {name} model ({shape}) on {opts.device} would take about "
            f"{_hours(seconds)}{speed_note(opts, seconds)} (limit {MAX_CALIBRATION_S / 3600:g} h){whole}; lower "
            "--layers, --seq-len or --reps, "
            "use a smaller model, calibrate on a GPU, or pass --allow-large"
        )


def check_at_size(opts: CalibrationOptions) -> None:
    """At size: refuse a block that cannot fit alone, naming what would (a tensor-parallel degree, a shorter
    sequence), or a calibration over the time limit."""
    source = opts.model_source
    est = at_size_estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe)
    have = device_memory_bytes(opts.device)
    cfg = opts.config
    if have is not None and est.need_bytes > MEMORY_SHARE * have:
        fits = _what_fits(source, budget=MEMORY_SHARE * have, device=opts.device) if est.block == "layer" else (
            f"the {est.block} is measured whole (its vocab x hidden weight): use a device with more memory")
        raise PPSimError(
            f"one {est.block} of {source.text} ({est.weight_bytes / 2**30:.3g} GiB of weights) needs about "
            f"{est.need_bytes / 2**30:.3g} GiB alone (weights, gradients, activations of microbatch "
            f"{cfg.mb_size}x{cfg.seq_len}) but {have / 2**30:.1f} GiB is available on {opts.device}; {fits}, "
            "or pass --allow-large")
    opts = decide_speed(opts)  # memory first: a refusal of it needs no torch
    est = at_size_estimate(source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=opts.probe,
                           flops_per_s=flops_rate(opts))
    if est.seconds > MAX_CALIBRATION_S:
        raise PPSimError(
            f"calibrating {source.text} at size on {opts.device} would take about {_hours(est.seconds)}"
            f"{speed_note(opts, est.seconds)} (limit {MAX_CALIBRATION_S / 3600:g} h); lower --reps, --warmup or "
            "--seq-len, calibrate on a GPU, or pass --allow-large")


def _what_fits(source: ModelSource, *, budget: float, device: str = "cuda") -> str:
    """What would let one block fit in ``budget`` bytes: a shorter sequence (activations) or, on GPUs, a
    tensor-parallel degree (weights split over T ranks, each on a GPU of its own; on CPU the T local ranks share
    the host's memory, so no degree lowers it)."""
    est, cfg = source.estimate, source.config
    item = cfg.itemsize
    weights = 2 * est.largest_layer_param_bytes + min(est.largest_tensor_bytes or 0, est.largest_layer_param_bytes) * (
        1 + 4 // item if item < 4 else 1)
    acts = 3 * est.layer_activation_bytes
    if weights < budget:
        seq = cfg.seq_len
        while seq > 1 and weights + acts * (seq / cfg.seq_len) ** 2 > budget:
            seq //= 2
        return f"--seq-len {seq} would fit"
    if device == "cpu":
        return ("its weights alone do not fit, and --tp does not lower that here (its local ranks share this host's "
                "memory); use a host with more memory, or GPUs with --tp")
    heads = cfg.heads
    for tp in (2, 4, 8, 16, 32, 64):
        if heads % tp == 0 and weights / tp + acts < budget:
            return (f"a tensor-parallel degree of {tp} would fit (its layer split over {tp} GPUs: --tp {tp}), or "
                    "a device with more memory")
    return "no tensor-parallel degree up to 64 fits; use a device with more memory"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds < 86400 * 10 else f"{seconds / 86400:,.0f} days"


# --- the units and their composition ----------------------------------------------------------------------------
def common_kind(source: ModelSource) -> str:
    """The most frequent layer kind (the first of equals): measured with 1 and ``K`` layers for the per-stage
    overhead; every other kind with one layer."""
    kinds = source.kinds
    return max(kinds, key=lambda k: (source.layer_kinds.count(k), -kinds.index(k)))


def kind_units(source: ModelSource) -> dict[str, str]:
    """Profile block name -> the unit measuring it, for the layer kinds other than the most common one."""
    common = common_kind(source)
    single = len(source.kinds) == 1
    from ppsim.calibrate.models import block_name_of

    return {block_name_of(k, single=single): f"kind.{k}" for k in source.kinds if k != common}


def units_of(source: ModelSource | ModelConfig) -> list[Any]:
    """The units to measure: the embedding alone, 1 and ``K`` layers of the most common layer kind, one layer of
    every other kind, the head alone."""
    from ppsim.calibrate.measure.harness import Unit, unit_of
    from ppsim.calibrate.models import ModelSource

    if not isinstance(source, ModelSource):
        from ppsim.calibrate.models.builtin import source_for

        source = source_for(source)
    common = common_kind(source)
    ids = tuple(i for i, k in enumerate(source.layer_kinds) if k == common)
    k = min(K_LAYERS, len(ids))
    units = [Unit("embed", (0, 0), True, False), unit_of("layers1", ids[:1])]
    if k >= 2:
        units.append(unit_of(f"layers{k}", ids[:k]))
    for kind in source.kinds:
        if kind != common:
            units.append(unit_of(f"kind.{kind}", (source.layer_kinds.index(kind),)))
    n = source.num_layers
    units.append(Unit("head", (n, n), False, True))
    return units


def num_common_layers(source: ModelSource) -> int:
    """``K``: layers in the multi-layer unit."""
    return min(K_LAYERS, source.layer_kinds.count(common_kind(source)))


def blocks_from_units(units: dict[str, dict[str, Any]], k: int, *, layer_block: str = "layer",
                      other_kinds: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(blocks, stage_overhead)`` in the profile's shape, from the measured units (per-repetition samples
    combined). ``layer_block`` names the block of the most common layer kind (measured by ``layers1`` and
    ``layers<k>``); ``other_kinds`` maps the block of every other kind to its one-layer unit, whose cost beyond the
    per-stage overhead is that layer's."""

    def samples(name: str, op: str) -> list[float]:
        return list(units[name][op]["samples"])

    def combine(fn: Callable[..., float], *series: list[float]) -> dict[str, Any]:
        return Stat.from_samples([max(0.0, fn(*xs)) for xs in zip(*series)]).to_dict()

    def ints(name: str, key: str) -> int:
        return int(units[name][key])

    others = dict(other_kinds or {})
    blocks: dict[str, Any] = {}
    overhead: dict[str, Any] = {}
    many = f"layers{k}" if k >= 2 else None  # k 1 (at size): no multi-layer unit
    for op in OPS:
        if units["layers1"].get(op) is None:  # I and W under activation checkpointing: not measured
            for name in ("embed", "head", layer_block, *others):
                blocks.setdefault(name, {})[op] = None
            overhead[op] = None
            continue
        t1 = samples("layers1", op)
        if many in units:
            tk = samples(many, op)
            layer = [(b - a) / (k - 1) for a, b in zip(t1, tk)]
        else:  # a one-layer model: no way to separate the overhead
            layer = t1
        over = [max(0.0, a - lay) for a, lay in zip(t1, layer)]
        blocks.setdefault(layer_block, {})[op] = combine(lambda x: x, layer)
        overhead[op] = combine(lambda x: x, over)
        for name, unit in others.items():
            blocks.setdefault(name, {})[op] = combine(lambda u, o: u - o, samples(unit, op), over)
        blocks.setdefault("embed", {})[op] = combine(lambda e, o: e - o, samples("embed", op), over)
        blocks.setdefault("head", {})[op] = combine(lambda h, o: h - o, samples("head", op), over)
    for key in ("activation_bytes", "activation_bytes_freed_by_I"):
        a1 = ints("layers1", key)
        lay = (ints(many, key) - a1) // (k - 1) if many in units else a1
        over = max(0, a1 - lay)  # a stage saves nothing of its own beyond its blocks: folded into the layer
        blocks[layer_block][key] = max(0, lay) + (over if many not in units else 0)
        for name, unit in others.items():
            blocks[name][key] = max(0, ints(unit, key) - over)
        blocks["embed"][key] = max(0, ints("embed", key) - over)
        blocks["head"][key] = max(0, ints("head", key) - over)
    for block in blocks.values():
        block["activation_bytes_freed_by_I"] = min(block["activation_bytes_freed_by_I"], block["activation_bytes"])
        block["activation_bytes_allocator"] = None
        block["peak_bytes_allocator"] = None
    for name, unit in (("embed", "embed"), ("head", "head")):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "output_bytes"):
            blocks[name][key] = units[unit][key]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "output_bytes"):
        blocks[layer_block][key] = units["layers1"][key]
        for name, unit in others.items():
            blocks[name][key] = units[unit][key]
    return blocks, overhead


def check_counts(opts: CalibrationOptions) -> tuple[int, ...]:
    """Layers per stage of the ``--check-stages`` stages: torchtitan's default split (what ``simulate`` composes)."""
    from ppsim.split import default_split

    return default_split(opts.config.layers, opts.num_stages)


def check_units(opts: CalibrationOptions) -> list[Any]:
    from ppsim.calibrate.measure.harness import Unit

    counts = check_counts(opts)
    units, first = [], 0
    for s, n in enumerate(counts):
        units.append(Unit(f"stage{s}", (first, first + n), s == 0, s == len(counts) - 1))
        first += n
    return units


# --- the calibration --------------------------------------------------------------------------------------------
def calibrate(opts: CalibrationOptions, *, log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Run (or resume) a calibration; returns the finished profile document on the writing rank, ``None`` on
    other ranks."""
    import torch

    from ppsim.calibrate.execute import launch, torch_adapter

    opts = decide_at_size(opts)
    check_all_limits(opts)
    opts = decide_speed(opts)
    torch_adapter.check()
    started = time.perf_counter()
    distributed = launch.torchrun_world_size() >= 2
    writer = int(os.environ.get("RANK", "0")) == 0 if distributed else True
    if opts.device == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
        raise PPSimError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__}); "
                         "use --device cpu or run on a machine with a GPU")
    world: World | None = None
    if distributed:
        world = launch.init_world(backend="nccl" if opts.device == "cuda" else "gloo", timeout_s=opts.init_timeout_s)
    threads = torch.get_num_threads()
    partial = progress_path(opts.output)
    existed = partial.exists()
    try:
        with exclusive_writer(opts.output) if writer else contextlib.nullcontext(), (
                launch.peers_lost_in_one_line(world.rank, world.world_size, "calibrate") if world is not None
                else contextlib.nullcontext()):
            return _calibrate(opts, world, started=started, writer=writer, log=log or _stderr)
    except PPSimError as exc:
        from ppsim.calibrate.models import ModelSourceError

        if isinstance(exc, ModelSourceError) and writer and not existed:
            partial.unlink(missing_ok=True)  # the model cannot run here: nothing worth resuming
        raise
    finally:
        torch.set_num_threads(threads)  # measured with one thread per rank; leave the caller's setting as it was
        if world is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _calibrate(opts: CalibrationOptions, world: World | None, *, started: float, writer: bool,
               log: Callable[[str], None]) -> dict[str, Any] | None:
    import torch

    from ppsim.calibrate.measure import comm

    rank, world_size = (world.rank, world.world_size) if world else (0, 1)
    if opts.device == "cuda":
        local = world.local_rank if world else 0
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    doc = new_document(opts, device=device, world_size=world_size, backend=world.backend if world else None)
    from ppsim.profile import Profile

    Profile.from_dict(doc, source=str(opts.output), allow_incomplete=True)  # the readers' shape rules, before measuring
    if writer and opts.resume:
        doc = resume_document(opts, doc, log=log)
    if writer:  # once the lock is held and a resume agrees: a refused calibration's stderr is its error line
        for line in estimate_lines(opts, doc["done"]):  # what is alive at once (a refusal carries it); what is left
            log(line)
        log(opts.model_source.summary())
    rec = Recorder(doc, opts.output, writer=writer)
    if world is not None:
        rec.doc = _broadcast(rec.doc)
    if rec.doc["complete"]:
        if writer:
            log(f"{opts.output} is already complete; nothing to resume")
        return rec.doc if writer else None
    prior_wall = float((rec.doc.get("method") or {}).get("wall_s") or 0.0)
    load_at_start = _load_avg()
    rec.save()
    estimates = dict(phase_estimates(opts, done=rec.done)) if writer else {}
    preload_workers(opts)

    def phase(name: str) -> PhaseProgress:  # a line at least every HEARTBEAT_S in each phase (the writing rank)
        return PhaseProgress(name, estimates.get(name), log if writer else None)

    # 1. units, their repetitions interleaved (the writing rank; under torchrun the others wait for p2p); one pass
    # per (--tp, --mb-size), the first into the profile's own blocks, the others into its entries
    passes = opts.all_passes
    for i, chosen in enumerate(passes):
        key = "units" if i == 0 else chosen.done_key
        if key in rec.done or not writer:
            continue
        if len(passes) > 1:
            log(f"pass {i + 1}/{len(passes)}: {chosen.describe()}")
        started_pass = time.perf_counter()
        pass_rec = rec if i == 0 else EntryRecorder(rec, i - 1)
        name = "units" if len(passes) == 1 else f"units, pass {i + 1}/{len(passes)} ({chosen.describe()})"
        with phase(name) as units:
            measure_blocks(decide_at_size(opts.for_pass(chosen)), pass_rec, device, log=units.log)
        pass_rec.finish(key)
        if len(passes) > 1:
            log(f"pass {i + 1}/{len(passes)} done ({time.perf_counter() - started_pass:.0f} s)")
    if world is not None:
        rec.doc = _broadcast(rec.doc)

    # 2. p2p
    notes = list(rec.doc["notes"])
    if opts.p2p and "p2p" not in rec.done:
        with phase("p2p") as p2p:
            p2p.log("measuring p2p latency and bandwidth")
            result = _measure_p2p(opts, world, comm.p2p_sizes(opts.config.boundary_bytes), device, notes=notes)
        rec.doc["p2p"] = None if result is None else result.to_dict()
        rec.doc["notes"] = notes
        rec.finish("p2p")
    if opts.p2p and "collectives" not in rec.done:
        with phase("collectives") as collectives:
            collectives.log("measuring FSDP's all-gather and reduce-scatter and EP's all-to-all")
            fits = _measure_collectives(opts, world, device, notes=notes)
        rec.doc["collectives"] = [f.to_dict() for f in fits]
        rec.doc["notes"] = notes
        rec.finish("collectives")
    elif not opts.p2p and rec.doc["p2p"] is None:
        note = "p2p not measured (--no-p2p): the simulator treats cross-rank hand-offs as free"
        if note not in notes:
            rec.doc["notes"] = [*notes, note]

    # 3. runtime probe (local ranks; the writing rank only)
    if opts.probe and writer:
        run_probes(opts, rec, log=log, estimates=estimates)
    if not writer:
        return None
    method = dict(rec.doc.get("method") or {})
    from ppsim.calibrate.measure.workspace import allocator_workspace_bytes

    workspace = allocator_workspace_bytes(device, getattr(torch, opts.config.dtype))
    if workspace is not None:
        method["workspace_bytes"] = workspace
    method["wall_s"] = prior_wall + time.perf_counter() - started
    method["host"] = host_load(rec.doc, load_at_start=load_at_start).to_dict()
    rec.doc["method"] = method
    rec.doc["complete"] = True
    profile = Profile.from_dict(rec.doc, source=str(opts.output))  # what every reader will check: fail here
    rec.publish()
    warning = profile.host_warning(str(opts.output))
    if warning:
        log(warning)
    return rec.doc


def preload_workers(opts: CalibrationOptions) -> None:
    """A torchtitan model's probe workers (and its EP/TP units' workers) start from a fork server that imported
    torchtitan's pipeline helpers and the model's family once (:func:`ppsim.calibrate.execute.launch.preload`)."""
    source = opts.model_source
    if source.scheme == "torchtitan" and source.family:
        from ppsim.calibrate.execute import launch

        launch.preload("torchtitan.distributed.pipeline_parallel", f"torchtitan.models.{source.family}",
                       "ppsim.calibrate.models.torchtitan", "ppsim.calibrate.torchtitan.runner")


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this system
        return 0.0


def host_load(doc: dict[str, Any], *, load_at_start: float) -> HostLoad:
    """How steady the host was: the larger load average of the calibration's start and end, and the median
    relative spread (p90 - p10) / median of the measured blocks' repetitions."""
    spreads = sorted((stat["p90"] - stat["p10"]) / stat["median"]
                     for block in (doc.get("blocks") or {}).values() for op in OPS
                     for stat in [block.get(op)] if isinstance(stat, dict) and (stat.get("median") or 0) > 0)
    spread = spreads[len(spreads) // 2] if spreads else 0.0
    return HostLoad(load_avg=max(load_at_start, _load_avg()), num_cpus=os.cpu_count() or 1, spread=spread)


def measure_blocks(opts: CalibrationOptions, rec: Recorder, device: Any, *, log: Callable[[str], None]) -> None:
    """One pass's units, measured (at size one at a time, else their repetitions interleaved) and composed into
    blocks and the per-stage overhead."""
    if opts.at_size:
        measure_at_size(opts, rec, device, log=log)
    else:
        todo: list[Any] = units_of(opts.model_source)
        if opts.check_stages:
            todo += check_units(opts)
        log("measuring " + ", ".join(u.name for u in todo) + f" ({opts.reps} interleaved repetitions)")
        for unit, fields in zip(todo, measure_units(opts, todo, device, log=log)):
            rec.add_unit(unit.name, fields)
    rec.compose(opts)
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def at_size_units(source: ModelSource) -> list[Any]:
    """The units measured at size: the embedding, one layer of each kind, the head (no ``K``-layer unit: the
    per-stage overhead is folded into the blocks)."""
    units = [u for u in units_of(source) if not (u.name.startswith("layers") and u.name != "layers1")]
    return units[1:] + units[:1]  # the embedding (a large dense gradient on CPU) last: the layers are kept first


def measure_at_size(opts: CalibrationOptions, rec: Recorder, device: Any, *, log: Callable[[str], None]) -> None:
    """Calibration at size: each unit materialised alone from the meta-device model (random weights), measured,
    recorded and freed before the next (``--resume`` skips the recorded ones)."""
    import gc

    todo = at_size_units(opts.model_source)
    log("measuring at size, one block at a time: " + ", ".join(u.name for u in todo)
        + f" ({opts.reps} repetitions each)")
    note = ("calibrated at size: each block materialised alone from a meta-device build with random weights "
            "(torchtitan's init_states; timings do not depend on the values); the per-stage overhead is not "
            "separated from the blocks (each stage's few-ms overhead is counted once per block)")
    if note not in rec.doc["notes"]:
        rec.doc["notes"] = [*rec.doc["notes"], note]
    est = at_size_estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=False)
    have = device_memory_bytes(opts.device)
    fresh = have is not None and est.need_bytes > MEMORY_SHARE * have  # allowed by --allow-large only
    if fresh:
        _note(rec, "gradients dropped before every backward (one gradient copy alive): the accumulation's transient "
                   f"copy would not fit ({est.need_bytes / 2**30:.3g} GiB estimated, {have / 2**30:.1f} GiB "
                   "available), so B and W leave out the gradient-accumulation add")
    tp = opts.tensor_parallel_degree
    if tp > 1:
        _note(rec, f"layers measured at tensor_parallel_degree {tp} as torchtitan shards them (its parallelize on "
                   f"{tp} local ranks: the costs include the layers' TP collectives; bytes are one rank's); the "
                   "embedding and the head are measured unsharded (an upper bound)")
    ep = opts.expert_parallel_degree
    moe: frozenset[int] = frozenset()
    if ep > 1:
        from ppsim.calibrate.models.torchtitan import moe_layer_ids

        moe = moe_layer_ids(opts.model_source)
        _note(rec, f"MoE layers measured at expert_parallel_degree {ep} as torchtitan parallelises them (the model's "
                   f"parallelize on {ep} local ranks, EP carved out of dp_shard {ep}, no FSDP; each rank its own "
                   "microbatch: the costs include the dispatch and combine all-to-alls; bytes are one rank's); the "
                   "dense layers, the embedding and the head are measured on one process (no EP)")
    for unit in todo:
        if unit.name in rec.doc["units"]:
            continue
        started = time.perf_counter()
        if ep > 1 and moe.intersection(unit.layer_ids):
            from ppsim.calibrate.measure.tensor_parallel import measure_unit_tp

            fields = measure_unit_tp(opts, unit)
        elif opts.tensor_parallel_degree > 1 and not (unit.has_embedding or unit.has_head):
            from ppsim.calibrate.measure.tensor_parallel import measure_unit_tp

            fields = measure_unit_tp(opts, unit)
        else:
            (fields,) = measure_units(opts, [unit], device, random_weights=True, fresh_grads=fresh, log=log)
        rec.add_unit(unit.name, fields)
        rec.save()
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        log(f"  {unit.name}: F {fields['F']['median']:.4g} s, B {fields['B']['median']:.4g} s "
            f"({time.perf_counter() - started:.0f} s)")


def measure_units(opts: CalibrationOptions, units: list[Any], device: Any, *, random_weights: bool = False,
                  fresh_grads: bool = False, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Timings (F, B, I, W, FB samples, repetitions interleaved across units), memory and sizes of each unit; a
    measurement that takes more than a few seconds reports each pass on ``log``."""
    from ppsim.calibrate.measure import harness
    from ppsim.calibrate.measure.interrupt import prompt_interrupt

    what = "the weights"
    source = opts.model_source
    try:
        with prompt_interrupt(interrupted_line(opts.output)):  # a Ctrl-C inside one long torch operation too
            benches = [harness.StageBench(opts.config, opts.num_stages, 1, device=device, seed=opts.seed, unit=u,
                                          source=source, random_weights=random_weights, fresh_grads=fresh_grads)
                       for u in units]
            ops = OPS if opts.activation_checkpoint == "none" else WHOLE_BACKWARD_OPS
            progress = harness.BlockProgress([u.name for u in units], warmup=opts.warmup, reps=opts.reps,
                                             log=log, ops=ops)

            def phase(name: str) -> None:
                nonlocal what
                what = name

            timings, memories = harness.measure_benches(benches, warmup=opts.warmup, reps=opts.reps,
                                                        activation_checkpoint=opts.activation_checkpoint,
                                                        progress=progress, phase=phase)
    except Exception as exc:
        if harness.is_oom(exc):
            raise harness.oom_error(opts.config, 0, what) from None
        if source.scheme != "builtin" and not isinstance(exc, PPSimError):
            from ppsim.calibrate.models import ModelSourceError

            reason = (str(exc).splitlines() or [""])[0][:160] or type(exc).__name__
            raise ModelSourceError(
                f"--model {source.text}: measuring {what} on {opts.device} failed ({type(exc).__name__}: {reason}); "
                "the model may need CUDA (--device cuda on a GPU machine), or pick another flavor") from None
        raise
    return [harness.unit_fields(opts, unit, samples, mem) for unit, samples, mem in zip(units, timings, memories)]


def _measure_p2p(opts: CalibrationOptions, world: World | None, sizes: list[int], device: Any, *,
                 notes: list[str]) -> Any:
    import torch

    from ppsim.calibrate.measure import comm

    reps = max(opts.reps, 30)  # exchanges are cheap next to stage measurements
    if world is not None:
        result = comm.measure_pairs(world, sizes, warmup=opts.warmup, reps=reps, device=device)
        if result is not None:
            worst = max(result.pairs, key=lambda p: p.alpha_s + max(sizes) / p.beta_bytes_per_s)
            count = f"{len(result.pairs)} neighbouring rank pair" + ("s" if len(result.pairs) > 1 else "")
            notes.append(f"p2p measured under torchrun over {count} ({world.backend}); "
                         f"alpha and beta are the slowest pair's ({worst.src}->{worst.dst})")
        return result
    if opts.device == "cuda":
        if torch.cuda.device_count() < 2:
            notes.append("p2p not measured: one GPU and no torchrun; run under torchrun with 2+ ranks "
                         "(see docs/calibration.md) to measure it")
            return None
        backend = "nccl"
    else:
        backend = "gloo"
    result = comm.measure_local_pair(sizes, backend=backend, warmup=opts.warmup, reps=reps,
                                     timeout_s=opts.init_timeout_s)
    notes.append(f"p2p measured between two local {backend} processes on one host (no torchrun)")
    if result.fit_rel_error > 0.3:
        notes.append(f"p2p fit error {result.fit_rel_error:.0%}: timings were noisy (a busy machine?); "
                     "see p2p.samples")
    return result


#: Largest full tensor the collectives are timed at (a layer's gathered weights can be GBs; the fit extrapolates).
COLLECTIVE_MAX_BYTES = 64 << 20


def _measure_collectives(opts: CalibrationOptions, world: World | None, device: Any, *,
                         notes: list[str]) -> list[Any]:
    """FSDP's all-gather and reduce-scatter and EP's all-to-all on the torchrun world, else on two local processes
    (CPU: gloo, two GPUs: nccl), and with ``--ep E`` above 2 the all-to-all again on ``E`` local processes (the EP
    group); sizes up to one layer's weights (at most :data:`COLLECTIVE_MAX_BYTES`)."""
    import torch

    from ppsim.calibrate.measure import comm

    largest = min(COLLECTIVE_MAX_BYTES, max(1 << 20, opts.model_source.estimate.largest_layer_param_bytes))
    sizes = comm.collective_sizes(largest)
    reps = max(opts.reps, 10)
    what = "all-gather / reduce-scatter / all-to-all"
    if world is not None:
        times = comm._collectives(world.world_size, world.rank, sizes=sizes, warmup=opts.warmup, reps=reps,
                                  device=device)
        fits = comm.fit_collectives(times, world.world_size)
        notes.append(f"{what} measured on the torchrun world ({world.world_size} ranks, {world.backend}), full "
                     f"tensors (an all-to-all: each rank's buffer) up to {largest / 2**20:.0f} MiB")
        return fits
    ep = opts.expert_parallel_degree
    if opts.device == "cuda" and torch.cuda.device_count() < max(2, ep):
        notes.append(f"{what} not measured: {torch.cuda.device_count()} GPU(s) here and no torchrun")
        return []
    backend = "nccl" if opts.device == "cuda" else "gloo"
    fits = comm.measure_local_collectives(sizes, backend=backend, warmup=opts.warmup, reps=reps,
                                          timeout_s=opts.init_timeout_s)
    notes.append(f"{what} measured on two local {backend} processes, full tensors (an all-to-all: each rank's "
                 f"buffer) up to {largest / 2**20:.0f} MiB (each costs alpha + bytes / beta)")
    if ep > 2:
        fits += comm.measure_local_collectives(sizes, group_size=ep, backend=backend, warmup=opts.warmup, reps=reps,
                                               timeout_s=opts.init_timeout_s, ops=(CollectiveKind.ALL_TO_ALL.value,))
        notes.append(f"all-to-all also measured on {ep} local {backend} processes (the EP group of --ep {ep})")
    return fits


def run_probes(opts: CalibrationOptions, rec: Recorder, *, log: Callable[[str], None],
               estimates: dict[str, float] | None = None) -> None:
    """The runtime probe: the reference schedule under torch's runtime, real then synthetic; fitted into
    ``runtime`` (each part resumable)."""
    import torch

    from ppsim.calibrate.measure import runtime_model as rm

    if opts.config.layers < rm.PROBE_RANKS:
        _note(rec, f"runtime probe skipped: the model has fewer than {rm.PROBE_RANKS} layers")
        return
    if opts.device == "cuda" and torch.cuda.device_count() < rm.PROBE_RANKS:
        _note(rec, f"runtime probe skipped: needs {rm.PROBE_RANKS} GPUs on this host; predictions use the op "
                   "costs and p2p only")
        return
    probe_opts, probe_doc = opts, rec.doc
    if opts.at_size:
        small = probe_source(opts.model_source)
        est = at_size_estimate(opts.model_source, device=opts.device, reps=opts.reps, warmup=opts.warmup, probe=True)
        have = (device_memory_bytes(opts.device) or 0) / 2**30
        if est.probe_bytes < 0:  # as the estimate said (--allow-large lifts limits, it does not add this run)
            _note(rec, f"runtime probe skipped: its {small.num_layers}-layer copy of the model needs about "
                       f"{-est.probe_bytes / 2**30:.3g} GiB and {have or 0:.3g} GiB is available; predictions use "
                       "the op costs and p2p only (calibrate on a larger device for the runtime's overheads)")
            return
        probe_opts = dataclasses.replace(opts, config=small.config, source=small, at_size=False)
        probe_doc = {**rec.doc, "model": small.config.to_dict(), "source": small.describe(), "layout": small.layout()}
        _note(rec, f"runtime probe run on a {small.num_layers}-layer copy of the model (same layer shapes)")
    runtime = dict(rec.doc.get("runtime") or {})
    for part in ("real", "synthetic"):
        key = f"runtime.{part}"
        if key in rec.done:
            continue
        ranks, microbatches = rm.probe_shape(part == "synthetic")
        name = f"runtime probe ({part})"
        with PhaseProgress(name, (estimates or {}).get(name), log) as progress:
            progress.log(f"{name}: {rm.PROBE_SCHEDULE} on {ranks} local ranks, "
                         f"{microbatches} microbatches, {PROBE_STEPS} steps")
            fitted, (ranks, microbatches) = probe(probe_opts, probe_doc, synthetic=part == "synthetic")
        probe_info = {"schedule": rm.PROBE_SCHEDULE, "ranks": ranks, "microbatches": microbatches,
                      "steps": PROBE_STEPS}
        section = {**fitted, "recv_posting": "consumer", "synthetic": None, "probe": probe_info}
        if part == "real":
            runtime = {**section, "synthetic": runtime.get("synthetic")}
        else:
            runtime["synthetic"] = section
        rec.doc["runtime"] = runtime
        rec.finish(key)
    name = "runtime probe (FSDP)"
    if estimates is not None and name not in estimates:  # not a phase of this calibration (the estimate said so)
        shared_probe(probe_opts, probe_doc, rec, log=log)
        return
    with PhaseProgress(name, (estimates or {}).get(name), log) as progress:
        shared_probe(probe_opts, probe_doc, rec, log=progress.log)


#: The FSDP probe's degree: each of the reference 1F1B's ranks is this many processes (torchtitan's ``fully_shard``).
SHARED_PROBE_DP_SHARD = 2
#: The FSDP probe's timed steps: their median fits ``runtime.shared_scale``, which multiplies every stretch of a run
#: whose processes time-share the cores. With :data:`PROBE_STEPS` (4) two calibrations of the same job on the 2-core
#: VM fitted 1.05 and 1.24, and every prediction made with them moved as much.
SHARED_PROBE_STEPS = 10


def shared_probe(opts: CalibrationOptions, doc: dict[str, Any], rec: Recorder, *,
                 log: Callable[[str], None]) -> None:
    """The FSDP probe (CPU, torchtitan models, a host with fewer cores than its processes): the reference 1F1B with
    each rank ``dp_shard`` 2 processes, pinned as ``ppsim run`` pins them, so its processes time-share the cores as a
    PP x FSDP run's do; ``runtime.shared_scale`` is the time-sharing slowdown with which the one step model
    (:func:`ppsim.step.build.build_step` under :func:`ppsim.step.sharing.shared_cores_step`) gives its measured step
    (:func:`ppsim.calibrate.measure.runtime_model.fit_shared_scale`). Never a run being predicted."""
    from ppsim.calibrate.measure import runtime_model as rm
    from ppsim.step.sharing import host_cores

    key = "runtime.shared"
    runtime = rec.doc.get("runtime")
    # FSDP runs (`run --dp-shard`) take torchtitan models; on GPUs the processes do not share cores
    if key in rec.done or not runtime or opts.device != "cpu" or opts.model_source.scheme != "torchtitan":
        return
    ranks, microbatches = rm.probe_shape(False)
    dp_shard = shared_probe_dp_shard(opts)
    processes = ranks * dp_shard
    skipped = "runtime.shared_scale not measured (1 in the step model)"
    if processes <= host_cores():
        _note(rec, f"FSDP probe skipped (its {processes} processes have a core each on this host, so runs of that "
                   f"size do not time-share): {skipped}")
        rec.finish(key)
        return
    ep = opts.expert_parallel_degree
    log(f"runtime probe (FSDP): {rm.PROBE_SCHEDULE} on {ranks} PP ranks x dp_shard {dp_shard}"
        + (f" (EP {ep} carved out of it)" if ep > 1 else "")
        + (f", activation checkpointing {opts.activation_checkpoint}" if opts.activation_checkpoint != "none" else "")
        + f" ({processes} processes on {host_cores()} cores), {microbatches} microbatches, {SHARED_PROBE_STEPS} "
          "steps")
    try:
        fitted = probe_shared(opts, doc, runtime)
    except Exception as exc:  # the other probes stand; the step model then shares the cores at the fair share
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        _note(rec, f"FSDP probe failed ({type(exc).__name__}: {reason}): {skipped}")
        rec.finish(key)
        return
    rec.doc["runtime"] = {**runtime, "shared_scale": fitted["shared_scale"],
                          "samples": {**(runtime.get("samples") or {}), **fitted["samples"]}}
    rec.finish(key)


def shared_probe_dp_shard(opts: CalibrationOptions) -> int:
    """The FSDP probe's degree: :data:`SHARED_PROBE_DP_SHARD`, or the profile's EP degree where larger (EP is carved
    out of it, as torchtitan carves it out of ``dp_shard``)."""
    return max(SHARED_PROBE_DP_SHARD, opts.expert_parallel_degree)


def probe_shared(opts: CalibrationOptions, doc: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """Run the FSDP probe and fit ``shared_scale`` on it (:func:`shared_probe`). The probe runs the job the
    profile's blocks were timed as: under their activation checkpointing and, for a profile measured at EP above 1,
    at that EP degree (its MoE layers' costs hold their all-to-alls, which the probe's step then issues too)."""
    from ppsim.calibrate.execute import steps
    from ppsim.calibrate.measure import runtime_model as rm
    from ppsim.calibrate.torchtitan import runner as titan_run
    from ppsim.calibrate.torchtitan.parts import module_names_per_stage
    from ppsim.calibrate.torchtitan.shapes import run_shapes
    from ppsim.costs import CostSpec
    from ppsim.job.degrees import Degrees
    from ppsim.profile import Profile
    from ppsim.schedules import get_schedule
    from ppsim.step.build import StepJob, build_step
    from ppsim.step.pricing import CollectiveCosts
    from ppsim.step.sharing import host_cores

    profile = Profile.from_dict({**doc, "runtime": runtime}, source=str(opts.output), allow_incomplete=True)
    ranks, microbatches = rm.probe_shape(False)
    dp_shard, ep = shared_probe_dp_shard(opts), opts.expert_parallel_degree
    schedule = get_schedule(rm.PROBE_SCHEDULE, ranks, microbatches)
    costs = CostSpec.from_profile(profile, source="probe").for_schedule(schedule)
    spec = steps.ExecSpec(
        schedule=schedule, model=opts.config, backend="gloo", device="cpu", num_steps=SHARED_PROBE_STEPS,
        num_warmup=PROBE_WARMUP, num_probes=0, seed=opts.seed, timeout_s=max(120.0, 4 * opts.init_timeout_s),
        timing_only=True,  # the fit reads the timed steps only (no memory step, gradients or reference check)
        layer_counts=costs.split_counts, source=opts.source, dp_shard=dp_shard,
        activation_checkpoint=opts.activation_checkpoint, ep=ep,
    )
    measurement = titan_run.TorchtitanRunner().launch(spec)
    shapes = run_shapes(opts.model_source, tp=1, fsdp=True, profile=profile, dp_shard=dp_shard, ep=ep,
                        ac=opts.activation_checkpoint)
    modules = module_names_per_stage(opts.model_source, schedule.num_stages, costs.split_counts)
    job = StepJob(shapes=shapes, stage_modules=modules, degrees=Degrees(pp=ranks, dp_shard=dp_shard, ep=ep),
                  costs=CollectiveCosts.from_profile(profile), ep_overlap="sequential",
                  ep_in_blocks=profile.expert_parallel_degree == ep, runtime_order=True)
    step = build_step(schedule, costs, job)
    return rm.fit_shared_scale(measurement, step, costs, per_rank=dp_shard, cores=host_cores())


def probe(opts: CalibrationOptions, doc: dict[str, Any], *,
          synthetic: bool) -> tuple[dict[str, Any], tuple[int, int]]:
    """Execute the reference schedule (real or synthetic stages) and fit the runtime quantities on its steps;
    returns the fit and the (ranks, microbatches) it ran. The op costs it is compared with are the blocks just
    measured, composed by ``ppsim.costs`` as for any schedule (runtime overheads left out). A model too small to
    cut into the synthetic probe's stages is probed on the real probe's shape."""
    from ppsim.calibrate.execute import steps
    from ppsim.calibrate.execute import synthetic as syn
    from ppsim.calibrate.measure import runtime_model as rm
    from ppsim.calibrate.torchtitan import runner as titan_run
    from ppsim.costs import CostSpec
    from ppsim.errors import PPSimError
    from ppsim.profile import Profile
    from ppsim.schedules import get_schedule

    profile = Profile.from_dict({**doc, "runtime": None}, source=str(opts.output), allow_incomplete=True)
    shapes = [rm.probe_shape(synthetic)] + ([rm.probe_shape(False)] if synthetic else [])
    for ranks, microbatches in shapes:
        schedule = get_schedule(rm.PROBE_SCHEDULE, ranks, microbatches)
        try:
            costs = CostSpec.from_profile(profile, source="probe").for_schedule(schedule)
            break
        except PPSimError:
            if (ranks, microbatches) == shapes[-1]:
                raise
    model = opts.config
    sleep_s = None
    if synthetic:
        model = syn.synthetic_model(model, schedule.num_stages)
        sleep_s = syn.cost_plan(schedule, costs, 1.0)
    spec = steps.ExecSpec(
        schedule=schedule, model=model, synthetic=synthetic, sleep_s=sleep_s,
        backend="nccl" if opts.device == "cuda" else "gloo", device=opts.device, num_steps=PROBE_STEPS,
        num_warmup=PROBE_WARMUP, num_probes=0, seed=opts.seed, timeout_s=max(120.0, 4 * opts.init_timeout_s),
        timing_only=True,  # the fit reads the timed steps only (no memory step, gradients or reference check)
        layer_counts=None if synthetic else costs.split_counts, source=None if synthetic else opts.source,
        activation_checkpoint="none" if synthetic else opts.activation_checkpoint,  # as the blocks were timed
    )
    # the runner `ppsim run` will use for this model (torchtitan's pipeline helpers for a torchtitan model), so the
    # runtime's overheads the probe fits are the ones the runs pay
    runner = titan_run.choose_runner("auto", opts.model_source, schedule, synthetic=synthetic)
    measurement = runner.launch(spec)
    return rm.fit_probe(measurement, schedule, costs), (ranks, microbatches)


def _note(rec: Recorder, note: str) -> None:
    if note not in rec.doc["notes"]:
        rec.doc["notes"] = [*rec.doc["notes"], note]


def _broadcast(doc: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    box = [doc]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- the profile document as it grows ---------------------------------------------------------------------------
def new_document(opts: CalibrationOptions, *, device: Any, world_size: int, backend: str | None) -> dict[str, Any]:
    """A version-3 profile with nothing measured yet (sizes known without running are filled in)."""
    import torch

    from ppsim.calibrate.execute.launch import cpu_name
    from ppsim.calibrate.measure.harness import unit_static

    cuda = device.type == "cuda"
    source = opts.model_source
    blocks = static_blocks(opts)
    stages = []
    if opts.check_stages:
        for s, unit in enumerate(check_units(opts)):
            stages.append({"stage": s, "layers": list(unit.layers), "has_embedding": unit.has_embedding,
                           "has_head": unit.has_head, **unit_static(opts.config, unit, source).to_dict()})
    return {
        "schema": "ppsim.profile",
        "version": 3,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": opts.device,
        "device_name": torch.cuda.get_device_name(device) if cuda else f"{cpu_name()} ({os.cpu_count()} cores)",
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "world_size": world_size,
        "backend": backend,
        "model": opts.config.to_dict(),
        "source": source.describe(),
        "blocks": blocks,
        "layout": source.layout(),
        "stage_overhead": None,
        "runtime": None,
        "num_stages": len(stages),
        "stages": stages,
        "p2p": None,
        "complete": False,
        "done": [],
        "method": {"warmup": opts.warmup, "reps": opts.reps, "timer": "cuda_events" if cuda else "perf_counter",
                   "threads_per_rank": None if cuda else 1, "wall_s": None},
        "notes": [*source.notes, *checkpoint_notes(opts.activation_checkpoint)],
        "units": {},
        **({"activation_checkpoint": opts.activation_checkpoint} if opts.activation_checkpoint != "none" else {}),
        **({"tensor_parallel_degree": opts.tensor_parallel_degree} if opts.tensor_parallel_degree > 1 else {}),
        **({"expert_parallel_degree": opts.expert_parallel_degree} if opts.expert_parallel_degree > 1 else {}),
        **({"cluster": opts.cluster} if opts.cluster is not None else {}),
        **({"entries": [entry_document(opts.for_pass(p)) for p in opts.all_passes[1:]]}
           if len(opts.all_passes) > 1 else {}),
    }


def checkpoint_notes(mode: str) -> list[str]:
    """The profile's note on a calibration under activation checkpointing (none without)."""
    if mode == "none":
        return []
    return [f"activation_checkpoint {mode}: each unit's blocks wrapped with torchtitan's {mode} policy as `ppsim run "
            f"--activation-checkpoint {mode}` wraps a model part, so F, B and FB are timed under it (B holds the "
            "backward's rerun of what the policy does not save); I and W are not measured (null: torch reruns a "
            "checkpointed region for each backward, so schedules that split it are refused with this profile); "
            "activation bytes are measured without checkpointing (the memory prediction applies the mode)"]


def static_blocks(opts: CalibrationOptions) -> dict[str, Any]:
    """The profile's blocks with the sizes known without running (the measured fields ``null``)."""
    from ppsim.calibrate.measure.harness import unit_of, unit_static
    from ppsim.calibrate.models import block_name_of

    source = opts.model_source
    units = units_of(source)
    per_block = [("embed", units[0])]
    single = len(source.kinds) == 1
    for kind in source.kinds:
        per_block.append((block_name_of(kind, single=single), unit_of(kind, (source.layer_kinds.index(kind),))))
    per_block.append(("head", units[-1]))
    return {name: unit_static(opts.config, unit, source).to_dict() for name, unit in per_block}


def entry_document(opts: CalibrationOptions) -> dict[str, Any]:
    """A pass beyond the first with nothing measured yet: the profile's ``entries`` item (``units``, ``stages``
    and ``notes`` are the recorder's while it is measured)."""
    return {"tensor_parallel_degree": opts.tensor_parallel_degree, "mb_size": opts.config.mb_size,
            "blocks": static_blocks(opts), "stage_overhead": None, "units": {}, "stages": [], "notes": []}


def resume_document(opts: CalibrationOptions, fresh: dict[str, Any], *, log: Callable[[str], None]) -> dict:
    """The unfinished profile (``-o``'s progress file, or ``-o`` itself as an older ppsim left it) if it was measured
    with the same options."""
    partial = progress_path(opts.output)
    path = partial if partial.exists() else opts.output
    if not path.exists():
        log(f"--resume: {opts.output} does not exist yet; starting a new calibration")
        return fresh
    load_profile(path, allow_incomplete=True)  # one-line errors for a broken file
    old = json.loads(path.read_text(encoding="utf-8"))
    method = old.get("method") or {}
    theirs = {"model": old.get("model"), "source": (old.get("source") or {}).get("source"),
              "stages": old.get("num_stages"), "device": old.get("device"),
              "warmup": method.get("warmup"), "reps": method.get("reps"),
              "--ep": old.get("expert_parallel_degree", 1),
              "--activation-checkpoint": old.get("activation_checkpoint", "none"),
              "passes": [(old.get("tensor_parallel_degree", 1), (old.get("model") or {}).get("mb_size")),
                                   *((e.get("tensor_parallel_degree"), e.get("mb_size"))
                                     for e in old.get("entries") or [])]}
    if old.get("version") != 3 or "units" not in old:
        raise PPSimError(f"--resume: {path} is a profile of an older ppsim (version {old.get('version')}); "
                         "drop --resume to start over")
    ours = {"model": fresh["model"], "source": fresh["source"]["source"], "stages": fresh["num_stages"],
            "device": fresh["device"],
            "warmup": opts.warmup, "reps": opts.reps, "--ep": opts.expert_parallel_degree,
            "--activation-checkpoint": opts.activation_checkpoint,
            "passes": [(p.tensor_parallel_degree, p.mb_size) for p in opts.all_passes]}
    diff = [k for k in ours if theirs[k] != ours[k]]
    if diff:
        k = diff[0]
        what = (f"{_show(theirs[k])}, not {_show(ours[k])}" if k == "passes" else
                f"{k} {_show(theirs[k])}, not {_show(ours[k])}")
        raise PPSimError(
            f"--resume: {path} was measured with {what}; "
            "repeat the original options, or drop --resume to start over"
        )
    return {**fresh, **old}


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):  # the (tp, mb_size) passes, as the options that make them
        tps = ",".join(dict.fromkeys(str(tp) for tp, _ in value))
        mbs = ",".join(dict.fromkeys(str(mb) for _, mb in value))
        return f"--tp {tps} --mb-size {mbs}"
    return str(value)


class Recorder:
    """Holds the profile document being measured; the writing rank saves it after every finished measurement."""

    def __init__(self, doc: dict[str, Any], path: Path, *, writer: bool) -> None:
        self.doc = doc
        self.path = path
        self.writer = writer

    @property
    def done(self) -> list[str]:
        return list(self.doc["done"])

    def save(self) -> None:
        """Keep the work so far in the progress file (``-o`` itself is replaced only by :meth:`publish`)."""
        if self.writer:
            from ppsim.io import write_atomic

            write_atomic(progress_path(self.path), json.dumps(self.doc, indent=1, allow_nan=False) + "\n",
                         option="-o")

    def publish(self) -> None:
        """Write the finished profile to ``-o`` (atomically) and drop the progress file."""
        if self.writer:
            from ppsim.io import write_atomic

            try:
                write_atomic(self.path, json.dumps(self.doc, indent=1, allow_nan=False) + "\n")
            except (PPSimError, OSError) as exc:  # the disk filled meanwhile: every measurement is in the progress file
                raise PPSimError(f"{exc}; the measurements are kept in {progress_path(self.path)}: make room and "
                                 "run the same command with --resume to write the profile") from None
            progress_path(self.path).unlink(missing_ok=True)

    def finish(self, key: str) -> None:
        self.doc["done"] = [*self.doc["done"], key]
        self.save()

    def add_unit(self, name: str, fields: dict[str, Any]) -> None:
        if name.startswith("stage"):
            s = int(name[5:])
            stages = list(self.doc["stages"])
            stages[s] = {**stages[s], **{k: v for k, v in fields.items() if k in stages[s]}}
            self.doc["stages"] = stages
        else:
            self.doc["units"] = {**self.doc["units"], name: fields}

    def compose(self, opts: CalibrationOptions) -> None:
        """Blocks and the per-stage overhead from the units; with ``--check-stages``, a note per stage comparing
        the composition (blocks + overhead) with the stage measured whole."""
        from ppsim.calibrate.models import block_name_of

        source = opts.model_source
        k = 1 if opts.at_size else num_common_layers(source)
        layer_block = block_name_of(common_kind(source), single=len(source.kinds) == 1)
        blocks, overhead = blocks_from_units(self.doc["units"], k, layer_block=layer_block,
                                             other_kinds=kind_units(source))
        self.doc["blocks"], self.doc["stage_overhead"] = blocks, overhead
        layout = source.layout()
        for st in self.doc["stages"]:
            n = st["layers"][1] - st["layers"][0]
            names = layout[1 + st["layers"][0]:1 + st["layers"][1]]
            parts = [(overhead, 1), *((blocks[name], 1) for name in names)]
            parts += [(blocks["embed"], 1)] if st["has_embedding"] else []
            parts += [(blocks["head"], 1)] if st["has_head"] else []
            errs = []
            for op in ("F", "B", "FB"):
                composed = sum(w * part[op]["median"] for part, w in parts)
                if st[op]["median"] > 0:
                    errs.append(f"{op} {100 * (composed - st[op]['median']) / st[op]['median']:+.0f}%")
            act = sum(w * part.get("activation_bytes", 0) for part, w in parts[1:])
            if st["activation_bytes"]:
                errs.append(f"activation bytes {100 * (act - st['activation_bytes']) / st['activation_bytes']:+.1f}%")
            self.doc["notes"] = [*self.doc["notes"], f"stage {st['stage']} ({n} layers) composed from blocks vs "
                                 f"measured whole: {', '.join(errs)}"]
        self.save()


class EntryRecorder(Recorder):
    """A pass beyond the first: its units and blocks go to the profile's ``entries[index]``, saved with the
    profile; its notes join the profile's when it finishes."""

    def __init__(self, parent: Recorder, index: int) -> None:
        super().__init__(parent.doc["entries"][index], parent.path, writer=parent.writer)
        self.parent, self.index = parent, index

    @property
    def done(self) -> list[str]:
        return self.parent.done

    def save(self) -> None:
        entries = list(self.parent.doc["entries"])
        entries[self.index] = self.doc
        self.parent.doc["entries"] = entries
        self.parent.save()

    def finish(self, key: str) -> None:
        said = f"tp {self.doc['tensor_parallel_degree']} x microbatch size {self.doc['mb_size']}: "
        notes = [said + n for n in self.doc.pop("notes", [])]
        self.doc.pop("stages", None)
        self.parent.doc["notes"] = [*self.parent.doc["notes"], *(n for n in notes if n not in self.parent.doc["notes"])]
        self.save()
        self.parent.finish(key)


def interrupted_line(output: Path) -> str:
    """What a Ctrl-C during a calibration says: where its finished measurements are and how to go on."""
    partial = progress_path(output)
    if not partial.exists():
        return f"interrupted before anything was measured; nothing written ({output} is untouched)"
    return (f"interrupted; finished measurements are in {partial} ({output} is untouched); continue with the same "
            "command and --resume")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
