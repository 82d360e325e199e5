"""The one collective cost model: how long one collective of ``nbytes`` takes on a group placed on a cluster.

Sizes follow nccl-tests' "size": all_gather the whole output buffer, reduce_scatter the whole input buffer,
all_reduce the buffer, all_to_all each rank's buffer (its (n-1)/n leaves the rank), send_recv the message. The bus
bandwidth is nccl-tests' too: algbw x (n-1)/n for AG, RS and all_to_all, x 2(n-1)/n for all_reduce, x 1 for
send_recv.

NCCL backend (GPUs). ppsim's own rendering of the rules NCCL 2.28 uses to pick an algorithm and protocol
(``src/graph/tuning.cc``: ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``), with its published constants: the
base latencies per algorithm and protocol, the hardware latencies (NVLink within a node, the network across), the
ring's (nsteps - nInterSteps) x intra + nInterSteps x inter latency with the network post overhead, the tree's
2 x ((ppn - 1) x intra + log2(nodes) x inter), NVLS's and NVLSTree's, PAT's; the LL/LL128/tree bandwidth factors
and per-channel caps of Hopper (Ampere for an A-series device, Blackwell for a B-series); the bus-to-algorithm
bandwidth ratios; the tree correction factors by size; the ring's multi-node all-reduce plateau factor. Time is
latency + bytes / algorithm bandwidth, and NCCL takes the fastest (algorithm, protocol) of those it considers
(:func:`all_choices`; :func:`predict` returns the minimum).

Assumptions (where NCCL reads its topology graph, ppsim reads the cluster):

* The graph's total bandwidth (channels x per-channel bandwidth): within one node, the cluster's per-GPU
  ``intra_node`` bandwidth; across nodes, the NICs the group can use, min(nics_per_node, ranks_per_node x
  nics_per_node / gpus_per_node) NICs at the ``inter_node`` bandwidth each, bounded by the intra-node bandwidth (a
  hierarchical ring also crosses NVLink). A group with fewer ranks on a node than the node has GPUs gets its share
  of the NICs: in a training step the node's other GPUs run their own groups' collectives at the same time.
* Channels: 16 within a node (NCCL's usual count on NVSwitch systems), 2 per usable NIC across nodes (NCCL's
  default), at least 2; every algorithm's graph has the same channels and per-channel bandwidth.
* Within a node the hardware is NVLink (NCCL's NVLink latencies); the tree is a balanced tree (no 0.85 penalty);
  the CPU is x86 Intel (1 us network post overhead, LL's multi-node cap row 0); LL128 is enabled (Hopper and
  Ampere with GPUDirect RDMA); CollNet (SHARP in the switches) is off, so NVLS runs within one node only and
  NVLSTree across nodes. On one node NVLS has no network leg, so only its NVLink bound applies.
* The graph's network latency (``latencyInter``) is the cluster's ``inter_node`` latency.
* The GPU generation comes from the device's name: "A..." Ampere, "B..."/"GB..." Blackwell, else Hopper.
* all_to_all (NCCL has no model: grouped sends and receives): each rank's (n-1)/n of ``nbytes`` leaves it, the part
  for its own node over ``intra_node``, the part for other nodes through the node's usable NICs, shared by the
  node's ranks; time = latency + one 1 us post per peer + max(intra part / intra bandwidth, the node's outgoing
  cross-node bytes / (usable NICs x NIC bandwidth)). send_recv: latency + bytes / bandwidth of the link between
  the two ranks (same node: ``intra_node``; else one NIC).

gloo backend (CPU ranks): alpha-beta per link with gloo's algorithms: all_gather and reduce_scatter as rings of n-1
steps of nbytes/n, all_reduce as a ring reduce-scatter then all-gather, all_to_all pairwise (each rank's n-1
exchanges one after another), send_recv direct. A ring whose group spans nodes runs each step at the inter-node
link's pace (a node's ranks share one link per direction, and a ring crosses each node boundary once per step).

What it lacks: contention between concurrent collectives beyond the NIC share, CollNet/SHARP, NCCL's channel and
thread tuning by size, PCIe-only nodes, network congestion and adaptive routing.

Measured samples (:class:`Measured`) replace the model for placements a profile measured; :func:`fit_links` fits the
gloo model's links from samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ppsim.errors import PPSimError
from ppsim.step.cluster import Cluster, Link
from ppsim.step.kinds import CollectiveKind

AG, RS, AR, A2A, P2P = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE,
                        CollectiveKind.ALL_TO_ALL, CollectiveKind.SEND_RECV)


class CollectiveError(PPSimError):
    """A collective that cannot be priced: bad ranks, nodes or size (one line)."""


@dataclass(frozen=True)
class Span:
    """How one group sits on the cluster: ``ranks`` spread evenly over ``nodes``."""

    ranks: int
    nodes: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise CollectiveError(f"ranks {self.ranks}: a collective needs at least 1 rank; give a positive count")
        if self.nodes < 1:
            raise CollectiveError(f"nodes {self.nodes}: a group spans at least 1 node; give a positive count")
        if self.ranks % self.nodes:
            raise CollectiveError(f"{self.ranks} ranks on {self.nodes} nodes: ranks spread evenly over nodes; "
                                  f"use a number of nodes that divides {self.ranks}")

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True)
class Prediction:
    """One collective's predicted time, how it runs, and its nccl-tests bandwidths."""

    kind: CollectiveKind
    nbytes: int
    span: Span
    seconds: float
    algorithm: str
    protocol: str
    algbw_Bps: float
    busbw_Bps: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.kind.value, "ranks": self.span.ranks, "nodes": self.span.nodes, "bytes": self.nbytes,
                "seconds": self.seconds, "algorithm": self.algorithm, "protocol": self.protocol,
                "algorithm_bandwidth_GBps": self.algbw_Bps / 1e9, "bus_bandwidth_GBps": self.busbw_Bps / 1e9}


