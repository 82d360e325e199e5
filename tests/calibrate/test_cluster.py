"""The Slurm recipe for real: `calibrate/slurm/calibrate-cpu.sbatch` submitted with `sbatch` to a running cluster.

Needs `sbatch` on PATH and a cluster whose node answers `sinfo` (`scripts/slurm-local.sh start` brings up a one-node
cluster on this machine; `.ci/run` does that before the test command). Without one every test here is skipped with
the reason; the tests never start or stop a cluster themselves. They check what a user relies on — the job writes a
profile that loads and is complete; a job cancelled half-way and resubmitted with RESUME=1 completes and keeps what
was already measured — not the profile's fields, so they survive changes to the profile format.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ppsim.io import progress_path
from ppsim.profile import load_profile

pytest.importorskip("torch")
pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "calibrate" / "slurm" / "calibrate-cpu.sbatch"
GPU_RECIPE = REPO / "calibrate" / "slurm" / "calibrate.sbatch"
JOB_TIMEOUT_S = 420.0
"""Generous: the node's two CPUs are shared with the rest of the suite, and a job may wait behind another one."""
KNOBS = ("PRESET", "STAGES", "OUT", "REPS", "RESUME", "EXTRA", "PYTHON", "MASTER_ADDR", "MASTER_PORT", "DEVICE",
         "GPUS_PER_NODE")
"""The recipe's environment interface."""
LOCAL_CLUSTER = "ppsim-local"
"""ClusterName in scripts/slurm-local.sh's slurm.conf: other clusters only with PPSIM_CLUSTER_TESTS=1."""
SMALL = "--warmup 1 --hidden 32 --heads 2 --ffn 64 --layers 4 --vocab 64 --seq-len 16 --mb-size 2"
"""A small custom model: the jobs exercise the recipes (launch, measure, write, resume), not the tiny preset's sizes."""
SUBMITTED: list[str] = []
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
           "STAGE_OUT"}


def _cluster_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None when a cluster answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return ("Slurm is not installed (no sbatch/sinfo on PATH); install slurm-wlm and munge and run "
                "scripts/slurm-local.sh start")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "no Slurm controller answered sinfo within 20 s; start one with scripts/slurm-local.sh start"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Slurm cluster is running (sinfo: {last}); start one with scripts/slurm-local.sh start"
    states = out.stdout.split()
    if not any(s.rstrip("*~#").startswith(("idle", "mix", "alloc")) for s in states):
        return f"the Slurm cluster has no usable node (sinfo states: {' '.join(states) or 'none'})"
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    name = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.MULTILINE)
    if (name.group(1) if name else "?") != LOCAL_CLUSTER and os.environ.get("PPSIM_CLUSTER_TESTS") != "1":
        return (f"the Slurm cluster here is '{name.group(1) if name else '?'}', not the local one of "
                f"scripts/slurm-local.sh; set PPSIM_CLUSTER_TESTS=1 to submit test jobs to it (pytest's --basetemp "
                "must then be on a file system its nodes share)")
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs() -> Any:
    """A test that fails or is interrupted leaves no job of its own running."""
    yield
    for job in SUBMITTED:
        if job_state(job) in RUNNING:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    SUBMITTED.clear()


def submit(tmp_path: Path, out: Path | None, *, recipe: Path = RECIPE, options: tuple[str, ...] = (), **env: str) -> str:
    """sbatch a recipe (the CPU one by default) from tmp_path; returns the job id."""
    job_env = {k: v for k, v in os.environ.items() if k not in KNOBS}  # only the knobs given here
    job_env.update(PYTHON=sys.executable, **env)
    if out is not None:
        job_env["OUT"] = str(out)
    cmd = ["sbatch", "--parsable", "--time=00:10:00", f"--chdir={tmp_path}", f"--output={tmp_path}/job-%j.log",
           *options, str(recipe)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=job_env, timeout=60)
    assert res.returncode == 0, f"sbatch failed: {res.stderr.strip()}"
    job = res.stdout.strip().split(";")[0]
    SUBMITTED.append(job)
    return job


def job_state(job: str) -> str:
    res = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    match = re.search(r"\bJobState=(\S+)", res.stdout)
    if res.returncode != 0 or not match:
        return "GONE"  # no longer known to the controller (older than MinJobAge): finished
    return match.group(1)


def log_of(tmp_path: Path, job: str) -> str:
    path = tmp_path / f"job-{job}.log"
    return path.read_text(errors="replace")[-4000:] if path.exists() else f"(no log at {path})"


