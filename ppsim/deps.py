"""Data dependencies between computations: the one place both the validator and the simulator read.

A computation is a single F, B, I or W (an overlapped pair is two computations that start and end together).
Its progress is tracked by *keys* ``(stage, microbatch, phase)``:

- phase ``FWD`` (0): the forward output of ``stage`` for ``microbatch`` exists;
- phase ``IGRAD`` (1): the gradient with respect to the stage input exists (B or I done);
- phase ``WGRAD`` (2): the weight gradient is accumulated (B or W done).

Rules: F of ``s`` needs F of the previous stage in its chain; B/I of ``s`` needs its own F and the B/I of the next
stage (a chain's last stage computes the loss from its own F); W needs its own I.
"""

from __future__ import annotations

from typing import Final

from ppsim.ir import Action, ActionType, Schedule

FWD: Final = 0
IGRAD: Final = 1
WGRAD: Final = 2

Key = tuple[int, int, int]

_PROVIDES: Final[dict[ActionType, tuple[int, ...]]] = {
    ActionType.F: (FWD,),
    ActionType.B: (IGRAD, WGRAD),
    ActionType.I: (IGRAD,),
    ActionType.W: (WGRAD,),
}


def provides(comp: Action) -> tuple[Key, ...]:
    """Keys a single computation makes available when it ends."""
    mb = comp.microbatch
    assert mb is not None, f"computation {comp} has no microbatch"
    return tuple((comp.stage, mb, phase) for phase in _PROVIDES[comp.type])


def requires(schedule: Schedule, comp: Action) -> tuple[Key, ...]:
    """Keys that must exist before a single computation may start."""
    s, mb, kind = comp.stage, comp.microbatch, comp.type
    assert mb is not None, f"computation {comp} has no microbatch"
    if kind is ActionType.F:
        prev = schedule.prev_stage(s)
        return () if prev is None else ((prev, mb, FWD),)
    if kind is ActionType.W:
        return ((s, mb, IGRAD),)
    nxt = schedule.next_stage(s)
    own = (s, mb, FWD)
    return (own,) if nxt is None else (own, (nxt, mb, IGRAD))


def describe(key: Key) -> str:
    """A key as the action that produces it, for messages (``3F1``, ``4B/I2``, ``5W0``)."""
    s, mb, phase = key
    return f"{s}{('F', 'B/I', 'W')[phase]}{mb}"