def bus_factor(kind: CollectiveKind, ranks: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth."""
    if kind is P2P:
        return 1.0
    if kind is AR:
        return 2.0 * (ranks - 1) / ranks
    return (ranks - 1) / ranks


def _prediction(kind: CollectiveKind, nbytes: int, span: Span, seconds: float, algorithm: str,
                protocol: str) -> Prediction:
    algbw = nbytes / seconds if seconds > 0 else 0.0
    return Prediction(kind, nbytes, span, seconds, algorithm, protocol, algbw, algbw * bus_factor(kind, span.ranks))


MAX_GROUP_RANKS = 1_000_000_000
"""The largest group priced (beyond it the model's floats would overflow; no cluster is near it)."""
MAX_BYTES = (1 << 63) - 1
"""The largest size priced (8 EiB, as ``ppsim.io.parse_bytes`` reads sizes)."""


def check(kind: CollectiveKind, nbytes: int, span: Span, cluster: Cluster) -> None:
    """Refuse (one line) a size or a placement the cluster cannot hold."""
    if nbytes < 0:
        raise CollectiveError(f"size {nbytes} bytes: a collective moves 0 bytes or more; give a size such as 64MiB")
    if nbytes > MAX_BYTES:
        raise CollectiveError(f"size {nbytes} bytes: more than {MAX_BYTES} (8 EiB), the largest size ppsim prices; "
                              "give a smaller size")
    if span.ranks > MAX_GROUP_RANKS:
        shown = span.ranks if span.ranks < 10**15 else f"an integer of {len(str(span.ranks))} digits"
        raise CollectiveError(f"ranks {shown}: more than {MAX_GROUP_RANKS:,}, the largest group ppsim prices; "
                              "give fewer ranks")
    if span.ranks_per_node > cluster.gpus_per_node:
        raise CollectiveError(
            f"{span.ranks} ranks on {span.nodes} node(s) puts {span.ranks_per_node} on a node of cluster "
            f"{cluster.name!r}, which has {cluster.gpus_per_node} GPUs per node; use at least "
            f"{math.ceil(span.ranks / cluster.gpus_per_node)} nodes")
    if cluster.num_nodes is not None and span.nodes > cluster.num_nodes:
        raise CollectiveError(f"{span.nodes} nodes: cluster {cluster.name!r} has {cluster.num_nodes}; use at most "
                              f"{cluster.num_nodes} nodes or a larger cluster")
    if kind is P2P and span.ranks != 2:
        raise CollectiveError(f"send_recv on {span.ranks} ranks: a send/recv joins 2 ranks; give --ranks 2 "
                              "(--nodes 1 within a node, 2 across)")


def predict(kind: CollectiveKind, nbytes: int, span: Span, cluster: Cluster, *,
            measured: Measured | None = None) -> Prediction:
    """The time of one collective: measured where ``measured`` has this placement, else the fastest choice of the
    cluster's backend (NCCL's rule: the minimum predicted time)."""
    check(kind, nbytes, span, cluster)
    if measured is not None:
        seconds = measured.seconds(kind, nbytes, span)
        if seconds is not None:
            return _prediction(kind, nbytes, span, seconds, "measured", "measured")
    return min(all_choices(kind, nbytes, span, cluster), key=lambda p: p.seconds)


def all_choices(kind: CollectiveKind, nbytes: int, span: Span, cluster: Cluster) -> list[Prediction]:
    """Every (algorithm, protocol) the backend would consider, each with its predicted time."""
    check(kind, nbytes, span, cluster)
    if span.ranks == 1:
        return [_prediction(kind, nbytes, span, 0.0, "local", "none")]
    if cluster.backend == "gloo":
        return [_gloo(kind, nbytes, span, cluster)]
    if kind is A2A:
        return [_nccl_all_to_all(nbytes, span, cluster)]
    if kind is P2P:
        link = _p2p_link(span, cluster)
        return [_prediction(kind, nbytes, span, link.seconds(nbytes) + _POST_US * 1e-6, "p2p", "Simple")]
    return [_prediction(kind, nbytes, span, seconds, algo, proto)
            for algo, proto, seconds in _nccl_times(kind, nbytes, span, cluster)]


# ----------------------------------------------------------------------------------------------- NCCL's constants

PROTOCOLS = ("LL", "LL128", "Simple")
_LL, _LL128, _SIMPLE = range(3)
_ALGOS = ("Tree", "Ring", "NVLS", "NVLSTree", "PAT")

_BASE_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4), "NVLS": (0.0, 0.0, 0.0),
            "NVLSTree": (0.0, 0.0, 0.0), "PAT": (8.0, 8.0, 8.0)}
