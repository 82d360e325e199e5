"""Simulator benchmark: prints a table (not a test; timings depend on the machine and its load).

    python bench/bench_simulator.py            # everything (about two minutes; torch part only if torch is installed)
    python bench/bench_simulator.py --quick    # skip the 1M-action CLI run and torch

Reports, for each case: simulate() alone on a prebuilt schedule (first call, then min / median / max of the
repeats, wall and CPU time) in actions per second; Interleaved1F1B 64 ranks x 256 microbatches x v2 built +
simulated, against torch 2.13 building the same order (with and without comms) and running its unit-step simulation
on the comms-lowered order; the CLI on 1M actions (target <= 2.0 s wall); validate and simulate on 1F1B with 4,000
and 20,000 ranks (linear in actions); and the tracemalloc peak of simulate() for two sizes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

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


def spread(values: list[float], unit: str = "s") -> str:
    """``min / median / max`` of a list of timings."""
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} {unit}"


def bench_simulate(cases: list[tuple[str, int, int, int | None]], repeats: int) -> None:
    print(f"simulate() alone (schedule built beforehand; first call, then min / median / max of {repeats})")
    for name, r, m, v in cases:
        schedule = get_schedule(name, r, m, v)
        n = schedule.num_actions
        first_wall, _, _ = timed(lambda: simulate(schedule))
        walls, cpus = [], []
        for _ in range(repeats):
            w, c, _ = timed(lambda: simulate(schedule))
            walls.append(w)
            cpus.append(c)
        label = f"{name} r{r} m{m}" + (f" v{v}" if v else "")
        print(f"  {label:<32} {n:>9}  first {first_wall:.3f} s  wall {spread(walls)}  CPU {spread(cpus)}  "
              f"({n / min(cpus) / 1e6:.2f} M actions/s CPU)")
        schedule = None  # freed before the next case is built
        gc.collect()


def bench_build_and_simulate(with_torch: bool, repeats: int, torch_repeats: int) -> None:
    name, r, m, v = "Interleaved1F1B", 64, 256, 2
    print(f"\n{name} {r} ranks x {m} microbatches x v{v}: build + simulate (min / median / max of {repeats})")
    walls, cpus = [], []
    for _ in range(repeats):
        w, c, _ = timed(lambda: simulate(get_schedule(name, r, m, v)))
        walls.append(w)
        cpus.append(c)
    print(f"  ppsim: wall {spread(walls)}, CPU {spread(cpus)}")
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

    runs = [timed(torch_run)[:2] for _ in range(torch_repeats)]
    build = [timed(lambda: get_schedule_ops(name, r, m, v, with_comms=False))[:2] for _ in range(torch_repeats)]
    tw, tc = [w for w, _ in runs], [c for _, c in runs]
    bw, bc = [w for w, _ in build], [c for _, c in build]
    print(f"  torch 2.13 get_schedule_ops(with_comms=True) + _simulate_comms_compute: wall {spread(tw)}, "
          f"CPU {spread(tc)}")
    print(f"  torch 2.13 get_schedule_ops(with_comms=False) alone: wall {spread(bw)}, CPU {spread(bc)}")
    print(f"  ratio torch / ppsim (median CPU): {statistics.median(tc) / statistics.median(cpus):.0f}x "
          f"(build + space), {statistics.median(bc) / statistics.median(cpus):.0f}x (torch build alone); "
          "target >= 20x")


def bench_cli(repeats: int) -> None:
    exe = shutil.which("ppsim")
    cmd = ([exe] if exe else [sys.executable, "-m", "ppsim.cli"]) + [
        "simulate", "-s", "Interleaved1F1B", "-r", "128", "-m", "1024", "-v", "4", "--json"]
    print("\nCLI:", " ".join(cmd[1:]), f"(1,048,576 actions; target <= 2.0 s wall; min / median / max of {repeats})")
    walls, cpus = [], []
    for _ in range(repeats):
        w0 = time.perf_counter()
        usage0 = _children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        walls.append(time.perf_counter() - w0)
        cpus.append(_children_cpu() - usage0)
        if proc.returncode != 0:
            print(f"  exit {proc.returncode}: {proc.stderr.strip()[:200]}")
            return
    print(f"  wall {spread(walls)}, CPU (user + sys) {spread(cpus)}")


def bench_linear() -> None:
    from ppsim.validate import validate

    print("\nlinear in actions: 1F1B with one microbatch (2 actions per rank)")
    for ranks in (4000, 20000):
        schedule = get_schedule("1F1B", ranks, 1)
        vw, vc, problems = timed(lambda: validate(schedule))
        sw, sc, _ = timed(lambda: simulate(schedule))
        print(f"  {ranks} ranks ({schedule.num_actions} actions): validate {vw:.2f} s wall / {vc:.2f} s CPU "
              f"({len(problems)} problems), simulate {sw:.2f} s wall / {sc:.2f} s CPU")


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, load average {_load()}")
    bench_simulate(QUICK_CASES if args.quick else CASES, args.repeats)
    bench_build_and_simulate(not args.quick, args.repeats, args.torch_repeats)
    if not args.quick:
        bench_cli(args.repeats)
        bench_linear()
    small = ("Interleaved1F1B", 64, 256, 2)
    bench_memory([small, ("Interleaved1F1B", 64, 1024, 2) if args.quick else ("Interleaved1F1B", 128, 1024, 4)])
    print(f"load average at the end {_load()}")


def _load() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    main()
