"""The one name of each collective kind, for every part of ppsim that prices, measures, records or draws one.

Values are the profile's and the JSON's spellings (``"all_gather"``...), so a kind is also a plain ``str``."""

from __future__ import annotations

from enum import Enum


class CollectiveKind(str, Enum):
    """A collective (or point-to-point) operation, as nccl-tests and torch.distributed name them."""

    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    SEND_RECV = "send_recv"

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        """For people: ``all-gather``."""
        return self.value.replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> CollectiveKind:
        """A kind from its name (``all_gather``, ``all-gather``, ``allgather``; any case); ``ValueError`` naming
        the choices otherwise."""
        key = text.strip().lower().replace("-", "_")
        for kind in cls:
            if key in (kind.value, kind.value.replace("_", "")):
                return kind
        raise ValueError(f"{text!r} is not a collective; choose one of {', '.join(k.value for k in cls)}")


ALL_KINDS: tuple[CollectiveKind, ...] = tuple(CollectiveKind)
"""Every kind, in the order results and tables list them (``simulate --json``'s ``collectives``)."""
