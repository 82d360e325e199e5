"""Benchmark of `ppsim search` against the named schedules and the lower bound (issue 11's targets).

    python bench/bench_search.py [--time-limit S] [--quick] [--recompute-frontier]
    python bench/bench_search.py --production [--time-limit S] [--quick] [--cases PV07@34] [--v-auto-scan]
                                                            # R 16/32 against the zero-bubble authors

Grid: R in {4, 8}, M in {8, 16, 24}, I in {1, 2} with F = W = 1 (B = I + W), comm in {0, 0.1}, cap R and 2R
activations (one microbatch's activations of one stage, one stage per rank): 48 cases. Per case it prints the
searched makespan, the best named schedule that fits the cap, the lower bound, and the share of the named
schedule's gap to the bound that the search closed. Then the V-shape memory levels (issue 19): V placement at
the peaks of V-Min, V-Half and ZBV (R in {4, 8}, M in {8, 16}, F = I = W = 1, comm in {0, 0.1}), the searched
makespan beside the best named schedule and the best controllable-memory building block that fit, the bound, and
whether the order is proven optimal. Then the targets, a timed R=8, M=32 search with per-stage (profile-like) costs
and a byte cap, and the zero-bubble authors' published numbers beside ppsim's.

Timings depend on the machine and its load: the first lines print the machine and the spread of a fixed workload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from ppsim import get_schedule, parse_costs, simulate
from ppsim.costs import StageCosts
from ppsim.search import search


def machine_noise() -> str:
    """Spread of one fixed workload (simulating ZBH1 on 8 ranks x 64 microbatches 20 times), 5 repeats."""
    sched = get_schedule("ZBH1", 8, 64)
    costs = parse_costs("F=1,B=2,comm=0.1")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            simulate(sched, costs)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return f"fixed workload {med * 1e3:.1f} ms median, spread {(max(times) - min(times)) / med:.0%} (min..max / median)"


def grid(time_limit: float, quick: bool) -> bool:
    rows = []
    print(f"{'R':>2} {'M':>3} {'I':>2} {'comm':>4} {'cap':>4} | {'searched':>9} {'named':>9} {'(name)':<22} "
          f"{'bound':>8} {'gap':>6} {'closed':>6}  source")
    for R in (4, 8):
        for M in (8, 16, 24):
            for i_cost in (1, 2):
                for comm in (0.0, 0.1):
                    for factor in (1, 2):
                        if quick and (M, comm) != (16, 0.1):
                            continue
                        costs = parse_costs(f"F=1,I={i_cost},W=1,B={i_cost + 1},comm={comm}")
                        res = search(R, M, costs, f"{factor * R}act", time_limit=time_limit, seed=0)
                        best = res.best_named
                        named = best.makespan if best else float("inf")
                        lb = res.lower_bound
                        closed = 1.0 if named - lb <= 1e-9 else (named - res.makespan) / (named - lb)
                        rows.append((R, M, i_cost, comm, factor * R, res.makespan, named, lb, res.gap, closed))
                        print(f"{R:>2} {M:>3} {i_cost:>2} {comm:>4} {factor * R:>4} | {res.makespan:>9.2f} "
                              f"{named:>9.2f} {best.name if best else '-':<22} {lb:>8.2f} {res.gap:>6.1%} "
                              f"{closed:>6.0%}  {res.source}", flush=True)
    n = len(rows)
    not_worse = sum(r[5] <= r[6] + 1e-9 for r in rows)
    wide = [r for r in rows if r[6] > 1.01 * r[7]]
    half = sum(r[9] >= 0.5 for r in wide)
    within = sum(r[8] <= 0.03 + 1e-12 for r in rows)
    ok = not_worse == n and half == len(wide) and within >= 0.8 * n
    print(f"\ntarget: searched <= best named that fits in every case: {not_worse}/{n} "
          f"{'PASS' if not_worse == n else 'FAIL'}")
    print(f"target: where the named one is > 1% above the bound, the search closes >= half the gap: "
          f"{half}/{len(wide)} {'PASS' if half == len(wide) else 'FAIL'}")
    print(f"target: within 3% of the bound in >= 80% of cases: {within}/{n} ({within / n:.0%}) "
          f"{'PASS' if within >= 0.8 * n else 'FAIL'}")
    return ok


def best_blocks(R: int, M: int, costs: StageCosts) -> dict[int, float]:
    """The fastest building block (repeated and reordered, as V-Half) at each peak, in chunk activations."""
    from ppsim.schedules._vshape import block_schedule, building_blocks

    best: dict[int, float] = {}
    for offsets in building_blocks(R):
        sim = simulate(block_schedule(R, M, offsets), costs)
        peak = max(p.peak_activations for p in sim.per_rank)
        best[peak] = min(best.get(peak, float("inf")), sim.makespan)
    return best


def v_levels(time_limit: float, quick: bool) -> bool:
    """V placement at the V-Min, V-Half and ZBV memory levels: searched <= best named and <= best block."""
    print(f"\nV-shape memory levels ({time_limit:g} s per case)")
    print(f"{'R':>2} {'M':>3} {'comm':>4} {'level':<7} {'cap':>4} | {'searched':>9} {'named':>9} {'(name)':<14} "
          f"{'block':>8} {'bound':>8} {'gap':>6}  proof")
    rows = []
    for R, M in ((4, 8), (8, 16)):
        for comm in (0.0, 0.1):
            if quick and (R, M, comm) != (4, 8, 0.1):
                continue
            costs = parse_costs(f"F=1,I=1,W=1,B=2,comm={comm}")
            blocks = best_blocks(R, M, costs)
            for level in ("V-Min", "V-Half", "ZBVZeroBubble"):
                cap = max(p.peak_activations for p in simulate(get_schedule(level, R, M), costs).per_rank)
                res = search(R, M, costs, f"{cap}act", placement="v", time_limit=time_limit, seed=0)
                best = res.best_named
                named = best.makespan if best else float("inf")
                block = min((v for peak, v in blocks.items() if peak <= cap), default=float("inf"))
                proof = "optimal" if res.optimal else f"gap ({res.bound_source})"
                rows.append((res.makespan, named, block, res.optimal))
                print(f"{R:>2} {M:>3} {comm:>4} {level[:7]:<7} {cap:>4} | {res.makespan:>9.2f} {named:>9.2f} "
                      f"{best.name if best else '-':<14} {block:>8.2f} {res.lower_bound:>8.2f} {res.gap:>6.1%}  "
                      f"{proof}", flush=True)
    n = len(rows)
    not_worse = sum(r[0] <= min(r[1], r[2]) + 1e-9 for r in rows)
    print(f"target: searched <= best named and <= best building block that fit: {not_worse}/{n} "
          f"{'PASS' if not_worse == n else 'FAIL'}; proven optimal: {sum(r[3] for r in rows)}/{n}")
    return not_worse == n


def profile_like_costs(num_stages: int) -> StageCosts:
    """Per-stage costs shaped like a calibrated transformer: an embedding-heavy first stage, a loss-heavy last one."""
    f = [1.0e-3 * (1.0 + 0.08 * (s % 3)) for s in range(num_stages)]
    f[0] *= 1.3
    f[-1] *= 1.6
    i_ = [1.1 * x for x in f]
    w = [0.9 * x for x in f]
    b = [a + c for a, c in zip(i_, w)]
    fb = [0.9 * (a + c) for a, c in zip(f, b)]
    act = [200 * 2**20] * num_stages
    return StageCosts(
        F=tuple(f), B=tuple(b), I=tuple(i_), W=tuple(w), FB=tuple(fb), comm=0.0,
        p2p_alpha=20e-6, p2p_beta=10e9, output_bytes=(16 * 2**20,) * num_stages,
        activation_bytes=tuple(act), activation_bytes_freed_by_I=tuple(a // 4 for a in act),
        static_bytes=(4 * 2**30,) * num_stages, unit="s", source="bench profile-like",
    )


def timed_profile_case(time_limit: float) -> bool:
    R, M = 8, 32
    costs = profile_like_costs(R)
    cap = 4 * 2**30 + R * 200 * 2**20  # static + 1F1B's R activations
    t = time.perf_counter()
    res = search(R, M, costs, cap, time_limit=time_limit, seed=0)
    elapsed = time.perf_counter() - t
    best = res.best_named
    print(f"\nR=8 M=32 per-stage costs, byte cap (static + 8 activations): searched {res.makespan * 1e3:.3f} ms, "
          f"best named {best.name if best else '-'} {best.makespan * 1e3 if best else float('nan'):.3f} ms, "
          f"bound {res.lower_bound * 1e3:.3f} ms, gap {res.gap:.1%}; wall {elapsed:.1f} s "
          f"({res.evaluations} orders, {res.stopped})")
    ok = elapsed <= 10.0
    print(f"target: R=8, M=32 with per-stage costs <= 10 s: {elapsed:.1f} s {'PASS' if ok else 'FAIL'}")
    return ok


def sail_sg_lines(time_limit: float) -> None:
    """The zero-bubble authors' scheduler on the same costs (issue 11), beside ppsim's search."""
    print("\nsanity: published numbers of sail-sg/zero-bubble-pipeline-parallelism (8 ranks, 8 microbatches)")
    c = parse_costs("F=1,B=2,I=1,W=1,comm=0.1")
    zbh1 = simulate(get_schedule("ZBH1", 8, 8), c)
    res = search(8, 8, c, "8act", time_limit=time_limit)
    print(f"  loop, F=I=W=1, comm 0.1, cap 8act: their auto 32.4 | ppsim ZBH1 {zbh1.makespan:.4g} | "
          f"searched {res.makespan:.4g} | bound {res.lower_bound:.4g}")
    for R, M, theirs in ((4, 8, 55.2), (8, 16, 117.8)):
        half = simulate(get_schedule("V-Half", R, M), c)
        print(f"  V-Half {R}x{M}, F=I=W=1, comm 0.1: their V-Half {theirs} | ppsim V-Half {half.makespan:.4g} at "
              f"{max(p.peak_activations for p in half.per_rank)} chunk activations")
    res = search(4, 8, c, "6act", placement="v", time_limit=time_limit)
    print(f"  V 4x8, F=I=W=1, comm 0.1, cap 6act (V-Half's): their v_auto_schedule 54.8 | searched {res.makespan:.4g} "
          f"| bound {res.lower_bound:.4g}")
    for text, theirs in (("F=1,B=2,I=1,W=1", 55.0), ("F=1,B=2,I=1,W=1,comm=0.1", 58.2), ("F=1,B=3,I=2,W=1", 78.0)):
        c = parse_costs(text)
        zbv = simulate(get_schedule("ZBVZeroBubble", 8, 8), c)
        cap = max(p.peak_activations for p in zbv.per_rank)
        res = search(8, 8, c, f"{cap}act", placement="v", time_limit=time_limit)
        print(f"  V, {text}, cap {cap}act (ZBV's peak): their V {theirs:.4g} | ppsim ZBVZeroBubble "
              f"{zbv.makespan:.4g} | searched {res.makespan:.4g} | bound {res.lower_bound:.4g}")


# --- recompute frontier (search --recompute auto) ------------------------------------------------------------------


def recompute_frontier(time_limit: float, *, ranks: int = 4, num_microbatches: int = 8,
                       text: str = "F=1,B=2,comm=0.1") -> None:
    """Makespan against cap, from the fastest named schedule's peak down to the smallest cap any order can meet
    with recomputation (one activation being recomputed plus what the others keep): the plain search (no
    recompute) beside `search --recompute auto`, and the time lost against the uncapped best."""
    from ppsim.errors import PPSimError
    from ppsim.search.recompute import search_recompute

    costs = parse_costs(text)
    names = ["GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBH2", "InterleavedZeroBubble", "LoopedBFS"]
    named = [(n, simulate(get_schedule(n, ranks, num_microbatches), costs)) for n in names]
    fastest = min(named, key=lambda x: x[1].makespan)
    top = max(p.peak_activations for p in fastest[1].per_rank)
    kept = costs.recompute_act
    caps = sorted({float(c) for c in range(int(top), 1, -1)} | {1.5, 1.0 + 2 * kept, 1.0 + kept, 1.0}, reverse=True)
    print(f"\nrecompute frontier: R={ranks} M={num_microbatches} {text}, recompute_act={kept:g}; caps from "
          f"{fastest[0]}'s peak {top}act (the fastest named) down; time limit {time_limit:g} s per search")
    print(f"  {'cap':>6} | {'best named that fits':>24} | {'search, no recompute':>20} | "
          f"{'--recompute auto':>16} | {'recomputed':>10} | {'time lost':>9} | chosen from")
    for cap in caps:
        fitting = [(n, r.makespan) for n, r in named if max(p.peak_activations for p in r.per_rank) <= cap + 1e-9]
        best_named = min(fitting, key=lambda x: x[1]) if fitting else None
        try:
            plain = f"{search(ranks, num_microbatches, costs, f'{cap:g}act', time_limit=time_limit).makespan:.4g}"
        except PPSimError:
            plain = "no order"
        try:
            res = search_recompute(ranks, num_microbatches, costs, f"{cap:g}act", time_limit=time_limit)
            auto, count, lost, source = f"{res.makespan:.4g}", str(len(res.recompute)), f"{res.time_lost:+.1%}", \
                res.source
        except PPSimError:
            auto, count, lost, source = "no order", "-", "-", "-"
        named_text = f"{best_named[0]} {best_named[1]:.4g}" if best_named else "none fits"
        print(f"  {cap:>5g}a | {named_text:>24} | {plain:>20} | {auto:>16} | {count:>10} | {lost:>9} | {source}")


REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "zb_peer_r16_r32.json"


def authors_best(case: dict, cap: float) -> tuple[float, str] | None:
    """The zero-bubble authors' fastest valid order (of every scheduler run for the case) that fits ``cap``."""
    fitting = [c for c in case["candidates"] if c["peak_act"] <= cap + 1e-9]
    if not fitting:
        return None
    best = min(fitting, key=lambda c: c["makespan"])
    return best["makespan"], best["method"]


