"""The simulation result: what viz, report, export and run read (and nothing else).

The simulator hands over flat numpy arrays (:class:`Trace`); per-action tuples and pandas frames are built lazily on
first use, so simulating a million actions does not pay for a million-row DataFrame nobody asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ppsim.costs import StageCosts
from ppsim.ir import Schedule
from ppsim.step.kinds import ALL_KINDS

if TYPE_CHECKING:
    import pandas

#: Computation codes used in :class:`Trace` arrays (index = code).
COMP_TYPES = ("F", "B", "I", "W")


@dataclass(frozen=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    bubble_ratio: float
    peak_activations: int | float
    """Activations held at once; a fraction only with recomputation (a recomputed one keeps its boundary)."""
    peak_memory_bytes: int | None
    over_memory_cap: bool


@dataclass(frozen=True)
class CollectiveTotals:
    """One kind of collective over a simulated step (``simulate --json``'s ``collectives``): how many were issued,
    their time, and the part of it a compute stream waited on (``total_s - exposed_s`` ran hidden behind compute).
    Times in the step's cost unit (seconds with a profile)."""

    count: int
    total_s: float
    exposed_s: float
    placement: tuple[GroupPlacement, ...] = ()
    """Where this kind's groups sit (one entry per dimension issuing it), when the step was placed on a cluster."""

    def __add__(self, other: CollectiveTotals) -> CollectiveTotals:
        merged = {p.group: p for p in self.placement}
        for p in other.placement:
            merged[p.group] = p if p.group not in merged else replace(p, count=merged[p.group].count + p.count)
        return CollectiveTotals(self.count + other.count, self.total_s + other.total_s,
                                self.exposed_s + other.exposed_s, tuple(merged.values()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count, "total_s": self.total_s, "exposed_s": self.exposed_s}
        if self.placement:
            out["placement"] = [p.to_dict() for p in self.placement]
        return out


@dataclass(frozen=True)
class GroupPlacement:
    """One dimension's group issuing a kind of collective: its ranks, the nodes they span, how many share a node,
    the algorithm its collective model chose, and how many it issued in the step."""

    group: str
    ranks: int
    nodes: int
    ranks_per_node: int
    algorithm: str
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "ranks": self.ranks, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "algorithm": self.algorithm, "count": self.count}


COLLECTIVE_KINDS: tuple[str, ...] = tuple(k.value for k in ALL_KINDS)
"""The kinds a step model can put in :attr:`SimResult.collectives` (:class:`ppsim.step.kinds.CollectiveKind`)."""


class CommSpan(NamedTuple):
    """The collectives one action holds (:attr:`SimResult.comm_spans`): their time, the part of it exposed (the
    compute waited on it: added to the action), and their kinds (:data:`COLLECTIVE_KINDS`)."""

    total: float
    exposed: float
    kinds: tuple[str, ...] = ()
    across: bool = False
    """Some of these collectives cross nodes (their group spans more than one node of the cluster)."""

    def plus(self, total: float, exposed: float, kind: str, across: bool = False) -> CommSpan:
        """This span with ``total`` more of ``kind``, ``exposed`` of it exposed (``across``: over the network)."""
        return CommSpan(self.total + total, self.exposed + exposed,
                        self.kinds if kind in self.kinds else (*self.kinds, kind), self.across or across)


@dataclass(frozen=True, eq=False)
class Trace:
    """Flat arrays of one simulation (internal; read through :class:`SimResult`).

    Actions are numbered rank by rank, in order (action ``offsets[r] + pos`` is ``schedule.actions[r][pos]``).
    Computations are single F/B/I/W; an overlapped pair contributes two, sharing the pair's start and end.
    Dependencies are the rank-crossing hand-offs plus any dependency the simulator had to wait on.
    """

    offsets: np.ndarray  # (R+1,) action index of each rank's first action
    start: np.ndarray  # (N,) float64
    end: np.ndarray  # (N,) float64
    act_delta: np.ndarray  # (N,) change of held activations when the action ends
    act_plus: np.ndarray  # (N,) positive part of act_delta (a pair: what its forward half adds)
    byte_delta: np.ndarray | None  # (N,) int64: change of activation bytes when the action ends
    byte_plus: np.ndarray | None
    static_bytes: tuple[int, ...]  # per rank
    # computations, ordered by (action, half)
    comp_owner: np.ndarray  # (C,) action index
    comp_stage: np.ndarray
    comp_type: np.ndarray  # code into COMP_TYPES
    comp_mb: np.ndarray
    pair_first: np.ndarray  # (pairs,) computation index of each overlapped pair's forward half
    pair_mid: np.ndarray  # (pairs,) when its forward half ends (the pair's start plus the forward share)
    # rank-crossing hand-offs, in parts of (producer computation, consumer computation, delay)
    xfer_parts: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    stage_out_bytes: np.ndarray  # per stage: bytes of the boundary tensor after it (NaN without a profile)
    stage_position: np.ndarray  # per stage: its position in its chain
    consumer_posting: bool = False  # hand-offs leave at max(producer end, end of the consumer's previous action)
    act_scale: int = 1  # act_delta/act_plus count activations in parts of this many (recomputation: millionths)
    comp_recomputed: np.ndarray | None = None  # (C,) bool: the computation's (stage, microbatch) is recomputed
    recompute_mid: np.ndarray | None = None  # (N,) when a recomputing single B/I has re-materialised (NaN: other)

    @cached_property
    def comp_half_start(self) -> np.ndarray:
        """(C,) start of each computation: its action's start; a pair's backward half starts at ``pair_mid``."""
        half_start = self.start[self.comp_owner]
        half_start[self.pair_first + 1] = self.pair_mid
        return half_start

    @cached_property
    def comp_half_end(self) -> np.ndarray:
        """(C,) end of each computation: its action's end; a pair's forward half ends at ``pair_mid``."""
        half_end = self.end[self.comp_owner]
        half_end[self.pair_first] = self.pair_mid
        return half_end

    @cached_property
    def transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(producer, consumer, send, arrive, bytes)`` of every rank-crossing hand-off, one row per consumer input.

        ``send`` is when the hand-off leaves: its producer's end, or with consumer posting the later of that and
        the end of the consumer rank's previous action."""

        if not self.xfer_parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0), np.zeros(0), np.zeros(0)
        prod, cons, delay = (np.concatenate(col) for col in zip(*self.xfer_parts))
        # the tensor crossing is the output of the upstream stage of the two (a gradient has the same size)
        ps, cs = self.comp_stage[prod], self.comp_stage[cons]
        upstream = np.where(self.stage_position[ps] < self.stage_position[cs], ps, cs)
        send = self.end[self.comp_owner[prod]]
        if self.consumer_posting:
            consumer = self.comp_owner[cons]
            previous = np.where(np.isin(consumer, self.offsets[:-1]), 0.0, self.end[np.maximum(consumer - 1, 0)])
            send = np.maximum(send, previous)
        return prod, cons, send, send + delay, self.stage_out_bytes[upstream]


