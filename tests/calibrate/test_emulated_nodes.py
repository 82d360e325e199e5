"""Two emulated nodes on this machine (`scripts/cluster-local.sh`): gloo jobs across a shaped link, and
`ppsim calibrate --collectives` across them.

The module fixture starts 2 nodes at 1gbit under its own prefix and stops them on teardown, whatever happened; without
root, `ip`, `tc` or network namespaces every test that needs them is skipped with the script's reason. The script's
refusals of bad arguments need none of that. No speed is asserted beyond what the link's rate makes impossible to
beat and a generous "slower than loopback" ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppsim.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cluster-local.sh"
TORCHRUN = Path(sys.executable).parent / "torchrun"
PREFIX = "ppsimtest"
LINK_BYTES_PER_S = 1e9 / 8
JOB_TIMEOUT_S = 120

PROBE = r'''
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
w = dist.get_world_size()
n = int(sys.argv[1])
shard = torch.zeros(n // 4 // w)
full = torch.zeros(shard.numel() * w)
op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
best = float("inf")
for _ in range(3):
    dist.barrier()
    t0 = time.perf_counter()
    op(full, shard)
    best = min(best, time.perf_counter() - t0)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"seconds": best, "world": w}), flush=True)
dist.destroy_process_group()
'''


def _script(*args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[str]]:
    """Two nodes at 1gbit (prefix ppsimtest); their addresses. Stopped on teardown even when a test failed."""
    pytest.importorskip("torch")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("ip or tc missing (iproute2): emulated nodes need both")
    if os.geteuid() != 0:
        pytest.skip("emulated nodes need root (network namespaces, veth pairs, tc)")
    _script("stop", "--prefix", PREFIX)  # a run killed earlier may have left its nodes
    started = _script("start", "--nodes", "2", "--link", "1gbit", "--prefix", PREFIX)
    try:
        if started.returncode == 2:
            pytest.skip(f"emulated nodes refused here: {started.stderr.strip()}")
        assert started.returncode == 0, started.stderr
        env = _script("env", "--prefix", PREFIX, check=True).stdout
        addrs = next(line.split("=", 1)[1] for line in env.splitlines() if "PPSIM_NODE_ADDRS=" in line)
        yield addrs.split(",")
    finally:
        _script("stop", "--prefix", PREFIX)


def _torchrun_across(addrs: list[str], args: list[str], *, per_node: int = 2, port: int = 29531,
                     cwd: Path = REPO) -> list[str]:
    """One torchrun per node (c10d rendezvous on node 0's address); every node's output. A job that outlives
    the timeout is killed, with every process it started."""
    procs = []
    try:
        for i, addr in enumerate(addrs):
            cmd = ["bash", str(SCRIPT), "exec", str(i), "--prefix", PREFIX, "--", str(TORCHRUN),
                   "--nnodes", str(len(addrs)), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", f"test{port}",
                   "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}", "--local-addr", addr, *args]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                          start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        outs = [p.communicate(timeout=JOB_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _result(outs: list[str]) -> dict[str, float]:
    line = next(ln for out in outs for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.torch
@pytest.mark.slow
def test_all_gather_across_nodes_is_limited_by_the_link(nodes: list[str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    size = 16 << 20
    across = _result(_torchrun_across(nodes, [str(probe), str(size)], port=29531))
    assert across["world"] == 4
    # a ring over 4 ranks, 2 a node: each node's link carries 3/4 of the gathered tensor each way
    floor = size * 3 / 4 / LINK_BYTES_PER_S
    assert across["seconds"] >= 0.8 * floor, across
    local = subprocess.run(["bash", str(SCRIPT), "exec", "0", "--prefix", PREFIX, "--", str(TORCHRUN),
                            "--standalone", "--nproc-per-node", "4", str(probe), str(size)],
                           capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stdout[-2000:] + local.stderr[-2000:]
    loopback = _result([local.stdout])
    assert across["seconds"] > 1.2 * loopback["seconds"], (across, loopback)


@pytest.mark.torch
@pytest.mark.slow
def test_calibrate_collectives_across_nodes(nodes: list[str], tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    logs = _torchrun_across(nodes, ["-m", "ppsim.cli", "calibrate", "--collectives", "--max-size", "64KiB",
                                    "--reps", "2", "-o", str(out)], port=29532)
    text = "\n".join(logs)
    assert "estimate" in text
    assert "FutureWarning" not in text and "DeprecationWarning" not in text
    profile = load_profile(out, allow_incomplete=True)
    placed = {(c.op, c.group_size, c.nodes) for c in profile.collectives}
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert {(op, 2, 1), (op, 2, 2), (op, 4, 2)} <= placed, placed
    assert {("send_recv", 2, 1), ("send_recv", 2, 2)} <= placed
    assert all(len(c.samples) == 3 for c in profile.collectives)  # 4, 16, 64 KiB
    from ppsim.calibrate.measure.collectives import samples_from_profile
    from ppsim.step.collectives import Measured

    measured = Measured.from_samples(samples_from_profile(profile))
    assert len(measured.points) == len(placed)


def test_bad_inputs_are_one_line() -> None:
    for args, fragment in ((["start", "--nodes", "0", "--link", "1gbit"], "--nodes 0"),
                           (["start", "--nodes", "2", "--link", "fast"], "--link fast"),
                           (["start", "--nodes", "2"], "--link"),
                           (["frobnicate"], "unknown command")):
        done = _script(*args, "--prefix", "ppsimbad")
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, done.stderr)


def test_stop_twice_is_fine() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("stop needs root and ip")
    for _ in range(2):
        done = _script("stop", "--prefix", "ppsimbad")
        assert done.returncode == 0, done.stderr
        assert "not running" in done.stdout


@pytest.mark.torch
def test_old_profile_collectives_read_as_one_node(tmp_path: Path) -> None:
    """A collective record written before ``nodes`` existed loads as one node; a new one keeps its count; a count
    below 1 is refused."""
    from ppsim.profile import CollectiveFit, P2PSample

    sample = P2PSample(bytes=4096, median_s=1e-4, p10_s=1e-4, p90_s=1e-4)
    new = CollectiveFit(op="all_gather", group_size=4, nodes=2, alpha_s=1e-5, beta_bytes_per_s=1e8,
                        fit_rel_error=0.0, samples=(sample,))
    old = new.to_dict()
    del old["nodes"]
    base = tmp_path / "base.json"
    assert subprocess.run([sys.executable, "-m", "ppsim.cli", "calibrate", "--collectives", "--max-size", "4KiB",
                           "--reps", "1", "--warmup", "0", "-o", str(base)], capture_output=True, text=True,
                          timeout=120).returncode == 0
    doc = json.loads(base.read_text())
    for records, nodes in (([old], 1), ([new.to_dict()], 2)):
        path = tmp_path / f"p{nodes}.json"
        path.write_text(json.dumps({**doc, "collectives": records}))
        (fit,) = load_profile(path, allow_incomplete=True).collectives
        assert (fit.op, fit.group_size, fit.nodes) == ("all_gather", 4, nodes)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "collectives": [{**old, "nodes": 0}]}))
    with pytest.raises(Exception, match="nodes"):
        load_profile(bad, allow_incomplete=True)


@pytest.mark.torch
@pytest.mark.slow
def test_run_across_nodes_predicts_with_the_cluster(nodes: list[str], tmp_path: Path) -> None:
    """One PP 2 x FSDP 2 step of torchtitan's llama3 debug model under torchrun across the 2 nodes, predicted with
    ``--cluster`` (2 ranks a node: torchtitan's mesh puts FSDP within a node and the PP hand-offs across)."""
    pytest.importorskip("torchtitan")
    cluster = tmp_path / "two-nodes.toml"
    cluster.write_text('name = "two-nodes"\ngpus_per_node = 2\nnodes = 2\nnics_per_node = 1\nbackend = "gloo"\n'
                       'intra_node = {bandwidth_GBps = 2, latency_us = 50}\n'
                       'inter_node = {bandwidth_GBps = 0.1196, latency_us = 50}\n'
                       'device = {name = "CPU", peak_tflops = 0.05, memory_GiB = 16}\n')
    model = ["--model", "torchtitan:llama3/debugmodel", "--layers", "2", "--seq-len", "32", "--mb-size", "1"]
    profile = tmp_path / "llama3.json"
    done = subprocess.run([sys.executable, "-m", "ppsim.cli", "calibrate", *model, "--warmup", "1", "--reps", "2",
                           "--no-probe", "-o", str(profile)], capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    outs = _torchrun_across(nodes, ["-m", "ppsim.cli", "run", "--profile", str(profile), "-s", "1F1B",
                                    "-r", "2", "-m", "2", "--dp-shard", "2", "--steps", "1", "--warmup", "1",
                                    "--probes", "0", "--cluster", str(cluster), "--json"], port=29533)
    text = next(out for out in outs if '"measured_step_s"' in out)
    doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert doc["measured_step_s"] > 0 and doc["predicted_step_s"] > 0
    notes = " ".join(doc["prediction_inputs"]["notes"])
    assert "sit on different nodes" in notes and "cross the network" in notes, notes
