"""What one collective of the step costs, in one place: the profile's measured samples where it measured that
operation on that placement, else the cluster's collective model (:mod:`ppsim.step.collectives`: NCCL's for GPUs,
gloo's for CPU ranks) on the links the group crosses, its constants replaced by the profile's measured ones where the
profile was measured on that cluster; without a cluster, a ring over the profile's point-to-point alpha/beta.

Every pass of the step model (:mod:`ppsim.step.fsdp`, :mod:`ppsim.step.ep`, :mod:`ppsim.step.pipeline_comm`) asks
:meth:`CollectiveCosts.seconds` with the group's placement (:mod:`ppsim.step.placement`); nothing else prices
communication. This module imports no torch."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ppsim.step.kinds import CollectiveKind

if TYPE_CHECKING:
    from ppsim.step.cluster import Cluster
    from ppsim.step.collectives import Sample


def ring_seconds(num_bytes: int, *, dp: int, alpha_s: float, bytes_per_s: float) -> float:
    """One ring all-gather or reduce-scatter of ``num_bytes`` (the unsharded size) over ``dp`` ranks."""
    if dp <= 1 or num_bytes <= 0:
        return 0.0
    return (dp - 1) * (alpha_s + num_bytes / dp / bytes_per_s)


@dataclass(frozen=True)
class MeasuredCollective:
    """One op's measured seconds per full-tensor size on a group of ``group_size`` ranks over ``nodes`` nodes (a
    profile's ``collectives[]``): sorted ``(bytes, median seconds)`` points and the fit's bandwidth to extrapolate."""

    op: str
    group_size: int
    points: tuple[tuple[int, float], ...]
    bytes_per_s: float
    nodes: int = 1

    def seconds(self, num_bytes: float) -> float:
        """Linear between the measured sizes; below the smallest, its time (latency-bound); above the largest, its
        time plus the rest at the fit's bandwidth."""
        sizes = [b for b, _ in self.points]
        if num_bytes <= sizes[0]:
            return self.points[0][1]
        if num_bytes >= sizes[-1]:
            return self.points[-1][1] + (num_bytes - sizes[-1]) / self.bytes_per_s
        i = bisect.bisect_right(sizes, num_bytes)
        (b0, t0), (b1, t1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (num_bytes - b0) / (b1 - b0)


@dataclass(frozen=True)
class CollectiveCosts:
    """How the step's collectives are priced: the profile's measured samples (by op, group size and nodes), its
    p2p alpha/beta, and the cluster the job runs on (``None``: the profile's host, as before clusters)."""

    measured: tuple[MeasuredCollective, ...] = ()
    p2p_alpha_s: float | None = None
    p2p_bytes_per_s: float | None = None
    cluster: Cluster | None = None
    measured_on: str | None = None
    """The cluster the profile was measured on (its ``cluster`` record); its constants replace the cluster's only
    when the two are the same cluster."""

    @classmethod
    def from_profile(cls, profile: Any, cluster: Cluster | None = None) -> CollectiveCosts:
        """From a :class:`ppsim.profile.Profile` (its ``collectives`` and ``p2p``), on ``cluster``."""
        measured = tuple(
            MeasuredCollective(op=c.op, group_size=c.group_size, bytes_per_s=c.beta_bytes_per_s,
                               points=tuple(sorted((s.bytes, s.median_s) for s in c.samples)),
                               nodes=getattr(c, "nodes", 1) or 1)
            for c in profile.collectives if c.samples and c.beta_bytes_per_s > 0)
        p2p = profile.p2p
        return cls(measured=measured, p2p_alpha_s=None if p2p is None else p2p.alpha_s,
                   p2p_bytes_per_s=None if p2p is None else p2p.beta_bytes_per_s, cluster=cluster,
                   measured_on=getattr(profile, "cluster", None))

    def on(self, cluster: Cluster | None) -> CollectiveCosts:
        """The same measurements, priced on ``cluster``."""
        return dataclasses.replace(self, cluster=cluster)

    # -- choosing the source -----------------------------------------------------------------------------------
    def _nearest(self, op: str, group_size: int, nodes: int = 1) -> MeasuredCollective | None:
        """The measured op on the same number of nodes (within one node: the nearest group size, rescaled as a
        ring; across nodes: only the same placement)."""
        mine = [m for m in self.measured if m.op == op and m.nodes == nodes
                and (nodes == 1 or m.group_size == group_size)]
        return min(mine, key=lambda m: (abs(m.group_size - group_size), -m.group_size), default=None)

    @property
    def has_p2p(self) -> bool:
        return self.p2p_alpha_s is not None and bool(self.p2p_bytes_per_s)

    @property
    def available(self) -> bool:
        return bool(self.measured) or self.has_p2p or self.cluster is not None

    def can_price(self, op: str | CollectiveKind) -> bool:
        """Whether :meth:`seconds` has a source for ``op``: measured samples of it, a cluster or a p2p fit."""
        kind = CollectiveKind(op)
        return any(m.op == kind.value for m in self.measured) or self.has_p2p or self.cluster is not None

    def model_cluster(self) -> Cluster | None:
        """The cluster whose model prices what was not measured: its links replaced by this profile's measured
        ones when the profile was measured on it (a gloo host: the p2p fit is the link within a node, a
        cross-node calibration's samples the link between nodes)."""
        cluster = self.cluster
        if cluster is None or not self._same_cluster():
            return cluster
        from ppsim.step.cluster import Link
        from ppsim.step.collectives import fit_links

        intra, inter = fit_links(self._samples())
        if intra is None and self.has_p2p:
            assert self.p2p_alpha_s is not None and self.p2p_bytes_per_s
            intra = Link(bandwidth_Bps=self.p2p_bytes_per_s, latency_s=self.p2p_alpha_s)
        return dataclasses.replace(cluster, intra_node=intra or cluster.intra_node,
                                   inter_node=inter or cluster.inter_node)

    def mismatch(self) -> str | None:
        """A warning when the profile was measured on another cluster than the one asked, naming both."""
        if self.cluster is None or self.measured_on is None or self._same_cluster():
            return None
        return (f"warning: the profile was measured on cluster {self.measured_on!r}, the job is priced on "
                f"{self.cluster.name!r}: its measured collectives are used only for placements it measured, and its "
                f"links do not replace {self.cluster.name!r}'s; calibrate on {self.cluster.name!r} "
                "(`ppsim calibrate --cluster ...`) for its own")

    def _same_cluster(self) -> bool:
        if self.cluster is None:
            return False
        if self.measured_on is None:  # a profile from before clusters: measured on its own host
            return self.cluster.backend == "gloo"
        return self.measured_on.lower() == self.cluster.name.lower()

    def _samples(self) -> list[Sample]:
        """Every measured point, for the model's link fit."""
        from ppsim.step.collectives import Sample

        return [Sample(CollectiveKind(m.op), m.group_size, m.nodes, b, t) for m in self.measured for b, t in m.points]

    # -- the price ---------------------------------------------------------------------------------------------
    def seconds(self, op: str | CollectiveKind, num_bytes: int, *, group_size: int, nodes: int = 1) -> float:
        """One ``op`` of ``num_bytes`` (nccl-tests' size: the whole tensor of an all-gather or reduce-scatter, a
        rank's buffer of an all-to-all, the message of a send) over ``group_size`` ranks on ``nodes`` nodes.
        Measured on a group of ``g`` ranks within one node, a ring's step is ``t_g(m * g) / (g - 1)`` for ``m``
        bytes a rank, so ``t(n) = (dp - 1) / (g - 1) * t_g(n * g / dp)``."""
        kind = CollectiveKind(op)
        if group_size <= 1 or num_bytes <= 0:
            return 0.0
        fit = self._nearest(kind.value, group_size, nodes)
        if fit is not None:
            if fit.group_size == group_size or group_size <= 1:
                return fit.seconds(num_bytes)
            g = fit.group_size
            return (group_size - 1) / (g - 1) * fit.seconds(num_bytes * g / group_size)
        cluster = self.model_cluster()
        if cluster is not None:
            from ppsim.step.collectives import Span, predict

            return predict(kind, int(num_bytes), Span(group_size, nodes), cluster).seconds
        if not self.has_p2p:
            raise ValueError("no collective costs: check `available` first")
        assert self.p2p_alpha_s is not None and self.p2p_bytes_per_s
        if kind is CollectiveKind.ALL_TO_ALL:  # a pairwise exchange: (n - 1) rounds of one peer's share
            return (group_size - 1) * (self.p2p_alpha_s + num_bytes / group_size / self.p2p_bytes_per_s)
        if kind is CollectiveKind.ALL_REDUCE:
            return 2 * ring_seconds(num_bytes, dp=group_size, alpha_s=self.p2p_alpha_s,
                                    bytes_per_s=self.p2p_bytes_per_s)
        if kind is CollectiveKind.SEND_RECV:
            return self.p2p_alpha_s + num_bytes / self.p2p_bytes_per_s
        return ring_seconds(num_bytes, dp=group_size, alpha_s=self.p2p_alpha_s, bytes_per_s=self.p2p_bytes_per_s)

    def source(self, op: str | CollectiveKind, group_size: int, nodes: int = 1) -> str:
        """Where one op's price comes from, for the notes."""
        kind = CollectiveKind(op)
        fit = self._nearest(kind.value, group_size, nodes)
        where = f"{group_size} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
        if fit is not None:
            sizes = f"{fit.points[0][0] / 2**10:.0f} KiB-{fit.points[-1][0] / 2**20:.1f} MiB"
            scaled = "" if fit.group_size == group_size else f", scaled as a ring to {group_size} ranks"
            return f"{kind.label} measured on {fit.group_size} ranks at {sizes}{scaled}"
        cluster = self.model_cluster()
        if cluster is not None:
            measured = " (its links as the profile measured them)" if self._same_cluster() else ""
            return f"{kind.label} over {where} by the {cluster.backend} model of cluster {cluster.name}{measured}"
        if self.has_p2p:
            shape = "a pairwise exchange" if kind is CollectiveKind.ALL_TO_ALL else "a ring"
            return (f"{kind.label}: the profile measured none, so {shape} over its p2p alpha/beta (re-run "
                    "`ppsim calibrate` with p2p, or give --cluster)")
        return f"{kind.label}: no price (no profile measurements and no --cluster)"

    def describe(self, group_size: int, nodes: int = 1) -> str:
        """FSDP's two ops' sources, for the notes."""
        return "; ".join(self.source(k, group_size, nodes)
                         for k in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER))