"""Base latency (us) per algorithm and protocol (LL, LL128, Simple)."""
_NVLINK_US = {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4), "NVLS": (0.0, 0.0, 25.0),
              "NVLSTree": (0.0, 0.0, 25.0), "PAT": (0.0, 0.0, 4.0)}
"""Hardware latency (us) of one step within a node over NVLink."""
_NET_US = {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0), "NVLS": (0.0, 0.0, 18.0),
           "NVLSTree": (0.0, 0.0, 14.0), "PAT": (0.0, 0.0, 14.0)}
"""Hardware latency (us) of one step across the network."""
_NET_OVERHEAD_US = 1.0
"""Network post overhead per step (x86 Intel CPU), x3 for Simple."""
_POST_US = 1.0
"""ppsim's cost of posting one send/recv (NCCL's network post overhead), for all_to_all and send_recv."""

_ARCHS = ("Ampere", "Hopper", "Blackwell")
_LL_MAX_ONE_NODE = {"Ampere": (87.7, 22.5, 19.0), "Hopper": (141.0, 45.0, 35.0), "Blackwell": (282.0, 90.0, 70.0)}
"""LL's bandwidth cap (GB/s) on one node, by GPU generation (columns: 1, 2, more nodes)."""
_LL_MAX_MULTI_NODE = (39.0, 39.0, 20.4)
"""LL's cap across nodes with an Intel CPU."""
_RING_LL128_PER_CH = {"Ampere": (20.0,) * 3, "Hopper": (36.7,) * 3, "Blackwell": (73.4,) * 3}
_TREE_LL128_PER_CH = {"Ampere": (20.0,) * 3, "Hopper": (36.7, 36.7, 29.0), "Blackwell": (55.6, 31.67, 20.0)}
_TREE_PER_CH = {"Ampere": (24.0, 23.6, 17.8), "Hopper": (38.7, 41.4, 36.0), "Blackwell": (70.0, 42.8, 24.0)}
_NVLS_TREE_PER_CH = {"Ampere": (24.0, 23.6, 17.8), "Hopper": (0.0, 57.7, 45.5), "Blackwell": (0.0, 96.0, 43.1)}
_NVLS_EFFICIENCY = {"Ampere": 0.0, "Hopper": 0.85, "Blackwell": 0.74}

