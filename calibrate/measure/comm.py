"""Point-to-point latency (alpha) and bandwidth (beta) between ranks.

A ping-pong between two ranks: the sender sends ``n`` bytes, the receiver sends them back; one-way time is half the
round trip, so no clock needs to agree across hosts. Sizes run from a few bytes to beyond the boundary tensor;
``t(n) = alpha + n / beta`` is fitted by least squares on relative errors (small and large messages count alike),
and ``fit_rel_error`` is the root-mean-square relative residual.

Without ``torchrun``, :func:`measure_local_pair` starts two local processes (:mod:`ppsim.calibrate.execute.launch`)
that talk
over gloo on 127.0.0.1 (or NCCL between two visible GPUs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from ppsim.errors import PPSimError
from ppsim.profile import P2PPair, P2PProfile, P2PSample, Stat
from ppsim.step.kinds import CollectiveKind

Tick = Callable[[], None]


def _noop() -> None:
    return None


def p2p_sizes(boundary_bytes: int, *, factor: int = 4, smallest: int = 4) -> list[int]:
    """Message sizes: ``smallest`` bytes, times ``factor`` each step, up to 4x the boundary tensor (at least 1 MiB)."""
    largest = max(4 * boundary_bytes, 1 << 20)
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] < largest:
        sizes.append(largest)
    if boundary_bytes > smallest and boundary_bytes not in sizes:
        sizes.append(boundary_bytes)
    return sorted(sizes)


def fit_alpha_beta(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float, float]:
    """Fit ``t = alpha + n / beta`` minimising relative residuals; returns ``(alpha_s, beta_bytes_per_s, rms_rel)``.

    alpha is kept >= 0 (refit through the origin otherwise). A non-positive slope (the larger sizes took no longer
    than the smaller ones: a stalled small transfer on a shared host, or a bandwidth the sizes cannot resolve) becomes
    the lowest bandwidth the samples allow, the largest size moved in its own measured time, with alpha refitted
    under it: extrapolating to larger transfers then errs slow, never toward free.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points")
    if any(t <= 0 for t in times):
        raise ValueError("times must be positive")
    # Weighted least squares with weights 1/t: rows [1/t, n/t] . [a, b] ~= 1
    s11 = sum(1 / t**2 for t in times)
    s12 = sum(n / t**2 for n, t in zip(sizes, times))
    s22 = sum(n * n / t**2 for n, t in zip(sizes, times))
    r1 = sum(1 / t for t in times)
    r2 = sum(n / t for n, t in zip(sizes, times))
    det = s11 * s22 - s12 * s12
    a, b = ((s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, 0.0)
    if a < 0:
        a, b = 0.0, r2 / s22
    if b <= 0:
        n_max, t_max = max(zip(sizes, times))
        b = t_max / n_max
        a = max(0.0, (r1 - b * r2) / s11)
    rel = [((a + b * n) - t) / t for n, t in zip(sizes, times)]
    return a, 1.0 / b, math.sqrt(sum(r * r for r in rel) / len(rel))


# --- process groups: see ppsim.calibrate.execute.launch (re-exported here for callers of this module) ----------------
from ppsim.calibrate.execute.launch import World, free_port, init_world, join_local_world, torchrun_world_size  # noqa: E402,F401,E501


def _pingpong(peer: int, *, initiator: bool, sizes: Sequence[int], warmup: int, reps: int, device: Any,
              tick: Tick = _noop) -> dict[int, list[float]]:
    """One-way seconds (half a round trip) per size, measured on the initiator (empty lists on the responder).

    Sizes are interleaved within each repetition, so a burst of load on a shared machine spreads over all sizes
    instead of bending the fit at one of them.
    """
    import torch
    import torch.distributed as dist

    bufs = {n: torch.zeros(max(n, 1), dtype=torch.uint8, device=device) for n in sizes}
    cuda = torch.device(device).type == "cuda"
    out: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(warmup + reps):
        for n in sizes:
            buf = bufs[n]
            if initiator:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.send(buf, peer)
                dist.recv(buf, peer)
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    out[n].append((time.perf_counter() - t0) / 2)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        if i >= warmup:
            tick()
    return out


def _samples(times: dict[int, list[float]]) -> list[P2PSample]:
    result = []
    for n, values in sorted(times.items()):
        st = Stat.from_samples(values)
        result.append(P2PSample(bytes=n, median_s=st.median, p10_s=st.p10, p90_s=st.p90))
    return result


def measure_pairs(world: World, sizes: Sequence[int], *, warmup: int, reps: int, device: Any,
                  tick: Tick = _noop) -> P2PProfile | None:
    """Every neighbouring pair (r, r+1), one pair at a time; returns the profile on rank 0 (``None`` elsewhere)."""
    import torch.distributed as dist

    pairs: list[P2PPair] = []
    for src in range(world.world_size - 1):
        dst = src + 1
        samples: list[P2PSample] = []
        if world.rank in (src, dst):
            times = _pingpong(dst if world.rank == src else src, initiator=world.rank == src, sizes=sizes,
                              warmup=warmup, reps=reps, device=device, tick=tick if world.rank == 0 else _noop)
            if world.rank == src:
                samples = _samples(times)
        gathered: list[Any] = [None] * world.world_size
        dist.all_gather_object(gathered, samples if world.rank == src else None)
        if world.rank == 0:
            got = gathered[src]
            alpha, beta, err = fit_alpha_beta([s.bytes for s in got], [s.median_s for s in got])
            pairs.append(P2PPair(src=src, dst=dst, alpha_s=alpha, beta_bytes_per_s=beta, fit_rel_error=err,
                                 samples=tuple(got)))
        dist.barrier()
    if world.rank != 0:
        return None
    return combine_pairs(pairs, max(sizes))


def combine_pairs(pairs: Sequence[P2PPair], reference_bytes: int) -> P2PProfile:
    """The slowest link (largest predicted time at ``reference_bytes``) stands for the whole pipeline."""
    slowest = max(pairs, key=lambda p: p.alpha_s + reference_bytes / p.beta_bytes_per_s)
    return P2PProfile(
        alpha_s=slowest.alpha_s, beta_bytes_per_s=slowest.beta_bytes_per_s, fit_rel_error=slowest.fit_rel_error,
        measured=True, samples=slowest.samples, pairs=tuple(pairs),
    )


# --- two local processes (no torchrun) -------------------------------------------------------------------------------
def _local_pair_rank(ctx: Any, backend: str, sizes: list[int], warmup: int, reps: int,
                     timeout_s: float) -> dict[int, list[float]]:
    """One of the two local processes (started by :func:`ppsim.calibrate.execute.launch.run_local`)."""
    import torch.distributed as dist

    device = join_local_world(ctx, backend=backend, timeout_s=timeout_s)
    try:
        times = _pingpong(1 - ctx.rank, initiator=ctx.rank == 0, sizes=sizes, warmup=warmup, reps=reps,
                          device=device, tick=lambda: ctx.send("rep") if ctx.rank == 0 else None)
        dist.barrier()
        return times
    finally:
        dist.destroy_process_group()


def measure_local_pair(sizes: Sequence[int], *, backend: str = "gloo", warmup: int, reps: int,
                       timeout_s: float = 60.0, tick: Tick = _noop) -> P2PProfile:
    """Start two local processes, ping-pong every size between them, fit alpha and beta."""
    from ppsim.calibrate.execute.launch import run_local

    failure = "re-run with --no-p2p to skip it, or under torchrun"
    try:
        times = run_local(_local_pair_rank, (backend, list(sizes), warmup, reps, timeout_s), world_size=2,
                          timeout_s=timeout_s + 60 + 0.05 * reps * len(sizes), what="p2p measurement",
                          on_message=lambda rank, msg: tick())
    except (PPSimError, RuntimeError) as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise PPSimError(f"p2p measurement between two local {backend} processes failed ({why[:200]}); "
                         f"{failure}") from None
    samples = _samples(times)
    alpha, beta, err = fit_alpha_beta([s.bytes for s in samples], [s.median_s for s in samples])
    pair = P2PPair(src=0, dst=1, alpha_s=alpha, beta_bytes_per_s=beta, fit_rel_error=err, samples=tuple(samples))
    return combine_pairs([pair], max(sizes))


# --- FSDP's collectives and EP's all-to-all -------------------------------------------------------------------------
COLLECTIVE_OPS = tuple(k.value for k in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                                         CollectiveKind.ALL_TO_ALL))
"""What :func:`_collectives` times: FSDP2's two collectives and EP's token exchange."""
ALL_TO_ALL_REFUSAL = "all_to_all:"
"""How the line refusing a backend without ``all_to_all_single`` starts (it passes the launcher unchanged)."""


