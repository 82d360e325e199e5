"""The step model across nodes on this machine: two emulated nodes (``scripts/cluster-local.sh``, root needed).

    python bench/bench_cluster.py collectives [--repeats 2] [--max-size 64MiB]
    python bench/bench_cluster.py run [--repeats 2] [--profile llama.json] [--model llama|moe]
    python bench/bench_cluster.py floor [--repeats 2]

``collectives``: per repeat, (1) ``calibrate --collectives`` on 2 local processes inside node 0 (nodes=1 samples and
the in-node send_recv, the p2p), (2) a cross-node calibration A (torchrun, one per node), (3) another, B, the
measurement compared against. Table 1: every op across both nodes (2 ranks, 1 a node; 4 ranks, 2 a node) as the
cluster model prices it (``CollectiveCosts(...).seconds(kind, nbytes, group_size=, nodes=2)`` on
``bench/data/emulated-2x2-1gbit.toml``: its inter link from the file, its intra link fitted to calibration 1)
against B. Table 2: the same with both links fitted (``fit_links``) to A, never to B.

``run``: ``ppsim run`` of PP 2 x FSDP 2 (torchtitan llama3 debug model) under torchrun across the nodes with
``--cluster``, in two placements: one torchrun of 2 ranks a node (ranks node by node: torchtitan's mesh, PP
outermost, puts FSDP within a node and PP across), and one torchrun a rank with node ranks 0 and 2 on node 0 and 1
and 3 on node 1 (ranks dealt round the nodes: FSDP across, PP within), predicted on
``bench/data/emulated-2x2-1gbit-cyclic.toml`` (``rank_order = "cyclic"``). Predicted step before the run against
the measured one, and whether the placement predicted faster measures faster.

``floor``: a gloo all_reduce of 4 KiB-1 MiB on 2 and 4 local processes in one node (no link) and across the
nodes with 1 and 2 processes a node: what this host's scheduling adds to a small collective, link or not.

Every number is printed with the command that made it and the spread over repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SCRIPT = REPO / "scripts" / "cluster-local.sh"
PY = Path(sys.executable)
TORCHRUN = PY.parent / "torchrun"
CLUSTER = REPO / "bench" / "data" / "emulated-2x2-1gbit.toml"
CYCLIC = REPO / "bench" / "data" / "emulated-2x2-1gbit-cyclic.toml"
PREFIX = "bench"
ADDRS = ("10.77.0.1", "10.77.0.2")


def sh(args: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, text=True, capture_output=True, **kw)


def start_nodes(prefix: str) -> None:
    done = sh(["bash", str(SCRIPT), "start", "--nodes", "2", "--link", "1gbit", "--prefix", prefix])
    if done.returncode:
        sys.exit(f"cluster-local start failed: {done.stderr.strip()}")


def in_node(prefix: str, args: list[str], timeout: float = 600) -> str:
    cmd = ["bash", str(SCRIPT), "exec", "0", "--prefix", prefix, "--", str(PY), "-m", "ppsim.cli", *args]
    done = sh(cmd, timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"failed: {shlex.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def across(prefix: str, args: list[str], *, port: int, seats: tuple[tuple[int, int], ...] = ((0, 0), (1, 1)),
           timeout: float = 900, per_node: int = 2) -> tuple[list[str], str]:
    """One torchrun per seat ``(emulated node, --node-rank)`` with ``per_node`` ranks each (static rendezvous on
    node 0's address). Returns every torchrun's output and their commands."""
    procs, cmds = [], []
    for node, node_rank in seats:
        cmd = ["bash", str(SCRIPT), "exec", str(node), "--prefix", prefix, "--", str(TORCHRUN), "--nnodes",
               str(len(seats)), "--nproc-per-node", str(per_node), "--node-rank", str(node_rank), "--master-addr",
               ADDRS[0], "--master-port", str(port), "--local-addr", ADDRS[node], *args]
        cmds.append(cmd)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out, cmd in zip(procs, outs, cmds):
        if p.returncode:
            sys.exit(f"failed ({p.returncode}): {shlex.join(cmd)}\n{out[-3000:]}")
    return outs, " & ".join(shlex.join(c[c.index("--") + 1:]) for c in cmds)


def cmdline(args: list[str]) -> str:
    return "ppsim " + shlex.join(args)


# --------------------------------------------------------------------------------------------------- collectives
def samples(path: Path) -> list:
    from ppsim.calibrate.measure.collectives import samples_from_profile
    from ppsim.profile import load_profile

    return samples_from_profile(load_profile(path, allow_incomplete=True))


def compare(costs, measured: list) -> list[tuple]:
    rows = []
    for s in measured:
        if s.nodes < 2:
            continue
        pred = costs.seconds(s.kind, s.nbytes, group_size=s.ranks, nodes=s.nodes)
        rows.append((s.kind.value, s.ranks, s.nbytes, s.seconds, pred, pred / s.seconds - 1))
    return rows


def summary(rows: list[tuple]) -> tuple[float, float, str]:
    errs = [abs(r[5]) for r in rows]
    worst = max(rows, key=lambda r: abs(r[5]))
    return statistics.median(errs), max(errs), f"{worst[0]} {worst[1]} ranks {worst[2] / 2**20:g} MiB"


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}\n")
    print("| op | ranks (nodes 2) | size | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|")
    for op, ranks, nbytes, meas, pred, err in rows:
        size = f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes // 1024} KiB"
        print(f"| {op} | {ranks} | {size} | {meas * 1e3:.3f} | {pred * 1e3:.3f} | {err * 100:+.1f} % |")
    med, worst, where = summary(rows)
    print(f"\nmedian |error| {med * 100:.1f} %, worst {worst * 100:.1f} % ({where})")


def collectives(args: argparse.Namespace) -> None:
    from ppsim.step.cluster import load_cluster
    from ppsim.step.collectives import fit_links
    from ppsim.step.pricing import CollectiveCosts

    start_nodes(args.prefix)
    cluster = load_cluster(str(CLUSTER))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for rep in range(args.repeats):
        stamp = f"{rep}-{int(time.time())}"
        intra_path, a_path, b_path = (out / f"intra-{stamp}.json", out / f"cross-a-{stamp}.json",
                                      out / f"cross-b-{stamp}.json")
        intra_args = ["calibrate", "--collectives", "--max-size", args.max_size, "--cluster", str(CLUSTER), "-o",
                      str(intra_path)]
        in_node(args.prefix, intra_args)
        cross = ["-m", "ppsim.cli", "calibrate", "--collectives", "--max-size", args.max_size, "--cluster",
                 str(CLUSTER), "-o"]
        _, cmd_a = across(args.prefix, [*cross, str(a_path)], port=29650 + 2 * rep)
        _, cmd_b = across(args.prefix, [*cross, str(b_path)], port=29651 + 2 * rep)
        print(f"\n## repeat {rep + 1}\n\nin-node calibration (node 0, 2 local processes): "
              f"`scripts/cluster-local.sh exec 0 -- {cmdline(intra_args)}`\ncross-node A (fitted): `{cmd_a}`\n"
              f"cross-node B (compared): `{cmd_b}`")
        from ppsim.profile import load_profile

        # 1: intra link from the in-node calibration, inter link from the cluster file
        costs = CollectiveCosts.from_profile(load_profile(intra_path, allow_incomplete=True), cluster)
        model = costs.model_cluster()
        rows1 = compare(costs, samples(b_path))
        print_table(f"Table 1 (repeat {rep + 1}): in-node calibration + {CLUSTER.name}'s inter link "
                    f"(intra fitted {model.intra_node.bandwidth_Bps / 1e6:.0f} MB/s, "
                    f"{model.intra_node.latency_s * 1e6:.0f} us; inter {model.inter_node.bandwidth_Bps / 1e6:.1f} "
                    f"MB/s, {model.inter_node.latency_s * 1e6:.0f} us) vs cross-node B", rows1)
        # 2: both links fitted to cross-node calibration A
        intra, inter = fit_links(samples(a_path))
        fitted = dataclasses.replace(cluster, intra_node=intra or cluster.intra_node,
                                     inter_node=inter or cluster.inter_node)
        rows2 = compare(CollectiveCosts(cluster=fitted), samples(b_path))
        print_table(f"Table 2 (repeat {rep + 1}): links fitted to cross-node A (intra "
                    f"{fitted.intra_node.bandwidth_Bps / 1e6:.0f} MB/s, {fitted.intra_node.latency_s * 1e6:.0f} us; "
                    f"inter {fitted.inter_node.bandwidth_Bps / 1e6:.1f} MB/s, "
                    f"{fitted.inter_node.latency_s * 1e6:.0f} us) vs cross-node B", rows2)
        results.append((summary(rows1), summary(rows2)))
    print("\n## summary\n\n| repeat | table 1 median / worst | table 2 median / worst |\n|---|---|---|")
    for i, ((m1, w1, _), (m2, w2, _)) in enumerate(results):
        print(f"| {i + 1} | {m1 * 100:.1f} % / {w1 * 100:.1f} % | {m2 * 100:.1f} % / {w2 * 100:.1f} % |")
    if len(results) > 1:
        for k, name in ((0, "table 1"), (1, "table 2")):
            meds = [r[k][0] * 100 for r in results]
            print(f"{name}: median |error| over repeats {min(meds):.1f}-{max(meds):.1f} %")


# --------------------------------------------------------------------------------------------------------- floor
FLOOR_RANKS = REPO / "bench" / "_floor_ranks.py"


def floor(args: argparse.Namespace) -> None:
    """What the host adds below the link: a gloo all_reduce (4 KiB-1 MiB, median of 30) on 2 and 4 local processes
    inside node 0 (no link crossed), and across the nodes with 1 and 2 processes a node. Where the 4-process rows
    are far above the 2-process ones with no link at all, the time is the host's scheduling of more processes than
    cores, not the link: no collective model of a cluster holds it."""
    start_nodes(args.prefix)
    rows: dict[str, dict[int, list[float]]] = {}
    for rep in range(args.repeats):
        for local in (2, 4):
            cmd = ["bash", str(SCRIPT), "exec", "0", "--prefix", args.prefix, "--", str(TORCHRUN), "--standalone",
                   "--nproc-per-node", str(local), str(FLOOR_RANKS)]
            done = sh(cmd, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode:
                sys.exit(f"failed: {shlex.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            _floor_row(rows, f"{local} processes in node 0 (no link)", done.stdout,
                       shlex.join(cmd[cmd.index("--") + 1:]))
        for per_node in (1, 2):
            outs, cmd_text = across(args.prefix, [str(FLOOR_RANKS)], port=29690 + 2 * rep + per_node - 1,
                                    per_node=per_node, timeout=600)
            _floor_row(rows, f"{2 * per_node} processes, {per_node} a node (across the link)", "\n".join(outs),
                       cmd_text)
    sizes = sorted({n for by_size in rows.values() for n in by_size})
    print(f"\n| ranks | {' | '.join(_size(n) for n in sizes)} |\n|---|{'---|' * len(sizes)}")
    for name, by_size in rows.items():
        cells = [", ".join(f"{t * 1e3:.2f}" for t in by_size.get(n, [])) for n in sizes]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\n(ms per all_reduce, the median of 30 each repeat; {os.cpu_count()} cores on this host)")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _floor_row(rows: dict[str, dict[int, list[float]]], name: str, text: str, cmd: str) -> None:
    line = next(ln for ln in text.splitlines() if ln.startswith('{"floor"'))
    got = {int(k): v for k, v in json.loads(line)["floor"].items()}
    print(f"{name}: " + ", ".join(f"{_size(n)} {t * 1e3:.2f} ms" for n, t in sorted(got.items())) + f": `{cmd}`")
    for n, t in got.items():
        rows.setdefault(name, {}).setdefault(n, []).append(t)


# ----------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> None:
    start_nodes(args.prefix)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    moe = args.model == "moe"  # PP 2 x EP 2 (EP carved out of dp_shard 2): the all-to-alls cross or stay in a node
    profile = Path(args.profile) if args.profile else out / ("deepseek-debug-ep2.json" if moe else "llama3-debug.json")
    model = (["--model", "torchtitan:deepseek_v3/debugmodel", "--seq-len", "32", "--dtype", "float32", "--ep", "2"]
             if moe else ["--model", "torchtitan:llama3/debugmodel", "--layers", "4", "--seq-len", "256", "--mb-size",
                          "1"])
    if not profile.exists():
        cal = ["calibrate", *model, "--warmup", "3", "--reps", "20", "-o", str(profile)]  # with its runtime probes
        in_node(args.prefix, cal, timeout=900)
        print(f"profile: `{cmdline(cal)}`")
        cross = ["-m", "ppsim.cli", "calibrate", "--collectives", "--max-size", "16MiB", "--cluster", str(CLUSTER),
                 "-o", str(profile)]
        _, cmd = across(args.prefix, cross, port=29670)
        print(f"collectives into it: `{cmd}`")
    # torchtitan's mesh puts PP outermost: ranks numbered node by node (one torchrun of 2 a node) put FSDP within a
    # node and PP across; one torchrun a rank with node ranks 0 and 2 on node 0 deals the ranks round the nodes
    # (rank_order = "cyclic"): FSDP across, PP within
    dim = "EP" if moe else "FSDP"
    placements = {f"PP across nodes, {dim} within": (((0, 0), (1, 1)), 2, CLUSTER),
                  f"{dim} across nodes, PP within": (((0, 0), (1, 1), (0, 2), (1, 3)), 1, CYCLIC)}
    rows = {name: [] for name in placements}
    for rep in range(args.repeats):
        for k, (name, (seats, per_node, cluster)) in enumerate(placements.items()):
            path = out / f"run-{'pp' if k == 0 else dim.lower()}-across-{rep}.json"
            cli = ["run", "--profile", str(profile), "-s", "1F1B", "-r", "2", "-m", "4", "--dp-shard", "2",
                   *(["--ep", "2"] if moe else []), "--steps", str(args.steps), "--warmup", "2", "--cluster",
                   str(cluster), "--json"]
            outs, cmd = across(args.prefix, ["-m", "ppsim.cli", *cli], port=29680 + rep * 2 + k, seats=seats,
                               per_node=per_node)
            text = next(o for o in outs if '"measured_step_s"' in o)
            doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
            path.write_text(json.dumps(doc, indent=1))
            meas, pred = doc["measured_step_s"], doc["predicted_step_s"]
            rows[name].append((meas, pred))
            print(f"{name} (repeat {rep + 1}): measured {meas:.3f} s, predicted {pred:.3f} s "
                  f"({(pred / meas - 1) * 100:+.1f} %): `{cmd}`")
    print("\n| placement | measured s (repeats) | predicted s | median error |\n|---|---|---|---|")
    for name, got in rows.items():
        errs = [p / m - 1 for m, p in got]
        print(f"| {name} | {', '.join(f'{m:.3f}' for m, _ in got)} | {', '.join(f'{p:.3f}' for _, p in got)} | "
              f"{statistics.median(errs) * 100:+.1f} % |")
    (a, got_a), (b, got_b) = rows.items()
    faster_pred = a if statistics.median(p for _, p in got_a) < statistics.median(p for _, p in got_b) else b
    faster_meas = a if statistics.median(m for m, _ in got_a) < statistics.median(m for m, _ in got_b) else b
    print(f"\npredicted faster: {faster_pred}; measured faster (median): {faster_meas}; "
          f"{'agree' if faster_pred == faster_meas else 'DISAGREE'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("collectives", "run", "floor"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-size", default="64MiB")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--out", default="/tmp/bench-cluster")
    ap.add_argument("--profile")
    ap.add_argument("--model", choices=("llama", "moe"), default="llama",
                    help="run: llama (PP 2 x FSDP 2, the llama3 debug model) or moe (PP 2 x EP 2, DeepSeek-V3's debug "
                         "flavor, EP carved out of dp_shard 2)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", action="store_true", help="leave the nodes running at the end (default: stop them)")
    args = ap.parse_args()
    try:
        {"collectives": collectives, "run": run, "floor": floor}[args.what](args)
    finally:  # what the bench started ends with it, unless asked to keep the nodes
        if not args.keep:
            sh(["bash", str(SCRIPT), "stop", "--prefix", args.prefix])


if __name__ == "__main__":
    main()
