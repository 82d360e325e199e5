"""EP's all-to-alls in a ``ppsim run``: torchtitan's token dispatcher, its three exchanges issued by ppsim, timed.

torchtitan's ``AllToAllTokenDispatcher`` moves routed tokens with three exchanges per MoE layer and forward: the
token counts, the dispatch and the combine (``_token_count_exchange``, ``_dispatch_token_exchange``,
``_combine_token_exchange``; the backward runs dispatch and combine the other way). :func:`install` replaces those
three methods with the same exchange made by ``torch.distributed.all_to_all_single`` (an autograd function whose
backward swaps the splits, as torch's differentiable all-to-all does), so that each call

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
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    def group_for(pg: Any) -> Any:
        if getattr(_ROLE, "second", False):
            return second[tuple(sorted(dist.get_process_group_ranks(pg)))]
        return pg

    def exchange(x: Any, out_splits: list[int] | None, in_splits: list[int] | None, pg: Any) -> Any:
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        group = group_for(pg)
        with stream.waiting():
            t0 = time.perf_counter()
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
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
