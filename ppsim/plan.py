"""`ppsim plan`: the fastest configuration of a torchtitan job that fits each device's memory.

The job fixes the model, the global batch and the sequence length. A plan varies the PP degree and the degrees that
make up the GPU count (TP within a node, FSDP for the rest, or as the job pins them), the schedule (every named one
torchtitan runs), the microbatches (through the microbatch size), the layers per stage (torchtitan's
``pipeline_parallel_layers_per_stage``) and the activation checkpoint mode. Every candidate is judged the same way:

1. its job is derived from the job's settings plus the candidate's overrides
   (:func:`ppsim.job.pipeline.job_from_settings`, torchtitan's rules), its stages cut by :mod:`ppsim.split`
   (torchtitan's split);
2. each PP rank's memory by :func:`ppsim.job.memory.job_memory` over the schedule's order, from shapes the caller passes
   (``shapes_for(tp, microbatch_size, activation_checkpoint)``; torch-free here), and the verdict against the cap;
3. only a candidate that fits is timed (:func:`ppsim.compare.compare`): with a profile that covers it (same TP, same
   tokens per microbatch) in seconds, otherwise in unit costs (F=1 per weighted layer, B=2, full checkpointing adds a
   forward to the backward) scaled by each chunk's work, which ranks candidates relative to each other only.

A plan (:func:`ppsim.plan_search.plan`) judges every candidate's memory before timing any, the model's shapes (the
expensive part) once per group; then those that fit are timed in order of a lower bound on their step (the larger
of a rank's compute and one microbatch's critical path), and once the bound reaches the K-th best step found, no
later candidate can enter the top K. The tools one plan owns
(simulations with their costs, the shapes, the order search, the time budget) are in :mod:`ppsim.plan_search`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppsim.errors import JobMemoryError, PPSimError
from ppsim.io import fmt_bytes
from ppsim.job import degrees
from ppsim.job.degrees import Degrees, check_degrees
from ppsim.job.memory import GIB, JobShapes, RankMemory, job_memory
from ppsim.job.pipeline import job_from_settings
from ppsim.job.settings import JobSettings, batch_shape
from ppsim.split import SplitSpec

SINGLE_STAGE = ("GPipe", "1F1B")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPE = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + MULTI_STAGE + V_SHAPE
"""torch's schedules torchtitan launches by name (``pipeline_parallel_schedule``)."""
NO_PIPELINE = "none"
"""A pp 1 candidate's schedule: torchtitan runs no pipeline; its microbatches are gradient accumulation steps, each
forward and backward in turn on the one stage (timed and counted as 1F1B on one rank)."""
MICROBATCH_SIZE_KEY = "parallelism.pipeline_parallel_microbatch_size"
DEGREE_KEYS = dict(degrees.DEGREE_KEYS)
"""Every degree a plan sets or keeps pinned (``--parallelism.KEY VALUE``), by :class:`Degrees` field."""
WORLD_KEYS = tuple(k for k in DEGREE_KEYS if k != "ep")
"""The degrees whose product is the GPU count (expert parallelism reuses the ``dp_shard x cp x tp`` ranks)."""
MAX_STAGES_PER_RANK = 4
MAX_LOCAL_EXPERTS = 32
"""EP degrees the plan tries on a MoE model (unless pinned): powers of two dividing the routed experts and
``dp_shard x cp x tp`` that leave each rank at most this many experts of a layer (fewer EP ranks gather more experts
per rank; DeepSeek-V3 trains 256 experts at EP 64, 4 a rank); where none does, the largest valid degree."""
CP_MIN_SEQ_LEN = 32768
"""The plan varies context parallelism only for sequences at least this long (or where the user pins it)."""
CP_DEGREES = (1, 2, 4, 8)
"""CP degrees the plan tries for long sequences: within a node with TP (``cp x tp <= --gpus-per-node``), the
sequence divisible by ``2 x cp`` (torchtitan's head-tail load balancer)."""


class PlanError(PPSimError):
    """A plan that cannot be made from these inputs (one line)."""


# --- unit costs: the step without a profile, communication included --------------------------------------------
H100_BF16_DENSE_FLOPS = 989e12
"""NVIDIA H100 SXM5 dense BF16 Tensor Core peak (NVIDIA's H100 datasheet: 1,979 TFLOP/s with sparsity, half of it
dense; torchtitan's ``get_peak_flops`` uses the same 989e12)."""
DEFAULT_MFU = 0.40
"""The share of that peak a layer's forward achieves: torchtitan's published H100 runs of Llama 3.1 8B with FSDP,
no Float8, reach 33-39 % MFU (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``); 40 %, about 400
TFLOP/s."""
NVLINK_BYTES_PER_S = 450e9
"""Intra-node link per GPU and direction: NVLink 4 on H100 SXM5, 900 GB/s bidirectional (NVIDIA's datasheet)."""
INTER_NODE_BYTES_PER_S = 50e9
"""Inter-node link per GPU and direction: one 400 Gb/s NDR InfiniBand (ConnectX-7) NIC per GPU, as on DGX H100 and
on the hosts of torchtitan's published H100 runs ("400 Gb/s per GPU")."""
TP_COLLECTIVES_PER_LAYER = 4
"""Sequence-parallel TP collectives per transformer layer and direction, as torchtitan shards a layer: an
all-gather of the sequence-sharded input before attention and before the feed-forward, a reduce-scatter of each
one's output; the backward runs the same four (reduce-scatter for each all-gather and the reverse)."""


@dataclass(frozen=True)
class UnitRates:
    """What unit costs charge communication at: a layer's compute rate and the links' bandwidths (bytes/s per GPU
    and direction). Only the ratios matter; the defaults are an H100 node's (the constants above)."""

    flops_per_s: float = H100_BF16_DENSE_FLOPS * DEFAULT_MFU
    intra_node_bytes_per_s: float = NVLINK_BYTES_PER_S
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S

    def fsdp_bytes_per_s(self, degrees: Degrees, gpus_per_node: int) -> float:
        """FSDP's ring over ``dp_shard`` ranks (stride ``cp x tp``, torchtitan's mesh order ``pp, dp_replicate,
        dp_shard, cp, tp``): the intra-node link when the group stays in a node, else the inter-node one."""
        within = degrees.dp_shard * degrees.cp * degrees.tp <= gpus_per_node
        return self.intra_node_bytes_per_s if within else self.inter_node_bytes_per_s

    @property
    def free(self) -> bool:
        """Links of infinite bandwidth: communication costs nothing (unit costs as compute alone)."""
        return math.isinf(self.intra_node_bytes_per_s) and math.isinf(self.inter_node_bytes_per_s)

    @classmethod
    def of_cluster(cls, cluster: Any) -> UnitRates:
        """A cluster's rates: its device's peak at :data:`DEFAULT_MFU`, its link within a node, and its NICs'
        bandwidth shared by a node's GPUs."""
        return cls(flops_per_s=cluster.device.peak_flops * DEFAULT_MFU,
                   intra_node_bytes_per_s=cluster.intra_node.bandwidth_Bps,
                   inter_node_bytes_per_s=cluster.inter_node.bandwidth_Bps * cluster.nics_per_node
                   / cluster.gpus_per_node)

    def describe(self) -> str:
        return (f"TP and FSDP collectives charged at {self.intra_node_bytes_per_s / 1e9:g} GB/s within a node and "
                f"{self.inter_node_bytes_per_s / 1e9:g} GB/s across nodes per GPU, against a layer's compute at "
                f"{self.flops_per_s / 1e12:.0f} TFLOP/s")


