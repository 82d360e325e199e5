"""The lower bound on the makespan and the smallest cap any order needs.

The lower bound (:func:`lower_bound`) is, for each rank, its busy time plus the idle time it cannot avoid at the
start (no backward can reach it before the first microbatch has gone down the chain and back, and until then it can
only run as many forwards as its memory holds) and at the end (after its last backward, only deferred W can run
while the last gradient travels to the first stage), a memory-bound admission term, the memory occupancy
(Little's law: the activations' least lifetimes over the cap) and the last forward (after it, the rank can only
work on the activations it holds while that microbatch goes down the chain and back; see docs/search.md).
"""

from __future__ import annotations

import math

from ppsim.ir import ActionType
from ppsim.search.listsched import Problem


def lower_bound(problem: Problem) -> float:
    """A makespan no order can beat under ``problem``'s costs and memory cap (see the module docstring)."""
    tpl = problem.template
    M = tpl.num_microbatches
    chain = tpl.pipelines[0]
    f, w = problem.f, problem.w
    bi = [min(problem.i[s], problem.b[s]) for s in range(tpl.num_stages)]
    bw = [min(problem.b[s], problem.i[s] + problem.w[s]) for s in range(tpl.num_stages)]
    # earliest forward start and earliest backward start of every stage (microbatch 0 alone)
    ef: dict[int, float] = {}
    t = 0.0
    for s in chain:
        ef[s] = t
        t += f[s] + problem.fwd_delay[s]
    last = chain[-1]
    eb: dict[int, float] = {last: ef[last] + f[last]}
    for k in range(len(chain) - 2, -1, -1):
        s, n = chain[k], chain[k + 1]
        eb[s] = eb[n] + bi[n] + problem.bwd_delay[s]
    # time from the end of a backward of stage s to the end of the first stage's work on that microbatch
    down: dict[int, float] = {chain[0]: 0.0}
    acc = bw[chain[0]] + problem.bwd_delay[chain[0]]
    for k in range(1, len(chain)):
        s = chain[k]
        down[s] = acc
        acc += bi[s] + problem.bwd_delay[s]
    best_one = best = eb[chain[0]] + bw[chain[0]]  # one microbatch alone
    for r in range(tpl.num_ranks):
        stages = tpl.stages_of(r)
        # an overlapped pair (a forward with another stage's backward) may take less than its halves apart
        save = pair_saving(problem, stages)
        work = M * sum(f[s] + bw[s] for s in stages) - M * len(stages) * save
        cap = problem.cap[r]
        min_act = min(problem.act[s] for s in stages)
        n_f = M * len(stages) if min_act <= 0 or cap == math.inf else min(M * len(stages), int(cap // min_act + 1e-9))
        held_w = min(problem.act[s] - problem.freed_by_i[s] for s in stages)
        n_w = M * len(stages) if held_w <= 0 or cap == math.inf else min(M * len(stages), int(cap // held_w + 1e-9))
        head = max(min(ef[s] for s in stages), min(eb[s] for s in stages) - n_f * max(f[s] for s in stages))
        tail = max(0.0, min(down[s] for s in stages) - n_w * max(w[s] for s in stages))
        best = max(best, head + work + tail)
        # Memory-bound admission: the last microbatch to enter the rank can start its forward only once the rank
        # has run every other entry forward and released enough memory (a B or an I + W releases a whole
        # activation, an I alone the part it frees), and then must still go down the chain, back up, and end with
        # the first stage's backward.
        entry = min(stages, key=chain.index)
        if cap < math.inf and problem.act[entry] > 0 and M * problem.act[entry] > cap:
            rate = min(
                min(max(bw[s] - save, 0.0) / problem.act[s],
                    max(bi[s] - save, 0.0) / problem.freed_by_i[s] if problem.freed_by_i[s] > 0 else math.inf)
                for s in stages
            )
            last_in = head + (M - 1) * f[entry] + (M * problem.act[entry] - cap) * rate
            best = max(best, last_in + eb[chain[0]] + bw[chain[0]] - ef[entry])
        if cap < math.inf and cap > 0 and save <= 0:
            best = max(best, min(ef[s] for s in stages) + _occupancy(problem, stages, ef, eb, bi, bw) / cap)
            if M * len(stages) > n_f:
                # Last forward: the rank's work after its last forward is at most the backwards of the activations
                # it then holds (n_f at most, each a B or an I + W; where an I frees bytes, more may be held after
                # their I, each owing only its W), and that forward's microbatch must still go down the rest of the
                # chain and back to the first stage.
                after = n_f * max(bw[s] for s in stages)
                if any(problem.freed_by_i[s] > 0 for s in stages) and held_w > 0:
                    after = max(cap / min_act * max(bw[s] for s in stages), cap / held_w * max(w[s] for s in stages))
                trip = min(best_one - ef[s] - f[s] for s in stages)
                best = max(best, head + work - after + trip)
    return best


def _occupancy(problem: Problem, stages: list[int] | tuple[int, ...], ef: dict[int, float], eb: dict[int, float],
               bi: list[float], bw: list[float]) -> float:
    """The least memory x time a rank's activations occupy over all microbatches (Little's law).

    An activation lives from its forward's start until its release: the part an I frees no earlier than the
    microbatch's round trip down the chain and back to the stage's backward (``eb - ef``, the chain alone), plus
    that backward; the rest no earlier than the B or the I and its W. The rank holds at most its cap at any time and
    nothing before its first forward, so ``makespan >= first forward + occupancy / cap``. It binds where a tight
    cap keeps few microbatches in flight while each round trip is long (V at V-Min's level: R=16, M=128, F=1,
    I=1.5, W=0.5, comm 0.1, 12act: 954.7 where the other terms give 833.5). Not used with overlapped pairs that are
    cheaper than their halves (a pair may shorten the round trip)."""
    M = problem.template.num_microbatches
    total = 0.0
    for s in stages:
        trip = eb[s] - ef[s]
        freed = problem.freed_by_i[s]
        total += freed * (trip + bi[s]) + (problem.act[s] - freed) * (trip + bw[s])
    return M * total


def pair_saving(problem: Problem, stages: list[int] | tuple[int, ...]) -> float:
    """The most one overlapped pair on these stages can save against running its forward and backward apart
    (0 when the costs make a pair no cheaper, as with uniform costs and FB = F + B)."""
    if len(stages) < 2:
        return 0.0
    tpl, costs = problem.template, problem.costs
    best = 0.0
    for s in stages:
        for bs in stages:
            if bs == s:
                continue
            for kind, alone in ((ActionType.B, problem.b[bs]), (ActionType.I, problem.i[bs])):
                best = max(best, problem.f[s] + alone - costs.pair_duration(tpl, s, bs, kind))
    return best


def smallest_cap(problem: Problem) -> float:
    """The least per-rank cap any order needs: one microbatch's activations on all of a rank's stages."""
    return max(problem.need(r) for r in range(problem.template.num_ranks))
