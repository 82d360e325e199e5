"""DeepSeek's eight DualPipe phases for one rank, shared by DualPipeV and DualPipe.

Both schedules run the same per-rank program on a V of ``num_half_ranks`` ranks: the rank at position ``h`` of the V
holds a *first* stage (chunk 0: data arrives from rank h-1) and a *second* stage (chunk 1: data arrives from rank
h+1). DualPipeV is one V over all ranks; DualPipe runs one V on each half of its ranks, mirrored.

Microbatch ids count per stage. A split backward queues its weight gradient; each W takes the oldest pending one
(first in, first out), across both stages.
"""

from __future__ import annotations

from collections import deque

from ppsim.ir import Action, ActionType, make_action, overlap

F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W


def dualpipe_rank_actions(
    h: int, *, num_half_ranks: int, num_microbatches: int, first_stage: int, second_stage: int
) -> list[Action]:
    """The compute order of the rank at position ``h`` (0-based) of a V with ``num_half_ranks`` ranks.

    ``num_microbatches`` is the number fed through this V (each stage runs every one); it must be at least
    ``2 * num_half_ranks`` (callers check, with their own message).
    """
    n, m = num_half_ranks, num_microbatches
    assert 0 <= h < n and m >= 2 * n, (h, n, m)
    stages = (first_stage, second_stage)
    next_f = [0, 0]
    next_b = [0, 0]
    pending_w: deque[Action] = deque()
    out: list[Action] = []
    append = out.append

    def fwd(chunk: int) -> Action:
        mb = next_f[chunk]
        next_f[chunk] = mb + 1
        return make_action(stages[chunk], F, mb)

    def bwd(chunk: int, *, split: bool = False) -> Action:
        mb = next_b[chunk]
        next_b[chunk] = mb + 1
        if split:
            pending_w.append(make_action(stages[chunk], W, mb))
            return make_action(stages[chunk], I, mb)
        return make_action(stages[chunk], B, mb)

    # Step 1: nF0 - fill the first stages downstream of this rank.
    for _ in range(2 * (n - h - 1)):
        append(fwd(0))
    # Step 2: nF0F1 - alternate first and second stage forwards.
    for _ in range(h + 1):
        append(fwd(0))
        append(fwd(1))
    # Step 3: nB1W1F1 - split second-stage backwards, weight gradient right away (zero bubble).
    for _ in range(n - h - 1):
        append(bwd(1, split=True))
        append(pending_w.popleft())
        append(fwd(1))
    # Step 4: nF0B1F1B0 - main phase of overlapped pairs; the V's tip does not overlap its first pair.
    for i in range(m - 2 * n + h + 1):
        if i == 0 and h == n - 1:
            append(fwd(0))
            append(bwd(1))
        else:
            append(overlap(fwd(0), bwd(1)))
        append(overlap(fwd(1), bwd(0)))
    # Step 5: nB1F1B0 - second-stage backward, then the remaining second-stage forwards overlapped.
    for _ in range(n - h - 1):
        append(bwd(1))
        append(overlap(fwd(1), bwd(0)))
    # Step 6: nB1B0 - alternate backwards; the second half of them split off their weight gradient.
    split = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        append(bwd(1, split=split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        append(bwd(0, split=split))
    # Step 7: nWB0 - a deferred weight gradient, then a split first-stage backward.
    for _ in range(n - h - 1):
        append(pending_w.popleft())
        append(bwd(0, split=True))
    # Step 8: nW - drain the deferred weight gradients.
    for _ in range(h + 1):
        append(pending_w.popleft())
    assert not pending_w and next_f == next_b == [m, m], (next_f, next_b, m)
    return out
