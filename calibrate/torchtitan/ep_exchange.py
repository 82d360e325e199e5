"""EP's all-to-alls in a ``ppsim run``: torchtitan's token dispatcher, its three exchanges issued by ppsim, timed.

torchtitan's ``AllToAllTokenDispatcher`` moves routed tokens with three exchanges per MoE layer and forward: the
token counts, the dispatch and the combine (``_token_count_exchange``, ``_dispatch_token_exchange``,
``_combine_token_exchange``; the backward runs dispatch and combine the other way). :func:`install` replaces those
three methods with the same exchange, torch's functional ``all_to_all_single`` waited for at once (the op torchtitan
issues, so its selective checkpointing saves it as it does torchtitan's), inside an autograd function whose backward
swaps the splits, so that each call

* is timed into :class:`~ppsim.calibrate.execute.overlap.CommStats` (the run's measured all-to-all time, and the
  part the compute stream waited for);
* gives up the pair's :class:`~ppsim.calibrate.execute.overlap.ComputeStream` while it waits;
* goes to the group of the thread that issues it: the step's thread uses the EP group torchtitan built, an
  overlapped pair's backward thread a second group over the same ranks (:func:`second_groups`). Every rank of an
  EP group runs the same order, so each group sees its collectives in one order on all of them, whichever thread
  reaches its call first. A backward runs its all-to-alls on its own thread's group, whichever thread ran the
  forward.

Everything else (routing, permutation, the experts) stays torchtitan's. torch and torchtitan are imported inside
functions only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_ROLE = threading.local()


@contextmanager
def second_thread() -> Iterator[None]:
    """Inside, this thread's all-to-alls go to the second group of their EP group."""
    _ROLE.second = True
    try:
        yield
    finally:
        _ROLE.second = False


def second_groups(ep_group: Any) -> dict[tuple[int, ...], Any]:
    """A second process group over each EP group's ranks, keyed by its ranks (collective: every rank calls it; each
    learns all EP groups, then creates them in one order)."""
    import torch.distributed as dist

    mine = tuple(sorted(dist.get_process_group_ranks(ep_group)))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[tuple[int, ...], Any] = {}
    for ranks in sorted(set(every)):
        group = dist.new_group(list(ranks))
        if ranks == mine:
            out[ranks] = group
    return out


def install(*, stream: Any, stats: Any, second: dict[tuple[int, ...], Any]) -> None:
    """Replace the dispatcher's three exchanges in this process (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    def group_for(pg: Any) -> Any:
        if getattr(_ROLE, "second", False):
            return second[tuple(sorted(dist.get_process_group_ranks(pg)))]
        return pg

    def exchange(x: Any, out_splits: list[int] | None, in_splits: list[int] | None, pg: Any) -> Any:
        # torch's functional all-to-all, the op torchtitan's dispatcher issues: torchtitan's selective checkpointing
        # saves its output (distributed/activation_checkpoint.py), so a rerun does not exchange again
        group = group_for(pg)
        with stream.waiting():
            t0 = time.perf_counter()
            out = funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
            out = torch.ops._c10d_functional.wait_tensor(out)
            stats.call(time.perf_counter() - t0)
        return out

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, out_splits: list[int], in_splits: list[int], pg: Any) -> Any:
            ctx.splits, ctx.pg = (out_splits, in_splits), pg
            return exchange(x, out_splits, in_splits, pg)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            out_splits, in_splits = ctx.splits
            return exchange(grad, in_splits, out_splits, ctx.pg), None, None, None

    def token_count_exchange(self: Any, counts: Any, pg: Any, ep_size: int) -> Any:
        return exchange(counts.view(ep_size, -1), None, None, pg)

    def dispatch_token_exchange(self: Any, routed: Any, pg: Any, output_splits: list[int],
                                input_splits: list[int]) -> Any:
        return AllToAll.apply(routed, output_splits, input_splits, pg)

    def combine_token_exchange(self: Any, routed: Any, pg: Any, input_splits: list[int],
                               output_splits: list[int]) -> Any:
        return AllToAll.apply(routed, input_splits, output_splits, pg)

    AllToAllTokenDispatcher._token_count_exchange = token_count_exchange
    AllToAllTokenDispatcher._dispatch_token_exchange = dispatch_token_exchange
    AllToAllTokenDispatcher._combine_token_exchange = combine_token_exchange