_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
"""Tree all-reduce bandwidth factor per protocol by size: 64 B x 2**i for i = floor(log2(bytes / 64)), 0..22."""
_RING_PLATEAU = 1.4
"""Multi-node ring/Simple all-reduce latency factor (Ampere and later)."""


def arch(cluster: Cluster) -> str:
    """The GPU generation NCCL's per-generation constants are read for (assumption: from the device's name)."""
    name = cluster.device.name.strip().upper()
    if name.startswith("A"):
        return "Ampere"
    if name.startswith(("B", "GB")):
        return "Blackwell"
    return "Hopper"


@dataclass(frozen=True)
class _Graph:
    """What NCCL reads from its topology graph, derived from the cluster (module docstring)."""

    channels: int
    per_channel_GBps: float
    latency_inter_us: float


def usable_nics(span: Span, cluster: Cluster) -> float:
    """NICs a group's ranks on one node can use: its share of the node's NICs."""
    return min(float(cluster.nics_per_node), span.ranks_per_node * cluster.nics_per_node / cluster.gpus_per_node)


def _graph(span: Span, cluster: Cluster) -> _Graph:
    intra = cluster.intra_node.bandwidth_Bps / 1e9
    lat = cluster.inter_node.latency_s * 1e6
    if span.nodes == 1:
        return _Graph(16, intra / 16, lat)
    nics = usable_nics(span, cluster)
    total = min(nics * cluster.inter_node.bandwidth_Bps / 1e9, intra)
    channels = max(2, round(2 * nics))
    return _Graph(channels, total / channels, lat)


def _steps(kind: CollectiveKind, ranks: int) -> int:
    return 2 * (ranks - 1) if kind is AR else ranks - 1


def _considered(kind: CollectiveKind, span: Span, cluster: Cluster) -> list[tuple[str, int]]:
    """The (algorithm, protocol) pairs NCCL enables for this collective on this placement."""
    pairs: list[tuple[str, int]] = [("Ring", p) for p in range(3)]
    hopper_nvls = cluster.nvls and _NVLS_EFFICIENCY[arch(cluster)] > 0
    if kind is AR:
        pairs += [("Tree", p) for p in range(3)]
        if hopper_nvls:
            pairs.append(("NVLS", _SIMPLE) if span.nodes == 1 else ("NVLSTree", _SIMPLE))
    else:
        if hopper_nvls and span.nodes == 1:
            pairs.append(("NVLS", _SIMPLE))
        if span.nodes == span.ranks and span.nodes > 1:
            pairs.append(("PAT", _SIMPLE))
    return pairs


def _row(span: Span) -> int:
    """NCCL's column for 1, 2, or more nodes."""
    return min(span.nodes, 3) - 1


