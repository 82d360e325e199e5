"""A torchtitan job's parallel degrees (torchtitan's ``ParallelDims``: PP, dp_shard, dp_replicate, TP, CP, EP) and
the rules torchtitan applies to them before it builds a mesh."""

from __future__ import annotations

from dataclasses import dataclass

from ppsim.errors import DegreesError


@dataclass(frozen=True)
class Degrees:
    """The job's parallel degrees (torchtitan's ``ParallelDims``)."""

    pp: int
    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp_shard * self.dp_replicate * self.cp

    @property
    def fsdp(self) -> int:
        """The dense FSDP mesh: ``dp_shard`` x ``cp`` (torchtitan's ``fsdp`` mesh)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int | None:
        """The routed experts' FSDP mesh when EP > 1: ``dp_shard`` x ``cp`` x ``tp`` / ``ep`` (EP is carved out of
        them); ``None`` without EP (the experts are on the dense mesh)."""
        return self.dp_shard * self.cp * self.tp // self.ep if self.ep > 1 else None


# --- the rules ----------------------------------------------------------------------------------------------------
DEGREE_KEYS = {"pp": "pipeline_parallel_degree", "tp": "tensor_parallel_degree",
               "dp_shard": "data_parallel_shard_degree", "dp_replicate": "data_parallel_replicate_degree",
               "cp": "context_parallel_degree", "ep": "expert_parallel_degree"}
"""torchtitan's ``parallelism`` key for each :class:`Degrees` field."""


def check_degrees(degrees: Degrees, *, num_heads: int, num_kv_heads: int, num_layers: int,
                  num_experts: int | None = None, world_size: int | None = None, fix: str = "",
                  seq_len: int | None = None) -> None:
    """Refuse (one line) degrees torchtitan could not run: a product that is not the world size, a TP degree that
    does not divide the heads, an EP degree on a dense model or that divides neither the experts nor
    ``dp_shard x cp x tp`` (torchtitan carves EP out of them), more PP ranks than layers."""
    tail = f"; {fix}" if fix else ""
    for field, key in DEGREE_KEYS.items():
        if getattr(degrees, field) < 1:  # before any division by it
            raise DegreesError(f"{key} {getattr(degrees, field)}: must be at least 1 (1 for none){tail}")
    if world_size is not None and degrees.world_size != world_size:
        raise DegreesError(f"degrees pp {degrees.pp} x tp {degrees.tp} x dp_shard {degrees.dp_shard} x "
                           f"dp_replicate {degrees.dp_replicate} x cp {degrees.cp} = {degrees.world_size}, not the "
                           f"world size {world_size}{tail}")
    for name, heads in (("heads", num_heads), ("kv heads", num_kv_heads)):
        if heads % degrees.tp:
            raise DegreesError(f"tensor_parallel_degree {degrees.tp} does not divide the model's {heads} {name}; "
                               f"pick a divisor of {heads}{tail}")
    if num_experts is None and degrees.ep > 1:
        raise DegreesError(f"expert_parallel_degree {degrees.ep}: the model has no experts (a dense model); pass "
                           "--parallelism.expert_parallel_degree 1")
    carved = degrees.dp_shard * degrees.cp * degrees.tp
    if num_experts is not None and num_experts % degrees.ep:
        raise DegreesError(f"expert_parallel_degree {degrees.ep} does not divide the model's {num_experts} experts;"
                           f" pick a divisor of {num_experts} that also divides dp_shard x cp x tp = {carved}")
    if carved % degrees.ep:
        raise DegreesError(f"expert_parallel_degree {degrees.ep} does not divide dp_shard x cp x tp = {carved} "
                           "(torchtitan carves EP out of them); pick an EP degree that divides both "
                           f"{carved} and the experts")
    if seq_len is not None and degrees.cp > 1 and seq_len % (2 * degrees.cp):
        raise DegreesError(f"context_parallel_degree {degrees.cp}: the sequence length {seq_len} is not divisible by "
                           f"2 x cp = {2 * degrees.cp} (torchtitan's head-tail load balancer cuts each sequence into "
                           "2 x cp chunks); pick a CP degree that divides seq_len / 2")
    if degrees.pp > num_layers:
        raise DegreesError(f"pipeline_parallel_degree {degrees.pp} is more than the model's {num_layers} layers"
                           f"{tail}")
