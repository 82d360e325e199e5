"""Benchmarks for the figures; prints numbers, asserts nothing.

    python bench/bench_plot.py            # all
    python bench/bench_plot.py --runs 9   # more cold starts

1. Cold start of the headline command ``ppsim plot --schedule DualPipeV --ranks 4 --mb 10`` (a fresh process each
   run; target <= 1.3 s wall on an idle machine; on a shared one read the CPU seconds), beside a bare ``python -c pass`` and ``import ppsim.cli`` for scale, and the slowest
   imports of one run (``python -X importtime``), and whether torch or pandas were imported (they must not be).
2. Interactive HTML of DualPipeV 32 ranks x 256 microbatches (20,000+ actions): seconds and MB (targets 10 s, 25 MB).
3. Static PNGs at 8x64 and 32x256 for scale.
4. Big static figures, each a fresh ``ppsim plot`` process (seconds and peak memory): 2,000 ranks, and a
   1,048,576-action Interleaved1F1B (drawn as one image per row, see ``ppsim.viz.gantt.MAX_DRAWN_CELLS``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADLINE = ["plot", "--schedule", "DualPipeV", "--ranks", "4", "--mb", "10"]


def ppsim_command() -> list[str]:
    script = Path(sys.executable).with_name("ppsim")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ppsim.cli"]


def wall(cmd: list[str], cwd: str) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys) of one fresh process; a busy machine inflates CPU time least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cold_start(runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmds = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import ppsim.cli": [sys.executable, "-c", "import ppsim.cli"],
            "ppsim plot (headline)": [*ppsim_command(), *HEADLINE],
        }
        wall(cmds["ppsim plot (headline)"], tmp)  # warm the OS file cache and matplotlib's font cache once
        print(f"cold start, {runs} fresh processes each (seconds)")
        for name, cmd in cmds.items():
            runs_ = [wall(cmd, tmp) for _ in range(runs)]
            times, cpu = [w for w, _ in runs_], [c for _, c in runs_]
            print(f"  {name:<24} wall min {min(times):.3f}  median {statistics.median(times):.3f}  "
                  f"max {max(times):.3f}   cpu median {statistics.median(cpu):.3f}")
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c",
             "import sys; from ppsim.cli import main; sys.argv = ['ppsim', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print('HEAVY', [m for m in ('torch', 'pandas', 'matplotlib.pyplot') if m in sys.modules])",
             *HEADLINE],
            cwd=tmp, capture_output=True, text=True, check=True,
        )
        rows = []
        for line in out.stderr.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                rows.append((int(parts[1]), parts[2].rstrip()))
        top = [r for r in rows if not r[1].startswith("   ")]  # top-level imports only
        print("  slowest top-level imports (cumulative ms):")
        for us, name in sorted(top, reverse=True)[:8]:
            print(f"    {us / 1000:7.1f}  {name.strip()}")
        heavy = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY")]
        print(f"  torch/pandas/pyplot imported by the headline: {heavy[0].split(' ', 1)[1] if heavy else '?'}")


def big_html() -> None:
    from ppsim.schedules import get_schedule
    from ppsim.simulator import simulate
    from ppsim.viz import plot_to_file

    schedule = get_schedule("DualPipeV", 32, 256)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = simulate(schedule)
        t1 = time.perf_counter()
        path = plot_to_file(result, Path(tmp) / "big.html")
        t2 = time.perf_counter()
        size = path.stat().st_size
    print(f"DualPipeV 32x256 ({schedule.num_actions} actions) interactive HTML")
    print(f"  simulate {t1 - t0:.2f} s, write html {t2 - t1:.2f} s, total {t2 - t0:.2f} s, {size / 2**20:.1f} MiB")


def big_png() -> None:
    from ppsim.schedules import get_schedule
    from ppsim.simulator import simulate
    from ppsim.viz import plot_to_file

    print("static PNG (dpi 200)")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, mb in ((8, 64), (32, 256)):
            result = simulate(get_schedule("DualPipeV", ranks, mb))
            t0 = time.perf_counter()
            path = plot_to_file(result, Path(tmp) / f"g{ranks}.png", dpi=200)
            print(f"  DualPipeV {ranks}x{mb}: {time.perf_counter() - t0:.2f} s, {path.stat().st_size / 2**20:.1f} MiB")


def big_static() -> None:
    print("big static PNGs, fresh processes (wall s, peak RSS)")
    cases = [
        ["-s", "1F1B", "-r", "2000", "-m", "8"],
        ["-s", "Interleaved1F1B", "-r", "128", "-m", "1024", "-v", "4"],
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for args in cases:
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            t0 = time.perf_counter()
            subprocess.run([*ppsim_command(), "plot", *args, "-o", "big.png"], cwd=tmp, check=True, capture_output=True)
            elapsed = time.perf_counter() - t0
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far, in KiB
            note = "" if peak > before else " (peak not above an earlier run's)"
            size = (Path(tmp) / "big.png").stat().st_size
            print(f"  plot {' '.join(args)}: {elapsed:.2f} s, peak {peak / 2**10:.0f} MiB{note}, "
                  f"{size / 2**20:.1f} MiB png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per cold-start measurement")
    args = parser.parse_args()
    os.environ.setdefault("MPLBACKEND", "Agg")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    cold_start(args.runs)
    big_html()
    big_png()
    big_static()


if __name__ == "__main__":
    main()
