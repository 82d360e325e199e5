"""Schedule-builder benchmark: prints a table (not a test; timings depend on the machine and its load).

    python bench/bench_schedules.py             # every case, best of 5
    python bench/bench_schedules.py --runs 9

For each case: the build's wall and CPU time (best of the runs), beside the CPU time of creating the same number of
bare ``Action`` objects, which is the floor a builder cannot go under; the difference is the builder's own cost.
Targets: Interleaved1F1B 64 x 256 x v2 well under 0.1 s; 128 x 1024 x v4 (1M actions) about 1 s.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from ppsim.ir import Action, ActionType
from ppsim.schedules import get_schedule, paused_gc

CASES = [
    ("Interleaved1F1B", 64, 256, 2),
    ("Interleaved1F1B", 128, 1024, 4),
    ("InterleavedZeroBubble", 128, 1024, 4),
    ("LoopedBFS", 128, 1024, 4),
    ("GPipe", 512, 1024, None),
    ("1F1B", 512, 1024, None),
    ("ZBH1", 512, 1024, None),
    ("ZBH2", 512, 1024, None),
]


def best(fn: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Best wall and best CPU seconds of ``runs`` calls (results dropped and collected between calls)."""
    walls, cpus = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        del out
        gc.collect()
    return min(walls), min(cpus)


@paused_gc
def bare_actions(n: int) -> list[Action]:
    return [Action(1, ActionType.F, i) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{'case':<36}{'actions':>10}{'wall':>10}{'CPU':>10}{'Action() CPU':>14}{'own CPU':>10}")
    for name, r, m, v in CASES:
        n = get_schedule(name, r, m, v).num_actions
        wall, cpu = best(lambda: get_schedule(name, r, m, v), args.runs)
        _, floor = best(lambda: bare_actions(n), args.runs)
        label = f"{name} r{r} m{m}" + (f" v{v}" if v else "")
        print(f"{label:<36}{n:>10}{wall:>9.3f}s{cpu:>9.3f}s{floor:>13.3f}s{cpu - floor:>9.3f}s")


if __name__ == "__main__":
    main()
