"""The action IR: torch.distributed.pipelining's action grammar as frozen dataclasses.

An action string is ``[stage][type][microbatch]`` (``2F0``, ``1UNSHARD``, ``3SEND_F1``); an overlapped
forward/backward pair is ``(0F7;7B3)OVERLAP_F_B``. ``str(parse_action(s)) == s`` for every string torch writes.
The leading number is always the *global stage*, never the rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from ppsim.errors import ScheduleConfigError, ScheduleFormatError


class ActionType(str, Enum):
    """Kinds of actions, with torch's string values."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch's name: backward for input
    W = "W"
    OVERLAP_F_B = "OVERLAP_F_B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    # torch 2.15's lowering: a wait for an earlier send, and for a gradient reduction
    WAIT_SEND_F = "WAIT_SEND_F"
    WAIT_SEND_B = "WAIT_SEND_B"
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_TYPES


_TYPES = {t.value: t for t in ActionType}
COMPUTE_TYPES = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B})
BACKWARD_TYPES = frozenset({ActionType.B, ActionType.I})

# ASCII digits only: ``\d`` and ``str.isdigit`` also accept Arabic-Indic and other Unicode digits (``٠F٠``).
_ACTION_RE = re.compile(r"([0-9]+)(WAIT_REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|"
                        r"SEND_B|RECV_B|F|I|B|W)([0-9]*)", re.ASCII)
