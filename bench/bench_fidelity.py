"""How well does ppsim predict a real pipeline step? Calibrate on this machine, execute a set of configurations with
torch's pipeline runtime (`ppsim run`), and print predicted vs measured step time per configuration, with the
median and worst error per group.

    python bench/bench_fidelity.py                    # real 2-rank runs + synthetic runs up to 8 ranks
    python bench/bench_fidelity.py --only synthetic   # or: --only real
    python bench/bench_fidelity.py -o fidelity.json   # also keep every run JSON

Groups and targets (|error| of the step time; the prediction adds the runtime model fitted on probe steps that
alternate with the timed ones):
real, 2 ranks, the calibration model's tiny preset on CPU: median <= 5 %, worst <= 10 %; synthetic stages (sleep
their cost): median <= 3 %. The "costs only" column is the simulator on the profile alone, before the runtime
model (dispatch per computation, hand-off latency, per-stage compute scale) is added. "spread" is how much the
timed steps of a run differ from each other, (slowest - fastest) / median: the noise floor of that run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS = {"real": (5.0, 10.0), "synthetic": (3.0, None)}
SYNTHETIC_COSTS = "F=1,B=2,I=1,W=1,FB=3"


@dataclass(frozen=True)
class Config:
    group: str  # "real" or "synthetic"
    schedule: str
    num_ranks: int
    num_microbatches: int
    num_stages_per_rank: int | None = None
    costs: str | None = None  # synthetic: cost string (None: the calibrated profile's costs)

    @property
    def label(self) -> str:
        v = f" v={self.num_stages_per_rank}" if self.num_stages_per_rank else ""
        src = "" if self.group == "real" else (" costs" if self.costs else " profile")
        return f"{self.schedule} r={self.num_ranks} m={self.num_microbatches}{v}{src}"


REAL = [
    Config("real", "GPipe", 2, 4),
    Config("real", "1F1B", 2, 4),
    Config("real", "1F1B", 2, 8),
    Config("real", "ZBH1", 2, 4),
    Config("real", "ZBH2", 2, 6),
    Config("real", "Interleaved1F1B", 2, 4, 2),
    Config("real", "InterleavedZeroBubble", 2, 4, 2),
    Config("real", "ZBVZeroBubble", 2, 4),
    Config("real", "DualPipeV", 2, 4),
]
SYNTHETIC = [
    Config("synthetic", "GPipe", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "1F1B", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "Interleaved1F1B", 4, 8, 2, costs=SYNTHETIC_COSTS),
    Config("synthetic", "InterleavedZeroBubble", 4, 8, 2, costs=SYNTHETIC_COSTS),
    Config("synthetic", "ZBH1", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "ZBH2", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "ZBVZeroBubble", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "DualPipeV", 4, 8, costs=SYNTHETIC_COSTS),
    Config("synthetic", "1F1B", 8, 16, costs=SYNTHETIC_COSTS),
    Config("synthetic", "DualPipeV", 8, 16, costs=SYNTHETIC_COSTS),
    Config("synthetic", "ZBH1", 2, 4),  # sleeps the calibrated profile's costs, real boundary tensors
]


def chain_length(cfg: Config) -> int:
    from ppsim.schedules import get_schedule

    return len(get_schedule(cfg.schedule, cfg.num_ranks, cfg.num_microbatches, cfg.num_stages_per_rank).pipelines[0])


def calibrate_profiles(chains: set[int], folder: Path, reps: int) -> dict[int, Path]:
    from ppsim.calibrate.model import get_preset
    from ppsim.calibrate.run_cmd import calibrate_here

    out: dict[int, Path] = {}
    for n in sorted(chains):
        path = folder / f"tiny_{n}stages.json"
        if not path.exists():
            t0 = time.perf_counter()
            calibrate_here(get_preset("tiny"), n, "cpu", save_to=path, reps=reps)
            print(f"calibrated {n} stages in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
        out[n] = path
    return out


def run_one(cfg: Config, profiles: dict[int, Path], *, steps: int, warmup: int, time_unit: float) -> dict[str, Any]:
    from ppsim.calibrate.run_cmd import RunOptions, execute

    profile = profiles.get(chain_length(cfg)) if cfg.costs is None else None
    report = execute(
        RunOptions(
            schedule=cfg.schedule, num_ranks=cfg.num_ranks, num_microbatches=cfg.num_microbatches,
            num_stages_per_rank=cfg.num_stages_per_rank, profile=profile, costs=cfg.costs,
            synthetic=cfg.group == "synthetic", time_unit_s=time_unit, num_steps=steps, num_warmup=warmup,
        )
    )
    assert report is not None
    return report.data


def spread(data: dict[str, Any]) -> float:
    """How much the timed steps of one run differ: (slowest - fastest) / median. Large on a busy or shared host."""
    steps = data["measured_steps_s"]
    return (max(steps) - min(steps)) / statistics.median(steps)


def summarize(rows: list[tuple[Config, dict[str, Any]]]) -> bool:
    ok = True
    header = (f"{'group':<10} {'configuration':<42} {'measured':>10} {'spread':>7} {'predicted':>10} {'error':>8} "
              f"{'costs only':>11} {'bubble m/p':>13} {'grads':>6}")
    print(header)
    print("-" * len(header))
    for cfg, d in rows:
        print(
            f"{cfg.group:<10} {cfg.label:<42} {d['measured_step_s'] * 1e3:>8.1f}ms {spread(d):>6.0%} "
            f"{d['predicted_step_s'] * 1e3:>8.1f}ms "
            f"{d['step_error_pct']:>+7.1f}% {d['step_error_costs_only_pct']:>+10.1f}% "
            f"{d['bubble_ratio_measured']:>6.1%}/{d['bubble_ratio_predicted']:<6.1%} "
            f"{'ok' if d['grad_ok'] and d['loss_match'] else 'BAD':>6}"
        )
        ok &= bool(d["grad_ok"] and d["loss_match"])
    print()
    for group, (median_target, worst_target) in TARGETS.items():
        errs = [abs(d["step_error_pct"]) for cfg, d in rows if cfg.group == group]
        if not errs:
            continue
        plain = [abs(d["step_error_costs_only_pct"]) for cfg, d in rows if cfg.group == group]
        med, worst = statistics.median(errs), max(errs)
        passed = med <= median_target and (worst_target is None or worst <= worst_target)
        ok &= passed
        target = f"median <= {median_target}%" + (f", worst <= {worst_target}%" if worst_target else "")
        print(f"{group:<10} |step error| median {med:.1f}%, worst {worst:.1f}% over {len(errs)} runs "
              f"(costs only: median {statistics.median(plain):.1f}%, worst {max(plain):.1f}%); "
              f"target {target}: {'PASS' if passed else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("real", "synthetic"), help="run one group only")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per run (default 3)")
    parser.add_argument("--time-unit", type=float, default=0.01, help="synthetic seconds per cost unit (0.01)")
    parser.add_argument("--reps", type=int, default=20, help="calibration repetitions per measurement (20)")
    parser.add_argument("--profiles", type=Path, help="folder to keep (and reuse) the calibrated profiles")
    parser.add_argument("-o", "--output", type=Path, help="write every run JSON here (one list)")
    args = parser.parse_args(argv)

    configs = [c for c in REAL + SYNTHETIC if args.only in (None, c.group)]
    with tempfile.TemporaryDirectory(prefix="ppsim-bench-") as tmp:
        folder = args.profiles or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        profiles = calibrate_profiles({chain_length(c) for c in configs if c.costs is None}, folder, args.reps)
        rows: list[tuple[Config, dict[str, Any]]] = []
        for cfg in configs:
            t0 = time.perf_counter()
            data = run_one(cfg, profiles, steps=args.steps, warmup=args.warmup, time_unit=args.time_unit)
            rows.append((cfg, data))
            print(f"{cfg.group} {cfg.label}: measured {data['measured_step_s'] * 1e3:.1f} ms, predicted "
                  f"{data['predicted_step_s'] * 1e3:.1f} ms ({data['step_error_pct']:+.1f}%) "
                  f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    print()
    ok = summarize(rows)
    if args.output is not None:
        from ppsim.io import write_atomic

        payload = [{"group": c.group, "label": c.label, **d} for c, d in rows]
        write_atomic(args.output, json.dumps(payload, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
