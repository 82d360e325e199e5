"""A timed step: the schedule the simulator replays (with the communication actions the passes lowered into it),
the seconds its collectives add to actions, what each kind totals, and what was assumed. This module imports no
torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ppsim.ir import Schedule
from ppsim.result import CollectiveTotals, CommSpan


@dataclass(frozen=True)
class Step:
    """The schedule to simulate (with ``UNSHARD`` / ``REDUCE_GRAD`` actions where they block) and the seconds
    added at (rank, position) of it (:func:`ppsim.simulator.simulate`'s ``extra_s``), with what was assumed."""

    schedule: Schedule
    extra_s: Mapping[tuple[int, int], float]
    notes: tuple[str, ...] = ()
    shared: tuple[int, int] | None = None
    """``(processes per PP rank, cores)`` when the ranks run as local processes sharing one host's cores
    (``ppsim run`` on CPU): the step is simulated with processor sharing
    (:func:`ppsim.step.sharing.shared_cores_step`)."""
    shared_scale: float = 1.0
    """With :attr:`shared`: the time-sharing slowdown beyond the fair share (the profile's ``runtime.shared_scale``,
    measured by calibration's FSDP probe; 1 where it measured none)."""
    collectives: Mapping[str, CollectiveTotals] = dataclasses.field(default_factory=dict)
    """By kind (:class:`ppsim.step.kinds.CollectiveKind` values), the collectives the passes placed (count, time,
    the part in ``extra_s``, their placement); the result carries them (:attr:`ppsim.result.SimResult.collectives`)."""
    comm_spans: Mapping[tuple[int, int], CommSpan] = dataclasses.field(default_factory=dict)
    """Per (rank, position): the collectives' time in that action, the part of it exposed (in ``extra_s``) and their
    kinds, for the figures' communication lane (:attr:`ppsim.result.SimResult.comm_spans`)."""
    links: Any = None
    """A :class:`ppsim.step.sharing.NodeLinks` where PP ranks share nodes whose NICs their cross-node collectives
    contend for (the passes set it from the placement); ``None``: each collective has its links to itself."""
    costs: Any = None
    """The :class:`ppsim.costs.StageCosts` to simulate with when a pass changed them (the pipeline hand-offs priced
    on their links); ``None``: the caller's."""

    def simulate(self, simulate_with: Any) -> Any:
        """The step: ``simulate_with(extra_s)`` (a :class:`~ppsim.result.SimResult`), with the cores shared when
        :attr:`shared` says so, and :attr:`collectives` on it."""
        if self.shared is None and self.links is None:
            result = simulate_with(self.extra_s)
        else:
            from ppsim.step.sharing import COLLECTIVES, shared_cores_step

            per_rank, cores = self.shared or (1, 0)
            acts = self.schedule.actions
            on_link = frozenset(k for k, span in self.comm_spans.items()
                                if span.across and acts[k[0]][k[1]].type in COLLECTIVES)
            result = shared_cores_step(self.schedule, simulate_with, per_rank=per_rank, cores=cores,
                                       extra_s=self.extra_s, scale=self.shared_scale, on_link=on_link,
                                       links=self.links)[0]
        if not self.collectives:
            return result
        return dataclasses.replace(result, collectives=dict(self.collectives), comm_spans=dict(self.comm_spans))

    def plus(self, *, extra_s: Mapping[tuple[int, int], float] | None = None, note: str | None = None,
             collectives: Mapping[str, CollectiveTotals] | None = None,
             comm_spans: Mapping[tuple[int, int], CommSpan] | None = None) -> Step:
        """This step with a pass's additions (its seconds, note, totals by kind and spans)."""
        return dataclasses.replace(
            self, extra_s=dict(extra_s) if extra_s is not None else self.extra_s,
            notes=(*self.notes, note) if note else self.notes,
            collectives={**self.collectives, **(collectives or {})},
            comm_spans=dict(comm_spans) if comm_spans is not None else self.comm_spans)