def _bus_GBps(kind: CollectiveKind, algo: str, p: int, span: Span, cluster: Cluster, g: _Graph) -> float:
    """NCCL's bus bandwidth for one (algorithm, protocol) before the conversion to algorithm bandwidth."""
    gen, col, n = arch(cluster), _row(span), span.nodes
    bw = g.per_channel_GBps
    if algo in ("NVLS", "NVLSTree"):
        ppn = span.ranks_per_node
        intra = bw * _NVLS_EFFICIENCY[gen] * (g.channels - 1) / g.channels
        intra *= 2.0 if kind is AR else (ppn - 1) / ppn
        if algo == "NVLS":  # one node: no network leg
            bw = intra
        else:
            bw = min(intra, bw * (2 if n <= 2 else 1), _NVLS_TREE_PER_CH[gen][col])
    bus = g.channels * bw
    ll_max = _LL_MAX_ONE_NODE[gen][col] if n == 1 else _LL_MAX_MULTI_NODE[col]
    if algo == "Ring" and p == _LL:
        bus = min(ll_max, bus * 0.5)
    if algo == "Ring" and p == _LL128:
        bus = min(bus * 0.92, g.channels * _RING_LL128_PER_CH[gen][col])
    if algo == "Tree":
        bus = min(bus * 0.92, g.channels * _TREE_PER_CH[gen][col])
        if p == _LL:
            bus = min(bus / 3.8, ll_max)
        elif p == _LL128:
            bus = min(bus * (7.0 / 9.0 if n == 1 else 120.0 / 128.0), g.channels * _TREE_LL128_PER_CH[gen][col])
    if algo == "PAT":
        bus *= 0.75
    return bus


def _algo_GBps(kind: CollectiveKind, algo: str, bus: float, ranks: int) -> float:
    """Bus to algorithm bandwidth: rings and NVLS by ranks / steps, the tree by 1/2; AG/RS by NVLS or PAT as is."""
    if kind is not AR and algo != "Ring":
        return bus
    if algo == "Tree":
        return bus * 0.5
    return bus * ranks / _steps(kind, ranks)


def _latency_us(kind: CollectiveKind, algo: str, p: int, span: Span, g: _Graph) -> float:
    """NCCL's latency of one collective for (algorithm, protocol)."""
    ranks, nodes, ppn = span.ranks, span.nodes, span.ranks_per_node
    intra = _NVLINK_US[algo][p]
    inter = (_NET_US["Tree"][p] if ppn == 1 else _NET_US[algo][p]) + g.latency_inter_us
    if p == _SIMPLE:
        inter += g.latency_inter_us  # the flush
    base = _BASE_US[algo][p]
    log_nodes = nodes.bit_length() - 1
    if algo == "Ring":
        overhead = 0.0 if nodes == 1 else _NET_OVERHEAD_US * (3 if p == _SIMPLE else 1)
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if kind is AR else nodes - 1)
        return base + (_steps(kind, ranks) - inter_steps) * max(intra, overhead) + inter_steps * inter
    if algo == "Tree":
        return base + 2 * ((ppn - 1) * intra + log_nodes * inter)
    if algo == "NVLS":
        return intra + (inter if nodes > 1 else 0.0)
    if algo == "NVLSTree":
        return base + intra + 2 * log_nodes * inter
    return base + log_nodes * (inter / 3.5) + ranks * 2.8  # PAT