def v_auto_scan(R: int, M: int, text: str, cap: float) -> str:
    """Every block of the authors' automatic V schedule (rebuilt, ppsim/search/vauto.py), as their code tries them:
    the best order's makespan by ppsim simulate, the blocks built and the time (the search tries the most promising
    few within its seed phase)."""
    from ppsim.search.driver import _templates
    from ppsim.search.vauto import block_orders, blocks, family

    (tpl,) = _templates(R, M, "v", None)
    costs = parse_costs(text)
    t = time.perf_counter()
    best, built = float("inf"), 0
    for fam in family(R):
        for block in blocks(R, *fam):
            orders, peak = block_orders(block, M, cap)
            if peak > min(cap, 2 * R):
                break
            if orders is not None:
                built += 1
                best = min(best, simulate(tpl.with_actions(orders), costs).makespan)
    return f"all v_auto blocks: best {best:.2f} over {built} blocks in {time.perf_counter() - t:.1f} s"


def production_grid(time_limit: float, quick: bool, only: set[str] | None = None, scan: bool = False) -> bool:
    """Issue 24 part 4: R 16/32, M 32-256, both placements, the reference caps (loop 1.5R / 2R, V at V-Half's level
    or 2R) and, for V, V-Min's level; beside the authors' schedulers at the same cap (tests/data/zb_peer_r16_r32.json,
    made by their code at commit 39f2c186 and timed by ppsim simulate on their orders)."""
    cases = json.loads(REFERENCE.read_text())["cases"]
    runs: list[tuple[dict, float]] = []
    for case in cases:
        runs.append((case, float(case["cap_act"])))
        if case["placement"] == "v" and case["cap_level"] == "V-Half":
            vmin = get_schedule("V-Min", case["R"], case["M"], 2)
            runs.append((case, float(max(r.peak_activations for r in simulate(vmin, parse_costs(None)).per_rank))))
    if quick:
        runs = [r for r in runs if r[0]["R"] == 16 and r[0]["M"] <= 64]
    if only:
        runs = [r for r in runs if r[0]["id"] in only or f"{r[0]['id']}@{r[1]:g}" in only]
    print(f"\nproduction grid ({time_limit:g} s per case): searched / best named that fits / authors at the same cap "
          "/ bound")
    print(f"{'case':<5} {'pl':<4} {'R':>2} {'M':>3} {'costs':<22} {'cap':>4} | {'searched':>9} {'named':>9} "
          f"{'authors':>9} {'(method)':<16} {'vs auth':>8} {'bound':>8} {'gap':>6} {'wall':>6}  source")
    worse = 0
    for case, cap in runs:
        R, M = case["R"], case["M"]
        text = f"F={case['F']},I={case['I']},W={case['W']},comm={case['comm']}"
        res = search(R, M, parse_costs(text), f"{cap:g}act", placement=case["placement"], time_limit=time_limit,
                     seed=0)
        theirs = authors_best(case, cap)
        named = res.best_named.makespan if res.best_named else float("nan")
        rel = None if theirs is None else (res.makespan - theirs[0]) / theirs[0]
        versus = "" if rel is None else "0" if abs(rel) < 5e-5 else f"{rel:+.2%}"
        if theirs is not None and res.makespan > theirs[0] + 1e-6:
            worse += 1
        print(f"{case['id']:<5} {case['placement']:<4} {R:>2} {M:>3} {text:<22} {cap:>4g} | {res.makespan:>9.2f} "
              f"{named:>9.2f} {theirs[0] if theirs else float('nan'):>9.2f} {theirs[1] if theirs else '-':<16} "
              f"{versus:>8} {res.lower_bound:>8.2f} {res.gap:>6.1%} {res.elapsed_s:>5.1f}s  {res.source}")
        if scan and case["placement"] == "v":
            print(f"      {v_auto_scan(R, M, text, cap)}", flush=True)
    print(f"target: never worse than the authors at the same cap: {len(runs) - worse}/{len(runs)} "
          f"{'PASS' if worse == 0 else 'FAIL'}")
    return worse == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=2.0, help="seconds per grid case (default 2)")
    parser.add_argument("--quick", action="store_true", help="8 grid cases instead of 48")
    parser.add_argument("--recompute-frontier", action="store_true",
                        help="only the recompute frontier (search --recompute auto against cap)")
    parser.add_argument("--production", action="store_true",
                        help="only the production-size grid (R 16/32, M 32-256) against the zero-bubble authors")
    parser.add_argument("--cases", default="",
                        help="with --production: only these cases, e.g. PL01,PV07@34 (id, or id@cap)")
    parser.add_argument("--v-auto-scan", action="store_true",
                        help="with --production: also build every block of the authors' automatic V schedule "
                             "(rebuilt) per V case, as their code does, and print the best")
    args = parser.parse_args()
    if args.production:
        print("command: python " + " ".join(sys.argv))
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
              f"python {platform.python_version()}; {machine_noise()}")
        only = {c.strip() for c in args.cases.split(",") if c.strip()} or None
        return 0 if production_grid(args.time_limit, args.quick, only, args.v_auto_scan) else 1
    if args.recompute_frontier:
        recompute_frontier(args.time_limit)
        return 0
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}; {machine_noise()}")
    ok = grid(args.time_limit, args.quick)
    ok = v_levels(args.time_limit, args.quick) and ok
    ok = timed_profile_case(min(8.0, 4 * args.time_limit)) and ok
    sail_sg_lines(args.time_limit)
    recompute_frontier(args.time_limit)
    print("\nall targets PASS" if ok else "\nsome target FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
