"""The cost model: how long each computation takes and how long a hand-off between ranks travels.

Two types. :class:`CostSpec` is what the user gave: a cost string (``--costs "F=1,B=2,I=1,W=1,FB=3,comm=0"``, one
value for every stage, in an arbitrary unit), per-stage tables from a version-1 profile, or a per-block (version-2)
profile with its split. :class:`StageCosts` is what the simulator reads: per-stage costs (in seconds with a profile,
plus activation and parameter bytes and a p2p model ``alpha + bytes / beta``) for one schedule, made by one method,
:meth:`CostSpec.for_schedule`. A cost string parses straight to :class:`StageCosts` (:func:`parse_costs`): one
table that fits every chain.

Profile tables are indexed by a stage's *position in its chain* (``schedule.pipelines[d].index(stage)``), so the
second model copy of DualPipe (stage ``R + j``) uses the profile's stage ``j``.

A version-1 profile gives fixed per-stage tables. A version-2 profile gives per-block costs;
:meth:`CostSpec.for_schedule` composes the tables for a schedule's chain length: the chain is split as
:mod:`ppsim.split` says, a stage costs the sum of its blocks plus the profile's fixed ``stage_overhead``, and the
profile's ``runtime`` section sets ``compute_scale``, ``dispatch_s``, ``recv_posting`` and the hand-off latency.

An overlapped pair ``(sF m; tB n)OVERLAP_F_B`` takes ``(F[s] + X[t]) * r`` where ``X`` is the backward half's cost
(B or I) and ``r`` is the mean of the two stages' overlap ratios ``FB / (F + B)``. With one stage and a full B this is
exactly ``FB``; with uniform costs and a full B it is ``FB`` for every pair.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.errors import CostError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.limits import MAX_COST, MIN_COST  # noqa: F401  (the range of one op's time; re-exported)
from ppsim.split import SplitError, SplitSpec, check_split, format_split, resolve_split, stage_blocks

if TYPE_CHECKING:
    from ppsim.profile import Profile

COST_KEYS = ("F", "B", "I", "W", "FB", "comm", "recompute_act")
_OP_KEYS = ("F", "B", "I", "W", "FB")
_DEFAULT_F = 1.0
_DEFAULT_B = 2.0
ACTIVATION_PARTS = 1_000_000
"""Activation counts are kept in millionths of one activation when a recomputed one holds a fraction of it (its
boundary input), so sums and peaks stay exact integers."""
DEFAULT_RECOMPUTE_ACT = 0.1
"""Fraction of one activation a recomputed (stage, microbatch) keeps (its boundary input) with a cost string."""


@dataclass(frozen=True)
class StageCosts:
    """What the simulator reads: per-chain-position costs; a table of length 1 applies to every position (cost
    strings). Made for one schedule by :meth:`CostSpec.for_schedule` (or directly by :func:`parse_costs`).

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
    recompute_act: float = DEFAULT_RECOMPUTE_ACT
    """Cost strings: the fraction of one activation a recomputed (stage, microbatch) keeps after its F (its
    boundary input). With byte tables the boundary is the stage input's bytes instead (:meth:`recompute_kept`)."""
    # -- runtime overheads (calibrated by a probe run, stored in the profile's ``runtime`` section) ------------------
    compute_scale: float = 1.0
    """Every computation's op cost is multiplied by this (several ranks of one host computing at once)."""
    dispatch_s: float = 0.0
    """Added to every computation (an overlapped pair holds two): the runtime's gap between computations."""
    shared_scale: float = 1.0
    """While a host's local processes outnumber its cores, CPU work runs this much slower than its fair share
    (:func:`ppsim.step.sharing.shared_cores_step`; the profile's ``runtime.shared_scale``)."""
    outputs_held_to_backward: bool = False
    """Whether the runtime keeps each stage's forward output (``output_bytes``) from its F until its backward (B or I)
    besides what autograd saves: torch before 2.15 does (``PipelineStage.fwd_cache``); 2.15 drops it once the send
    completes, as a runtime without a pipeline stage does (the default)."""
    recv_posting: str = "early"
    """``"early"``: a cross-rank hand-off leaves when its producer ends. ``"consumer"``: it leaves at the later of the
    producer's end and the end of the consumer rank's previous action (torch's lowering posts the receive just before
    the computation that needs it, and gloo/NCCL transfer only once both sides are posted)."""
    split_counts: tuple[int, ...] | None = None
    """Layers per stage of tables composed from a per-block profile; ``None`` for version-1 / cost-string costs."""
    rank_links: Mapping[tuple[int, int], tuple[float, float | None]] | None = None
    """Hand-offs between these two PP ranks (the lower first) priced on their own link, ``(alpha, beta)`` (``beta``
    ``None``: a flat delay): the step model's pipeline pass (:mod:`ppsim.step.pipeline_comm`) for ranks on different
    nodes. Pairs not listed use ``p2p_alpha``/``p2p_beta`` (or ``comm``)."""

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_stage_table(cls, profile: Profile, *, source: str = "profile") -> StageCosts:
        """Fixed per-stage tables of a version-1 profile (already validated by its reader)."""
        return _from_stage_table(cls, profile, source)

    # -- lookups ------------------------------------------------------------------------------------------------

    @property
    def num_positions(self) -> int | None:
        """Chain length the tables describe; ``None`` for uniform costs (any length)."""
        return None if len(self.F) == 1 and self.activation_bytes is None else len(self.F)

    @property
    def has_memory(self) -> bool:
        """Whether byte sizes are known (tables from a profile)."""
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

    def duration(self, schedule: Schedule, action: Action, *, recomputed: bool = False) -> float:
        """Time of one action: a single computation, or an overlapped pair (see the module docstring), its op cost
        times ``compute_scale`` plus ``dispatch_s`` per computation (a pair holds two).

        ``recomputed``: the action's backward (a B or I, or a pair's backward half) belongs to a recomputed
        (stage, microbatch), so it runs that stage's forward again first: F is added to its op cost (no second
        dispatch: the recompute runs inside the backward call). F and W ignore it."""
        if action.type is ActionType.OVERLAP_F_B:
            f, b = action.sub_actions
            op = self.pair_duration(schedule, f.stage, b.stage, b.type)
            if recomputed:
                op += self.op_cost(schedule, b.stage, ActionType.F)
            return op * self.compute_scale + 2 * self.dispatch_s
        if not action.is_compute:
            return 0.0
        op = self.op_cost(schedule, action.stage, action.type)
        if recomputed and action.type in (ActionType.B, ActionType.I):
            op += self.op_cost(schedule, action.stage, ActionType.F)
        return op * self.compute_scale + self.dispatch_s

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

    def recompute_share(self, schedule: Schedule, f_stage: int, b_stage: int, b_kind: ActionType) -> float:
        """Forward share of a pair whose backward half is recomputed: the pair's forward part over its whole op
        cost (the recomputed forward is drawn with the backward half)."""
        op, share = self.pair_split(schedule, f_stage, b_stage, b_kind)
        total = op + self.op_cost(schedule, b_stage, ActionType.F)
        return op * share / total if total > 0 else share

    def recompute_kept(self, schedule: Schedule, stage: int) -> tuple[int, int]:
        """``(bytes, parts)`` a recomputed (stage, microbatch) keeps between its F and its backward: its boundary
        input. ``parts`` counts activations in :data:`ACTIVATION_PARTS` (one activation = that many).

        With byte tables: the stage input's bytes (the previous chain position's ``output_bytes``; the first
        position uses its own output size, the model's boundary tensor, as a bound for its input), at most the
        stage's activation bytes, and parts in the same proportion. With a cost string: no bytes and
        ``recompute_act`` of one activation."""
        held, _ = self.activation_of(schedule, stage)
        if self.output_bytes is None or self.activation_bytes is None:
            return 0, round(self.recompute_act * ACTIVATION_PARTS)
        pos = self.position(schedule, stage)
        kept = min(self.output_bytes[max(pos - 1, 0)], held)
        parts = ACTIVATION_PARTS if held <= 0 else (kept * ACTIVATION_PARTS + held // 2) // held
        return kept, parts

    def boundary_delay(self, schedule: Schedule, upstream_stage: int) -> float:
        """Cross-rank travel time of the tensor on the boundary after ``upstream_stage`` (activation or gradient)."""
        if self.p2p_alpha is None or self.p2p_beta is None:
            return self.comm
        assert self.output_bytes is not None
        return self.p2p_alpha + self.output_bytes[self.position(schedule, upstream_stage)] / self.p2p_beta

    def comm_delay(self, schedule: Schedule, producer_stage: int, consumer_stage: int) -> float:
        """Delay from the producer's end to the consumer's earliest start (0 on the same rank)."""
        ranks = schedule.stage_to_rank[producer_stage], schedule.stage_to_rank[consumer_stage]
        if ranks[0] == ranks[1]:
            return 0.0
        upstream = producer_stage
        if schedule.direction(consumer_stage) == schedule.direction(producer_stage) and schedule.position(
            consumer_stage
        ) < schedule.position(producer_stage):
            upstream = consumer_stage
        link = None if self.rank_links is None else self.rank_links.get((min(ranks), max(ranks)))
        if link is not None:
            alpha, beta = link
            if beta is None or self.output_bytes is None:
                return alpha
            return alpha + self.output_bytes[self.position(schedule, upstream)] / beta
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
        if self.split_counts is not None:
            out["split"] = list(self.split_counts)
        for key in _OP_KEYS:
            out[key] = table(getattr(self, key))
        if self.p2p_alpha is None:
            out["comm"] = self.comm
        else:
            out["p2p"] = {"alpha_s": self.p2p_alpha, "beta_bytes_per_s": self.p2p_beta}
        if self.activation_bytes is None and self.recompute_act != DEFAULT_RECOMPUTE_ACT:
            out["recompute_act"] = self.recompute_act
        if self.activation_bytes is not None:
            out["output_bytes"] = list(self.output_bytes or ())
            out["activation_bytes"] = list(self.activation_bytes)
            out["activation_bytes_freed_by_I"] = list(self.activation_bytes_freed_by_I or ())
            out["static_bytes"] = list(self.static_bytes or ())
        if self.compute_scale != 1.0 or self.dispatch_s != 0.0 or self.recv_posting != "early":
            out["runtime"] = {"compute_scale": self.compute_scale, "dispatch_s": self.dispatch_s,
                              "recv_posting": self.recv_posting}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


COST_SCOPES = ("stage", "rank")


@dataclass(frozen=True)
class CostSpec:
    """What the user gave: one of ``tables`` (uniform costs from a cost string, or a version-1 profile's fixed
    per-stage tables) or ``profile`` (a version-2 per-block profile, cut into stages by ``split``).

    :meth:`for_schedule` is the one way to the simulator's :class:`StageCosts`.
    """

    tables: StageCosts | None = None
    profile: Profile | None = None
    split: SplitSpec = SplitSpec()
    source: str = "default"
    notes: tuple[str, ...] = ()
    """Notes on a per-block profile, carried into every schedule's composed costs."""

    def __post_init__(self) -> None:
        assert (self.tables is None) != (self.profile is None), "give exactly one of tables and profile"

    @classmethod
    def uniform(cls, tables: StageCosts) -> CostSpec:
        """Costs that are already the simulator's (a cost string, say): every schedule they fit reads them as is."""
        return cls(tables=tables, source=tables.source)

    @classmethod
    def from_profile(cls, profile: Profile | Mapping[str, Any], *, source: str = "profile",
                     split: SplitSpec | None = None) -> CostSpec:
        """Costs from a parsed profile (:class:`ppsim.profile.Profile`, not validated again); a mapping in the
        profile JSON schema is first read by :meth:`Profile.from_dict` (the one schema reader).

        A version-1 profile gives fixed per-stage tables; a version-2 profile gives costs that :meth:`for_schedule`
        composes for each schedule (``split`` says how, torchtitan's default spread when ``None``).
        """
        from ppsim.profile import Profile

        if not isinstance(profile, Profile):
            profile = Profile.from_dict(profile, source=source)
        spec = split or SplitSpec()
        if profile.blocks is not None:
            if spec.split is not None:
                check_split(spec.split, profile.num_layers)
            notes = [] if profile.p2p is not None or _runtime_handoff(profile) is not None else [
                "profile has no p2p measurement: cross-rank hand-offs cost 0"]
            return cls(profile=profile, split=spec, source=source, notes=tuple(notes))
        if not spec.is_default:
            raise SplitError(
                f"profile {source} is version 1 (measured for {profile.num_stages} fixed stages): "
                f"{spec.describe()} needs a per-block profile; re-run `ppsim calibrate` with this ppsim"
            )
        return cls.uniform(StageCosts.from_stage_table(profile, source=source))

    def with_split(self, split: SplitSpec) -> CostSpec:
        """These per-block costs cut into stages by ``split`` instead (a torchtitan job's own split, say); checked
        as :meth:`from_profile` checks one. Costs that are not a per-block profile cannot be split again."""
        if self.profile is None:
            raise SplitError(f"costs {self.source}: {split.describe()} needs a per-block profile; pass --profile")
        if split.split is not None:
            check_split(split.split, self.profile.num_layers)
        return replace(self, split=split)

    @property
    def is_uniform(self) -> bool:
        """Costs from a ``--costs`` string (the same for every stage), not a profile (per stage, or per block)."""
        return self.tables is not None and self.tables.num_positions is None

    @property
    def has_memory(self) -> bool:
        """Whether byte sizes are known: per-stage tables, or a per-block profile (composed per schedule)."""
        return self.profile is not None or (self.tables is not None and self.tables.has_memory)

    @property
    def unit(self) -> str:
        return "s" if self.tables is None else self.tables.unit

    def for_schedule(self, schedule: Schedule, *, scope: str = "stage") -> StageCosts:
        """The costs to simulate ``schedule`` with, reading a cost string at ``scope``; raises :class:`CostError`
        (or :class:`SplitError`) when they cannot fit it.

        ``"stage"`` (the default, as in the DualPipe figures): each op on one stage chunk costs the given time.
        ``"rank"``: the times are one rank's share of one model copy (Megatron's "per full stage"), so a chunk of a
        chain of ``S`` stages on ``R`` ranks costs ``R / S`` of them; schedules that cut the model into different
        numbers of stages (1F1B vs Interleaved1F1B vs DualPipeV) then run the same model and compare fairly.
        A per-block profile is composed for the schedule's chain length (:func:`_compose`).
        """
        if scope not in COST_SCOPES:
            raise CostError(f"--cost-scope {scope!r} is unknown; use one of {', '.join(COST_SCOPES)}")
        if self.tables is None:
            if scope == "rank":
                raise CostError("--cost-scope rank applies to --costs; a per-block profile composes each schedule's "
                                "stages from the same model already, drop --cost-scope")
            return _compose(self, schedule)
        costs = self.tables
        if scope == "rank":
            costs = _rank_share(costs, schedule)
        costs.check(schedule)
        return costs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description: the tables' (:meth:`StageCosts.to_dict`), or a per-block profile's medians."""
        return _blocks_dict(self) if self.tables is None else self.tables.to_dict()


def as_spec(costs: CostSpec | StageCosts | None) -> CostSpec:
    """What a public entry point was given, as a spec: ``None`` is the default costs, tables are used as they are."""
    if costs is None:
        return CostSpec.uniform(StageCosts())
    return costs if isinstance(costs, CostSpec) else CostSpec.uniform(costs)


def _rank_share(costs: StageCosts, schedule: Schedule) -> StageCosts:
    """A cost string read as one rank's share of one model copy (``--cost-scope rank``)."""
    if costs.num_positions is not None:
        raise CostError("--cost-scope rank applies to --costs; a profile is measured per stage already, "
                        "drop --cost-scope or calibrate with the schedule's stage count")
    factor = schedule.num_ranks / len(schedule.pipelines[0])

    def scaled(table: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * factor for v in table)

    return replace(
        costs,
        F=scaled(costs.F), B=scaled(costs.B), I=scaled(costs.I), W=scaled(costs.W), FB=scaled(costs.FB),
        source=f"{costs.source} (per rank share x {factor:g} per chunk)",
    )


def _op(costs: StageCosts, kind: ActionType, pos: int) -> float:
    if kind is ActionType.F:
        return costs.F[pos]
    if kind is ActionType.B:
        return costs.B[pos]
    if kind is ActionType.I:
        return costs.I[pos]
    if kind is ActionType.W:
        return costs.W[pos]
    return 0.0


def _overlap_ratio(costs: StageCosts, pos: int) -> float:
    total = costs.F[pos] + costs.B[pos]
    return costs.FB[pos] / total if total > 0 else 1.0


def parse_costs(text: str | None) -> StageCosts:
    """Parse ``--costs "F=1,B=2,I=1,W=1,FB=2.5,comm=0.1"`` (any subset; see the contract for defaults): uniform costs,
    the simulator's type already (they fit every chain)."""
    if text is None:
        return StageCosts(source="default")
    if not text.strip():  # an unset shell variable, most likely: say so rather than use the defaults silently
        raise CostError(f"--costs {text!r}: give KEY=VALUE pairs, e.g. \"F=1,B=2,comm=0.1\"; drop --costs for the "
                        "defaults (F=1, B=2, I=W=1)")
    canonical = {k.lower(): k for k in COST_KEYS}
    given: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise CostError(f"--costs item {item[:40]!r} has no '='; write KEY=VALUE pairs, e.g. \"F=1,B=2,comm=0.1\"")
        raw_key, raw_value = (part.strip() for part in item.split("=", 1))
        key = canonical.get(raw_key.lower())
        if key is None:
            raise CostError(f"--costs key {raw_key[:40]!r} is unknown; use one of {', '.join(COST_KEYS)}")
        if key in given:
            raise CostError(f"--costs key {key} is given twice; give each key once")
        try:
            if not raw_value.isascii() or "_" in raw_value:
                raise ValueError(raw_value)  # float() also reads Arabic-Indic digits and 1_000
            value = float(raw_value)
        except ValueError:
            raise CostError(f"--costs {key}={raw_value[:40]!r} is not a number; write e.g. {key}=1.5") from None
        if not math.isfinite(value) or value < 0:
            raise CostError(f"--costs {key}={raw_value[:40]} must be a finite number >= 0; write e.g. {key}=1.5")
        if value > MAX_COST:
            raise CostError(
                f"--costs {key}={raw_value[:40]} is above the limit of {MAX_COST:g} per op (sums of such times over a "
                "step lose precision or overflow); express the times in a larger unit (e.g. ms instead of ns)"
            )
        if 0 < value < MIN_COST:
            raise CostError(
                f"--costs {key}={raw_value[:40]} is below the limit of {MIN_COST:g} per op (such times lose precision "
                "when added up); express the times in a smaller unit (e.g. ns instead of s), or write 0"
            )
        if key == "recompute_act" and value > 1:
            raise CostError(f"--costs recompute_act={raw_value[:40]} is a fraction of one activation (what a "
                            "recomputed stage keeps: its boundary input); give a value in 0..1, e.g. recompute_act=0.1")
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
    if max(f, b, i, w, fb) == 0:
        raise CostError(f"--costs {text.strip()[:60]!r}: every op takes 0, so the makespan and bubble would be "
                        "meaningless; give the ops positive times, e.g. F=1,B=2")
    return StageCosts(
        F=(f,), B=(b,), I=(i,), W=(w,), FB=(fb,), comm=given.get("comm", 0.0), unit="unit", source=text.strip(),
        recompute_act=given.get("recompute_act", DEFAULT_RECOMPUTE_ACT),
    )


def load_costs(costs: str | None = None, profile: str | Path | None = None, *,
               split: SplitSpec | Sequence[int] | str | None = None, layers_per_stage: int | None = None) -> CostSpec:
    """The one entry every command uses: a cost string, or a profile file, or the defaults.

    ``split`` (counts per stage, ``"3,4,4,3"`` or a :class:`SplitSpec`) and ``layers_per_stage`` choose how a
    per-block (version 2) profile is cut into stages; :meth:`CostSpec.for_schedule` then composes the tables per
    schedule.
    """
    from ppsim.split import parse_split

    if costs is not None and profile is not None:
        raise CostError("--costs and --profile both given: a profile replaces the cost string; pass only one")
    if isinstance(split, SplitSpec):
        if layers_per_stage is not None:
            raise SplitError("give layers_per_stage inside the SplitSpec, not beside it")
        spec = split
    else:
        counts = parse_split(split) if isinstance(split, str) else None if split is None else tuple(split)
        spec = SplitSpec(split=counts, layers_per_stage=layers_per_stage)
    if profile is None:
        if not spec.is_default:
            option = "--split" if spec.split is not None else "--layers-per-stage"
            raise SplitError(f"{option} needs a per-block profile (--profile FILE.json from `ppsim calibrate`); "
                             "--costs give every stage the same cost whatever its layers")
        return CostSpec.uniform(parse_costs(costs))
    from ppsim.profile import load_profile  # only profile users pay for the schema module

    path = Path(profile)
    return CostSpec.from_profile(load_profile(path), source=str(path), split=spec)


def _compose(spec: CostSpec, schedule: Schedule) -> StageCosts:
    """Tables for ``schedule`` from a per-block profile: split the chain, sum each stage's blocks, add the fixed
    stage overhead (:func:`_stage_tables`), apply the runtime overheads (:func:`_runtime_terms`)."""
    profile = spec.profile
    assert profile is not None
    if profile.activation_checkpoint != "none" and any(
            c.type is ActionType.W for row in schedule.actions for a in row for c in a.computations):
        raise CostError(f"profile {spec.source}: measured under activation_checkpoint {profile.activation_checkpoint}, "
                        f"whose backward is timed whole (B; I and W not measured: torch reruns a checkpointed region "
                        f"for each backward), and {schedule.name} splits it into I and W; use a schedule with whole "
                        "backwards (1F1B, Interleaved1F1B, GPipe) or a profile calibrated without "
                        "--activation-checkpoint")
    num_stages = len(schedule.pipelines[0])
    counts = resolve_split(spec.split, profile.num_layers, num_stages,
                           schedule=f"{schedule.name} with {schedule.num_ranks} ranks")
    tables, sizes = _stage_tables(profile, counts)
    notes = list(spec.notes)
    notes.append(f"{num_stages} stages composed from blocks: {spec.split.describe()} -> layers per stage "
                 f"{format_split(counts)}")
    check = _against_measured_stages(profile, counts, tables)
    if check:
        notes.append(check)
    runtime = _runtime_terms(profile, schedule, notes)
    return StageCosts(
        F=tuple(tables["F"]), B=tuple(tables["B"]), I=tuple(tables["I"]), W=tuple(tables["W"]),
        FB=tuple(tables["FB"]),
        output_bytes=tuple(sizes["output_bytes"]), activation_bytes=tuple(sizes["activation_bytes"]),
        activation_bytes_freed_by_I=tuple(sizes["activation_bytes_freed_by_I"]),
        static_bytes=tuple(sizes["static_bytes"]),
        **runtime,
        unit="s", source=spec.source, split_counts=counts, notes=tuple(notes),
    )


def _stage_tables(profile: Profile, counts: tuple[int, ...]) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Per stage of the split ``counts``: op times (blocks' medians plus the stage overhead) and byte sizes."""
    blocks = profile.blocks
    assert blocks is not None and profile.stage_overhead is not None
    overhead = {op: _median(getattr(profile.stage_overhead, op)) for op in _OP_KEYS}
    tables: dict[str, list[float]] = {op: [] for op in _OP_KEYS}
    sizes: dict[str, list[int]] = {key: [] for key in (
        "output_bytes", "activation_bytes", "activation_bytes_freed_by_I", "static_bytes")}
    for s, names in enumerate(stage_blocks(profile.layout, counts)):
        members = [blocks[n] for n in names]
        op = {key: sum(_median(getattr(b, key)) for b in members) + overhead[key] for key in _OP_KEYS}
        freed_by_i = sum(b.activation_bytes_freed_by_I or 0 for b in members)
        if s == 0:
            # torch's runtime: stage 0's input (token ids) needs no gradient, so I runs nothing there and W runs
            # the whole backward; nothing is released at I.
            op["I"] = _median(blocks[names[0]].I) + overhead["I"]
            op["W"] = op["B"]
            freed_by_i = 0
        for key in _OP_KEYS:
            tables[key].append(op[key])
        sizes["activation_bytes"].append(sum(b.activation_bytes or 0 for b in members))
        sizes["activation_bytes_freed_by_I"].append(freed_by_i)
        sizes["static_bytes"].append(sum(b.param_bytes + b.grad_bytes + b.optimizer_bytes for b in members))
        sizes["output_bytes"].append(members[-1].output_bytes)
    return tables, sizes


def _runtime_terms(profile: Profile, schedule: Schedule, notes: list[str]) -> dict[str, Any]:
    """The p2p model and the runtime overheads for ``schedule``'s rank count, as :class:`StageCosts` fields; what
    was chosen and why is appended to ``notes``."""
    alpha = beta = None
    comm = 0.0
    if profile.p2p is not None:
        alpha, beta = profile.p2p.alpha_s, profile.p2p.beta_bytes_per_s
    handoff = _runtime_handoff(profile)
    runtime = profile.runtime
    scale, dispatch, posting = 1.0, 0.0, "early"
    if runtime is None:
        notes.append("profile has no runtime overheads (no probe run): compute_scale 1, no dispatch cost, "
                     "hand-offs at the p2p fit")
    else:
        scale, how = pick_compute_scale(runtime.compute_scale, schedule.num_ranks)
        notes.append(f"compute_scale {scale:.4g} for {schedule.num_ranks} ranks computing at once ({how})")
        dispatch, posting = runtime.dispatch_s, runtime.recv_posting
        if handoff is not None:
            if alpha is not None:
                notes.append(f"hand-off latency {handoff:.3g} s from the probe run replaces the p2p alpha "
                             f"{alpha:.3g} s (bandwidth kept)")
                alpha = handoff
            else:
                notes.append(f"hand-off latency {handoff:.3g} s from the probe run (no p2p fit: no size term)")
                comm = handoff
    shared = 1.0 if runtime is None or runtime.shared_scale is None else runtime.shared_scale
    return {"comm": comm, "p2p_alpha": alpha, "p2p_beta": beta, "compute_scale": scale, "dispatch_s": dispatch,
            "recv_posting": posting, "shared_scale": shared}


def _against_measured_stages(profile: Profile, counts: tuple[int, ...], tables: Mapping[str, list[float]]) -> str:
    """A note comparing the composed F and B with whole stages the profile measured for the same split, if any."""
    measured = profile.stages
    if len(measured) != len(counts) or any(st.F is None or st.B is None for st in measured):
        return ""
    if tuple(st.layers[1] - st.layers[0] for st in measured) != counts:
        return ""
    worst = 0.0
    for op in ("F", "B"):
        for s, st in enumerate(measured):
            value = _median(getattr(st, op))
            if value > 0:
                worst = max(worst, abs(tables[op][s] - value) / value)
    return f"composed F and B are within {worst:.1%} of the stages measured whole for this split"


def pick_compute_scale(table: Mapping[int, float], num_ranks: int) -> tuple[float, str]:
    """The slowdown for ``num_ranks`` ranks computing at once, and how it was found.

    A measured entry is used as is. Between two measured counts the factor is interpolated linearly; beyond the
    largest it stays at the largest count's factor (the brief's ``min(num_ranks, measured)``); below the smallest
    it takes the smallest count's factor (never less than measured: conservative).
    """
    if num_ranks in table:
        return table[num_ranks], "measured"
    keys = sorted(table)
    if num_ranks > keys[-1]:
        return table[keys[-1]], f"not measured: the largest measured count ({keys[-1]} ranks) is used"
    if num_ranks < keys[0]:
        return table[keys[0]], f"not measured: the smallest measured count ({keys[0]} ranks) is used"
    lo = max(k for k in keys if k < num_ranks)
    hi = min(k for k in keys if k > num_ranks)
    value = table[lo] + (table[hi] - table[lo]) * (num_ranks - lo) / (hi - lo)
    return value, f"not measured: interpolated between {lo} and {hi} ranks"


def _runtime_handoff(profile: Profile) -> float | None:
    return None if profile.runtime is None else profile.runtime.handoff_s


def _median(stat: Any) -> float:
    return 0.0 if stat is None else float(stat.median)


def _from_stage_table(cls: type[StageCosts], profile: Profile, source: str) -> StageCosts:
    """Fixed per-stage tables of a version-1 profile (already validated by its reader)."""
    stages = profile.stages
    if not stages:
        raise CostError(f"profile {source}: no stages; re-run `ppsim calibrate`")
    if any(st.activation_bytes is None or st.activation_bytes_freed_by_I is None for st in stages):
        raise CostError(f"profile {source}: some stages are not measured; "
                        f"finish it with `ppsim calibrate --resume -o {source}`")

    def ops(key: str) -> tuple[float, ...]:
        return tuple(_median(getattr(st, key)) for st in stages)

    notes: list[str] = []
    alpha = beta = None
    if profile.p2p is None:
        notes.append("profile has no p2p measurement: cross-rank hand-offs cost 0")
    else:
        alpha, beta = profile.p2p.alpha_s, profile.p2p.beta_bytes_per_s
    return cls(
        F=ops("F"), B=ops("B"), I=ops("I"), W=ops("W"), FB=ops("FB"),
        comm=0.0,
        p2p_alpha=alpha,
        p2p_beta=beta,
        output_bytes=tuple(st.output_bytes for st in stages),
        activation_bytes=tuple(st.activation_bytes or 0 for st in stages),
        activation_bytes_freed_by_I=tuple(st.activation_bytes_freed_by_I or 0 for st in stages),
        static_bytes=tuple(st.param_bytes + st.grad_bytes + st.optimizer_bytes for st in stages),
        unit="s",
        source=source,
        notes=tuple(notes),
    )


def _blocks_dict(costs: CostSpec) -> dict[str, Any]:
    """What a per-block spec holds: per-block medians, the overhead and the split rule."""
    profile = costs.profile
    assert profile is not None and profile.blocks is not None
    out: dict[str, Any] = {"unit": costs.unit, "source": costs.source, "split": costs.split.describe()}
    for key in _OP_KEYS:
        out[key] = {name: _median(getattr(b, key)) for name, b in profile.blocks.items()}
        if profile.stage_overhead is not None:
            out[key]["stage_overhead"] = _median(getattr(profile.stage_overhead, key))
    if profile.p2p is not None:
        out["p2p"] = {"alpha_s": profile.p2p.alpha_s, "beta_bytes_per_s": profile.p2p.beta_bytes_per_s}
    if profile.runtime is not None:
        rt = profile.runtime
        out["runtime"] = {
            **{f"compute_scale[{k}]": v for k, v in sorted(rt.compute_scale.items())},
            "dispatch_s": rt.dispatch_s, "handoff_s": rt.handoff_s, "recv_posting": rt.recv_posting,
        }
    if costs.notes:
        out["notes"] = list(costs.notes)
    return out
