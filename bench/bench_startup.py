"""Start-up and end-to-end benchmark of the `ppsim` command (not a test; timings depend on the machine and its load).

    python bench/bench_startup.py                       # everything (torch part only if torch is installed)
    python bench/bench_startup.py --repeats 10
    python bench/bench_startup.py --vs /path/to/other/.venv/bin/ppsim --skip-torch   # before vs after, one run

Prints, each with its command and min / median / max of the repeats (wall, and CPU = user + sys of the child):
`ppsim --version` and `ppsim list` (target <= 0.10 s median each); `ppsim simulate -s Interleaved1F1B -r 64 -m 256
-v 2 --json` (65,536 actions) end to end against torch's in-process build of the same order
(`get_schedule_ops(..., with_comms=False)`), measured in this one run, with the ratio of the medians (target >= 10x);
and the 1M-action run (Interleaved1F1B r128 m1024 v4, target <= 1.0 s end to end). With ``--vs CMD`` each command is
also run as ``CMD ARGS`` (another checkout's ppsim), the two in turn, and the ratio of their medians is printed.

With PYTHONDONTWRITEBYTECODE set, nothing caches the compiled modules and every run compiles the edited ones again:
run ``python -m compileall -q ppsim`` in each checkout first, or the comparison measures the compiler.

Measured on the shared 2-core machine (Intel Xeon; 2 cores shared with other work, load average 12-13 during the
runs, so wall times are inflated and CPU = user + sys is the steadier figure), one venv and Python for both sides:
"main" is 1a3924e, "branch" this change, each run as ``env PYTHONPATH=CHECKOUT python ENTRY ARGS`` with compiled
modules, the two in turn; median [min-max] seconds, ratio branch / main of the medians:

| command | runs | main CPU | branch CPU | ratio | main wall | branch wall |
|---|---|---|---|---|---|---|
| `ppsim --version` | 20 | 0.081 [0.075-0.088] | 0.027 [0.024-0.030] | 0.33 | 0.166 | 0.056 |
| `ppsim list` | 20 | 0.123 [0.118-0.129] | 0.081 [0.077-0.088] | 0.66 | 0.306 | 0.203 |
| `ppsim simulate` 65,536 actions | 10 | 0.346 [0.332-0.388] | 0.219 [0.208-0.241] | 0.63 | 1.165 | 0.651 |
| `ppsim simulate` 1,048,576 actions | 10 | 1.117 [1.068-1.209] | 0.983 [0.949-1.110] | 0.88 | 2.794 | 2.583 |

On the same machine idle (load 0.5), `ppsim list` took 0.085 s wall [0.083-0.091] against main's 0.128 s (before
the collector pause, which saves about 5 ms more). torch's in-process build of the 65,536-action order took 2.49 s
CPU [2.29-2.67] (7.2 s wall) in the same run as the table's 65,536 row: 11.4x the branch's CPU (11.1x wall; main:
7.2x). See docs/architecture.md (start-up) for what each saving is.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
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


def run_once(cmd: list[str]) -> tuple[float, float]:
    """Wall and child CPU seconds of one run of ``cmd`` (which must succeed)."""
    w0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[:200]}")
    return time.perf_counter() - w0, _children_cpu() - c0


def run_cli(prefixes: list[list[str]], args: list[str], repeats: int) -> list[tuple[list[float], list[float]]]:
    """Wall and CPU seconds of ``PREFIX ARGS`` for each prefix: one warm-up each (not counted), then ``repeats``
    rounds running every prefix in turn (so a change in the machine's load hits them alike)."""
    for prefix in prefixes:
        run_once(prefix + args)
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in prefixes]
    for _ in range(repeats):
        for (walls, cpus), prefix in zip(out, prefixes):
            wall, cpu = run_once(prefix + args)
            walls.append(wall)
            cpus.append(cpu)
    return out


def report(label: str, walls: list[float], cpus: list[float], target: str = "") -> None:
    print(f"  {label}: wall {spread(walls)}, CPU {spread(cpus)}{target}")


def measure(prefixes: list[list[str]], args: list[str], repeats: int, label: str,
            target: str = "") -> tuple[list[float], list[float]]:
    """Time ``ppsim ARGS`` (and the baseline's, with --vs); print each and the ratio; this checkout's times."""
    results = run_cli(prefixes, args, repeats)
    report(label, *results[0], target=target)
    if len(results) > 1:
        (walls, cpus), (base_walls, base_cpus) = results
        report(f"  baseline {' '.join(prefixes[1])}", base_walls, base_cpus)
        print(f"    this / baseline (medians): wall {statistics.median(walls) / statistics.median(base_walls):.2f}, "
              f"CPU {statistics.median(cpus) / statistics.median(base_cpus):.2f}")
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vs", metavar="CMD", help="a baseline ppsim command (e.g. another checkout's venv's ppsim)")
    parser.add_argument("--skip-torch", action="store_true", help="leave out torch's build (and the ratio)")
    args = parser.parse_args()
    n = args.repeats
    prefixes = [ppsim_command()] + ([shlex.split(args.vs)] if args.vs else [])
    print(f"ppsim start-up and end to end (min / median / max of {n}, after one warm-up run)")
    for cmd in (["--version"], ["list"]):
        measure(prefixes, cmd, n, "ppsim " + " ".join(cmd), target="  (target <= 0.10 s median)")

    walls, cpus = measure(prefixes, SIM_65K, n, "ppsim " + " ".join(SIM_65K) + " (65,536 actions)")
    if args.skip_torch or importlib.util.find_spec("torch") is None:
        print("  torch: skipped (--skip-torch, or not installed); no ratio")
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

    measure(prefixes, SIM_1M, n, "ppsim " + " ".join(SIM_1M) + " (1,048,576 actions)",
            target="  (target <= 1.0 s median)")


if __name__ == "__main__":
    main()
