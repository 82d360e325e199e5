"""Shared by the viz tests (pytest puts tests/ on sys.path)."""

from __future__ import annotations

from ppsim.costs import StageCosts


def profile_like_costs(num_stages: int) -> StageCosts:
    """Per-stage seconds and bytes, as a calibration profile gives them (forward cost grows with the stage)."""
    gib = 2**30
    return StageCosts(
        F=tuple(0.004 + 0.001 * i for i in range(num_stages)), B=(0.008,) * num_stages, I=(0.004,) * num_stages,
        W=(0.004,) * num_stages, FB=(0.0115,) * num_stages, p2p_alpha=2e-5, p2p_beta=2e10,
        output_bytes=(2**24,) * num_stages, activation_bytes=(gib // 2,) * num_stages,
        activation_bytes_freed_by_I=(gib // 4,) * num_stages, static_bytes=(3 * gib,) * num_stages,
        unit="s", source="profile.json",
    )
