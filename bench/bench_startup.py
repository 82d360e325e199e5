"""Start-up and end-to-end benchmark of the `ppsim` command (not a test; timings depend on the machine and its load).

    python bench/bench_startup.py              # everything (torch part only if torch is installed)
    python bench/bench_startup.py --repeats 9

Prints, each with its command and min / median / max of the repeats (wall, and CPU = user + sys of the child):
`ppsim --version` and `ppsim list` (target <= 0.10 s median each; `farm-bench` is the project's yardstick for these);
`ppsim simulate -s Interleaved1F1B -r 64 -m 256 -v 2 --json` (65,536 actions) end to end against torch's in-process
build of the same order (`get_schedule_ops(..., with_comms=False)`), measured in this one run, with the ratio of the
medians (target >= 10x); and the 1M-action run (Interleaved1F1B r128 m1024 v4, target <= 1.0 s end to end).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import time

from bench_simulator import _children_cpu, spread, timed

SIM_65K = ["simulate", "-s", "Interleaved1F1B", "-r", "64", "-m", "256", "-v", "2", "--json"]
SIM_1M = ["simulate", "-s", "Interleaved1F1B", "-r", "128", "-m", "1024", "-v", "4", "--json"]


def ppsim_command() -> list[str]:
    exe = shutil.which("ppsim")
    return [exe] if exe else [sys.executable, "-m", "ppsim.cli"]


def run_cli(args: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """Wall and child CPU seconds of ``ppsim ARGS``, once as warm-up (not counted), then ``repeats`` times."""
    cmd = ppsim_command() + args
    walls, cpus = [], []
    for k in range(repeats + 1):
        w0, c0 = time.perf_counter(), _children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"ppsim {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[:200]}")
        if k:
            walls.append(time.perf_counter() - w0)
            cpus.append(_children_cpu() - c0)
    return walls, cpus


def report(label: str, walls: list[float], cpus: list[float], target: str = "") -> None:
    print(f"  {label}: wall {spread(walls)}, CPU {spread(cpus)}{target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.repeats
    print(f"ppsim start-up and end to end (min / median / max of {n}, after one warm-up run)")
    for cmd in (["--version"], ["list"]):
        report("ppsim " + " ".join(cmd), *run_cli(cmd, n), target="  (target <= 0.10 s median)")

    walls, cpus = run_cli(SIM_65K, n)
    report("ppsim " + " ".join(SIM_65K) + " (65,536 actions)", walls, cpus)
    if importlib.util.find_spec("torch") is None:
        print("  torch: not installed, the ratio is skipped")
    else:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        get_schedule_ops("Interleaved1F1B", 64, 256, 2, with_comms=False)  # warm-up, as for the CLI
        runs = [timed(lambda: get_schedule_ops("Interleaved1F1B", 64, 256, 2, with_comms=False))[:2]
                for _ in range(n)]
        tw, tc = [w for w, _ in runs], [c for _, c in runs]
        report("torch in-process get_schedule_ops('Interleaved1F1B', 64, 256, 2, with_comms=False)", tw, tc)
        ratio_wall = statistics.median(tw) / statistics.median(walls)
        print(f"  ratio torch build / ppsim end to end (medians): wall {ratio_wall:.1f}x, "
              f"CPU {statistics.median(tc) / statistics.median(cpus):.1f}x (target >= 10x)")

    report("ppsim " + " ".join(SIM_1M) + " (1,048,576 actions)", *run_cli(SIM_1M, n),
           target="  (target <= 1.0 s median)")


if __name__ == "__main__":
    main()
