"""Check `ppsim plan` against real runs (issue 24, "Checked against real runs").

Plans the llama3 debug job on N CPU ranks with one or more profiles (each times the candidates whose microbatch it
measured) and a memory cap, then runs the plan's top candidates and a few others that fit with `ppsim run` (the
candidate's own overrides, the profile that covers it). The others are spread over the rest of the timed, fitting
candidates in the plan's order, from the next one to the slowest, so the check sees near ties and clear gaps alike.
Every candidate runs ``--rounds`` times, the rounds alternating in direction, so a slow phase of this shared host
falls on all of them; a candidate's measured step is the median of all its timed steps, its spread their min-max.

Prints, per candidate: the predicted step, the measured step and spread, the plan's peak memory per rank against
the measured allocator peak (the largest over the rounds), and the cap. Verdict: every pair of candidates whose
measured intervals do not overlap must be ordered as the plan orders them; no candidate the plan says fits may
measure above the cap.

    python bench/bench_plan_runs.py --gpus 2 --memory-cap 64MiB --out /tmp/plan_runs

The plan is made first, from the profile alone; no run feeds it. It judges memory with `--memory-as-run` (each
candidate as `ppsim run` holds it on the profile's device), the count a run's measured peak is compared with.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

PROFILE = "tests/data/llama3_debugmodel_s32_mem.profile.json"
JOB = ["--torchtitan-config", "llama3:llama3_debugmodel", "--training.seq_len", "32"]  # --seq-len changes the 32
MIB = 2 ** 20


def _sh(argv: list[str], *, stdout: Path | None = None) -> None:
    print("$", shlex.join(argv) + (f" > {stdout}" if stdout else ""), flush=True)
    with open(stdout, "w") if stdout else open(os.devnull, "w") as out:
        subprocess.run(argv, check=True, stdout=out)


def make_plan(*, gpus: int, cap: str, profiles: list[str], out: Path, time_limit: float) -> dict:
    path = out / f"plan_g{gpus}.json"
    given = [t for p in profiles for t in ("--profile", p)]
    _sh(["ppsim", "plan", *JOB, "--gpus", str(gpus), "--memory-cap", cap, *given, "--memory-as-run",
         "--time-limit", str(time_limit), "--top", "10", "--json", "-o", str(out / f"plan_g{gpus}.html")],
        stdout=path)
    return json.loads(path.read_text())


def pick(plan: dict, *, num_top: int, num_others: int, also: tuple[int, ...] = ()) -> list[tuple[int, dict]]:
    """The top candidates that fit and are timed (the plan's order, fastest first), then ``num_others`` spread
    evenly over the rest of them (the next one first, the slowest last), plus the plan ranks in ``also`` (1-based)."""
    timed = [(i, c) for i, c in enumerate(plan["candidates"]) if c["fits"] and c["step_s"] is not None]
    for i, c in timed:
        if not runnable(c):
            print(f"skipping plan #{i + 1} ({label(c)}): no pipeline: `ppsim run` executes pipelines only",
                  flush=True)
    timed = [(i, c) for i, c in timed if runnable(c)]
    first, rest = timed[:num_top], timed[num_top:]
    if num_others >= len(rest):
        first += rest
    elif num_others == 1:
        first.append(rest[0])
    elif num_others > 1:
        first += [rest[round(k * (len(rest) - 1) / (num_others - 1))] for k in range(num_others)]
    return first + [t for t in timed if t[0] + 1 in also and t not in first]


def covering(profiles: list[str], cand: dict) -> str:
    """The profile that measured the candidate's microbatch (``mb_size`` at the job's ``seq_len``); the plan timed
    the candidate from it."""
    for path in profiles:
        model = json.loads(Path(path).read_text())["model"]
        if model["mb_size"] == cand["microbatch_size"] and model["seq_len"] == int(JOB[-1]):
            return path
    sys.exit(f"no --profile measured microbatches of {cand['microbatch_size']} x {JOB[-1]} tokens ({label(cand)})")


def runnable(cand: dict) -> bool:
    """Whether `ppsim run` can execute the candidate: a pipeline (torchtitan's helpers need pp >= 2; DualPipe's two
    run on ppsim's chain executor over torchtitan's parts, FSDP and TP degrees too)."""
    return cand["pp"] > 1


def run_argv(cand: dict, *, profile: str, out: Path, steps: int, warmup: int) -> list[str]:
    overrides = [t for o in cand["overrides"] for t in o.split(" ", 1)]   # "key value" pairs
    # FSDP and TP degrees run as --dp-shard / --tp processes per pipeline rank (docs/run.md); the overrides stay, so
    # the job reads the same degrees (without a pipeline its gradient accumulation steps need the dp degree)
    extra: list[str] = []
    for key, flag in (("--parallelism.data_parallel_shard_degree", "--dp-shard"),
                      ("--parallelism.tensor_parallel_degree", "--tp")):
        if key in overrides:
            extra += [flag, overrides[overrides.index(key) + 1]]
    return ["ppsim", "run", *JOB[:2], *overrides, "--training.disable_cuda_graphs", *extra, "--profile", profile,
            "--steps", str(steps), "--warmup", str(warmup), "--json", "-o", str(out)]


def label(cand: dict) -> str:
    v = cand.get("stages_per_rank")
    searched = "searched " if cand.get("schedule_csv") else ""   # search's order, written as a schedule CSV
    return (f"pp{cand['pp']} tp{cand['tp']} dp{cand['dp_shard']} {searched}{cand['schedule']} m{cand['microbatches']}"
            f" v{v} {cand['recompute']}")


def row(rank: int, cand: dict, runs: list[dict], cap: int) -> dict:
    steps = sorted(s for run in runs for s in run["measured_steps_s"])
    meas = [max(m) for m in zip(*([m["peak_allocated_bytes_measured"] for m in run["memory"]] for run in runs))]
    return {"plan_rank": rank + 1, "label": label(cand), "pred_s": cand["step_s"],
            "meas_s": statistics.median(steps), "lo": steps[0], "hi": steps[-1], "plan_peak": cand["peak_memory_bytes"],
            "run_pred_peak": [m["peak_allocated_bytes_predicted"] for m in runs[0]["memory"]], "meas_peak": meas,
            "optimizer": [p.get("optimizer", 0) for p in cand.get("memory_parts") or []],
            "fits": cand["fits"], "over_cap": any(b > cap for b in meas)}


def verdict(rows: list[dict]) -> list[str]:
    lines = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["hi"] < b["lo"] or b["hi"] < a["lo"]:          # measured apart beyond both spreads
                agree = (a["pred_s"] < b["pred_s"]) == (a["meas_s"] < b["meas_s"])
                lines.append(f"#{a['plan_rank']} vs #{b['plan_rank']}: measured {a['meas_s']:.3f} vs "
                             f"{b['meas_s']:.3f} s, predicted {a['pred_s']:.3f} vs {b['pred_s']:.3f} s: "
                             + ("agrees" if agree else "DISAGREES"))
    return lines


def table(rows: list[dict], cap: int) -> str:
    mib = lambda xs: "/".join(f"{x / MIB:.1f}" for x in xs)  # noqa: E731
    out = ["| plan # | candidate | predicted step s | measured step s (median, min-max) | plan peak MiB per rank "
           "| run-predicted MiB | measured MiB | fits / cap |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fit = ("fits" if r["fits"] else "over") + (", measured OVER cap" if r["over_cap"] else ", measured under")
        out.append(f"| {r['plan_rank']} | {r['label']} | {r['pred_s']:.3f} | {r['meas_s']:.3f} ({r['lo']:.3f}-"
                   f"{r['hi']:.3f}) | {mib(r['plan_peak'])} | {mib(r['run_pred_peak'])} | {mib(r['meas_peak'])} "
                   f"| {fit} {cap / MIB:.0f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--memory-cap", default="64MiB")
    ap.add_argument("--profile", action="append", help=f"repeatable; default {PROFILE}")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--others", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="runs per candidate, alternating in direction")
    ap.add_argument("--time-limit", type=float, default=30)
    ap.add_argument("--out", type=Path, default=Path("/tmp/plan_runs"))
    ap.add_argument("--also", default="", help="more plan ranks to run, e.g. 9,12 (1-based)")
    ap.add_argument("--seq-len", type=int, default=32,
                    help="the job's training.seq_len (a profile covers its own seq_len x microbatch size)")
    a = ap.parse_args()
    JOB[-1] = str(a.seq_len)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (before)", flush=True)
    profiles = a.profile or [PROFILE]
    plan = make_plan(gpus=a.gpus, cap=a.memory_cap, profiles=profiles, out=a.out, time_limit=a.time_limit)
    cap = plan["memory_cap_bytes"]
    also = tuple(int(x) for x in a.also.split(",") if x)
    picked = pick(plan, num_top=a.top, num_others=a.others, also=also)
    runs: dict[int, list[dict]] = {rank: [] for rank, _ in picked}
    for r in range(a.rounds):
        for rank, cand in picked if r % 2 == 0 else picked[::-1]:
            path = a.out / f"run_g{a.gpus}_{rank + 1}_r{r + 1}.json"
            if not path.exists():
                _sh(run_argv(cand, profile=covering(profiles, cand), out=path, steps=a.steps, warmup=a.warmup))
            runs[rank].append(json.loads(path.read_text()))
    rows = [row(rank, cand, runs[rank], cap) for rank, cand in picked]
    print(f"machine: load average {os.getloadavg()[0]:.1f} (after); a candidate's spread is the min-max of its "
          f"timed steps over {a.rounds} round(s) of {a.steps}")
    print(table(rows, cap))
    checks = verdict(rows)
    print("\n".join(checks) or "no pair measured apart beyond the runs' spreads")
    bad = [c for c in checks if "DISAGREES" in c] + [r["label"] for r in rows if r["fits"] and r["over_cap"]]
    print(f"verdict: {len(checks) - sum('DISAGREES' in c for c in checks)}/{len(checks)} separable pairs agree; "
          f"{sum(r['over_cap'] for r in rows)} of {len(rows)} fitting candidates measured over the cap")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
