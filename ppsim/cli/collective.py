"""`ppsim collective`: one collective's predicted time on a cluster, as nccl-tests prints it; and the cluster
table of `ppsim list --clusters`."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import user_errors
from ppsim.cli.options import ClusterOpt, JsonOpt
from ppsim.cli.output import console, echo_json
from ppsim.errors import PPSimError


class Backend(str, Enum):
    nccl = "nccl"
    gloo = "gloo"


@app.command("collective")
@user_errors
def collective_cmd(
    op: Annotated[str, typer.Option("--op", help="all_gather, reduce_scatter, all_reduce, all_to_all or send_recv.")],
    ranks: Annotated[int, typer.Option("--ranks", "-r", help="Ranks in the group.")],
    size: Annotated[str, typer.Option("--size", help="Bytes, nccl-tests' size: 64MiB, 1GB or digits.")],
    nodes: Annotated[Optional[int], typer.Option(
        "--nodes", help="Nodes the ranks spread over evenly (default: as few whole nodes as hold them).")] = None,
    cluster: ClusterOpt = None,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="Profile JSON from `ppsim calibrate --collectives`: its measured samples replace the "
        "model at the placements it measured (and its links, measured on this cluster, the cluster's).")] = None,
    backend: Annotated[Optional[Backend], typer.Option(
        "--backend", case_sensitive=False, help="Collective library (default: the cluster's).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """One collective's predicted time, algorithm and bandwidths (nccl-tests' sizes and bus bandwidth)."""
    from ppsim.io import parse_bytes
    from ppsim.step.cluster import load_cluster
    from ppsim.step.collectives import Measured, Sample, Span, predict
    from ppsim.step.kinds import CollectiveKind

    try:
        kind = CollectiveKind.parse(op)
    except ValueError as exc:
        raise PPSimError(f"--op {exc}") from None
    if ranks < 1:
        raise PPSimError(f"--ranks {ranks}: a collective needs at least 1 rank; give a positive count")
    if nodes is not None and nodes < 1:
        raise PPSimError(f"--nodes {nodes}: a group spans at least 1 node; give a positive count")
    nbytes = parse_bytes(size, option="--size")
    assert nbytes is not None
    chosen = load_cluster("h100" if cluster is None else cluster).with_backend(
        backend.value if backend is not None else None)
    if nodes is None:
        nodes = chosen.nodes_for(ranks)
    elif ranks % nodes:
        raise PPSimError(f"--ranks {ranks} over --nodes {nodes}: ranks spread evenly over nodes; use a number of "
                         f"nodes that divides {ranks}")
    measured = None
    if profile is not None:  # read after every cheap check: a mistake above is the one line
        from ppsim.profile import load_profile
        from ppsim.step.pricing import CollectiveCosts

        costs = CollectiveCosts.from_profile(load_profile(profile, allow_incomplete=True), chosen)
        warning = costs.mismatch()
        if warning:
            typer.echo(warning, err=True)
        measured = Measured.from_samples(Sample(CollectiveKind(m.op), m.group_size, m.nodes, b, t)
                                         for m in costs.measured for b, t in m.points)
        chosen = costs.model_cluster() or chosen
    result = predict(kind, nbytes, Span(ranks, nodes), chosen, measured=measured)
    if json_out:
        echo_json({**result.to_dict(), "cluster": chosen.name, "backend": chosen.backend})
        return
    typer.echo(f"{kind.value}  {nbytes} B  {result.seconds * 1e6:.1f} us  algbw {result.algbw_Bps / 1e9:.2f} GB/s  "
               f"busbw {result.busbw_Bps / 1e9:.2f} GB/s  {result.algorithm}/{result.protocol}  {ranks} ranks on "
               f"{nodes} node(s)  ({chosen.name}, {chosen.backend})")


def print_clusters(*, json_out: bool) -> None:
    """`ppsim list --clusters`: every cluster preset, as a table or JSON."""
    from ppsim.step.cluster import list_presets

    rows: list[dict[str, Any]] = [{**c.to_dict(), "aliases": list(c.aliases)} for c in list_presets()]
    if json_out:
        echo_json(rows)
        return
    from rich.table import Table

    table = Table(title="ppsim clusters")
    for col in ("cluster", "GPUs/node", "intra GB/s", "NICs x GB/s", "device", "memory", "source"):
        table.add_column(col, overflow="fold")
    for r in rows:
        name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        intra, inter, dev = r["intra_node"], r["inter_node"], r["device"]
        table.add_row(name, str(r["gpus_per_node"]), f"{intra['bandwidth_GBps']:g}",
                      f"{r['nics_per_node']} x {inter['bandwidth_GBps']:g}", f"{dev['name']} ({r['backend']})",
                      f"{dev['memory_GiB']:.4g} GiB", r["source"])
    console().print(table)