def wait(tmp_path: Path, job: str, *, until: Any = None, timeout: float = JOB_TIMEOUT_S) -> str:
    """Poll until the job leaves the queue (returns its final state) or ``until()`` is true (returns "")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until is not None and until():
            return ""
        state = job_state(job)
        if state not in RUNNING:
            return state
        time.sleep(0.1 if until is not None else 0.5)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} did not finish within {timeout:.0f} s; log:\n{log_of(tmp_path, job)}")


def float_lists(node: Any) -> list[list[float]]:
    """Every list of two or more numbers in a JSON document (the raw samples of each measurement)."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in float_lists(v)]
    if isinstance(node, list):
        if len(node) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in node):
            return [node]
        return [x for v in node for x in float_lists(v)]
    return []


def test_cpu_recipe_writes_a_complete_profile(cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    job = submit(tmp_path, out, PRESET="tiny", STAGES="2", REPS="3", EXTRA=SMALL)
    state = wait(tmp_path, job)
    assert state in ("COMPLETED", "GONE"), f"job {job} ended {state}; log:\n{log_of(tmp_path, job)}"
    profile = load_profile(out)
    assert profile.complete, log_of(tmp_path, job)


def test_gpu_recipe_launch_runs_on_cpus(cluster: None, tmp_path: Path) -> None:
    """The GPU recipe's launch (srun, one torchrun per node, c10d rendezvous) with DEVICE=cpu and no GPUs."""
    out = tmp_path / "profile.json"
    job = submit(tmp_path, out, recipe=GPU_RECIPE, options=("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"),
                 DEVICE="cpu", GPUS_PER_NODE="2", PRESET="tiny", REPS="3",
                 EXTRA=f"{SMALL} --no-probe")  # the launch is under test; the CPU recipe's test covers the probe
    state = wait(tmp_path, job)
    assert state in ("COMPLETED", "GONE"), f"job {job} ended {state}; log:\n{log_of(tmp_path, job)}"
    profile = load_profile(out)
    assert profile.complete, log_of(tmp_path, job)


def test_cancelled_job_resumes_with_resume_1(cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    progress = progress_path(out)
    # The progress file (-o.partial) is rewritten after every finished measurement (the blocks, the per-stage
    # overhead, p2p, the runtime probes), so there is room to cancel the job once it shows one finished and before
    # the end; -o itself is written only by a finished calibration.
    same = {"PRESET": "tiny", "STAGES": "8", "REPS": "6", "EXTRA": SMALL}
    job = submit(tmp_path, out, **same)

    def partly_done() -> bool:
        try:
            profile = load_profile(progress, allow_incomplete=True)
        except Exception:  # noqa: BLE001 - not written yet
            return False
        return bool(profile.done) and not profile.complete

    state = wait(tmp_path, job, until=partly_done)
    assert state == "", f"job {job} ended {state} before any measurement was saved; log:\n{log_of(tmp_path, job)}"
    subprocess.run(["scancel", job], check=True, timeout=30)
    state = wait(tmp_path, job)
    assert state == "CANCELLED", f"job {job} ended {state}, not cancelled; log:\n{log_of(tmp_path, job)}"

    assert not out.exists(), "a cancelled calibration wrote -o"
    killed_text = progress.read_text()
    killed = load_profile(progress, allow_incomplete=True)
    assert not killed.complete and killed.done, f"the cancelled job left {killed.done}, complete={killed.complete}"
    with pytest.raises(Exception, match="complete"):
        load_profile(progress)  # an unfinished profile is refused without allow_incomplete

    again = submit(tmp_path, out, RESUME="1", **same)
    state = wait(tmp_path, again)
    assert state in ("COMPLETED", "GONE"), f"resumed job {again} ended {state}; log:\n{log_of(tmp_path, again)}"
    resumed = load_profile(out)
    assert resumed.complete, log_of(tmp_path, again)
    # The finished measurements were kept, not measured again: same order first, no key twice, samples unchanged.
    assert list(resumed.done[: len(killed.done)]) == list(killed.done)
    assert len(set(resumed.done)) == len(resumed.done), resumed.done
    resumed_lists = float_lists(json.loads(out.read_text()))
    kept = float_lists(json.loads(killed_text))
    assert kept, "the cancelled job's profile holds no samples"
    missing = [samples for samples in kept if samples not in resumed_lists]
    assert not missing, f"{len(missing)} of {len(kept)} sample lists of the cancelled job changed on resume"


def test_resume_without_out_is_refused(cluster: None, tmp_path: Path) -> None:
    job = submit(tmp_path, None, RESUME="1")
    state = wait(tmp_path, job)
    assert state == "FAILED" and "RESUME=1 needs OUT=" in log_of(tmp_path, job), f"{state}: {log_of(tmp_path, job)}"
    assert not list(tmp_path.glob("*.json")), "nothing was measured"