def link_rates(text: str) -> UnitRates:
    """``--link-bandwidth INTRA[,INTER]`` in GB/s (10^9 bytes/s) per GPU and direction; one value for both."""
    values: list[float] = []
    for item in text.split(","):
        try:
            value = float(item) if item.strip().isascii() and "_" not in item else math.nan
        except ValueError:
            value = math.nan
        values.append(value)
    if not 1 <= len(values) <= 2 or not all(math.isfinite(v) and v > 0 for v in values):
        raise PlanError(f"--link-bandwidth {text!r}: give GB/s per GPU and direction within a node and across nodes, "
                        "two positive finite numbers, e.g. --link-bandwidth 450,50 (one value: both)")
    intra, inter = values if len(values) == 2 else values * 2
    return UnitRates(intra_node_bytes_per_s=intra * 1e9, inter_node_bytes_per_s=inter * 1e9)


@dataclass(frozen=True)
class ModelFacts:
    """What the degrees must divide: the model's layers and attention heads."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    source: str = ""
    """``torchtitan:FAMILY/FLAVOR``: a profile must be of the same model."""
    num_experts: int | None = None
    """A MoE layer's routed experts (``None``: a dense model, EP 1)."""


@dataclass(frozen=True)
class ProfileCover:
    """One pass of a profile and what it covers: its TP degree and tokens per microbatch (a profile of several
    passes, ``calibrate --tp 1,2 --mb-size 1,2``, gives one cover each)."""

    path: str
    tp: int
    tokens_per_microbatch: int
    collectives: Any = None
    """Its measured collectives (:class:`ppsim.step.pricing.CollectiveCosts`); ``None``: not costed."""
    mb_size: int | None = None
    """The pass's microbatch size (:meth:`ppsim.profile.Profile.entry`); ``None``: the first pass at ``tp``."""
    shared_scale: float = 1.0
    """The profile's time-sharing slowdown (``runtime.shared_scale``, :mod:`ppsim.step.sharing`); 1: not measured."""

    @property
    def key(self) -> tuple[str, int, int | None]:
        """What its costs are loaded by: the file and the pass."""
        return (self.path, self.tp, self.mb_size)

    def profile(self) -> Any:
        """The :class:`ppsim.profile.Profile` as this pass measured it."""
        from ppsim.profile import load_profile

        return load_profile(self.path).entry(tp=self.tp, mb_size=self.mb_size, source=self.path)


