"""The list-scheduling rules the search tries: a fixed set first, then random rules and mutations of good ones.

A :class:`~ppsim.search.listsched.Rule` sets how the memory-aware list scheduler picks the next computation on a
rank (admission limits per rank, when deferred W run, B or I+W, overlapped pairs, ...).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from ppsim.costs import StageCosts
from ppsim.ir import ActionType, Schedule
from ppsim.search.listsched import Problem, Rule


def random_rule(rng: random.Random, problem: Problem, *, allow_pairs: bool) -> Rule:
    R = problem.num_ranks
    cap_mb = [max(1, int(problem.cap[r] // max(problem.need(r), 1e-12))) if problem.cap[r] < math.inf else 10**6
              for r in range(R)]
    style = rng.random()
    inflight: tuple[int, ...] | None
    if style < 0.2:
        inflight = None
    else:
        a = rng.choice((0.5, 1.0, 1.0, 1.5, 2.0))
        b = rng.choice((-1, 0, 0, 1, 2, 3))
        inflight = tuple(max(1, min(cap_mb[r], round(a * (R - r) + b))) for r in range(R))
        if rng.random() < 0.3:
            inflight = tuple(max(1, min(cap_mb[r], x + rng.choice((-1, 0, 1)))) for r, x in enumerate(inflight))
    return Rule(
        backward=rng.choice(("split", "split", "auto", "fused")) if rng.random() < 0.4 else "split",
        backward_first=rng.random() < 0.85,
        w_fill=rng.choice(("eager", "fit")),
        w_keep=rng.choice((1 << 30, 1 << 30, 0, 1, 2, 4)),
        inflight=inflight,
        pairs=allow_pairs and rng.random() < 0.7,
        deep_first=rng.random() < 0.7,
        wait_b=rng.choice((0.0, 0.0, 0.25, 0.5, 1.0, 2.0)) * min(problem.f),
        reserve="one" if problem.template.num_stages_per_rank > 1 and rng.random() < 0.4 else "all",
        jitter=rng.randrange(1 << 30) if rng.random() < 0.5 else None,
    )


_RULE_FIELDS = ("backward", "backward_first", "w_fill", "w_keep", "inflight", "pairs", "deep_first", "wait_b",
                "reserve", "jitter")


def mutate(rule: Rule, donor: Rule, rng: random.Random) -> Rule:
    """``rule`` with one setting taken from ``donor`` (for per-rank limits, sometimes one rank's only)."""
    name = rng.choice(_RULE_FIELDS)
    if name == "inflight" and rule.inflight is not None and donor.inflight is not None and rng.random() < 0.5:
        r = rng.randrange(len(rule.inflight))
        limits = list(rule.inflight)
        limits[r] = max(1, limits[r] + rng.choice((-1, 1)))
        return replace(rule, inflight=tuple(limits))
    return replace(rule, **{name: getattr(donor, name)})


def fixed_rules(problem: Problem, *, allow_pairs: bool) -> list[Rule]:
    rules = []
    for pairs in ((False, True) if allow_pairs else (False,)):
        for w_fill in ("eager", "fit"):
            for backward in ("split", "auto"):
                for wait in (0.0, 0.5, 1.0):
                    rules.append(Rule(backward=backward, w_fill=w_fill, pairs=pairs, wait_b=wait * min(problem.f)))
                    if problem.template.num_stages_per_rank > 1:
                        rules.append(Rule(backward=backward, w_fill=w_fill, pairs=pairs, reserve="one",
                                          wait_b=wait * min(problem.f)))
    return rules


def pairs_help(costs: StageCosts, tpl: Schedule) -> bool:
    return any(
        costs.pair_duration(tpl, s, tpl.num_stages - 1 - s, ActionType.B)
        < costs.op_cost(tpl, s, ActionType.F) + costs.op_cost(tpl, tpl.num_stages - 1 - s, ActionType.B) - 1e-12
        for s in range(tpl.num_stages)
    )