@dataclass(frozen=True)
class SimResult:
    """A simulated step. Times are in the cost unit (seconds for profile costs)."""

    schedule: Schedule
    costs: StageCosts
    makespan: float
    bubble_ratio: float
    throughput: float
    """Microbatches per cost unit: ``num_microbatches / makespan``."""
    per_rank: tuple[RankStats, ...]
    memory_cap_bytes: int | None
    trace: Trace = field(repr=False, compare=False)
    recompute: frozenset[tuple[int, int]] = frozenset()
    """The (stage, microbatch) pairs simulated with activation recomputation (:mod:`ppsim.recompute`)."""
    collectives: Mapping[str, CollectiveTotals] | None = field(default=None, compare=False)
    """By kind (:data:`COLLECTIVE_KINDS`), the collectives the step model put in this step: EP's all-to-alls
    (:mod:`ppsim.step.ep`), FSDP's all-gathers and reduce-scatters (:mod:`ppsim.step.fsdp`); a kind only
    where its model applies, ``None`` where none does."""
    comm_spans: Mapping[tuple[int, int], CommSpan] | None = field(default=None, compare=False)
    """Per (rank, position) of an action holding collectives: their time, the part of it exposed (added to the
    action) and their kinds; the figures' communication lane (``viz/_data.py`` ``comm_lane``)."""

    @property
    def unit(self) -> str:
        return self.costs.unit

    @cached_property
    def starts(self) -> tuple[tuple[float, ...], ...]:
        """Start of each action, aligned with ``schedule.actions[rank][pos]``."""
        return self._per_rank(self.trace.start)

    @cached_property
    def ends(self) -> tuple[tuple[float, ...], ...]:
        """End of each action, aligned with ``schedule.actions[rank][pos]``."""
        return self._per_rank(self.trace.end)

    def with_memory(self, *, static_bytes: Sequence[int], byte_delta: np.ndarray, byte_plus: np.ndarray,
                    cap_bytes: int | None) -> SimResult:
        """This step with another count of its memory (a whole job's, :func:`ppsim.job.memory.with_job_memory`):
        ``static_bytes`` held per rank before its first action, and per action (rank by rank, in order) the change
        when it ends and its high point above what was held before it."""
        t = self.trace
        assert len(byte_delta) == len(byte_plus) == len(t.end), "one value per action"
        peaks = peaks_of(byte_delta, byte_plus, t.offsets)
        stats = tuple(replace(st, peak_memory_bytes=static_bytes[st.rank] + peaks[st.rank],
                              over_memory_cap=cap_bytes is not None
                              and static_bytes[st.rank] + peaks[st.rank] > cap_bytes) for st in self.per_rank)
        trace = replace(t, byte_delta=byte_delta, byte_plus=byte_plus, static_bytes=tuple(static_bytes))
        return replace(self, per_rank=stats, trace=trace, memory_cap_bytes=cap_bytes)

    def _per_rank(self, values: np.ndarray) -> tuple[tuple[float, ...], ...]:
        o = self.trace.offsets
        return tuple(tuple(values[o[r] : o[r + 1]].tolist()) for r in range(len(o) - 1))

    @cached_property
    def over_memory_cap(self) -> tuple[int, ...]:
        """Ranks whose peak memory exceeds ``memory_cap_bytes``."""
        return tuple(s.rank for s in self.per_rank if s.over_memory_cap)

    # -- frames -------------------------------------------------------------------------------------------------

    def timeline(self) -> pandas.DataFrame:
        """One row per single computation (a pair gives two rows), in rank / position order."""
        import pandas as pd

        t = self.trace
        owner = t.comp_owner
        rank = np.searchsorted(t.offsets, owner, side="right") - 1
        position = owner - t.offsets[rank]
        stage = t.comp_stage
        chunk_of, direction_of = stage_tables(self.schedule)
        types = np.asarray(COMP_TYPES, dtype=object)[t.comp_type]
        is_pair = np.zeros(len(owner), dtype=bool)
        if len(owner) > 1:
            same_as_next = owner[1:] == owner[:-1]
            is_pair[1:] |= same_as_next
            is_pair[:-1] |= same_as_next
        single_names = _names(stage, t.comp_type, t.comp_mb)
        action = single_names.astype(object)
        if is_pair.any():
            for i in np.flatnonzero(is_pair):
                r = int(rank[i])
                action[i] = str(self.schedule.actions[r][int(position[i])])
        return pd.DataFrame(
            {
                "rank": rank,
                "position": position,
                "action": action,
                "stage": stage,
                "microbatch": t.comp_mb,
                "type": types,
                "start": t.start[owner],
                "end": t.end[owner],
                "chunk": chunk_of[stage],
                "direction": direction_of[stage],
                "pair": is_pair,
                "half_start": t.comp_half_start,
                "half_end": t.comp_half_end,
            }
        )

    def transfers(self) -> pandas.DataFrame:
        """Rank-crossing hand-offs: activations (kind "F") and gradients (kind "B"), one row per consumer input."""
        import pandas as pd

        t = self.trace
        prod, cons, send, arrive, nbytes = t.transfers
        p_owner, c_owner = t.comp_owner[prod], t.comp_owner[cons]
        src = np.searchsorted(t.offsets, p_owner, side="right") - 1
        dst = np.searchsorted(t.offsets, c_owner, side="right") - 1
        names = _names(t.comp_stage, t.comp_type, t.comp_mb)
        return pd.DataFrame(
            {
                "src_rank": src,
                "dst_rank": dst,
                "producer": names[prod].astype(object),
                "consumer": names[cons].astype(object),
                "kind": np.where(t.comp_type[prod] == 0, "F", "B").astype(object),
                "send": send,
                "arrive": arrive,
                "bytes": nbytes,
                "src_position": p_owner - t.offsets[src],
                "dst_position": c_owner - t.offsets[dst],
            }
        )

    def memory(self) -> pandas.DataFrame:
        """Held activations (count) and memory bytes per rank as a step function of time.

        Each row holds from its ``time`` until the rank's next row. The first row per rank is time 0 with only the
        static bytes; then a row wherever an action's end changes what is held. An overlapped pair adds a row at
        its forward half's end (its new activation held, the backward half's not yet freed). ``bytes`` is NaN
        without a profile.
        """
        import pandas as pd

        t = self.trace
        num_ranks = len(t.offsets) - 1
        lengths = np.diff(t.offsets)
        action_rank = np.repeat(np.arange(num_ranks), lengths)
        first_comp = np.searchsorted(t.comp_owner, np.arange(len(t.end)))
        mid_time = t.comp_half_end[np.minimum(first_comp, max(len(t.comp_owner) - 1, 0))] if len(t.comp_owner) \
            else np.zeros(len(t.end))
        if t.recompute_mid is not None:  # a recomputing single B/I peaks once its forward is recomputed
            mid_time = np.where(np.isnan(t.recompute_mid), mid_time, t.recompute_mid)

        def held(delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            after = np.cumsum(delta)
            base = np.concatenate(([0], after))[t.offsets[:-1]]
            after = after - np.repeat(base, lengths)
            return after - delta, after

        series = [(t.act_delta, t.act_plus)]
        if t.byte_delta is not None and t.byte_plus is not None:
            series.append((t.byte_delta, t.byte_plus))
        need_mid = np.zeros(len(t.end), dtype=bool)
        changed = np.zeros(len(t.end), dtype=bool)
        for delta, plus in series:
            need_mid |= (plus > 0) & (plus != delta)
            changed |= delta != 0
        changed |= need_mid
        mid = np.flatnonzero(need_mid)
        fin = np.flatnonzero(changed)
        columns: list[np.ndarray] = []
        for delta, plus in series:
            before, after = held(delta)
            columns.append(np.concatenate((np.zeros(num_ranks, dtype=np.int64), (before + plus)[mid], after[fin])))
        key = np.concatenate((3 * t.offsets[:-1], 3 * mid + 1, 3 * fin + 2))
        rank = np.concatenate((np.arange(num_ranks), action_rank[mid], action_rank[fin]))
        time = np.concatenate((np.zeros(num_ranks), mid_time[mid], t.end[fin]))
        order = np.lexsort((rank, key))
        rank = rank[order]
        acts = columns[0][order]
        if t.act_scale != 1:
            acts = acts / t.act_scale
        if len(series) > 1:
            mem = (columns[1][order] + np.asarray(t.static_bytes, dtype=np.int64)[rank]).astype(float)
        else:
            mem = np.full(len(order), np.nan)
        return pd.DataFrame({"rank": rank, "time": time[order], "activations": acts, "bytes": mem})

    def to_dict(self) -> dict[str, Any]:
        """The contract's ``simulate --json`` object."""
        return {
            **schedule_header(self.schedule),
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "per_rank": [
                {
                    "rank": st.rank,
                    "busy": st.busy,
                    "idle": st.idle,
                    "bubble_ratio": st.bubble_ratio,
                    "peak_activations": st.peak_activations,
                    "peak_memory_bytes": st.peak_memory_bytes,
                }
                for st in self.per_rank
            ],
            "costs": self.costs.to_dict(),
            **({"recompute": [list(p) for p in sorted(self.recompute)]} if self.recompute else {}),
            **({"collectives": {k: self.collectives[k].to_dict() for k in COLLECTIVE_KINDS if k in self.collectives}}
               if self.collectives else {}),
        }


def peaks_of(delta: np.ndarray, plus: np.ndarray, offsets: np.ndarray) -> list[int]:
    """Per rank: the most held at once, ``max(0, held before an action + its positive part)``."""
    held_after = np.cumsum(delta)
    high = held_after - delta + plus
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    peaks = np.zeros(len(lengths), dtype=np.int64)
    if len(nonempty):
        base = np.concatenate(([0], held_after))[offsets[:-1][nonempty]]
        peaks[nonempty] = np.maximum.reduceat(high, offsets[:-1][nonempty]) - base
    return np.maximum(peaks, 0).tolist()


def stage_tables(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Per stage: its chunk (index among its rank's stages) and its direction (chain index)."""

    chunk = np.zeros(max(schedule.num_stages, 1), dtype=np.int64)
    direction = np.zeros(max(schedule.num_stages, 1), dtype=np.int64)
    for r in range(schedule.num_ranks):
        for c, st in enumerate(schedule.stages_of(r)):
            chunk[st] = c
    for d, chain in enumerate(schedule.pipelines):
        for st in chain:
            direction[st] = d
    return chunk, direction


def _names(stage: np.ndarray, code: np.ndarray, mb: np.ndarray) -> np.ndarray:
    """Action strings (``2F0``) of single computations, vectorised."""

    letters = np.asarray(COMP_TYPES)[code]
    return np.char.add(np.char.add(stage.astype(str), letters), mb.astype(str))


def schedule_header(schedule: Schedule) -> dict[str, Any]:
    """The keys that open every JSON about one schedule (``simulate --json``, the run JSON)."""
    return {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "stages": schedule.num_stages,
        "stages_per_rank": schedule.num_stages_per_rank,
    }


def safe_ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else (0.0 if numerator == 0 else math.inf)
