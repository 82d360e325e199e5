"""Step time of PP x FSDP runs, predicted before each run (issue 23 item 5): PP 2 x FSDP 2 on 4 CPU ranks (gloo),
several schedules, two torchtitan debug models (not a test; needs torchtitan, about 10 minutes on a 2-core VM).

    python bench/bench_steptime.py --out /tmp/steptime-bench              # calibrates each model once, first
    python bench/bench_steptime.py --out /tmp/steptime-bench --only 1,3   # some cases

Each model's profile is calibrated once, before any run (`ppsim calibrate --model M`, p2p and the FSDP collectives
measured, kept in --out; never fitted on a run). Every case is one `ppsim run ... --dp-shard 2 --profile P --json`
in a fresh process: its prediction is made before it runs (``ppsim.step.build.build_step``: the pipeline's simulated
step
with FSDP's exposed all-gathers and reduce-scatters costed from the profile's measured collectives, the cores shared
by processor sharing with the profile's time-sharing scale, ``runtime.shared_scale``), then it runs
``--steps`` timed steps. With ``--twins`` each case is followed by the same run without FSDP (``--dp-shard 1``), so
the FSDP increment (dp 2 minus dp 1) can be compared, predicted against measured.

Printed per case: predicted step; measured median, min and max of the timed steps; |error| against the median and
against the minimum (the fairer figure on a shared machine: the load of other jobs only adds time); the spread
(max - min over median); the 1-minute load average before and after. Target (issue 23): |error| median <= 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _runs import calibrated, sh  # bench/ is on sys.path when run as a script

MODELS = {"llama3": "torchtitan:llama3/debugmodel", "deepseek_v3": "torchtitan:deepseek_v3/debugmodel"}
CASES: list[tuple[str, str]] = [
    ("llama3", "GPipe"),
    ("llama3", "1F1B"),
    ("llama3", "Interleaved1F1B"),
    ("llama3", "ZBVZeroBubble"),
    ("deepseek_v3", "1F1B"),
    ("deepseek_v3", "Interleaved1F1B"),
]


def profile_of(name: str, out: Path) -> Path:
    """The model's profile, calibrated once before any run (kept in ``out``)."""
    return calibrated(out / f"{name}.json", MODELS[name])


def load1() -> float:
    return os.getloadavg()[0]


def run_one(name: str, schedule: str, dp: int, out: Path, *, steps: int, tag: str) -> dict | None:
    target = out / f"{tag}.json"
    cmd = ["ppsim", "run", "-s", schedule, "-r", "2", "-m", "4", "--dp-shard", str(dp),
           "--profile", str(profile_of(name, out)), "--steps", str(steps), "--warmup", "1", "--probes", "0",
           "-o", str(target)]
    before = load1()
    done = sh(cmd)
    if done.returncode != 0 or not target.exists():
        print(f"  {tag} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}")
        return None
    data = json.loads(target.read_text())
    data["load"] = (before, load1())
    data["fsdp_notes"] = [n for n in data["prediction_inputs"]["notes"] if n.startswith("FSDP (dp_shard")
                          or "share" in n and "CPU cores" in n]
    return data


def largest_gap(data: dict) -> tuple[float, str]:
    """The longest time a rank spent between two of its actions not waiting for an input (FSDP's collectives and
    the runtime's own work sit there), with the pair."""
    best = (0.0, "")
    for rank in sorted({a["rank"] for a in data["per_action"]}):
        acts = sorted((a for a in data["per_action"] if a["rank"] == rank), key=lambda a: a["start_s"])
        for a, b in zip(acts, acts[1:]):
            gap = b["start_s"] - a["end_s"] - b["wait_s"]
            if gap > best[0]:
                best = (gap, f"r{rank} {a['action']}->{b['action']}")
    return best


def row(data: dict) -> dict:
    pred = data["predicted_step_s"]
    med = data["measured_step_s"]
    lo, hi = data["measured_step_spread_s"]
    return {"pred": pred, "med": med, "min": lo, "max": hi, "err_med": 100 * (pred - med) / med,
            "err_min": 100 * (pred - lo) / lo, "spread": 100 * (hi - lo) / med, "load": data["load"],
            "gap": largest_gap(data)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/ppsim-bench-steptime"))
    parser.add_argument("--only", default=None, help="case numbers, e.g. 1,3")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (at least 3)")
    parser.add_argument("--twins", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each case without FSDP (dp 1) to compare the FSDP increment")
    opts = parser.parse_args()
    if opts.steps < 3:
        sys.exit("--steps: at least 3 timed steps, for a spread")
    opts.out.mkdir(parents=True, exist_ok=True)
    only = None if opts.only is None else {int(x) for x in opts.only.split(",")}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    for name in sorted({n for n, _ in CASES}):
        profile_of(name, opts.out)  # every calibration before the first run
    results = []
    for i, (name, schedule) in enumerate(CASES, 1):
        if only is not None and i not in only:
            continue
        data = run_one(name, schedule, 2, opts.out, steps=opts.steps, tag=f"case{i}_dp2")
        twin = run_one(name, schedule, 1, opts.out, steps=opts.steps, tag=f"case{i}_dp1") if opts.twins else None
        if data is None:
            continue
        results.append((i, name, schedule, row(data), None if twin is None else row(twin), data["fsdp_notes"]))
    print(f"\n{'case':34s} {'pred s':>7s} {'med s':>7s} {'min s':>7s} {'max s':>7s} {'err/med':>8s} "
          f"{'err/min':>8s} {'spread':>7s}  load 1-min   | dp1: pred  med   min  | FSDP increment pred / med / min")
    for i, name, schedule, r, t, _ in results:
        line = (f"{i:2d} {name:12s} {schedule:18s} {r['pred']:7.3f} {r['med']:7.3f} {r['min']:7.3f} {r['max']:7.3f} "
                f"{r['err_med']:+7.1f}% {r['err_min']:+7.1f}% {r['spread']:6.1f}%  "
                f"{r['load'][0]:4.1f}-{r['load'][1]:4.1f}")
        if t is not None:
            line += (f"   | {t['pred']:.3f} {t['med']:.3f} {t['min']:.3f} | {r['pred'] - t['pred']:+.3f} / "
                     f"{r['med'] - t['med']:+.3f} / {r['min'] - t['min']:+.3f}")
        print(line)
    print("\nlargest time between two actions of a rank not spent waiting for an input (dp 2 runs; the median step's):")
    for i, name, schedule, r, _t, _n in results:
        print(f"{i:2d} {name:12s} {schedule:18s} {1e3 * r['gap'][0]:7.1f} ms  {r['gap'][1]}")
    if results:
        rows = [r for _, _, _, r, _, _ in results]
        each_med = ", ".join(f"{r['err_med']:+.0f}%" for r in rows)
        each_min = ", ".join(f"{r['err_min']:+.0f}%" for r in rows)
        spreads = ", ".join(f"{r['spread']:.0f}%" for r in rows)
        print(f"\nstep time, PP 2 x FSDP 2 runs ({len(rows)}): |error| against the median step: median "
              f"{statistics.median(abs(r['err_med']) for r in rows):.1f}% (each {each_med}); against the minimum "
              f"step: median {statistics.median(abs(r['err_min']) for r in rows):.1f}% (each {each_min}); spread "
              f"{spreads} (target: median <= 10%)")
        for i, *_, notes in results[:1]:
            for n in notes:
                print(f"prediction note (case {i}): {n}")
    print(f"machine after: load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
