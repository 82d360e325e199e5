"""The cost model: how long each computation takes and how long a hand-off between ranks travels.

One model, one place. Costs come either from a cost string (``--costs "F=1,B=2,I=1,W=1,FB=3,comm=0"``, one value
for every stage, in an arbitrary unit) or from a calibration profile (per stage, in seconds, plus activation and
parameter bytes and a p2p model ``alpha + bytes / beta``).

Profile tables are indexed by a stage's *position in its chain* (``schedule.pipelines[d].index(stage)``), so the
second model copy of DualPipe (stage ``R + j``) uses the profile's stage ``j``.

An overlapped pair ``(sF m; tB n)OVERLAP_F_B`` takes ``(F[s] + X[t]) * r`` where ``X`` is the backward half's cost
(B or I) and ``r`` is the mean of the two stages' overlap ratios ``FB / (F + B)``. With one stage and a full B this is
exactly ``FB``; with uniform costs and a full B it is ``FB`` for every pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ppsim.errors import CostError
from ppsim.ir import Action, ActionType, Schedule

COST_KEYS = ("F", "B", "I", "W", "FB", "comm")
_OP_KEYS = ("F", "B", "I", "W", "FB")
_DEFAULT_F = 1.0
_DEFAULT_B = 2.0


@dataclass(frozen=True)
class CostModel:
    """Per-chain-position costs; a table of length 1 applies to every position (cost strings).

    ``comm`` is a flat cross-rank delay used when there is no p2p model (``p2p_alpha is None``); with a p2p model a
    hand-off across the boundary after chain position ``i`` takes ``p2p_alpha + output_bytes[i] / p2p_beta``.
    Byte tables are ``None`` without a profile (memory is then reported in activation counts only).
    """

    F: tuple[float, ...] = (_DEFAULT_F,)
    B: tuple[float, ...] = (_DEFAULT_B,)
    I: tuple[float, ...] = (_DEFAULT_B / 2,)  # noqa: E741 - the domain's name
    W: tuple[float, ...] = (_DEFAULT_B / 2,)
    FB: tuple[float, ...] = (_DEFAULT_F + _DEFAULT_B,)
    comm: float = 0.0
    p2p_alpha: float | None = None
    p2p_beta: float | None = None
    output_bytes: tuple[int, ...] | None = None
    activation_bytes: tuple[int, ...] | None = None
    activation_bytes_freed_by_I: tuple[int, ...] | None = None
    static_bytes: tuple[int, ...] | None = None
    unit: str = "unit"
    source: str = "default"
    notes: tuple[str, ...] = ()
    # -- runtime overheads (calibrated by a probe run, stored in the profile's ``runtime`` section) ------------------
    compute_scale: float = 1.0
    """Every computation's op cost is multiplied by this (several ranks of one host computing at once)."""
    dispatch_s: float = 0.0
    """Added to every computation (an overlapped pair holds two): the runtime's gap between computations."""
    recv_posting: str = "early"
    """``"early"``: a cross-rank hand-off leaves when its producer ends. ``"consumer"``: it leaves at the later of the
    producer's end and the end of the consumer rank's previous action (torch's lowering posts the receive just before
    the computation that needs it, and gloo/NCCL transfer only once both sides are posted)."""

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_profile(cls, profile: Any, *, source: str = "profile") -> CostModel:
        """Costs from a calibration profile: a mapping in the profile JSON schema, or an object with ``to_dict()``."""
        data: Any = profile.to_dict() if hasattr(profile, "to_dict") else profile
        if not isinstance(data, Mapping):
            raise CostError(f"profile {source}: expected a JSON object, got {type(data).__name__}; "
                            "pass a file written by `ppsim calibrate`")
        if data.get("schema", "ppsim.profile") != "ppsim.profile":
            raise CostError(f"profile {source}: schema {data.get('schema')!r} is not 'ppsim.profile'; "
                            "pass a file written by `ppsim calibrate`")
        stages = data.get("stages")
        if not isinstance(stages, list) or not stages:
            raise CostError(f"profile {source}: no 'stages' list; re-run `ppsim calibrate`")
        num_stages = data.get("num_stages", len(stages))
        if num_stages != len(stages):
            raise CostError(f"profile {source}: num_stages is {num_stages} but {len(stages)} stages are listed; "
                            "re-run `ppsim calibrate`")
        ordered = sorted(stages, key=lambda st: _get(st, "stage", source, int))
        if [_get(st, "stage", source, int) for st in ordered] != list(range(len(stages))):
            raise CostError(f"profile {source}: stage indices must be 0..{len(stages) - 1}; re-run `ppsim calibrate`")
        ops = {key: tuple(_stat_median(st, key, source) for st in ordered) for key in _OP_KEYS}
        act = tuple(_get(st, "activation_bytes", source, int) for st in ordered)
        freed = tuple(_get(st, "activation_bytes_freed_by_I", source, int) for st in ordered)
        for i, (a, f) in enumerate(zip(act, freed)):
            if not 0 <= f <= a:
                raise CostError(f"profile {source}: stage {i} frees {f} bytes at I but holds {a}; "
                                "activation_bytes_freed_by_I must lie in [0, activation_bytes]")
        static = tuple(
            sum(_get(st, key, source, int) for key in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            for st in ordered
        )
        out = tuple(_get(st, "output_bytes", source, int) for st in ordered)
        p2p = data.get("p2p")
        notes: list[str] = []
        alpha: float | None = None
        beta: float | None = None
        if p2p is None:
            notes.append("profile has no p2p measurement: cross-rank hand-offs cost 0")
        else:
            alpha = _number(p2p.get("alpha_s"), f"profile {source}: p2p.alpha_s")
            beta = _number(p2p.get("beta_bytes_per_s"), f"profile {source}: p2p.beta_bytes_per_s")
            if beta <= 0:
                raise CostError(f"profile {source}: p2p.beta_bytes_per_s is {beta}; bandwidth must be > 0")
        return cls(
            **ops,
            comm=0.0,
            p2p_alpha=alpha,
            p2p_beta=beta,
            output_bytes=out,
            activation_bytes=act,
            activation_bytes_freed_by_I=freed,
            static_bytes=static,
            unit="s",
            source=source,
            notes=tuple(notes),
        )

    # -- lookups ------------------------------------------------------------------------------------------------

    @property
    def num_positions(self) -> int | None:
        """Chain length the tables describe; ``None`` for uniform costs (any length)."""
        return None if len(self.F) == 1 and self.activation_bytes is None else len(self.F)

    @property
    def has_memory(self) -> bool:
        return self.activation_bytes is not None

    def check(self, schedule: Schedule) -> None:
        """Raise :class:`CostError` unless the tables fit ``schedule``'s chains."""
        n = self.num_positions
        if n is None:
            return
        for chain in schedule.pipelines:
            if len(chain) != n:
                raise CostError(
                    f"profile has {n} stages but {schedule.name} with {schedule.num_ranks} ranks has {len(chain)}; "
                    f"re-run `ppsim calibrate --stages {len(chain)}`"
                )

    def position(self, schedule: Schedule, stage: int) -> int:
        """Index into the cost tables for ``stage``: its position in its chain (0 for uniform costs)."""
        if self.num_positions is None:
            return 0
        return schedule.position(stage)

    def op_cost(self, schedule: Schedule, stage: int, kind: ActionType) -> float:
        """Time of one single computation ``kind`` (F, B, I or W) of ``stage``."""
        return _op(self, kind, self.position(schedule, stage))

    def duration(self, schedule: Schedule, action: Action) -> float:
        """Time of one action: a single computation, or an overlapped pair (see the module docstring), its op cost
        times ``compute_scale`` plus ``dispatch_s`` per computation (a pair holds two)."""
        if action.type is ActionType.OVERLAP_F_B:
            f, b = action.sub_actions
            return self.pair_duration(schedule, f.stage, b.stage, b.type) * self.compute_scale + 2 * self.dispatch_s
        if not action.is_compute:
            return 0.0
        return self.op_cost(schedule, action.stage, action.type) * self.compute_scale + self.dispatch_s

    def pair_split(self, schedule: Schedule, f_stage: int, b_stage: int, b_kind: ActionType) -> tuple[float, float]:
        """``(duration, forward share)`` of an overlapped pair; the forward half is drawn first, in that share."""
        pf = self.position(schedule, f_stage)
        pb = self.position(schedule, b_stage)
        fwd = self.F[pf]
        bwd = _op(self, b_kind, pb)
        duration = (fwd + bwd) * (_overlap_ratio(self, pf) + _overlap_ratio(self, pb)) / 2
        share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
        return duration, share

    def pair_duration(self, schedule: Schedule, f_stage: int, b_stage: int, b_kind: ActionType) -> float:
        return self.pair_split(schedule, f_stage, b_stage, b_kind)[0]

    def boundary_delay(self, schedule: Schedule, upstream_stage: int) -> float:
        """Cross-rank travel time of the tensor on the boundary after ``upstream_stage`` (activation or gradient)."""
        if self.p2p_alpha is None or self.p2p_beta is None:
            return self.comm
        assert self.output_bytes is not None
        return self.p2p_alpha + self.output_bytes[self.position(schedule, upstream_stage)] / self.p2p_beta

    def comm_delay(self, schedule: Schedule, producer_stage: int, consumer_stage: int) -> float:
        """Delay from the producer's end to the consumer's earliest start (0 on the same rank)."""
        if schedule.stage_to_rank[producer_stage] == schedule.stage_to_rank[consumer_stage]:
            return 0.0
        upstream = producer_stage
        if schedule.direction(consumer_stage) == schedule.direction(producer_stage) and schedule.position(
            consumer_stage
        ) < schedule.position(producer_stage):
            upstream = consumer_stage
        return self.boundary_delay(schedule, upstream)

    def static_bytes_of(self, schedule: Schedule, stage: int) -> int:
        """Parameter + gradient + optimizer bytes of ``stage`` (0 without a profile)."""
        if self.static_bytes is None:
            return 0
        return self.static_bytes[self.position(schedule, stage)]

    def activation_of(self, schedule: Schedule, stage: int) -> tuple[int, int]:
        """``(activation bytes per microbatch, part freed by I)`` of ``stage`` (zeros without a profile)."""
        if self.activation_bytes is None or self.activation_bytes_freed_by_I is None:
            return 0, 0
        pos = self.position(schedule, stage)
        return self.activation_bytes[pos], self.activation_bytes_freed_by_I[pos]

    # -- output -------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description: scalars for uniform costs, per-position lists for profile costs."""

        def table(values: tuple[float, ...]) -> float | list[float]:
            return values[0] if self.num_positions is None else list(values)

        out: dict[str, Any] = {"unit": self.unit, "source": self.source}
        for key in _OP_KEYS:
            out[key] = table(getattr(self, key))
        if self.p2p_alpha is None:
            out["comm"] = self.comm
        else:
            out["p2p"] = {"alpha_s": self.p2p_alpha, "beta_bytes_per_s": self.p2p_beta}
        if self.activation_bytes is not None:
            out["output_bytes"] = list(self.output_bytes or ())
            out["activation_bytes"] = list(self.activation_bytes)
            out["activation_bytes_freed_by_I"] = list(self.activation_bytes_freed_by_I or ())
            out["static_bytes"] = list(self.static_bytes or ())
        if self.notes:
            out["notes"] = list(self.notes)
        return out


COST_SCOPES = ("stage", "rank")


def costs_for(costs: CostModel, schedule: Schedule, *, scope: str = "stage") -> CostModel:
    """The cost model to simulate ``schedule`` with, reading a cost string at ``scope``.

    ``"stage"`` (the default, as in the DualPipe figures): each op on one stage chunk costs the given time.
    ``"rank"``: the times are one rank's share of one model copy (Megatron's "per full stage"), so a chunk of a
    chain of ``S`` stages on ``R`` ranks costs ``R / S`` of them; schedules that cut the model into different
    numbers of stages (1F1B vs Interleaved1F1B vs DualPipeV) then run the same model and compare fairly.
    """
    if scope not in COST_SCOPES:
        raise CostError(f"--cost-scope {scope!r} is unknown; use one of {', '.join(COST_SCOPES)}")
    if scope == "stage":
        return costs
    if costs.num_positions is not None:
        raise CostError("--cost-scope rank applies to --costs; a profile is measured per stage already, "
                        "drop --cost-scope or calibrate with the schedule's stage count")
    factor = schedule.num_ranks / len(schedule.pipelines[0])
    return replace(
        costs,
        **{key: tuple(v * factor for v in getattr(costs, key)) for key in _OP_KEYS},
        source=f"{costs.source} (per rank share x {factor:g} per chunk)",
    )


def _op(costs: CostModel, kind: ActionType, pos: int) -> float:
    if kind is ActionType.F:
        return costs.F[pos]
    if kind is ActionType.B:
        return costs.B[pos]
    if kind is ActionType.I:
        return costs.I[pos]
    if kind is ActionType.W:
        return costs.W[pos]
    return 0.0


def _overlap_ratio(costs: CostModel, pos: int) -> float:
    total = costs.F[pos] + costs.B[pos]
    return costs.FB[pos] / total if total > 0 else 1.0


def parse_costs(text: str | None) -> CostModel:
    """Parse ``--costs "F=1,B=2,I=1,W=1,FB=2.5,comm=0.1"`` (any subset; see the contract for defaults)."""
    if text is None or not text.strip():
        return CostModel(source="default")
    canonical = {k.lower(): k for k in COST_KEYS}
    given: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise CostError(f"--costs item {item!r} has no '='; write KEY=VALUE pairs, e.g. \"F=1,B=2,comm=0.1\"")
        raw_key, raw_value = (part.strip() for part in item.split("=", 1))
        key = canonical.get(raw_key.lower())
        if key is None:
            raise CostError(f"--costs key {raw_key!r} is unknown; use one of {', '.join(COST_KEYS)}")
        if key in given:
            raise CostError(f"--costs key {key} is given twice; give each key once")
        try:
            value = float(raw_value)
        except ValueError:
            raise CostError(f"--costs {key}={raw_value!r} is not a number; write e.g. {key}=1.5") from None
        if not math.isfinite(value) or value < 0:
            raise CostError(f"--costs {key}={raw_value} must be a finite number >= 0; write e.g. {key}=1.5")
        given[key] = value
    f = given.get("F", _DEFAULT_F)
    i, w = given.get("I"), given.get("W")
    if "B" in given:
        b = given["B"]
    elif i is not None and w is not None:
        b = i + w
    else:
        b = _DEFAULT_B
    if i is None and w is None:
        i = w = b / 2
    elif i is None:
        assert w is not None
        i = b - w
    elif w is None:
        w = b - i
    if i < 0 or w < 0:
        raise CostError(f"--costs I={i:g}, W={w:g}: with B={b:g} the missing part of B = I + W would be negative; "
                        "give B, I and W consistently")
    fb = given.get("FB", f + b)
    return CostModel(
        F=(f,), B=(b,), I=(i,), W=(w,), FB=(fb,), comm=given.get("comm", 0.0), unit="unit", source=text.strip()
    )


def load_costs(costs: str | None = None, profile: str | Path | None = None) -> CostModel:
    """The one entry the CLI uses: a cost string, or a profile file, or the defaults."""
    if costs is not None and profile is not None:
        raise CostError("--costs and --profile both given: a profile replaces the cost string; pass only one")
    if profile is None:
        return parse_costs(costs)
    from ppsim.profile import load_profile  # only profile users pay for the schema module

    path = Path(profile)
    data = load_profile(path)
    return CostModel.from_profile(data, source=str(path))


def _get(entry: Any, key: str, source: str, kind: type) -> Any:
    if not isinstance(entry, Mapping) or key not in entry:
        raise CostError(f"profile {source}: a stage entry lacks {key!r}; re-run `ppsim calibrate`")
    value = entry[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CostError(f"profile {source}: {key}={value!r} must be an integer >= 0; re-run `ppsim calibrate`")
        return value
    return _number(value, f"profile {source}: {key}")


def _stat_median(entry: Any, key: str, source: str) -> float:
    stat = entry.get(key) if isinstance(entry, Mapping) else None
    if isinstance(stat, Mapping):
        stat = stat.get("median")
    if stat is None:
        raise CostError(f"profile {source}: a stage entry lacks {key}.median; re-run `ppsim calibrate`")
    return _number(stat, f"profile {source}: {key}.median")


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CostError(f"{what} is {value!r}; it must be a finite number >= 0 (re-run `ppsim calibrate`)")
    return float(value)