MAX_ID = 2**31 - 1
"""Largest stage or microbatch id an action string may carry (torch stores them as C ints)."""
_MAX_ID_DIGITS = len(str(MAX_ID))
_PAIR_RE = re.compile(r"\(([^()]*)\)(OVERLAP_F_B)")


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of a rank's order.

    ``stage`` is the global stage index; ``microbatch`` is ``None`` for stage-wide actions (``UNSHARD``).
    An overlapped pair has type ``OVERLAP_F_B``, ``stage == -1`` (as in torch) and its two halves in
    ``sub_actions`` (forward first).
    """

    stage: int
    type: ActionType
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.sub_actions:
            return "(" + ";".join(str(a) for a in self.sub_actions) + ")" + self.type.value
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.type.value}{mb}"

    @property
    def is_compute(self) -> bool:
        return self.type in COMPUTE_TYPES

    @property
    def computations(self) -> tuple[Action, ...]:
        """The single computations this action performs: its halves for a pair, itself otherwise."""
        return self.sub_actions if self.sub_actions else (self,)


class _ActionMaker:
    """Builds an :class:`Action` at a quarter of the frozen dataclass's cost (schedule builders make millions).

    The frozen ``__init__`` fills each slot through ``object.__setattr__``; this class has the same slots, fills
    them by plain assignment, then turns the instance into an ``Action`` (an identical layout, so the assignment of
    ``__class__`` is allowed). The result is an ordinary, immutable ``Action``.
    """

    __slots__ = ("stage", "type", "microbatch", "sub_actions")

    def __init__(
        self, stage: int, type: ActionType, microbatch: int | None = None, sub_actions: tuple[Action, ...] = ()
    ) -> None:
        self.stage = stage
        self.type = type
        self.microbatch = microbatch
        self.sub_actions = sub_actions
        self.__class__ = Action  # type: ignore[assignment]


#: ``make_action(stage, type, microbatch)``: the same as ``Action(stage, type, microbatch)``, faster.
make_action: Callable[..., Action] = _ActionMaker  # type: ignore[assignment]
assert type(make_action(0, ActionType.F, 0)) is Action and make_action(0, ActionType.F, 0) == Action(0, ActionType.F, 0)


def overlap(forward: Action, backward: Action) -> Action:
    """An overlapped forward/backward pair, forward half first (torch's ``OVERLAP_F_B``)."""
    if forward.type is not ActionType.F or backward.type not in BACKWARD_TYPES:
        raise ScheduleFormatError(
            f"overlapped pair ({forward};{backward}) must be a forward then a backward (B or I); "
            "write it as (sF m;sB m)OVERLAP_F_B"
        )
    return make_action(-1, ActionType.OVERLAP_F_B, None, (forward, backward))


def parse_action(text: str) -> Action | None:
    """Parse one torch action string; ``None`` for an empty cell (an idle slot)."""
    s = text.strip()
    if not s:
        return None
    if s.startswith("("):
        m = _PAIR_RE.fullmatch(s)
        if m is None:
            raise ScheduleFormatError(
                f"malformed overlapped pair {_shown(s)}: expected (sFm;sBm)OVERLAP_F_B, e.g. (0F7;7B3)OVERLAP_F_B"
            )
        halves = [parse_action(part) for part in m.group(1).split(";")]
        if len(halves) != 2 or any(h is None for h in halves):
            raise ScheduleFormatError(
                f"overlapped pair {_shown(s)} must hold exactly two actions, e.g. (0F7;7B3)OVERLAP_F_B"
            )
        try:
            return overlap(halves[0], halves[1])  # type: ignore[arg-type]
        except ScheduleFormatError as exc:
            raise ScheduleFormatError(f"malformed overlapped pair {_shown(s)}: {exc}") from None
    m = _ACTION_RE.fullmatch(s)
    if m is None:
        ascii_note = "" if s.isascii() else " (it has non-ASCII characters: ids are ASCII digits 0-9)"
        raise ScheduleFormatError(
            f"malformed action {_shown(s)}{ascii_note}: expected [stage][type][microbatch] with type one of "
            "F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, WAIT_SEND_F, WAIT_SEND_B, UNSHARD, RESHARD, REDUCE_GRAD, "
            "WAIT_REDUCE_GRAD (e.g. 2F0)"
        )
    stage, kind, mb = m.groups()
    st = int(stage) if len(stage) < _MAX_ID_DIGITS else _id(stage, "stage", s)
    mbi = (int(mb) if len(mb) < _MAX_ID_DIGITS else _id(mb, "microbatch", s)) if mb else None
    return Action(st, _TYPES[kind], mbi)


def _shown(text: str, limit: int = 40) -> str:
    """``repr`` of a cell for a message, cut to ``limit`` characters (a cell can be megabytes long)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text):,} characters)"


def _id(digits: str, what: str, text: str) -> int:
    """An id from ASCII digits, refusing ones beyond :data:`MAX_ID` before converting (no 5,000-digit ints)."""
    if len(digits) > _MAX_ID_DIGITS or int(digits) > MAX_ID:
        shown = digits if len(digits) <= 20 else f"{digits[:12]}... ({len(digits)} digits)"
        raise ScheduleFormatError(
            f"action {_shown(text)}: {what} id {shown} exceeds the limit {MAX_ID:,}; ids count stages and "
            "microbatches from 0, so use small ids"
        )
    return int(digits)


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline schedule: the per-rank orders plus what is needed to interpret them.

    ``pipelines`` lists the stage chains data flows through, first stage first. Ordinary schedules have one
    chain ``(0, 1, ..., S-1)``; DualPipe has two independent chains (direction 0 and direction 1, each a copy of
    the model). Microbatch ids count within a chain, so each chain sees ``num_microbatches // len(pipelines)``.
    """

    name: str
    actions: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    num_stages_per_rank: int = 1
    pipelines: tuple[tuple[int, ...], ...] = ()
    idle_slots: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """For orders read from a CSV: positions of empty cells per rank (kept so a round trip is exact)."""

    def __post_init__(self) -> None:
        if not self.pipelines:
            object.__setattr__(self, "pipelines", (tuple(range(len(self.stage_to_rank))),))

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    @property
    def microbatches_per_pipeline(self) -> int:
        return self.num_microbatches // len(self.pipelines)

    @cached_property
    def splits_backward(self) -> bool:
        """Whether some backward is split into I and W (a W action): torch's activation checkpointing then reruns a
        checkpointed region once per half, which ``run`` and ``plan`` refuse."""
        return any(c.type is ActionType.W for row in self.actions for a in row for c in a.computations)

    @cached_property
    def _links(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
        prev: dict[int, int] = {}
        nxt: dict[int, int] = {}
        direction: dict[int, int] = {}
        position: dict[int, int] = {}
        for d, chain in enumerate(self.pipelines):
            for i, s in enumerate(chain):
                direction[s] = d
                position[s] = i
                if i > 0:
                    prev[s] = chain[i - 1]
                if i + 1 < len(chain):
                    nxt[s] = chain[i + 1]
        return prev, nxt, direction, position

    @cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        by_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, r in enumerate(self.stage_to_rank):
            if 0 <= r < len(by_rank):
                by_rank[r].append(s)
        return tuple(tuple(stages) for stages in by_rank)

    def prev_stage(self, stage: int) -> int | None:
        """The stage whose forward output feeds ``stage`` (``None`` for a chain's first stage)."""
        return self._links[0].get(stage)

    def next_stage(self, stage: int) -> int | None:
        """The stage ``stage`` feeds (``None`` for a chain's last stage, which computes the loss)."""
        return self._links[1].get(stage)

    def direction(self, stage: int) -> int:
        """Which chain (DualPipe direction / model copy) ``stage`` belongs to."""
        return self._links[2][stage]

    def position(self, stage: int) -> int:
        """Index of ``stage`` in its chain (``pipelines[direction(stage)].index(stage)``, in constant time)."""
        return self._links[3][stage]

    def chunk(self, stage: int) -> int:
        """Index of ``stage`` among the stages its rank holds, in stage order (0 = first chunk)."""
        return self._stages_by_rank[self.stage_to_rank[stage]].index(stage)

    def stages_of(self, rank: int) -> list[int]:
        return list(self._stages_by_rank[rank]) if 0 <= rank < self.num_ranks else []

    def iter_computations(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, position, single computation)`` with overlapped pairs expanded."""
        for rank, row in enumerate(self.actions):
            for pos, action in enumerate(row):
                for comp in action.computations:
                    yield rank, pos, comp

    def to_rows(self) -> list[list[str]]:
        """The order as torch's compute-only CSV cells (``""`` = idle), one row per rank."""
        rows: list[list[str]] = []
        for rank, row in enumerate(self.actions):
            cells = [str(a) for a in row]
            for pos in self.idle_slots[rank] if rank < len(self.idle_slots) else ():
                cells.insert(pos, "")
            rows.append(cells)
        return rows

    def with_actions(self, actions: Sequence[Sequence[Action]]) -> Schedule:
        """A copy with other per-rank orders (same placement and sizes)."""
        return Schedule(
            name=self.name,
            actions=tuple(tuple(r) for r in actions),
            stage_to_rank=self.stage_to_rank,
            num_microbatches=self.num_microbatches,
            num_stages_per_rank=self.num_stages_per_rank,
            pipelines=self.pipelines,
        )


def require(condition: bool, message: str) -> None:
    """Raise a one-line :class:`ScheduleConfigError` unless ``condition`` holds (never stripped by ``-O``)."""
    if not condition:
        raise ScheduleConfigError(message)
