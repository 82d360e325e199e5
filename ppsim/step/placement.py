"""Where each group of each parallel dimension sits: ranks on nodes, as torchtitan's device mesh orders them.

torchtitan 0.3.0 (``ParallelDims``) builds one mesh ``pp x dp_replicate x dp_shard x cp x tp``, TP innermost, and
``torchrun`` numbers the ranks node by node (``rank // gpus_per_node`` is the node: the ``block`` rank order; a
launcher that deals ranks round the nodes, as Slurm's ``--distribution=cyclic`` or one torchrun per rank with
``--node-rank`` dealt so, gives the ``cyclic`` order, ``rank % nodes``). So a group of dimension ``d`` is ``size``
ranks ``stride`` apart, ``stride`` the product of the dimensions inside ``d``:

==============  ===========================================  ==========================================
group           size                                         stride
==============  ===========================================  ==========================================
``tp``          tp                                           1
``cp``          cp                                           tp
``dp_shard``    dp_shard                                     cp x tp
``fsdp``        dp_shard x cp (the dense parameters' mesh)   tp
``dp_replicate``dp_replicate                                 dp_shard x cp x tp
``pp``          pp                                           dp_replicate x dp_shard x cp x tp
``ep``          ep (carved from ``dp_shard x cp x tp``)      1
``efsdp``       dp_shard x cp x tp / ep (the experts' FSDP)  ep
==============  ===========================================  ==========================================

(EP: torchtitan flattens ``dp_shard_in_ep x cp x tp`` into ``ep``, innermost, and shards the experts over the rest,
``dp_shard_mod_ep``; ``fsdp`` is strided over TP's ranks.) A group's :class:`~ppsim.step.collectives.Span` counts
the nodes its ranks touch and how many share one (the first group of each dimension; every group of a dimension
sits alike when the GPU count fills whole nodes, which :func:`place` requires). This module imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ppsim.errors import PPSimError
from ppsim.job.degrees import Degrees
from ppsim.step.collectives import Span

DIMENSIONS = ("tp", "cp", "dp_shard", "fsdp", "dp_replicate", "pp", "ep", "efsdp")


class PlacementError(PPSimError):
    """The job's ranks cannot be placed on the cluster's nodes (one line)."""


@dataclass(frozen=True)
class Group:
    """One dimension's group: ``size`` ranks ``stride`` apart."""

    name: str
    size: int
    stride: int


def groups(degrees: Degrees) -> dict[str, Group]:
    """Each dimension's group in torchtitan's mesh order (module docstring)."""
    d = degrees
    out = {
        "tp": Group("tp", d.tp, 1),
        "cp": Group("cp", d.cp, d.tp),
        "dp_shard": Group("dp_shard", d.dp_shard, d.cp * d.tp),
        "fsdp": Group("fsdp", d.dp_shard * d.cp, d.tp),
        "dp_replicate": Group("dp_replicate", d.dp_replicate, d.dp_shard * d.cp * d.tp),
        "pp": Group("pp", d.pp, d.dp_replicate * d.dp_shard * d.cp * d.tp),
    }
    if d.ep > 1:
        out["ep"] = Group("ep", d.ep, 1)
        out["efsdp"] = Group("efsdp", d.dp_shard * d.cp * d.tp // d.ep, d.ep)
    return out


def node_of(rank: int, gpus_per_node: int, nodes: int, rank_order: str = "block") -> int:
    """The node a rank runs on: ``block`` (torchrun's: node by node), ``cyclic`` (dealt round the nodes)."""
    return rank % nodes if rank_order == "cyclic" else rank // gpus_per_node


def span_of(group: Group, gpus_per_node: int, nodes: int = 0, rank_order: str = "block") -> Span:
    """The nodes the group's ranks (``0, stride, 2 stride, ...``) touch, and how many of them share one (``nodes``:
    the job's node count, which the ``cyclic`` order deals over)."""
    nodes = len({node_of(i * group.stride, gpus_per_node, nodes, rank_order) for i in range(group.size)})
    while group.size % nodes:  # an uneven spread (degrees not dividing a node): counted as the next even one
        nodes += 1
    return Span(group.size, nodes)


@dataclass(frozen=True)
class Placement:
    """The job's ranks on ``nodes`` nodes of ``gpus_per_node``: each dimension's group span, and for each pipeline
    hand-off (PP rank ``j`` to ``j + 1``) whether it leaves the node."""

    degrees: Degrees
    gpus_per_node: int
    nodes: int
    spans: Mapping[str, Span]
    pp_crosses: tuple[bool, ...]
    rank_order: str = "block"

    def span(self, name: str) -> Span:
        return self.spans.get(name, Span(1, 1))

    def pp_rank_nodes(self, j: int) -> tuple[tuple[int, int], ...]:
        """The nodes PP rank ``j``'s processes (its ``dp_replicate x dp_shard x cp x tp`` ranks) sit on, as
        ``(node, processes)`` pairs."""
        stride = groups(self.degrees)["pp"].stride
        count: dict[int, int] = {}
        for i in range(j * stride, (j + 1) * stride):
            node = node_of(i, self.gpus_per_node, self.nodes, self.rank_order)
            count[node] = count.get(node, 0) + 1
        return tuple(sorted(count.items()))

    def to_dict(self) -> dict[str, object]:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "groups": {k: {"ranks": s.ranks, "nodes": s.nodes, "ranks_per_node": s.ranks // s.nodes}
                           for k, s in self.spans.items() if s.ranks > 1},
                "pp_hops_across_nodes": sum(self.pp_crosses)}


def place(degrees: Degrees, gpus_per_node: int, *, cluster_name: str = "the cluster",
          rank_order: str = "block") -> Placement:
    """Place the job on nodes of ``gpus_per_node`` in ``rank_order`` (module docstring); a job of more GPUs than
    one node must fill whole nodes."""
    world = degrees.world_size
    if gpus_per_node < 1:
        raise PlacementError(f"gpus_per_node {gpus_per_node}: must be at least 1; fix {cluster_name}'s file")
    if world > gpus_per_node and world % gpus_per_node:
        raise PlacementError(f"{world} GPUs (pp x dp_replicate x dp_shard x cp x tp) do not fill whole nodes of "
                             f"{gpus_per_node} ({cluster_name}); use a multiple of {gpus_per_node} GPUs")
    nodes = max(1, -(-world // gpus_per_node))
    spans = {name: span_of(g, gpus_per_node, nodes, rank_order) for name, g in groups(degrees).items()}
    stride = groups(degrees)["pp"].stride
    crosses = tuple(node_of(j * stride, gpus_per_node, nodes, rank_order)
                    != node_of((j + 1) * stride, gpus_per_node, nodes, rank_order) for j in range(degrees.pp - 1))
    return Placement(degrees=degrees, gpus_per_node=gpus_per_node, nodes=nodes, spans=spans, pp_crosses=crosses,
                     rank_order=rank_order)