@dataclass(frozen=True)
class PlanRequest:
    settings: JobSettings
    """The job's settings with the user's overrides applied."""
    user_overrides: tuple[str, ...]
    model: ModelFacts
    num_gpus: int
    gpus_per_node: int
    cap_bytes: int
    pinned: Mapping[str, int] = field(default_factory=dict)
    """Degrees the user fixed (``pp``, ``tp``, ``dp_shard``, ``dp_replicate``, ``cp``, ``ep``)."""
    profiles: tuple[ProfileCover, ...] = ()
    time_limit_s: float = 60.0
    top: int = 5
    activation_checkpoints: tuple[str, ...] = ("none",)
    microbatch_sizes: tuple[int, ...] = (1, 2, 4)
    unit_rates: UnitRates = UnitRates()
    """What unit costs (candidates no profile times) charge TP's collectives and compute at (``--link-bandwidth``,
    else the cluster's links and device)."""
    cluster: Any = None
    """The :class:`ppsim.step.cluster.Cluster` (``--cluster``) whose collective model prices FSDP's and EP's
    collectives on each candidate's placement; ``None``: an HGX H100 node's links at :attr:`unit_rates`."""
    shared_cores: int | None = None
    """Judging candidates as ``ppsim run`` executes them on this CPU host (``plan --memory-as-run`` with a CPU
    profile): its cores, which a candidate's local processes share (:class:`ppsim.step.model.Step` ``shared``)."""
    allocator: str | None = "expandable"
    """The CUDA caching allocator's mode replayed for the verdict (reserved plus outside it against the cap, as
    ``simulate`` judges); ``None``: the tensors' peak (``--memory-as-run`` on a CPU host, which has no such
    allocator)."""


    def model_cluster(self) -> Any:
        """The cluster the candidates run on (``--cluster``, else an HGX H100 node's), its links those of
        :attr:`unit_rates` (``--link-bandwidth`` where given), on nodes of :attr:`gpus_per_node`."""
        from ppsim.step.cluster import Link, load_cluster

        base = self.cluster if self.cluster is not None else load_cluster("h100")
        rates = self.unit_rates
        nics = max(1, base.nics_per_node * self.gpus_per_node // base.gpus_per_node)
        per_nic = rates.inter_node_bytes_per_s * self.gpus_per_node / nics  # the rates are per GPU
        return dataclasses.replace(
            base, gpus_per_node=self.gpus_per_node, nics_per_node=nics,
            intra_node=Link(bandwidth_Bps=rates.intra_node_bytes_per_s, latency_s=base.intra_node.latency_s),
            inter_node=Link(bandwidth_Bps=per_nic, latency_s=base.inter_node.latency_s))


@dataclass(frozen=True)
class Candidate:
    """One configuration of the job."""

    degrees: Degrees
    schedule: str
    microbatch_size: int
    local_batch_size: int
    layers_per_stage: int | None
    activation_checkpoint: str
    num_stages_per_rank: int
    csv: str | None = None
    """A searched order's CSV file (``search``'s order for this configuration), or ``None`` for the named order."""

    @property
    def num_microbatches(self) -> int:
        return self.local_batch_size // self.microbatch_size

    @property
    def order_name(self) -> str:
        """The schedule whose order it runs (1F1B on one rank without a pipeline: forward, backward, in turn)."""
        return "1F1B" if self.schedule == NO_PIPELINE else self.schedule

    @property
    def shape_key(self) -> tuple[int, int, str, int, int]:
        """What its model shapes depend on (:func:`shapes_of`): TP degree, microbatch size, checkpoint mode, EP and
        CP degrees."""
        return (self.degrees.tp, self.microbatch_size, self.activation_checkpoint, self.degrees.ep, self.degrees.cp)

    def overrides(self, settings: JobSettings) -> tuple[str, ...]:
        """torchtitan's command-line overrides that launch it (each ``--KEY VALUE``); EP and CP where the candidate
        or the job sets them above 1."""
        d = self.degrees
        out = [f"--parallelism.{DEGREE_KEYS[k]} {getattr(d, k)}" for k in ("pp", "tp", "dp_shard", "dp_replicate")]
        for k in ("cp", "ep"):
            if getattr(d, k) != 1 or int(settings.parallelism.get(DEGREE_KEYS[k], 1) or 1) != 1:
                out.append(f"--parallelism.{DEGREE_KEYS[k]} {getattr(d, k)}")
        if self.schedule == NO_PIPELINE:  # gradient accumulation: global / (local x data parallel) steps
            global_batch = self.local_batch_size * d.dp_shard * d.dp_replicate
            return (*out, f"--training.local_batch_size {self.microbatch_size}",
                    f"--training.global_batch_size {global_batch}")
        out.append(f"--parallelism.pipeline_parallel_schedule {self.schedule}")
        keys = batch_shape(settings).keys
        if keys.size == "parallelism.pipeline_parallel_microbatch_size":
            out += [f"--training.local_batch_size {self.local_batch_size}",
                    f"--parallelism.pipeline_parallel_microbatch_size {self.microbatch_size}"]
        else:
            out += [f"--parallelism.num_pp_microbatches {self.num_microbatches}",
                    f"--{keys.size} {self.microbatch_size * batch_shape(settings).seq_len}"]
        if self.layers_per_stage is not None:
            out.append(f"--parallelism.pipeline_parallel_layers_per_stage {self.layers_per_stage}")
        if self.csv is not None:
            out.append(f"--parallelism.pipeline_parallel_schedule_csv {self.csv}")
        return tuple(out)


@dataclass(frozen=True)
class Judged:
    """A candidate's verdict: memory per PP rank, and its step where it fits and was timed."""

    candidate: Candidate
    overrides: tuple[str, ...]
    memory: tuple[RankMemory, ...] = ()
    step_s: float | None = None
    relative_step: float | None = None
    """The step in unit costs (:func:`unit_costs`: F=1 per weighted layer and token / TP, plus TP's and FSDP's
    collectives at the request's :class:`UnitRates`): comparable with other unit-cost candidates only, never with
    a step in seconds."""
    reason: str = ""
    """Why it does not fit, could not run, or was not timed."""

    @property
    def fits(self) -> bool:
        return bool(self.memory) and all(m.fits for m in self.memory)

    @property
    def peak_bytes(self) -> int:
        return max((m.peak_memory_bytes for m in self.memory), default=0)

    @property
    def device_bytes(self) -> int:
        """What the verdict judged at the fullest rank: reserved plus outside the allocator where it was replayed,
        else the tensors' peak."""
        return max((m.peak_memory_bytes if m.reserved is None else m.reserved.device_bytes for m in self.memory),
                   default=0)

    @property
    def step_unit(self) -> str | None:
        """``"s"`` (timed with a profile), ``"unit"`` (unit costs), or ``None`` (not timed)."""
        return "s" if self.step_s is not None else "unit" if self.relative_step is not None else None

    def key(self) -> tuple[float, float]:
        """Sort key: timed with a profile first (by seconds), then by unit-cost step (two groups, never compared)."""
        if self.step_s is not None:
            return (0, self.step_s)
        return (1, self.relative_step if self.relative_step is not None else math.inf)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    global_batch: int
    judged: tuple[Judged, ...]
    ranked: tuple[Judged, ...]
    """Those that fit and were timed, fastest first."""
    num_candidates: int
    stopped: str = ""
    """Why the plan stopped before judging every candidate (``time limit``, ``interrupted``), or empty."""
    pruned: int = 0
    """Candidates that fit left untimed because their lower bound could not enter the top K."""
    memory_judged: int = 0
    """Candidates whose memory was judged (all of them unless the time limit or Ctrl-C stopped the plan)."""
    best_timeline: Any = field(default=None, repr=False, compare=False)
    """The best candidate's simulated step (:class:`ppsim.result.SimResult`), as it was timed: its Gantt chart."""

    @property
    def best(self) -> Judged | None:
        return self.ranked[0] if self.ranked else None

    def counts(self) -> str:
        """How far the plan got, for people (the table's title, the page)."""
        fit = sum(j.fits for j in self.judged)
        return (f"memory of {self.memory_judged} of {self.num_candidates} candidates judged ({fit} fit), "
                f"{len(self.ranked)} timed" + (f", {self.pruned} pruned by their lower bound" if self.pruned else "")
                + (f"; stopped: {self.stopped}" if self.stopped else ""))

    def ranked_in(self, unit: str) -> tuple[Judged, ...]:
        """The ranked candidates whose step is in ``unit`` (``"s"`` or ``"unit"``), fastest first: seconds and unit
        costs are two rankings, never one list."""
        return tuple(j for j in self.ranked if j.step_unit == unit)

    @property
    def units(self) -> tuple[str, ...]:
        """The step units among the ranked candidates, the best's first."""
        return tuple(dict.fromkeys(j.step_unit for j in self.ranked if j.step_unit is not None))

    def frontier(self, unit: str | None = None) -> list[Judged]:
        """The candidates timed in ``unit`` (default: the best's) no other of them beats on both step and peak
        memory, fastest first."""
        unit = unit or (self.best.step_unit if self.best is not None else None)
        out: list[Judged] = []
        for j in self.ranked_in(unit or "s"):
            if not out or j.peak_bytes < out[-1].peak_bytes:
                out.append(j)
        return out


# --- the space -------------------------------------------------------------------------------------------------
def _divisors(n: int, *, at_most: int) -> list[int]:
    """The divisors of ``n`` up to ``at_most`` (a degree is bounded by the layers or heads, so a billion GPUs
    enumerates a few dozen degrees, not a billion)."""
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def global_batch(settings: JobSettings, num_gpus: int) -> int:
    """Sequences per step: ``training.global_batch_size``, or the job's local batch times its data-parallel degree
    (``data_parallel_shard_degree -1`` filling the GPUs the other degrees leave)."""
    given = int(settings.training.get("global_batch_size", -1) or -1)
    if given > 0:
        return given
    par = settings.parallelism
    other = 1
    for key in ("pipeline_parallel_degree", "tensor_parallel_degree", "context_parallel_degree",
                "data_parallel_replicate_degree"):
        other *= max(1, int(par.get(key, 1)))
    shard = int(par.get("data_parallel_shard_degree", -1))
    if shard < 1:
        shard = max(1, num_gpus // other)
    return batch_shape(settings).local_batch_size * shard * max(1, int(par.get("data_parallel_replicate_degree", 1)))


def node_layout(num_gpus: int, gpus_per_node: int) -> str:
    """The nodes the GPUs make: whole nodes of ``gpus_per_node`` (no line), or one partial node when there are
    fewer GPUs than a node holds (one line saying so); GPUs that leave a node partly filled are refused."""
    n, g = num_gpus, gpus_per_node
    if n > g and n % g:
        raise PlanError(f"--gpus {n} with --gpus-per-node {g}: the GPUs must fill whole nodes ({n} is not a "
                        f"multiple of {g}); use --gpus {n - n % g} or {n - n % g + g}, or the node's real "
                        "--gpus-per-node")
    if n < g:
        return (f"plan: --gpus {n} < --gpus-per-node {g}: one node, {n} of its GPUs used; TP divides {n} (all "
                "GPUs share the node's links)")
    return ""


def _node_gpus(request: PlanRequest) -> int:
    """The GPUs of one node the job uses (TP stays within them): a whole node, or all of a partial one."""
    return min(request.num_gpus, request.gpus_per_node)


def degree_layouts(request: PlanRequest, batch: int) -> list[Degrees]:
    """Every (pp, tp, cp, dp_shard, dp_replicate) whose product is the GPU count, each with its EP degrees: TP within
    a node and dividing the heads, CP where the sequence is long (:func:`cp_options`), PP at most the layers (1: no
    pipeline, with HSDP's replicas across nodes too), the data-parallel degree dividing the global batch, EP over
    :func:`ep_options`; pins kept."""
    n, pins, model = request.num_gpus, request.pinned, request.model
    node_layout(n, request.gpus_per_node)
    _check_pins(request)
    out: list[Degrees] = []
    for pp in ([pins["pp"]] if "pp" in pins else _divisors(n, at_most=model.num_layers)):
        if pp == 1 and batch_shape(request.settings).keys.size != MICROBATCH_SIZE_KEY:
            continue  # gradient accumulation is read from 0.3.0's keys only
        for tp in ([pins["tp"]] if "tp" in pins else _divisors(_node_gpus(request), at_most=model.num_heads)):
            for cp in cp_options(request, tp):
                for rep in _replicas(request, pp):
                    rest, rem = divmod(n, pp * tp * cp * rep)
                    if rem or rest < 1 or pp > model.num_layers or model.num_heads % tp or model.num_kv_heads % tp:
                        continue
                    if ("dp_shard" in pins and pins["dp_shard"] != rest) or batch % (rest * rep):
                        continue
                    for ep in ep_options(request, rest * cp * tp):
                        out.append(Degrees(pp=pp, tp=tp, dp_shard=rest, dp_replicate=rep, cp=cp, ep=ep))
    if not out:
        raise PlanError(f"--gpus {n}: no degrees make it up (PP 1..{model.num_layers} layers, TP dividing "
                        f"{request.gpus_per_node} GPUs per node and the {model.num_heads} heads / "
                        f"{model.num_kv_heads} kv heads, data parallel dividing the global batch of {batch}"
                        + (", EP dividing dp_shard x cp x tp" if "ep" in pins else "")
                        + (f", pinned {_pins_text(pins)}" if pins else "") + "); pick a GPU count such as "
                        f"{2 * request.gpus_per_node if request.gpus_per_node > 1 else 2}")
    return out


def ep_options(request: PlanRequest, carved: int) -> list[int]:
    """The EP degrees a layout of ``carved = dp_shard x cp x tp`` ranks is tried at: the pinned one (where it
    divides ``carved``), 1 for a dense model, else the powers of two dividing the routed experts and ``carved``
    that leave at most :data:`MAX_LOCAL_EXPERTS` experts a rank, or where none does the largest valid degree
    (a power of two where one divides both)."""
    if "ep" in request.pinned:
        ep = request.pinned["ep"]
        return [ep] if carved % ep == 0 else []
    experts = request.model.num_experts
    if not experts:
        return [1]
    valid = [e for e in range(1, min(experts, carved) + 1) if experts % e == 0 and carved % e == 0]
    powers = [e for e in valid if e & (e - 1) == 0]
    chosen = [e for e in powers if experts // e <= MAX_LOCAL_EXPERTS]
    return chosen or [max(powers or valid)]


def cp_options(request: PlanRequest, tp: int) -> list[int]:
    """The CP degrees tried with TP degree ``tp``: the pinned one; 1 for sequences shorter than
    :data:`CP_MIN_SEQ_LEN`; else :data:`CP_DEGREES` that divide ``seq_len / 2`` (torchtitan's load balancer cuts
    each sequence into ``2 x cp`` chunks) and keep ``cp x tp`` within a node (CP's all-gathers ride NVLink)."""
    if "cp" in request.pinned:
        return [request.pinned["cp"]]
    seq = batch_shape(request.settings).seq_len
    if seq < CP_MIN_SEQ_LEN:
        return [1]
    return [cp for cp in CP_DEGREES if seq % (2 * cp) == 0 and cp * tp <= _node_gpus(request)] or [1]


def _replicas(request: PlanRequest, pp: int) -> list[int]:
    """``data_parallel_replicate_degree``: as pinned, else 1, and without a pipeline on several nodes also HSDP's
    one replica per node (FSDP within a node, replication across nodes)."""
    if "dp_replicate" in request.pinned:
        return [request.pinned["dp_replicate"]]
    nodes = request.num_gpus // request.gpus_per_node
    return [1, nodes] if pp == 1 and nodes > 1 else [1]


def _pins_text(pins: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in pins.items())


def _check_pins(request: PlanRequest) -> None:
    """Pinned degrees must multiply into the GPU count (EP apart: it reuses the ``dp_shard x cp x tp`` ranks) and keep
    TP within a node and dividing the heads; a pinned EP must divide the routed experts (a dense model: 1); a pinned
    CP must divide the sequence into ``2 x cp`` chunks."""
    pins, n = request.pinned, request.num_gpus
    below_one = {k: v for k, v in pins.items() if v < 1}  # before any division by them
    if below_one:
        raise PlanError(f"pinned degrees {_pins_text(below_one)}: a degree must be at least 1; pass "
                        f"--parallelism.{DEGREE_KEYS[next(iter(below_one))]} 1 or more")
    world = {k: v for k, v in pins.items() if k in WORLD_KEYS}
    product = math.prod(world.values()) if world else 1
    fix = "drop one of the --parallelism.*_degree overrides or change --gpus"
    if n % product or (set(world) >= set(WORLD_KEYS) and product != n):
        raise PlanError(f"pinned degrees {_pins_text(world)} multiply to {product}, which does not divide --gpus {n}; "
                        f"{fix}")
    if "tp" in pins and pins["tp"] > request.gpus_per_node:
        raise PlanError(f"pinned tensor_parallel_degree {pins['tp']} is more than --gpus-per-node "
                        f"{request.gpus_per_node}: TP stays within a node; {fix}")
    experts = request.model.num_experts
    ep = pins.get("ep", 1)
    if ep > 1 and not experts:
        raise PlanError(f"pinned expert_parallel_degree {ep}: the model has no experts (a dense model); pass "
                        "--parallelism.expert_parallel_degree 1 or drop it")
    if experts and experts % ep:
        raise PlanError(f"pinned expert_parallel_degree {ep} does not divide the model's {experts} routed experts; "
                        f"pick a divisor of {experts}, or drop it and let the plan choose")
    seq = batch_shape(request.settings).seq_len
    if pins.get("cp", 1) > 1 and seq % (2 * pins["cp"]):
        raise PlanError(f"pinned context_parallel_degree {pins['cp']}: the sequence length {seq} is not divisible by "
                        f"2 x cp = {2 * pins['cp']} (torchtitan's load balancer cuts each sequence into 2 x cp "
                        "chunks); pick a CP degree that divides seq_len / 2")
    try:
        check_degrees(Degrees(pp=pins.get("pp", 2), tp=pins.get("tp", 1)), num_heads=request.model.num_heads,
                      num_kv_heads=request.model.num_kv_heads, num_layers=request.model.num_layers)
    except JobMemoryError as exc:
        raise PlanError(f"pinned degrees {_pins_text(pins)}: {exc}") from None


def _stage_options(name: str, pp: int, num_layers: int) -> list[tuple[int | None, int]]:
    """``(layers_per_stage, stages per rank)`` a schedule can take: torchtitan's default, and for the looped
    multi-stage schedules a ``layers_per_stage`` giving each other stage count up to 4 per rank."""
    if name in SINGLE_STAGE or name == NO_PIPELINE:
        return [(None, 1)]
    if name in V_SHAPE:
        return [(None, 2)]
    weighted = num_layers + 2
    out: list[tuple[int | None, int]] = [(None, 2)]
    for v in range(3, MAX_STAGES_PER_RANK + 1):
        fits = [k for k in range(1, weighted + 1) if math.ceil(weighted / k) == pp * v]
        if fits:
            out.append((fits[0], v))
    return out


def candidates(request: PlanRequest, batch: int) -> list[Candidate]:
    """The whole space (layouts x microbatch sizes x schedules x layer splits x checkpoint modes); an empty one is
    refused in one line saying why (:class:`PlanError`), before any work."""
    layouts = degree_layouts(request, batch)
    out = [c for deg in layouts for c in _candidates_of(deg, request, batch)]
    if not out:
        raise PlanError(_empty_space(request, batch, layouts))
    return out


def _empty_space(request: PlanRequest, batch: int, layouts: Sequence[Degrees]) -> str:
    """Why no candidate can be formed, and the fix."""
    n = request.num_gpus
    pinned = ", ".join(f"{k} {v}" for k, v in sorted(request.pinned.items()))
    if not layouts:
        return (f"--gpus {n}: no layout of the degrees makes {n} GPUs with this model and global batch {batch}"
                + (f" and the pinned degrees ({pinned})" if pinned else "")
                + " (TP within a node dividing the heads, PP at most the layers, the data-parallel degree dividing "
                "the global batch); change the GPU count, the pins or --training.global_batch_size")
    pp = min(d.pp for d in layouts)
    return (f"--gpus {n}: at global batch {batch} every layout gives each data-parallel rank fewer sequences than "
            f"microbatches its pipeline needs (at least PP, {pp} at the smallest, of sizes "
            f"{'/'.join(map(str, request.microbatch_sizes))}), so no candidate can run"
            + (f" (pinned: {pinned})" if pinned else "")
            + "; raise --training.global_batch_size, or use fewer GPUs or a smaller pinned degree")


def _candidates_of(deg: Degrees, request: PlanRequest, batch: int) -> list[Candidate]:
    """One layout's candidates: each microbatch size giving its pipeline at least PP microbatches, x schedules x
    layer splits x checkpoint modes."""
    out: list[Candidate] = []
    local = batch // (deg.dp_shard * deg.dp_replicate)
    for size in request.microbatch_sizes:
        if local % size or local // size < deg.pp:
            continue
        for name in (SCHEDULES if deg.pp > 1 else (NO_PIPELINE,)):
            for lps, v in _stage_options(name, deg.pp, request.model.num_layers):
                for ac in request.activation_checkpoints:
                    out.append(Candidate(degrees=deg, schedule=name, microbatch_size=size, local_batch_size=local,
                                         layers_per_stage=lps, activation_checkpoint=ac, num_stages_per_rank=v))
    return out


# --- unit costs and bounds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitCosts:
    """A candidate's costs without a profile, one stage chunk's share, in layer-token units: 1 is one transformer
    layer's forward for one token at TP 1 (the embedding and the head each weighted as one layer)."""

    work: float
    """One chunk's forward compute: weighted layers x tokens / TP."""
    tp_comm: float = 0.0
    """One chunk's TP collectives in one direction (forward, or the backward's input gradient)."""
    seconds_per_unit: float = 0.0
    """Seconds one unit takes at the :class:`UnitRates` (0: unknown, no communication charged)."""
    activation_checkpoint: str = "none"

    @property
    def time_scale(self) -> float:
        """Seconds per unit of the simulation, whose chunk forward computes in 1 (FSDP's collectives are divided by
        it)."""
        return self.work * self.seconds_per_unit

    def text(self) -> str:
        """The ``--costs`` string per chunk, normalised to its forward compute: F=1, B=2 (I=W=1) plus the TP
        collectives on F and on I; full checkpointing runs the forward again, collectives included, inside I."""
        r = self.tp_comm / self.work if self.work > 0 else 0.0
        if self.activation_checkpoint == "full":
            return f"F={1 + r!r},B={3 + 2 * r!r},I={2 + 2 * r!r},W=1"
        return f"F={1 + r!r},B={2 + r!r},I={1 + r!r},W=1"


def layer_flops_per_token(shapes: JobShapes, seq_len: int, *, ep: int = 1) -> float:
    """One transformer layer's forward FLOPs per token at TP 1, as torchtitan counts them for MFU
    (``2 x parameters + 4 x dim x seq_len``; a MoE layer's routed experts count the ``top_k`` a token uses), the
    mean over the model's layers; its TP-local parameters times TP (the replicated norms counted TP times: a few
    parts in 10^4). Under EP (``ep`` > 1) the routed experts are whole on their EP rank whatever the TP degree
    (torchtitan 0.3.0 ``models/common/moe_sharding.py``: ``expert_param_placement_sparse``), so they count once;
    without EP they are TP-sharded like the dense weights."""
    layers = [b for name, b in shapes.blocks.items() if name.startswith("layers.")]
    if not layers:
        return 0.0
    total = 0.0
    for block in layers:
        dense = experts = 0.0
        for name, shape in block.tensors:
            numel: float = math.prod(shape)
            if name in block.sparse and shape and shapes.moe_top_k:
                experts += numel * shapes.moe_top_k / shape[0]  # one expert's share (dim 0: the local experts)
            else:
                dense += numel
        total += 2 * (dense * shapes.tp + experts * (1 if ep > 1 else shapes.tp)) + 4 * shapes.dim * seq_len
    return total / len(layers)


def unit_costs(c: Candidate, request: PlanRequest, shapes: JobShapes | None = None) -> UnitCosts:
    """The unit-cost model, the one for every candidate no profile times: F=1 and B=2 per weighted layer and token /
    TP, full checkpointing adding a forward to the backward, plus TP's sequence-parallel collectives
    (:data:`TP_COLLECTIVES_PER_LAYER` a layer and direction, each moving ``(tp - 1) / tp`` of the microbatch's
    ``tokens x dim`` activations over the node's link) at the request's :class:`UnitRates`. FSDP's all-gathers and
    reduce-scatters go into the step by :func:`step_collectives` at :attr:`UnitCosts.time_scale`. ``shapes``
    (``None``: compute only) give the dim, the activation dtype and the layer's FLOPs. A CP rank holds ``1 / cp``
    of each sequence's tokens (each attending over the whole sequence: the FLOPs per token keep the full length)."""
    tokens = c.microbatch_size * batch_shape(request.settings).seq_len / c.degrees.cp
    chunks = c.degrees.pp * c.num_stages_per_rank
    work = (request.model.num_layers + 2) / chunks * tokens / c.degrees.tp
    if shapes is None:
        return UnitCosts(work=work, activation_checkpoint=c.activation_checkpoint)
    from ppsim.job.memory import DTYPE_BYTES

    flops = layer_flops_per_token(shapes, batch_shape(request.settings).seq_len, ep=c.degrees.ep)
    seconds = flops / request.unit_rates.flops_per_s
    tp = c.degrees.tp
    per_token = (TP_COLLECTIVES_PER_LAYER * (tp - 1) / tp * shapes.dim * DTYPE_BYTES[shapes.param_dtype]
                 / request.unit_rates.intra_node_bytes_per_s)
    comm = request.model.num_layers / chunks * tokens * per_token / seconds if seconds > 0 else 0.0
    return UnitCosts(work=work, tp_comm=comm, seconds_per_unit=seconds, activation_checkpoint=c.activation_checkpoint)


def lower_bound(c: Candidate, request: PlanRequest) -> float:
    """No order beats the larger of a rank's compute and one microbatch's critical path (every stage's F, then
    every stage's input gradient), in unit costs (compute only: communication only adds to a step)."""
    f, b = (1.0, 3.0) if c.activation_checkpoint == "full" else (1.0, 2.0)
    chunks = c.degrees.pp * c.num_stages_per_rank
    rank_work = c.num_microbatches * c.num_stages_per_rank * (f + b)
    chain = chunks * (f + b / 2)
    return max(rank_work, chain) * unit_costs(c, request).work


# --- judging one candidate ------------------------------------------------------------------------------------
ShapesFor = Callable[..., JobShapes]
"""``shapes_for(tp, microbatch_size, activation_checkpoint)``, and ``ep=`` / ``cp=`` keywords where the candidate's
EP or CP degree is above 1 (:func:`shapes_of`)."""


def shapes_of(shapes_for: ShapesFor, c: Candidate) -> JobShapes:
    """The candidate's model shapes: ``shapes_for(tp, microbatch_size, activation_checkpoint)``, with ``ep=`` and
    ``cp=`` only where they are above 1 (a dense job's caller needs to know nothing of them)."""
    tp, size, ac, ep, cp = c.shape_key
    extra = {k: v for k, v in (("ep", ep), ("cp", cp)) if v != 1}
    return shapes_for(tp, size, ac, **extra)
Build = Callable[[str, int, int, int], Any]
"""``build(schedule_name, ranks, microbatches, stages_per_rank) -> Schedule``."""
Simulate = Callable[..., Any]
"""``simulate(schedule, job, profile_path_or_None, unit_costs, step=None) -> SimResult`` (its ``makespan`` in
seconds with a profile); ``step(schedule, costs)`` is the one step model's (:func:`step_collectives`)."""


def stage_modules(num_layers: int, counts: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """torchtitan's module names per stage for a split (``tok_embeddings`` first, ``norm`` and ``lm_head`` last)."""
    from ppsim.split import stage_blocks

    layout = ["tok_embeddings", *(f"layers.{i}" for i in range(num_layers)), "lm_head"]
    names = stage_blocks(layout, counts)
    return tuple(tuple(n for m in stage for n in (("norm", m) if m == "lm_head" else (m,))) for stage in names)


@dataclass(frozen=True)
class NoPipelineJob:
    """A pp 1 candidate's job: torchtitan runs no pipeline, so its one stage holds the whole model (the split the
    costs and the memory count read)."""

    split: SplitSpec = field(default_factory=SplitSpec)


def job_of(c: Candidate, request: PlanRequest) -> Any:
    """The candidate's :class:`~ppsim.job.pipeline.TorchtitanJob` by torchtitan's rules (pure Python); for pp 1, a
    :class:`NoPipelineJob` (torchtitan's pipeline rules do not apply)."""
    if c.degrees.pp == 1:
        return NoPipelineJob()
    settings = request.settings
    par = dict(settings.parallelism)
    tr = dict(settings.training)
    for k in DEGREE_KEYS:
        par[DEGREE_KEYS[k]] = getattr(c.degrees, k)
    par["pipeline_parallel_schedule"] = c.schedule
    par["pipeline_parallel_schedule_csv"] = ""
    par["pipeline_parallel_layers_per_stage"] = c.layers_per_stage
    keys = batch_shape(settings).keys
    if keys.size == "parallelism.pipeline_parallel_microbatch_size":
        tr["local_batch_size"], par["pipeline_parallel_microbatch_size"] = c.local_batch_size, c.microbatch_size
    else:
        par["num_pp_microbatches"] = c.num_microbatches
        tr[keys.size.split(".")[1]] = c.microbatch_size * batch_shape(settings).seq_len
    return job_from_settings(dataclasses.replace(settings, parallelism=par, training=tr, notes=()),
                             num_layers=request.model.num_layers)


def check_checkpointed_backward(c: Candidate, splits_backward: bool) -> None:
    """A split backward (I then W) under torchtitan's activation checkpointing is refused: torch's checkpointing
    reruns a checkpointed region for each of the two backwards (selective refuses the second; full recomputes the
    forward twice), the same refusal as ``ppsim run``'s."""
    if c.activation_checkpoint != "none" and splits_backward:
        raise PlanError(f"{c.order_name} splits its backward into I and W, and torch's {c.activation_checkpoint} "
                        "activation checkpointing reruns a checkpointed region for each")


def covering_profile(c: Candidate, request: PlanRequest) -> ProfileCover | None:
    """The profile measured at the candidate's TP degree and tokens per microbatch, under the job's own activation
    checkpoint mode (a profile times what it measured)."""
    if c.activation_checkpoint != request.activation_checkpoints[0]:
        return None
    tokens = c.microbatch_size * batch_shape(request.settings).seq_len
    return next((p for p in request.profiles if p.tp == c.degrees.tp and p.tokens_per_microbatch == tokens), None)


@dataclass(frozen=True)
class Prepared:
    """What timing a candidate that fits needs, kept from judging its memory."""

    job: Any
    schedule: Any
    shapes: JobShapes
    modules: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Judge:
    """Judges candidates of one request the same way: memory per PP rank first; only one that fits is timed."""

    request: PlanRequest
    shapes_for: ShapesFor
    build: Build
    simulate: Simulate
    splits: dict[tuple[str, int, int], bool] = field(default_factory=dict, compare=False, repr=False)
    """Whether each named order (schedule, PP degree, stages a rank) splits its backward, once one was built."""

    def memory(self, c: Candidate, *, order: Any = None) -> tuple[Judged, Prepared | None]:
        """Each PP rank's memory and the verdict; what timing needs where it fits. ``order``: a searched order to
        judge in place of the named schedule's. A named order of many microbatches is judged on its steady state
        where that is exact (:meth:`steady`)."""
        if order is None and c.csv is None:
            steady = self.steady(c)
            if steady is not None:
                return steady
        return self.walked(c, order=order)

    def steady(self, c: Candidate) -> tuple[Judged, Prepared | None] | None:
        """``c``'s verdict from two short orders of the same schedule, ``pp x (v + 1)`` and one round of ``pp``
        more microbatches, each with the receive buffers ``c``'s ``m`` microbatches hold from the start, where both
        give every rank the same memory (its peak, parts, the action it is in, the allocator's reserved peak and
        the verdict): a named order of ``m`` microbatches is the short one with more rounds of its steady state,
        each holding what the round before held, so ``m``'s peaks are the short order's. ``None`` (judge the whole
        order) where ``m`` is not above both, either cannot run, or the two differ (GPipe, LoopedBFS: memory that
        grows with ``m``). Judging walks every computation and replays every tensor, so a candidate of 2,048
        microbatches costs about what two of 8 do."""
        pp, v, m = c.degrees.pp, c.num_stages_per_rank, c.num_microbatches
        short = pp * (v + 1)
        if m <= short + pp:
            return None
        walked = [self.walked(dataclasses.replace(c, local_batch_size=n * c.microbatch_size), prepare=False,
                              buffered=m)[0] for n in (short, short + pp)]
        if not all(j.memory for j in walked) or not _same_memory(*walked):
            return None
        judged = dataclasses.replace(walked[0], candidate=c, overrides=self.overrides(c))
        return judged, (self.prepared(c) if judged.fits else None)

    def walked(self, c: Candidate, *, order: Any = None, prepare: bool = True,
               buffered: int | None = None) -> tuple[Judged, Prepared | None]:
        """:meth:`memory` over the whole order (``prepare``: return what timing needs where it fits; ``buffered``:
        the microbatches whose receive buffers are held, where ``c`` is a shorter order judged for a longer one)."""
        request = self.request
        overrides = self.overrides(c)
        try:
            prepared = self.prepared(c, order=order)
            memory = tuple(job_memory(prepared.shapes, degrees=c.degrees, schedule=prepared.schedule,
                                      stage_modules=prepared.modules, cap_bytes=request.cap_bytes, until_over=True,
                                      buffered=buffered))
        except PPSimError as exc:
            return Judged(c, overrides, reason=f"cannot run: {exc}"), None
        memory = with_reserved(memory, request, shapes=prepared.shapes, degrees=c.degrees,
                               schedule=prepared.schedule, modules=prepared.modules, buffered=buffered)
        judged = Judged(c, overrides, memory=memory)
        if judged.fits:
            return judged, (prepared if prepare else None)
        over = [m for m in memory if not m.fits]
        return dataclasses.replace(judged, reason="; ".join(m.verdict() for m in over[:2])
                                   + (f" (+{len(over) - 2} ranks)" if len(over) > 2 else "")
                                   + (" (the ranks after it not counted)" if len(memory) < c.degrees.pp else "")), None

    def refusal(self, c: Candidate) -> Judged | None:
        """``c``'s verdict where it cannot run for a reason known without its shapes or its whole order (torchtitan's
        stage split; a split backward under checkpointing, read off a short order of the same schedule); ``None``
        otherwise. Judging one costs microseconds, so ``plan`` judges these first, whatever their order's size."""
        if c.csv is not None:
            return None
        from ppsim.split import resolve_split

        named = (c.order_name, c.degrees.pp, c.num_stages_per_rank)
        try:
            job = job_of(c, self.request)
            resolve_split(job.split, self.request.model.num_layers, c.degrees.pp * c.num_stages_per_rank,
                          schedule=c.order_name)
            if named not in self.splits:
                try:
                    short = self.build(c.order_name, c.degrees.pp, c.degrees.pp * (c.num_stages_per_rank + 1),
                                       c.num_stages_per_rank)
                except PPSimError:
                    return None  # no short order of it: the whole one is judged as it comes
                self.splits[named] = short.splits_backward
            check_checkpointed_backward(c, self.splits[named])
        except PPSimError as exc:
            return Judged(c, self.overrides(c), reason=f"cannot run: {exc}")
        return None

    def overrides(self, c: Candidate) -> tuple[str, ...]:
        """The user's overrides and the candidate's own: the command that launches it."""
        return tuple(self.request.user_overrides) + c.overrides(self.request.settings)

    def prepared(self, c: Candidate, *, order: Any = None) -> Prepared:
        """The candidate's job, order (``order``, else its named schedule's), shapes and stages' modules: what
        judging its memory and timing it need (raises :class:`PPSimError` where it cannot run)."""
        from ppsim.split import resolve_split

        job = job_of(c, self.request)
        num_stages = c.degrees.pp * c.num_stages_per_rank
        counts = resolve_split(job.split, self.request.model.num_layers, num_stages, schedule=c.order_name)
        named = (c.order_name, c.degrees.pp, c.num_stages_per_rank)
        if order is None and named in self.splits:  # refused before its order is built (thousands of actions)
            check_checkpointed_backward(c, self.splits[named])
        schedule = order or self.build(c.order_name, c.degrees.pp, c.num_microbatches, c.num_stages_per_rank)
        if order is None:
            self.splits[named] = schedule.splits_backward
        check_checkpointed_backward(c, schedule.splits_backward)
        return Prepared(job=job, schedule=schedule, shapes=shapes_of(self.shapes_for, c),
                        modules=stage_modules(self.request.model.num_layers, counts))

    def time(self, j: Judged, prepared: Prepared) -> tuple[Judged, Any]:
        """A candidate that fits, timed: with its step and the simulated step (``None`` where it could not be)."""
        c, request = j.candidate, self.request
        cover = covering_profile(c, request)
        unit = unit_costs(c, request, prepared.shapes)
        timed = step_collectives(c, prepared.shapes, prepared.modules, cover, shared_cores=request.shared_cores,
                                unit=unit, request=request)
        try:
            sim = self.simulate(prepared.schedule, prepared.job, cover,
                                unit.text(), **({} if timed is None else {"step": timed}))
        except PPSimError as exc:
            return dataclasses.replace(j, reason=f"not timed: {exc}"), None
        if cover is not None:
            return dataclasses.replace(j, step_s=float(sim.makespan)), sim
        return dataclasses.replace(j, relative_step=float(sim.makespan) * unit.work), sim

    def __call__(self, c: Candidate, *, order: Any = None) -> tuple[Judged, Any]:
        """Memory, then the step where it fits: the verdict and the simulated step (or ``None``)."""
        j, prepared = self.memory(c, order=order)
        return (j, None) if prepared is None else self.time(j, prepared)


def _same_memory(a: Judged, b: Judged) -> bool:
    """Whether two verdicts give every rank the same memory: peak, parts, the action it is in, what is held from
    start to end, the allocator's reserved peak and what lives outside it, and the verdict."""
    def seen(j: Judged) -> tuple[Any, ...]:
        return (j.fits, j.reason, tuple((m.rank, m.peak_memory_bytes, tuple(sorted(m.parts.items())), m.during,
                                         tuple(sorted(m.static_bytes.items())), m.start_bytes, m.end_bytes,
                                         None if m.reserved is None else (m.reserved.reserved_peak_bytes,
                                                                          m.reserved.device_bytes, m.reserved.fits))
                                        for m in j.memory))
    return seen(a) == seen(b)


def with_reserved(memory: tuple[RankMemory, ...], request: PlanRequest, *, shapes: JobShapes, degrees: Degrees,
                  schedule: Any, modules: Any, buffered: int | None = None) -> tuple[RankMemory, ...]:
    """Each rank's memory with the caching allocator replayed and what lives outside it, so the verdict judges
    reserved plus outside, as ``simulate`` does (:mod:`ppsim.job.outside`). Only where the tensors alone fit: the
    reserved peak is never below them, so a candidate over the cap by its tensors is over by more."""
    if request.allocator is None or not all(m.fits for m in memory):
        return memory
    from ppsim.job.outside import reserved_per_rank

    reserved = reserved_per_rank(shapes, degrees=degrees, schedule=schedule, stage_modules=modules,
                                 mode=request.allocator, cap_bytes=request.cap_bytes, until_over=True,
                                 buffered=buffered)
    counted = tuple(dataclasses.replace(m, reserved=r) for m, r in zip(memory, reserved))
    return counted if all(r.fits is not False for r in reserved) else counted[:len(reserved)]


def step_collectives(c: Candidate, shapes: JobShapes, modules: Sequence[Sequence[str]],
                     cover: ProfileCover | None, *, shared_cores: int | None = None, unit: UnitCosts | None = None,
                     request: PlanRequest | None = None) -> Callable[[Any, Any], Any] | None:
    """The candidate's step by the one step model (:func:`ppsim.step.build.build_step`, as ``run`` and ``simulate``
    time it): FSDP's exposed all-gathers and reduce-scatters and EP's all-to-alls, each on its group's placement on
    the request's cluster; priced by the covering profile's measured collectives, or without a profile by the
    cluster's collective model (NCCL's) in ``unit``'s simulation units; ``None`` where nothing is priced.
    ``shared_cores``: the candidate's dp_shard x tp processes per PP rank share this many cores, as ``ppsim run``
    runs them here."""
    from ppsim.step.build import StepJob, build_step
    from ppsim.step.placement import place
    from ppsim.step.pricing import CollectiveCosts

    per_rank = c.degrees.dp_shard * c.degrees.tp
    shared = None if shared_cores is None or c.degrees.pp * per_rank <= shared_cores else (per_rank, shared_cores)
    costs, scale = None, 1.0
    cluster = request.model_cluster() if request is not None else None
    if cover is not None:
        costs = cover.collectives
    elif unit is not None and request is not None and unit.time_scale > 0 and not request.unit_rates.free:
        costs, scale = CollectiveCosts(cluster=cluster), unit.time_scale
    if costs is None and shared is None and c.degrees.ep <= 1 and c.degrees.cp <= 1:
        return None
    gpus_per_node = request.gpus_per_node if request is not None else c.degrees.world_size
    job = StepJob(shapes=shapes, stage_modules=modules, degrees=c.degrees, costs=costs,
                  placement=(place(c.degrees, gpus_per_node, rank_order=cluster.rank_order)
                             if cover is None and cluster is not None else None),
                  time_scale=scale, shared=shared,
                  shared_scale=1.0 if cover is None else cover.shared_scale,  # as `run` reads it
                  activation_bytes=shapes.boundary_bytes)
    return lambda schedule, stage_costs: build_step(schedule, stage_costs, job)


# --- what a plan found, for people --------------------------------------------------------------------------
def refusal_rule(reason: str) -> str:
    """A "cannot run" reason as the rule that refused it: the numbers and schedule names taken out, so the same rule
    on different candidates counts once (``"N stages for N layers ..."``)."""
    import re

    text = reason.removeprefix("cannot run: ")
    text = re.sub(r"\b(" + "|".join(SCHEDULES) + r")\b", "S", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


def _per_rank(j: Judged) -> list[RankMemory | None]:
    """A verdict's memory by PP rank, ``None`` for a rank not counted (judging stopped at a rank over the cap); empty
    where the candidate could not run."""
    if not j.memory:
        return []
    by_rank = {m.rank: m for m in j.memory}
    return [by_rank.get(r) for r in range(j.candidate.degrees.pp)]


def nothing_fits(result: Plan) -> str:
    """Why no candidate is ranked when every one was judged, in one line: how many could not run (and the rule that
    refused most of them, with one of its reasons), how many ran but none fits the cap (with the smallest peak among
    them and its candidate), and what to change."""
    from collections import Counter

    cap = result.request.cap_bytes
    ran = [j for j in result.judged if j.memory]
    refused = [j for j in result.judged if not j.memory]
    rules = Counter(refusal_rule(j.reason) for j in refused)
    said = ""
    if refused:
        rule, count = rules.most_common(1)[0]
        example = next(j.reason for j in refused if refusal_rule(j.reason) == rule).removeprefix("cannot run: ")
        example = example if len(example) <= 240 else example[:237] + "..."
        said = (f"{len(refused)} could not run ({count} of them: {example}"
                + (f"; {len(rules) - 1} other rule{'s' if len(rules) > 2 else ''}" if len(rules) > 1 else "") + ")")
    if not ran:
        return (f"--gpus {result.request.num_gpus}: none of the {len(result.judged)} candidates can run: {said}; "
                "change the job's batch, the GPU count or the pinned degrees")
    smallest = min(ran, key=lambda j: j.device_bytes)
    ran_text = f"all {len(ran)} candidates ran" if not refused else f"{len(ran)} of the {len(result.judged)} ran"
    return (f"--memory-cap {fmt_bytes(cap)}: no candidate fits; the smallest peak is {smallest.device_bytes / GIB:.2f} "
            f"GiB ({describe(smallest.candidate)}); {ran_text} and none fits" + (f", {said}" if said else "")
            + "; raise the cap to at least that or use more GPUs")


def describe(c: Candidate) -> str:
    d = c.degrees
    lps = f", {c.layers_per_stage} layers per stage" if c.layers_per_stage is not None else ""
    name = f"search's order ({c.csv}, stages placed as {c.schedule})" if c.csv else c.schedule
    degrees = (f"pp {d.pp} x tp {d.tp}" + (f" x cp {d.cp}" if d.cp > 1 else "") + f" x dp_shard {d.dp_shard}"
               + (f" x dp_replicate {d.dp_replicate}" if d.dp_replicate > 1 else "")
               + (f", ep {d.ep}" if d.ep > 1 else ""))
    if c.schedule == NO_PIPELINE:
        steps = "step" if c.num_microbatches == 1 else "steps"
        return (f"{degrees}, no pipeline: {c.num_microbatches} gradient accumulation {steps} of {c.microbatch_size}, "
                f"activation checkpoint {c.activation_checkpoint}")
    return (f"{degrees}, {name} with {c.num_microbatches} microbatches of {c.microbatch_size}{lps}, activation "
            f"checkpoint {c.activation_checkpoint}")


def to_dict(result: Plan, *, job: str) -> dict[str, Any]:
    """``plan --json`` (the contract's keys, plus ``reason``, ``relative_step``, ``step_unit`` and ``memory_parts``
    per rank). The ranked come first: those timed in seconds fastest first, then those in unit costs fastest first."""
    seq = batch_shape(result.request.settings).seq_len
    rows = []
    shown = {id(j) for j in result.ranked}
    order = list(result.ranked) + [j for j in result.judged if id(j) not in shown]
    for j in order:
        c = j.candidate
        tps = (result.global_batch * seq / (j.step_s * result.request.num_gpus)) if j.step_s else None
        ranks = _per_rank(j)
        rows.append({
            "pp": c.degrees.pp, "tp": c.degrees.tp, "dp_shard": c.degrees.dp_shard,
            "dp_replicate": c.degrees.dp_replicate, "schedule": c.schedule, "schedule_csv": c.csv,
            "microbatches": c.num_microbatches,
            "microbatch_size": c.microbatch_size, "stages_per_rank": c.num_stages_per_rank,
            "ep": c.degrees.ep, "cp": c.degrees.cp, "layers_per_stage": c.layers_per_stage,
            "activation_checkpoint": c.activation_checkpoint, "recompute": c.activation_checkpoint,  # old alias
            "fits": j.fits,
            "peak_memory_bytes": [None if m is None else m.peak_memory_bytes for m in ranks],
            "reserved_peak_bytes": [None if m is None or m.reserved is None else m.reserved.reserved_peak_bytes
                                    for m in ranks],
            "outside_allocator_bytes": [None if m is None or m.reserved is None else m.reserved.outside_allocator_bytes
                                        for m in ranks],
            "memory_parts": [None if m is None else dict(m.parts) for m in ranks],
            "step_s": j.step_s, "tokens_per_s_per_gpu": tps, "relative_step": j.relative_step,
            "step_unit": j.step_unit,  # "s" | "unit" | null: the two are ranked apart, never against each other
            "reason": j.reason or None, "overrides": list(j.overrides),
        })
    return {"job": job, "gpus": result.request.num_gpus, "memory_cap_bytes": result.request.cap_bytes,
            "global_batch": result.global_batch, "seq_len": seq, "num_candidates": result.num_candidates,
            "stopped": result.stopped or None, "candidates": rows, "best": 0 if result.ranked else None}

