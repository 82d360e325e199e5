"""The runtime model: what executing under torch's pipeline runtime adds on top of the profile's op costs.

Two uses, one fitting code:

- **Calibration** (:func:`fit_probe`): `ppsim calibrate` runs a fixed reference schedule (1F1B on two local ranks,
  :data:`PROBE_SCHEDULE`) under torch's runtime, real and with synthetic stages, and fits the profile's ``runtime``
  section on it. The simulator applies that section to every schedule (``ppsim.costs``), so `simulate --profile`
  and `run --profile` give the same before-run prediction.
- **Post-hoc explanation** (:func:`fit_runtime_model`, :func:`with_runtime`): `ppsim run` may fit the same model
  on probe steps of the run itself and report the result as ``explained_step_s``. That number explains a run; it is
  never the prediction.

Fitted quantities:

- ``compute_scale``: measured computation time over profile cost. The profile times one stage at a time in one
  process; in a run all ranks of a host compute at once and share cores, caches and memory bandwidth. The probe
  also splits it by how many ranks were computing at the same moment (``compute_scale_by_concurrency``).
- ``dispatch_s``: the gap between one computation's end and the next one's start on a rank, input waits excluded
  (posting sends and receives, the runtime's bookkeeping, waking up), plus for synthetic stages the amount a sleep
  overran its cost. Added to every computation (twice to a pair).
- ``handoff_s``: a cross-rank hand-off's travel time, from when it could start (the later of the producer's end and
  the consumer's receive post: torch's lowering posts some receives only just before their consumer, and gloo/NCCL
  move a message only once both sides are posted) to the start of a consumer that was waiting for it.

Each is a mean within a step (a step accumulates these delays) and the median over the fitted steps.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppsim.calibrate.execute.steps import Measurement
    from ppsim.costs import StageCosts
    from ppsim.ir import Schedule

from ppsim.calibrate.execute.synthetic import cost_plan

#: A computation counts as having waited for its input when its receive wait exceeds this (seconds).
WAITED_S = 100e-6
#: The fixed reference schedule of the calibration probe (never the schedule being predicted).
PROBE_SCHEDULE = "1F1B"
PROBE_RANKS = 2
PROBE_MICROBATCHES = 8
#: The synthetic probe's shape: sleeping ranks need no core, so it runs more ranks than the real one. A 2-rank
#: synthetic probe measured hand-offs of 0.74-0.82 ms where 4- and 8-rank runs on the same host saw 0.2-0.45 ms.
SYNTHETIC_PROBE_RANKS = 4
SYNTHETIC_PROBE_MICROBATCHES = 6


def probe_shape(synthetic: bool) -> tuple[int, int]:
    """(ranks, microbatches) of the reference 1F1B the probe runs, real or synthetic."""
    return (SYNTHETIC_PROBE_RANKS, SYNTHETIC_PROBE_MICROBATCHES) if synthetic else (PROBE_RANKS, PROBE_MICROBATCHES)


@dataclass(frozen=True)
class RuntimeModel:
    """What executing under torch's runtime changes about the per-op costs, fitted on measured steps; the model
    simulates
    ``cost * compute_scale + dispatch_s`` per computation with ``latency_s`` per cross-rank hand-off.

    ``compute_scale`` (real stages), per chain position: measured computation time of the stage over its profile
    cost. Calibration times one stage at a time in one process, at another moment; in the run all ranks compute at
    once and share cores, caches and memory bandwidth, and a shared or virtual machine changes speed with its
    neighbours' load, so a stage's computations run slower (or faster) by about this factor. The profile's ratios
    between F, B, I and W of a stage are kept.
    ``dispatch_s``: mean time from one computation's end to the next one's start on a rank, input waits excluded
    (posting sends and receives, the runtime's bookkeeping, waking up); for synthetic stages plus the mean amount by
    which a sleep overran its cost.
    ``latency_s``: mean travel time of a hand-off between ranks, from when it could start (the producer's action
    end, or the consumer's receive post when torch's lowering posts it later: gloo and NCCL transfer only once both
    sides are posted) plus ``dispatch_s`` to the start of a consumer that was waiting for it (wire time, the
    receiver's wake-up, the runtime's receive path); the prediction uses it as the flat ``comm`` in place of the
    profile's p2p fit or the cost string's comm.
    Each quantity is a mean within a step (a step accumulates these delays, so their average is what lengthens it)
    and the median over the probe steps (one disturbed step does not skew it).
    """

    compute_scale: tuple[float, ...]
    dispatch_s: float
    latency_s: float
    gap_s: float
    overrun_s: float
    num_gap_samples: int
    num_latency_samples: int
    comm_source: str
    fitted_on: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fit_runtime_model(
    measurement: Measurement, schedule: Schedule, costs: StageCosts, *, time_scale: float = 1.0,
    per_stage: bool = True,
) -> RuntimeModel | None:
    """Fit :class:`RuntimeModel` on the probe steps, or without probes on the warm-up steps (the first skipped
    when there are more: it sets up the communicators and infers shapes). Never on the timed steps. ``None`` when
    there is nothing to fit on.

    Each quantity is fitted per step (a mean over the step's samples: a step adds up its delays) and the median
    over the steps is kept, as the measured step time is the median over the timed steps."""
    steps = measurement.probe_steps or (
        measurement.warmup_steps[1:] if len(measurement.warmup_steps) > 1 else measurement.warmup_steps
    )
    if not steps:
        return None
    plan = cost_plan(schedule, costs, time_scale)
    num_positions = costs.num_positions or 1
    fits = [_fit_step(step, schedule, costs, plan, num_positions, per_stage, measurement.synthetic) for step in steps]
    scale = tuple(statistics.median(f[0][k] for f in fits) for k in range(num_positions))
    gap = statistics.median(f[1] for f in fits)
    overrun = statistics.median(f[2] for f in fits)
    dispatch = gap + overrun
    latencies = [lat for step in steps for lat in _latencies(step, schedule, dispatch)]
    per_step_latency = [statistics.fmean(x) for x in (_latencies(st, schedule, dispatch) for st in steps) if x]
    latency = max(0.0, statistics.median(per_step_latency)) if per_step_latency else 0.0
    if latencies:
        source = "measured hand-offs"
    elif costs.p2p_alpha is not None:
        source = "profile p2p (alpha + bytes/beta)"
    else:
        source = "cost string comm"
    fitted_on = f"{len(steps)} probe step(s)" if measurement.probe_steps else f"{len(steps)} warm-up step(s)"
    num_gaps = sum(len(st) for st in steps) - len(steps) * schedule.num_ranks
    return RuntimeModel(scale, dispatch, latency, gap, overrun, num_gaps, len(latencies), source, fitted_on)


def _fit_step(
    step: tuple[Any, ...], schedule: Schedule, costs: StageCosts, plan: tuple[tuple[float, ...], ...],
    num_positions: int, per_stage: bool, synthetic: bool,
) -> tuple[tuple[float, ...], float, float]:
    """One step's (compute scale per chain position, mean dispatch gap, mean sleep overrun)."""
    from ppsim.ir import parse_action

    gaps: list[float] = []
    measured = [0.0] * num_positions
    planned = [0.0] * num_positions
    by_rank: dict[int, list[Any]] = {}
    for c in step:
        by_rank.setdefault(c.rank, []).append(c)
    for rank, comps in by_rank.items():
        for prev, cur in zip(comps, comps[1:]):
            gaps.append(max(0.0, cur.start - prev.end - cur.wait))
        for c, cost in zip(comps, plan[rank]):
            comp = parse_action(c.name)
            assert comp is not None
            pos = costs.position(schedule, comp.stage) if per_stage else 0
            measured[pos] += c.end - c.start
            planned[pos] += cost
    gap = statistics.fmean(gaps) if gaps else 0.0
    if synthetic:
        return (1.0,) * num_positions, gap, max(0.0, (sum(measured) - sum(planned)) / len(step))
    total = sum(measured) / sum(planned) if sum(planned) > 0 else 1.0
    if not per_stage:
        return (total,) * num_positions, gap, 0.0
    return tuple(m / p if p > 0 else total for m, p in zip(measured, planned)), gap, 0.0


def _latencies(step: tuple[Any, ...], schedule: Schedule, dispatch: float) -> list[float]:
    """Hand-off latencies of one step: for consumers that waited, start minus when the hand-off could start, minus
    the dispatch the simulation adds to the producer."""
    handoffs = _cross_rank_handoffs(schedule, step)
    return [cons.start - sent - dispatch for sent, cons in handoffs if cons.wait > WAITED_S]


def _cross_rank_handoffs(schedule: Schedule, step: tuple[Any, ...]) -> list[tuple[float, Any]]:
    """(time the hand-off could start, consumer computation timing) for every input that crosses ranks.

    The output leaves when the producer's whole action ends (the runtime posts a pair's sends after both halves),
    and moves only once the consumer has posted its receive (gloo and NCCL both rendezvous), whichever is later.
    """
    from ppsim import deps
    from ppsim.ir import parse_action

    action_end: dict[tuple[int, int], float] = {}
    for c in step:
        action_end[(c.rank, c.position)] = max(action_end.get((c.rank, c.position), c.end), c.end)
    producers: dict[tuple[int, int, int], Any] = {}
    parsed = []
    for c in step:
        comp = parse_action(c.name)
        assert comp is not None
        parsed.append((c, comp))
        for key in deps.provides(comp):
            producers[key] = c
    pairs = []
    for c, comp in parsed:
        for key in deps.requires(schedule, comp):
            prod = producers.get(key)
            if prod is not None and prod.rank != c.rank:
                sent = action_end[(prod.rank, prod.position)]
                pairs.append((sent if c.posted is None else max(sent, c.posted), c))
    return pairs


def with_runtime(costs: StageCosts, runtime: RuntimeModel | None, time_scale: float) -> StageCosts:
    """``costs`` in seconds; with a runtime model, every computation scaled by ``compute_scale`` plus ``dispatch_s``
    (a pair holds two computations) and the fitted hand-off latency as the flat comm (when the fitted steps had
    hand-offs to fit it on)."""
    n = len(costs.F)
    scale = [time_scale * (runtime.compute_scale[k] if runtime is not None else 1.0) for k in range(n)]
    o = runtime.dispatch_s if runtime is not None else 0.0
    f, b, i, w = (tuple(x * scale[k] + o for k, x in enumerate(t)) for t in (costs.F, costs.B, costs.I, costs.W))
    fb = tuple(x * scale[k] + 2 * o for k, x in enumerate(costs.FB))
    if runtime is not None and runtime.num_latency_samples:
        return dataclasses.replace(
            costs, F=f, B=b, I=i, W=w, FB=fb, comm=runtime.latency_s, p2p_alpha=None, p2p_beta=None, unit="s"
        )
    return dataclasses.replace(costs, F=f, B=b, I=i, W=w, FB=fb, comm=costs.comm * time_scale, unit="s")


def fit_probe(measurement: Measurement, schedule: Schedule, costs: StageCosts) -> dict[str, Any]:
    """Fit the profile's ``runtime`` quantities on a probe run's timed steps (the calibration's own run of the
    reference schedule, never a schedule being predicted).

    ``compute_scale`` (version-2 profile: rank count -> factor): key ``R`` (the probe's rank count) is the measured
    computation time over the op cost for every computation of the R-rank run, which is what the simulator applies
    to a schedule on R ranks of one host; key ``"1"`` is the same ratio for the computations during which no other
    rank computed. Synthetic probes (sleeps need no core) give ``{"1": 1.0}``."""
    steps = measurement.steps
    plan = cost_plan(schedule, costs, 1.0)
    fits = [_fit_step(step, schedule, costs, plan, 1, False, measurement.synthetic) for step in steps]
    per_step_scale = [f[0][0] for f in fits]
    per_step_dispatch = [f[1] + f[2] for f in fits]
    dispatch = max(0.0, statistics.median(per_step_dispatch))
    per_step_latency = [statistics.fmean(x) for x in (_latencies(st, schedule, dispatch) for st in steps) if x]
    handoff = max(0.0, statistics.median(per_step_latency)) if per_step_latency else None
    scale: dict[str, float] = {"1": 1.0}
    samples = {"dispatch_s": [max(0.0, x) for x in per_step_dispatch],
               "handoff_s": [max(0.0, x) for x in per_step_latency]}
    if not measurement.synthetic:
        key = str(schedule.num_ranks)
        solo, together, contention = [], [], []
        for step in steps:
            sums = [0.0, 0.0, 0.0, 0.0]  # measured and planned: alone, with another rank computing
            for k, measured, planned in _by_concurrency(step, plan):
                sums[0 if k == 1 else 2] += measured
                sums[1 if k == 1 else 3] += planned
            if sums[1] > 0 and sums[3] > 0 and sums[0] > 0:
                solo.append(sums[0] / sums[1])
                together.append(sums[2] / sums[3])
                contention.append(together[-1] / solo[-1])
        samples[f"host_scale.{key}"] = per_step_scale
        if contention:
            # Slowdown from ranks computing at once, measured within each step (computations alone vs together), so
            # the host's speed at the probe's moment, which drifts against the blocks' moment on a shared machine,
            # cancels. Computing alongside another rank cannot make a computation faster: at least 1.
            scale[key] = max(1.0, statistics.median(contention))
            samples[f"compute_scale.{key}"] = contention
            samples["host_scale.1"] = solo
        else:  # no computation ran alone: the step-wide ratio, drift included
            scale = {key: statistics.median(per_step_scale)}
            samples[f"compute_scale.{key}"] = per_step_scale
    return {"compute_scale": dict(sorted(scale.items())), "dispatch_s": dispatch, "handoff_s": handoff,
            "samples": samples}


def _by_concurrency(step: tuple[Any, ...], plan: tuple[tuple[float, ...], ...]) -> list[tuple[int, float, float]]:
    """Per computation: (1 + how many other ranks computed during it, rounded; measured s; planned s)."""
    by_rank: dict[int, list[Any]] = {}
    for c in step:
        by_rank.setdefault(c.rank, []).append(c)
    out = []
    for rank, comps in by_rank.items():
        for c, cost in zip(comps, plan[rank]):
            dur = c.end - c.start
            if dur <= 0:
                continue
            overlap = sum(
                max(0.0, min(c.end, o.end) - max(c.start, o.start))
                for other, ocomps in by_rank.items() if other != rank for o in ocomps
            )
            out.append((1 + round(overlap / dur), dur, cost))
    return out


#: The largest time-sharing slowdown :func:`fit_shared_scale` reports (a probe slower than this is said, not fitted).
SHARED_SCALE_MAX = 4.0


def fit_shared_scale(measurement: Measurement, step: Any, costs: StageCosts, *, per_rank: int,
                     cores: int) -> dict[str, Any]:
    """``runtime.shared_scale`` from the FSDP probe (calibration's own run of the reference 1F1B with ``per_rank``
    processes per rank on ``cores`` cores, never a schedule being predicted): the slowdown of CPU work beyond the
    fair share (:func:`ppsim.step.sharing.shared_cores_step`) with which the one step model of that probe -- ``step``
    (its :class:`ppsim.step.model.Step`) with ``costs``, shared as ``ppsim run`` shares -- gives the probe's measured
    step (the median of its timed steps, from the first rank's call of the runtime's step to its end, as a run measures
    it). Found by bisection (the step grows with the scale); at least 1 (time-sharing cannot make work faster), at most
    :data:`SHARED_SCALE_MAX`."""
    from ppsim.calibrate.execute.predict import predict_step

    measured = statistics.median(measurement.step_spans)

    def predicted(scale: float) -> float:
        result, _ = predict_step(step, dataclasses.replace(costs, shared_scale=scale), 1.0, recompute=None,
                                 per_rank=per_rank, shared=True, cores=cores)
        return float(result.makespan)

    lo, hi = 1.0, SHARED_SCALE_MAX
    if predicted(lo) >= measured:
        scale = lo
    elif predicted(hi) <= measured:
        scale = hi
    else:
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
        scale = (lo + hi) / 2
    return {"shared_scale": scale,
            "samples": {"shared_scale.step_s": list(measurement.step_spans),
                        "shared_scale.predicted_fair_share_s": [predicted(1.0)]}}
