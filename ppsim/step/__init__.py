"""The one step model: a pipeline order turned into a timed training step with every parallel dimension's
communication in it (docs/step.md). Passes add each dimension's collectives the way torch lowers them; the cluster
(:mod:`ppsim.step.cluster`) and the placement of every group on it (:mod:`ppsim.step.placement`) price each collective
on the links it crosses (:mod:`ppsim.step.collectives`)."""

from ppsim.step.kinds import ALL_KINDS, CollectiveKind

__all__ = ["ALL_KINDS", "CollectiveKind"]
