"""Simulator benchmark: prints a table (not a test; timings depend on the machine and its load).

    python bench/bench_simulator.py            # everything (about a minute; torch part only if torch is installed)
    python bench/bench_simulator.py --quick    # skip the 1M-action CLI run and torch

Reports, for each case: simulate() alone on a prebuilt schedule (first call and best of the repeats, wall and CPU
time) in actions per second; Interleaved1F1B 64 ranks x 256 microbatches x v2 built + simulated; torch 2.13 building
the same schedule and running its unit-step simulation on the comms-lowered order; the CLI on 1M actions; and the
tracemalloc peak of simulate() for two sizes (memory should grow linearly with the number of actions).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import shutil
import subprocess
import sys
import time
import tracemalloc
from typing import Any, Callable

from ppsim import get_schedule, simulate

CASES = [
    ("Interleaved1F1B", 64, 256, 2),
    ("Interleaved1F1B", 128, 1024, 4),
    ("1F1B", 8, 16384, None),
    ("ZBH1", 16, 4096, None),
    ("DualPipeV", 32, 4096, None),
]
QUICK_CASES = CASES[:1] + [("1F1B", 8, 2048, None), ("DualPipeV", 8, 512, None)]


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds, result) of one call."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def row(*cells: Any) -> str:
    widths = (34, 10, 12, 12, 12, 12)
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def bench_simulate(cases: list[tuple[str, int, int, int | None]], repeats: int) -> None:
    print("simulate() alone (schedule built beforehand; best of", repeats, "after the first call)")
    print(row("case", "actions", "first wall", "best wall", "best CPU", "Mact/s CPU"))
    for name, r, m, v in cases:
        schedule = get_schedule(name, r, m, v)
        n = schedule.num_actions
        first_wall, _, _ = timed(lambda: simulate(schedule))
        walls, cpus = [], []
        for _ in range(repeats):
            w, c, _ = timed(lambda: simulate(schedule))
            walls.append(w)
            cpus.append(c)
        best_c = min(cpus)
        label = f"{name} r{r} m{m}" + (f" v{v}" if v else "")
        print(row(label, n, f"{first_wall:.3f}s", f"{min(walls):.3f}s", f"{best_c:.3f}s", f"{n / best_c / 1e6:.2f}"))
        del schedule
        gc.collect()


def bench_build_and_simulate(with_torch: bool) -> None:
    name, r, m, v = "Interleaved1F1B", 64, 256, 2
    print(f"\n{name} {r} ranks x {m} microbatches x v{v}: build + simulate (target <= 0.25 s)")
    results = []
    for _ in range(3):
        w, c, _ = timed(lambda: simulate(get_schedule(name, r, m, v)))
        results.append((w, c))
    w, c = min(results)
    print(f"  ppsim: {w:.3f} s wall, {c:.3f} s CPU (best of 3)")
    if not with_torch:
        return
    if importlib.util.find_spec("torch") is None:
        print("  torch: not installed, skipped")
        return
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType, _simulate_comms_compute

    fsdp = {_ComputationType.UNSHARD, _ComputationType.RESHARD, _ComputationType.REDUCE_GRAD}

    def torch_run() -> Any:
        ops = get_schedule_ops(name, r, m, v, with_comms=True)
        # FSDP actions are outside the unit-step simulator's vocabulary; drop them as its own tests do
        order = {k: [a for a in ops[k] if a is not None and a.computation_type not in fsdp] for k in range(r)}
        return _simulate_comms_compute(order, lambda s: s % r, r * v)

    tw, tc, _ = timed(torch_run)
    print(f"  torch 2.13 (get_schedule_ops with comms + _simulate_comms_compute): {tw:.2f} s wall, {tc:.2f} s CPU")
    print(f"  ratio torch / ppsim: {tw / w:.0f}x wall, {tc / c:.0f}x CPU")


def bench_cli() -> None:
    exe = shutil.which("ppsim")
    cmd = ([exe] if exe else [sys.executable, "-m", "ppsim.cli"]) + [
        "simulate", "-s", "Interleaved1F1B", "-r", "128", "-m", "1024", "-v", "4", "--json"]
    print("\nCLI:", " ".join(cmd[1:]), "(1,048,576 actions; target <= 3 s wall)")
    for _ in range(2):
        w0 = time.perf_counter()
        usage0 = _children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - w0
        cpu = _children_cpu() - usage0
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[:200]}"
        print(f"  {wall:.2f} s wall, {cpu:.2f} s CPU ({status})")


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_memory(sizes: list[tuple[str, int, int, int | None]]) -> None:
    print("\ntracemalloc peak of simulate() (result kept) per action")
    simulate(get_schedule("1F1B", 2, 2))  # warm up: first-call imports and caches are not per-action memory
    for name, r, m, v in sizes:
        schedule = get_schedule(name, r, m, v)
        gc.collect()
        tracemalloc.start()
        result = simulate(schedule)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        n = schedule.num_actions
        print(f"  {name} r{r} m{m} v{v}: {n} actions, peak {peak / 2**20:.1f} MiB ({peak / n:.0f} B/action), "
              f"result {current / 2**20:.1f} MiB ({current / n:.0f} B/action)")
        del result, schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small cases only; no CLI run, no torch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, load average {_load()}")
    bench_simulate(QUICK_CASES if args.quick else CASES, args.repeats)
    bench_build_and_simulate(with_torch=not args.quick)
    if not args.quick:
        bench_cli()
    small = ("Interleaved1F1B", 64, 256, 2)
    bench_memory([small, ("Interleaved1F1B", 64, 1024, 2) if args.quick else ("Interleaved1F1B", 128, 1024, 4)])


def _load() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    main()