def collective_sizes(largest: int, *, factor: int = 4, smallest: int = 4096) -> list[int]:
    """Full-tensor sizes for the collectives: ``smallest`` bytes, times ``factor`` each step, up to ``largest``
    (at least 1 MiB)."""
    return p2p_sizes(largest // 4, factor=factor, smallest=smallest)


def all_to_all_unsupported(backend: str, exc: BaseException) -> PPSimError:
    """The one line for a backend that cannot run ``all_to_all_single`` (what EP's token dispatch issues)."""
    import torch

    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return PPSimError(f"{ALL_TO_ALL_REFUSAL} the {backend} backend of the installed torch {torch.__version__} cannot "
                      f"run all_to_all_single ({why}); install a torch whose {backend} has it, calibrate where nccl "
                      "runs it (--device cuda), or pass --no-p2p to measure no communication")


def _collectives(group_size: int, rank: int, *, sizes: Sequence[int], warmup: int, reps: int, device: Any,
                 tick: Tick = _noop, ops: Sequence[str] = COLLECTIVE_OPS) -> dict[str, dict[int, list[float]]]:
    """Seconds of each of ``ops`` per size ``n`` on the current group: ``all_gather_into_tensor`` (each rank gives
    ``n / group_size`` bytes, all get ``n``), ``reduce_scatter_tensor`` (each gives ``n``, keeps its
    ``n / group_size`` sum) and ``all_to_all_single`` (each rank sends ``n`` bytes in all, ``n / group_size`` to each
    rank, itself included, and receives as much: ``n`` is each rank's whole buffer, the size
    :func:`ppsim.step.ep.all_to_all_seconds` costs). A barrier starts every sample, so a sample is the slowest rank's
    finish. A backend without ``all_to_all_single`` is one line (:func:`all_to_all_unsupported`)."""
    import torch
    import torch.distributed as dist

    cuda = torch.device(device).type == "cuda"
    # torch's current names where this torch has them (2.13 deprecates the older two with a FutureWarning)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out: dict[str, dict[int, list[float]]] = {op: {n: [] for n in sizes} for op in ops}
    bufs = {n: (torch.zeros(max(n // 4 // group_size, 1), dtype=torch.float32, device=device),
                torch.zeros(max(n // 4 // group_size, 1) * group_size, dtype=torch.float32, device=device),
                torch.zeros(max(n // 4 // group_size, 1) * group_size, dtype=torch.float32, device=device))
            for n in sizes}
    for i in range(warmup + reps):
        for n in sizes:
            shard, full, received = bufs[n]
            for op in ops:
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if op == "all_gather":
                    all_gather(full, shard)
                elif op == "reduce_scatter":
                    reduce_scatter(shard, full)
                else:
                    try:
                        dist.all_to_all_single(received, full)
                    except (RuntimeError, NotImplementedError, ValueError) as exc:  # the backend lacks it
                        raise all_to_all_unsupported(dist.get_backend(), exc) from None
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    out[op][n].append(time.perf_counter() - t0)
        if i >= warmup:
            tick()
    return out


def _local_collectives_rank(ctx: Any, backend: str, sizes: list[int], warmup: int, reps: int, timeout_s: float,
                            ops: tuple[str, ...] = COLLECTIVE_OPS) -> dict[str, dict[int, list[float]]]:
    """One of the local processes of :func:`measure_local_collectives`."""
    import torch.distributed as dist

    device = join_local_world(ctx, backend=backend, timeout_s=timeout_s)
    try:
        times = _collectives(ctx.world_size, ctx.rank, sizes=sizes, warmup=warmup, reps=reps, device=device, ops=ops)
        dist.barrier()
        return times
    finally:
        dist.destroy_process_group()


def fit_collectives(times: dict[str, dict[int, list[float]]], group_size: int) -> list[Any]:
    """One :class:`ppsim.profile.CollectiveFit` per op from its samples (``t = alpha + bytes / beta``)."""
    from ppsim.profile import CollectiveFit

    fits = []
    for op, per_size in times.items():
        samples = _samples(per_size)
        alpha, beta, err = fit_alpha_beta([s.bytes for s in samples], [s.median_s for s in samples])
        fits.append(CollectiveFit(op=op, group_size=group_size, alpha_s=alpha, beta_bytes_per_s=beta,
                                  fit_rel_error=err, samples=tuple(samples)))
    return fits


def measure_local_collectives(sizes: Sequence[int], *, group_size: int = 2, backend: str = "gloo", warmup: int,
                              reps: int, timeout_s: float = 60.0,
                              ops: Sequence[str] = COLLECTIVE_OPS) -> list[Any]:
    """Start ``group_size`` local processes, time ``ops`` (FSDP's all-gather and reduce-scatter, EP's all-to-all) at
    every size, fit each."""
    from ppsim.calibrate.execute.launch import run_local

    names = " / ".join(op.replace("_", "-") for op in ops)
    try:
        times = run_local(_local_collectives_rank, (backend, list(sizes), warmup, reps, timeout_s, tuple(ops)),
                          world_size=group_size, timeout_s=timeout_s + 60 + 0.1 * reps * len(sizes) * len(ops),
                          what="collective measurement")
    except (PPSimError, RuntimeError) as exc:
        if str(exc).startswith(ALL_TO_ALL_REFUSAL):  # the rank's own line: the backend lacks all_to_all
            raise PPSimError(str(exc)) from None
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise PPSimError(f"{names} measurement on {group_size} local {backend} processes failed "
                         f"({why[:200]}); re-run with --no-p2p to skip communication, or under torchrun") from None
    return fit_collectives(times, group_size)