def _nccl_times(kind: CollectiveKind, nbytes: int, span: Span, cluster: Cluster) -> list[tuple[str, str, float]]:
    """(algorithm, protocol, seconds) for every choice NCCL considers (NCCL's time: latency + bytes / bandwidth)."""
    g = _graph(span, cluster)
    out = []
    for algo, p in _considered(kind, span, cluster):
        bw = _algo_GBps(kind, algo, _bus_GBps(kind, algo, p, span, cluster, g), span.ranks)
        if bw <= 0:
            continue
        lat = _latency_us(kind, algo, p, span, g)
        if algo == "Tree" and kind is AR:
            size_class = max((nbytes >> 6).bit_length() - 1, 0)
            if size_class < len(_TREE_CORRECTION[p]):
                bw *= _TREE_CORRECTION[p][size_class]
        if (algo == "Ring" and p == _SIMPLE and kind is AR and span.nodes > 1
                and nbytes // (g.channels * span.ranks) >= 64):
            lat *= _RING_PLATEAU
        out.append((algo, PROTOCOLS[p], (lat + nbytes / (1000.0 * bw)) * 1e-6))
    return out


def _nccl_all_to_all(nbytes: int, span: Span, cluster: Cluster) -> Prediction:
    """Grouped sends and receives: the intra-node part over NVLink, the cross-node part through the node's NICs."""
    n, ppn = span.ranks, span.ranks_per_node
    intra_s = nbytes * (ppn - 1) / n / cluster.intra_node.bandwidth_Bps
    cross_s = 0.0
    latency = cluster.intra_node.latency_s
    if span.nodes > 1:
        node_out = ppn * nbytes * (n - ppn) / n
        cross_s = node_out / (usable_nics(span, cluster) * cluster.inter_node.bandwidth_Bps)
        latency = cluster.inter_node.latency_s
    seconds = latency + (n - 1) * _POST_US * 1e-6 + max(intra_s, cross_s)
    return _prediction(A2A, nbytes, span, seconds, "p2p", "Simple")


def _p2p_link(span: Span, cluster: Cluster) -> Link:
    return cluster.intra_node if span.nodes == 1 else cluster.inter_node


# ---------------------------------------------------------------------------------------------------------- gloo

def _gloo_terms(kind: CollectiveKind, nbytes: int, span: Span) -> tuple[str, tuple[int, float], tuple[int, float]]:
    """gloo's algorithm and its (messages, bytes) on the intra-node link and on the inter-node link (the bytes in
    the link's busier direction, as the time counts them: a pair's two directions that do not overlap add up).

    As torch 2.x's ProcessGroupGloo runs them (and as measured on ``scripts/cluster-local.sh``'s emulated nodes):

    * all_gather: ``gloo::allgather``, a ring of n - 1 steps of nbytes/n, each step in two halves kept in flight.
      Where the ring's two neighbours are one rank on the other node (2 ranks on 2 nodes), one TCP pair carries
      both directions at once, and gloo's pair overlaps them only by about half (:data:`GLOO_PAIR_AG_SERIAL`).
    * all_reduce: ``gloo::allreduce``'s ring (reduce-scatter then all-gather, 2(n - 1) steps of nbytes/n), its
      receives posted ahead in segments, so both directions of a pair run at once.
    * reduce_scatter: torch's ``reduce_scatter_tensor_coalesced`` clones the input and all-reduces the whole
      buffer (then copies its chunk out): an all_reduce plus one copy of nbytes (:func:`gloo_copy_bytes`).
    * all_to_all: ``gloo::alltoall``, pairwise: n - 1 exchanges one after another, a node's cross-node bytes
      sharing its link. In the exchange with the rank n/2 away (when that rank is on another node) each pair
      sends and receives at once, and a gloo pair carries the two directions one after the other in an order
      neither side chooses: the node's link then carries, per direction, the expected busier share of its
      ``k`` such pairs (2 E[max(j, k - j)], j ~ Binomial(k, 1/2), chunks instead of k).
    * send_recv: direct.
    """
    n, ppn = span.ranks, span.ranks_per_node
    chunk = nbytes / n
    if kind is P2P:
        return ("direct", (1, nbytes), (0, 0.0)) if span.nodes == 1 else ("direct", (0, 0.0), (1, nbytes))
    if kind is A2A:
        inter_bytes = ppn * (n - ppn) * chunk
        if span.nodes > 1 and n % 2 == 0 and (n // 2) // ppn % span.nodes:  # the half-way partner is elsewhere
            inter_bytes += (_serial_pairs_load(ppn) - ppn) * chunk
        return "pairwise", (ppn - 1, (ppn - 1) * chunk), (n - ppn, inter_bytes)
    steps = _steps(AR if kind is RS else kind, n)
    if span.nodes == 1:
        return "ring", (steps, steps * chunk), (0, 0.0)
    cross = steps * chunk
    if kind is AG and ppn == 1 and n == 2:
        cross *= GLOO_PAIR_AG_SERIAL
    return "ring", (steps, steps * chunk), (steps, cross)


GLOO_PAIR_AG_SERIAL = 1.5
"""How many times one direction's bytes a gloo TCP pair takes when both of its directions carry one all_gather
step at once (2 ranks on 2 nodes): 2 would be one after the other, 1 full duplex. Measured on the emulated nodes at
1 Gbit/s, 4-64 MiB: 1.45-1.6 (a send_recv alone runs at the link's rate; an all_to_all exchange on one pair takes
2.0; the all_reduce ring, which posts its receives ahead, 1.0)."""


def _serial_pairs_load(k: int) -> float:
    """Chunks the busier direction of a link carries when ``k`` pairs each move one chunk each way, one direction
    after the other in a random order: 2 E[max(j, k - j)], j ~ Binomial(k, 1/2)."""
    # max(j, k - j) = k/2 + |j - k/2|; the binomial's mean absolute deviation in de Moivre's closed form,
    # (k - m) C(k, m) / 2**k with m = floor(k/2): one term, so a node of a million ranks prices at once
    m = k // 2
    if k <= 1000:
        mad = (k - m) * math.comb(k, m) / 2 ** k
    else:  # in logs: 2**k overflows a float
        mad = (k - m) * math.exp(math.lgamma(k + 1) - math.lgamma(m + 1) - math.lgamma(k - m + 1) - k * math.log(2))
    return k + 2 * mad


def gloo_copy_bytes(kind: CollectiveKind, nbytes: int) -> float:
    """Bytes a collective copies in memory one after its transfers (torch's gloo reduce_scatter clones its input
    before the all-reduce), priced at the intra-node link's bandwidth (a CPU host's loopback runs at its copy
    speed)."""
    return float(nbytes) if kind is RS else 0.0


def _gloo(kind: CollectiveKind, nbytes: int, span: Span, cluster: Cluster) -> Prediction:
    algo, (mi, bi), (mx, bx) = _gloo_terms(kind, nbytes, span)
    intra = cluster.intra_node.seconds(bi, mi) if mi else 0.0
    inter = cluster.inter_node.seconds(bx, mx) if mx else 0.0
    # a ring's steps run in lock step (the slower link paces them); pairwise exchanges run one after another
    seconds = intra + inter if algo == "pairwise" else max(intra, inter)
    seconds += gloo_copy_bytes(kind, nbytes) / cluster.intra_node.bandwidth_Bps
    return _prediction(kind, nbytes, span, seconds, algo, "tcp")


# ------------------------------------------------------------------------------------------------ measured samples

@dataclass(frozen=True)
class Sample:
    """One measured collective: ``kind`` of ``nbytes`` on ``ranks`` over ``nodes`` took ``seconds``."""

    kind: CollectiveKind
    ranks: int
    nodes: int
    nbytes: int
    seconds: float


Key = tuple[CollectiveKind, int, int]


@dataclass(frozen=True)
class Measured:
    """Measured times by placement: (kind, ranks, nodes) -> (bytes, seconds) points sorted by bytes."""

    points: Mapping[Key, tuple[tuple[int, float], ...]]

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> Measured:
        """Points from samples; repeated sizes of one placement keep their median."""
        grouped: dict[Key, dict[int, list[float]]] = {}
        for s in samples:
            grouped.setdefault((s.kind, s.ranks, s.nodes), {}).setdefault(s.nbytes, []).append(s.seconds)
        return cls({key: tuple(sorted((b, statistics.median(ts)) for b, ts in sizes.items()))
                    for key, sizes in grouped.items()})

    def seconds(self, kind: CollectiveKind, nbytes: int, span: Span) -> float | None:
        """Interpolated time (None where this placement was not measured): linear between measured sizes, the
        smallest's time below it, above the largest its time plus the rest at the last segment's bandwidth."""
        pts = self.points.get((kind, span.ranks, span.nodes))
        if not pts:
            return None
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b_last, t_last = pts[-1]
        if len(pts) > 1 and pts[-1][1] > pts[-2][1]:
            per_byte = (t_last - pts[-2][1]) / (b_last - pts[-2][0])
        else:
            per_byte = t_last / b_last if b_last > 0 else 0.0
        return t_last + (nbytes - b_last) * per_byte


def fit_links(samples: Iterable[Sample]) -> tuple[Link | None, Link | None]:
    """The gloo model's intra- and inter-node links fitted to samples: least squares of the relative error of
    seconds = messages x latency + bytes / bandwidth over the link each sample's model puts its time on (nodes = 1:
    intra, nodes > 1: inter; relative, so the small sizes fix the latency and the large ones the bandwidth). The
    intra link is fitted first; a cross-node sample's time in series on it (an all_to_all's exchanges within the
    node, reduce_scatter's copy) is taken off before the inter link's fit. A link gets None without two samples of
    different shape or when the fit is not physical."""
    rows: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    series: list[tuple[float, float]] = []
    for s in samples:
        span = Span(s.ranks, s.nodes)
        if span.ranks < 2:
            continue
        algo, (mi, bi), (mx, bx) = _gloo_terms(s.kind, s.nbytes, span)
        copy = gloo_copy_bytes(s.kind, s.nbytes)
        if span.nodes > 1:
            rows[True].append((float(mx), bx, s.seconds))
            series.append((float(mi) if algo == "pairwise" else 0.0, (bi if algo == "pairwise" else 0.0) + copy))
        else:
            rows[False].append((float(mi), bi + copy, s.seconds))
    intra = _fit(rows[False])
    if intra is not None:
        rows[True] = [(m, b, t - (mi * intra.latency_s + bi / intra.bandwidth_Bps))
                      for (m, b, t), (mi, bi) in zip(rows[True], series)]
        rows[True] = [r for r in rows[True] if r[2] > 0]
    return intra, _fit(rows[True])


def _fit(rows: list[tuple[float, float, float]]) -> Link | None:
    """A link from rows of (messages, bytes, seconds) in two steps, each from the sizes that decide it: the bandwidth
    from an unweighted least-squares fit of t = m * alpha + b / bandwidth (the large sizes, whose times are long,
    decide it), then the latency as the median over the latency-bound rows (those whose bytes take under half their
    time at that bandwidth) of (t - b / bandwidth) / m. A relative-error fit let the small sizes' scheduling noise on
    a shared host set the bandwidth too (one gave a link faster than its own rate limit). None without two rows of
    different shape or when the bandwidth is not positive."""
    rows = [(m, b, t) for m, b, t in rows if t > 0]
    if len(rows) < 2:
        return None
    smm = sum(m * m for m, _, _ in rows)
    smb = sum(m * b for m, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    smt = sum(m * t for m, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = smm * sbb - smb * smb
    if det <= 1e-12 * max(smm * sbb, 1e-300):
        return None
    beta = (smm * sbt - smb * smt) / det
    if beta <= 0:
        return None
    bound = [(t - b * beta) / m for m, b, t in rows if m > 0 and b * beta < t / 2]
    alpha = max(0.0, statistics.median(bound)) if bound else max(0.0, (smt * sbb - sbt * smb) / det)
    return Link(1.0 / beta, alpha)
