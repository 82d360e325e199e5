"""The calibration profile: what `ppsim calibrate` writes and the simulator reads (schema in docs/profile.md).

Plain Python (no torch). :func:`load_profile` turns every malformed file into one :class:`CostError` line naming
the file, the field and the fix; :func:`save_profile` writes atomically, so a killed calibration never leaves half
a file. A profile in progress has ``complete: false``, ``null`` for what is not measured yet and lists the finished
measurement keys in ``done`` (what ``--resume`` skips).

Version 2 stores the model's building blocks (embedding, a transformer layer, the head) instead of whole stages,
so one profile serves any stage count (:mod:`ppsim.split` composes stages from blocks); version 3 adds the model
``source`` (``--model``: source, family, flavor, parameter count, attention backend, each layer's kind) and one
block per layer kind. Version 1 (fixed stages) and 2 files still load. This module is the only place the schema is
validated.

A calibration of several tensor-parallel degrees and microbatch sizes (``calibrate --tp 1,2 --mb-size 1,2``) writes
one profile: its first pass is the profile's own ``blocks`` / ``stage_overhead`` / ``tensor_parallel_degree`` /
``model.mb_size`` (what a profile of one pass holds, so every reader and older ppsims read it as before), the others
are ``entries`` (:class:`ProfileEntry`); :meth:`Profile.entry` is the profile as one pass measured it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ppsim.errors import CostError, PPSimError
from ppsim.io import write_atomic
from ppsim.limits import MAX_PROFILE_BYTES
from ppsim.model_config import DTYPE_BYTES, MODEL_KEYS, ModelConfig
from ppsim.step.kinds import ALL_KINDS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SCHEMA = "ppsim.profile"
VERSION = 3
"""The version `ppsim calibrate` writes (blocks per layer kind and the model ``source``); 1 and 2 still load."""
VERSIONS = (1, 2, 3)
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
DTYPE_NAMES = tuple(DTYPE_BYTES)
RECV_POSTINGS = ("early", "consumer")
BLOCK_EMBED = "embed"
BLOCK_LAYER = "layer"
BLOCK_HEAD = "head"
MAX_INT = 2**63 - 1
"""Largest byte count or count accepted (int64, what torch reports)."""
OPS = ("F", "B", "I", "W", "FB")
AC_MODES = ("none", "selective", "full")
"""torchtitan's activation-checkpoint modes (``run``/``calibrate --activation-checkpoint``; a profile's
``activation_checkpoint``, absent: ``none``)."""
WHOLE_BACKWARD_OPS = ("F", "B", "FB")
"""What a calibration under activation checkpointing measures: torch reruns a checkpointed region for each backward,
so a backward split into I and W is not measured (its I and W are null)."""


def checkpoint_mismatch(measured: str, mode: str, *, source: str, rerun_added: bool = False) -> str | None:
    """One line when a job checkpointing activations as ``mode`` is timed by costs ``source`` measured under the
    mode ``measured``, else ``None``: a mode that reruns more in its backward (none < selective < full) overstates
    the step, one that reruns less understates it; ``rerun_added``: the caller adds every forward's rerun to the
    backward itself (``run`` under ``full`` with costs measured without checkpointing)."""
    if measured == mode:
        return None
    more = AC_MODES.index(measured) > AC_MODES.index(mode)
    bound = ("every forward's rerun added to the backward by ppsim's recompute model" if rerun_added
             else "an upper bound: its backwards rerun what the job's saves" if more
             else "a lower bound: the backward's rerun of what the job's policy does not save is missing")
    return (f"{source} was measured under activation_checkpoint {measured}, the job runs {mode}: the predicted step "
            f"takes its costs as measured ({bound}); calibrate with --activation-checkpoint {mode}")


def measured_ops(activation_checkpoint: str) -> tuple[str, ...]:
    """The timings a complete profile measured under ``activation_checkpoint`` holds."""
    return OPS if activation_checkpoint == "none" else WHOLE_BACKWARD_OPS
ABSENT_IN_OLD = {"absent_in_old": True}
DEFAULT_IF_ABSENT = {"default_if_absent": True}
"""Field metadata: a key that profiles written before it existed lack, read as the field's default."""
OMIT_IF_NONE = {"omit_if_none": True}
"""Field metadata: the key is left out of the file when the value is ``None`` (older profiles lack it)."""


def at_least(minimum: int) -> dict[str, Any]:
    """Field metadata: an ``int`` read from a profile must be at least ``minimum`` (otherwise 0)."""
    return {"minimum": minimum}


POSITIVE = {"positive": True}
"""Field metadata: a ``float`` read from a profile must be > 0 (otherwise >= 0)."""


def one_of(choices: tuple[str, ...]) -> dict[str, Any]:
    """Field metadata: a ``str`` read from a profile must be one of ``choices``."""
    return {"choices": choices}


class Record:
    """A record stored in a profile as a JSON object of its fields, in order (see :func:`_as_json`); :class:`_Reader`
    reads it back from the same fields, their types and metadata, so a new field is one line."""

    def to_dict(self) -> dict[str, Any]:
        return _as_json(self)


def _as_json(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.metadata.get("omit_if_none"):
            continue
        out[f.name] = _json_value(value)
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):  # JSON keys are strings; rank counts are written in order
        items = sorted(value.items()) if all(isinstance(k, int) for k in value) else value.items()
        return {str(k): _json_value(v) for k, v in items}
    return value
"""Field metadata: a key that profiles written before it existed lack (read as ``None``)."""
"""Timed operations per stage: forward, full backward, backward-for-input, backward-for-weights, one F&B pair."""


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of a non-empty sequence."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stat:
    """Repeated measurements in seconds: median with p10/p90, and the raw samples."""

    median: float
    p10: float
    p90: float
    samples: tuple[float, ...]
    n: int

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Stat:
        values = tuple(float(s) for s in samples)
        return cls(
            median=percentile(values, 50), p10=percentile(values, 10), p90=percentile(values, 90),
            samples=values, n=len(values),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "samples": list(self.samples), "n": self.n}


ModelInfo = ModelConfig
"""The profile's ``model`` object: :class:`ppsim.model_config.ModelConfig` (the old name stays importable)."""


@dataclass(frozen=True)
class Block:
    """One building block of the model (version 2): the embedding, one transformer layer, or the head (final norm,
    LM head and the loss). Timings and activation bytes are ``None`` until measured."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    output_bytes: int
    """Tensor this block hands to the next one per microbatch (0 for the head, which ends the model)."""
    F: Stat | None = None
    B: Stat | None = None
    I: Stat | None = None  # noqa: E741 - the schedule's name for backward-for-input
    W: Stat | None = None
    FB: Stat | None = None
    activation_bytes: int | None = None
    activation_bytes_freed_by_I: int | None = None
    activation_bytes_allocator: int | None = field(default=None, metadata=ABSENT_IN_OLD)
    peak_bytes_allocator: int | None = field(default=None, metadata=ABSENT_IN_OLD)

    @property
    def is_measured(self) -> bool:
        return self.measured(OPS)

    def measured(self, ops: tuple[str, ...]) -> bool:
        """Whether the timings ``ops`` (:func:`measured_ops`) and the activation bytes are measured."""
        return all(getattr(self, op) is not None for op in ops) and self.activation_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        return _measured_dict(self)


@dataclass(frozen=True)
class MeasuredFields:
    """The measured fields a block and a stage share, read from :class:`Block`'s own fields, in the order a
    profile stores and checks them: the timings (``Stat | None``), the byte counts that may be unmeasured
    (``int | None``: activations), the other byte counts (``int``), then the keys older profiles lack
    (``metadata=ABSENT_IN_OLD``). A new measured field is one line in :class:`Block` (and :class:`StageProfile`)."""

    stats: tuple[str, ...]
    ints: tuple[str, ...]
    optional_ints: tuple[str, ...]
    unmeasured_ints: tuple[str, ...]
    """Of ``ints``, those a profile still being measured may leave null (``int | None``)."""

    @classmethod
    def of(cls, record: type) -> MeasuredFields:
        fs = fields(record)
        ints = [f for f in fs if f.type in ("int", "int | None") and not f.metadata.get("absent_in_old")]
        return cls(
            stats=tuple(f.name for f in fs if f.type == "Stat | None"),
            ints=tuple(f.name for f in sorted(ints, key=lambda f: f.type == "int")),
            optional_ints=tuple(f.name for f in fs if f.metadata.get("absent_in_old")),
            unmeasured_ints=tuple(f.name for f in ints if f.type == "int | None"),
        )


def _measured_dict(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in MEASURED.stats:
        stat = getattr(record, op)
        out[op] = None if stat is None else stat.to_dict()
    for key in MEASURED.ints + MEASURED.optional_ints:
        out[key] = getattr(record, key)
    return out


MEASURED = MeasuredFields.of(Block)
assert MEASURED.stats == OPS, "Block's timings are the schedule's operations"


@dataclass(frozen=True)
class StageOverhead:
    """Fixed cost of one stage that its blocks do not hold (hooks, boundary handling, ...), per operation."""

    F: Stat | None = None
    B: Stat | None = None
    I: Stat | None = None  # noqa: E741
    W: Stat | None = None
    FB: Stat | None = None

    @property
    def is_measured(self) -> bool:
        return self.measured(OPS)

    def measured(self, ops: tuple[str, ...]) -> bool:
        return all(getattr(self, op) is not None for op in ops)

    def to_dict(self) -> dict[str, Any]:
        return {op: None if getattr(self, op) is None else getattr(self, op).to_dict() for op in OPS}


@dataclass(frozen=True)
class ProfileEntry:
    """One more pass of a calibration: the blocks and per-stage overhead measured at another tensor-parallel degree
    or microbatch size (the runtime, p2p and collectives are the profile's, measured once)."""

    tensor_parallel_degree: int
    mb_size: int
    blocks: Mapping[str, Block]
    stage_overhead: StageOverhead | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.tensor_parallel_degree, self.mb_size)

    def to_dict(self) -> dict[str, Any]:
        return {"tensor_parallel_degree": self.tensor_parallel_degree, "mb_size": self.mb_size,
                "blocks": {name: block.to_dict() for name, block in self.blocks.items()},
                "stage_overhead": None if self.stage_overhead is None else self.stage_overhead.to_dict()}


def degrees_text(degrees: Sequence[int]) -> str:
    """``1``, ``1 and 2``, ``1, 2 and 4``."""
    shown = [str(d) for d in degrees]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


@dataclass(frozen=True)
class SourceInfo:
    """Version 3: which model was measured (``--model``) and how."""

    source: str
    """``builtin:tiny``, ``torchtitan:llama3/debugmodel``, ``python:pkg.mod:make``."""
    scheme: str
    family: str | None
    flavor: str | None
    num_params: int
    attention: str
    """Attention backend used, e.g. ``sdpa (FlexAttention has no CPU backward)``."""
    layer_kinds: tuple[str, ...]
    """Kind of each layer, in order."""
    kinds: Mapping[str, str] = field(default_factory=dict)
    """What distinguishes each kind."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The model-size options it was measured with (``seq_len``, ``mb_size``, ``dtype``, ``layers``, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "scheme": self.scheme, "family": self.family, "flavor": self.flavor,
                "num_params": self.num_params, "attention": self.attention, "layer_kinds": list(self.layer_kinds),
                "kinds": dict(self.kinds), "options": dict(self.options)}


@dataclass(frozen=True)
class Probe(Record):
    """The fixed reference run the runtime overheads were measured on."""

    schedule: str
    ranks: int = field(metadata=at_least(1))
    microbatches: int = field(metadata=at_least(1))
    steps: int = field(metadata=at_least(1))


@dataclass(frozen=True)
class RuntimeOverheads(Record):
    """What executing under torch's pipeline runtime adds to the op costs, measured by a probe run.

    ``compute_scale`` maps the number of ranks computing at once on one host to the factor every computation is
    slowed by (``{1: 1.0, 2: 1.6}``); ``dispatch_s`` is added per computation; ``handoff_s`` is the latency of one
    cross-rank hand-off (replaces the p2p fit's alpha when simulating); ``recv_posting`` is ``"early"`` or
    ``"consumer"`` (see :class:`ppsim.costs.StageCosts`). ``synthetic`` holds the same for synthetic sleeping stages.
    ``samples`` keeps raw measurements by name (e.g. ``"dispatch_s"``, ``"compute_scale.2"``).
    """

    compute_scale: Mapping[int, float]
    dispatch_s: float
    handoff_s: float | None = None
    recv_posting: str = field(default="early", metadata=one_of(RECV_POSTINGS))
    synthetic: RuntimeOverheads | None = None
    """Only one level deep: a profile's ``runtime.synthetic.synthetic`` must be null."""
    probe: Probe | None = None
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    shared_scale: float | None = field(default=None, metadata=OMIT_IF_NONE)
    """How much slower CPU work runs while a host's local processes outnumber its cores (time-sharing: context
    switches, caches, both cores saturated), beyond the fair share itself; measured by the FSDP probe
    (:func:`ppsim.calibrate.measure.runtime_model.fit_shared_scale`) and applied by processor sharing
    (:func:`ppsim.step.sharing.shared_cores_step`). ``None``: not measured (1)."""


@dataclass(frozen=True)
class StageProfile:
    """One stage of the chain. Timings and activation bytes are ``None`` until measured."""

    stage: int
    layers: tuple[int, int]
    has_embedding: bool
    has_head: bool
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    output_bytes: int
    """Boundary tensor sent to the next stage per microbatch (its gradient comes back at the same size); 0 on the
    last stage, which sends nothing."""
    F: Stat | None = None
    B: Stat | None = None
    I: Stat | None = None  # noqa: E741 - the schedule's name for backward-for-input
    W: Stat | None = None
    FB: Stat | None = None
    activation_bytes: int | None = None
    activation_bytes_freed_by_I: int | None = None
    activation_bytes_allocator: int | None = field(default=None, metadata=ABSENT_IN_OLD)
    """CUDA only: allocator bytes still held after a forward (what the runtime keeps until backward)."""
    peak_bytes_allocator: int | None = field(default=None, metadata=ABSENT_IN_OLD)
    """CUDA only: allocator peak above the pre-forward level over one forward + backward."""

    @property
    def is_measured(self) -> bool:
        return self.measured(OPS)

    def measured(self, ops: tuple[str, ...]) -> bool:
        return all(getattr(self, op) is not None for op in ops) and self.activation_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stage": self.stage, "layers": list(self.layers),
            "has_embedding": self.has_embedding, "has_head": self.has_head,
        }
        return {**out, **_measured_dict(self)}


assert MeasuredFields.of(StageProfile).stats == MEASURED.stats and {
    f.name: f.type for f in fields(StageProfile)}.items() >= {f.name: f.type for f in fields(Block)}.items(), \
    "a stage holds every measured field of a block"


@dataclass(frozen=True)
class P2PSample(Record):
    bytes: int
    median_s: float
    p10_s: float
    p90_s: float


@dataclass(frozen=True)
class P2PPair(Record):
    """The fit for one pair of neighbouring ranks (``src`` -> ``dst``)."""

    src: int
    dst: int
    alpha_s: float
    beta_bytes_per_s: float = field(metadata=POSITIVE)
    fit_rel_error: float
    samples: tuple[P2PSample, ...] = ()


@dataclass(frozen=True)
class P2PProfile(Record):
    """Point-to-point cost ``alpha_s + bytes / beta_bytes_per_s`` (cross-rank only); with several rank pairs, the
    slowest pair's fit (a pipeline waits on its slowest link) and every pair in ``pairs``."""

    alpha_s: float
    beta_bytes_per_s: float = field(metadata=POSITIVE)
    fit_rel_error: float
    measured: bool
    samples: tuple[P2PSample, ...]
    pairs: tuple[P2PPair, ...] = ()

    def time(self, num_bytes: int) -> float:
        return self.alpha_s + num_bytes / self.beta_bytes_per_s


@dataclass(frozen=True)
class HostLoad(Record):
    """How steady the host was while it was calibrated: a busy host inflates every time it measures, and every later
    prediction with them (optional: profiles before it lack it)."""

    load_avg: float
    """The largest 1-minute load average seen (start, end), the calibration's own process included."""
    num_cpus: int = field(metadata=at_least(1))
    spread: float
    """The median over the measured block ops of (p90 - p10) / median of their repetitions."""

    BUSY_FREE_CPUS = 2
    """Fewer idle CPUs than this (the runtime probe runs two ranks at once) with others' load makes a host busy."""
    UNSTEADY_SPREAD = 1.0
    """Repetitions spread wider than their median make the timings unsteady."""

    @property
    def others(self) -> float:
        """Load besides the calibration's own process."""
        return max(0.0, self.load_avg - 1.0)

    def warning(self, source: str) -> str | None:
        """One line when the calibration is not to be trusted, else None."""
        busy = self.others >= 0.5 and self.num_cpus - self.others < self.BUSY_FREE_CPUS
        unsteady = self.spread > self.UNSTEADY_SPREAD
        if not busy and not unsteady:
            return None
        seen = (f"a load of {self.others:.1f} besides the calibration on {self.num_cpus} CPUs" if busy else
                f"repetitions spread {self.spread:.0%} around their median")
        return (f"warning: {source} was calibrated on a busy host ({seen}): its times, and every prediction made "
                "with them, may be inflated; calibrate again on a quiet host")


COLLECTIVE_OPS = tuple(kind.value for kind in ALL_KINDS)
"""The kinds a collective record may time (:class:`ppsim.step.kinds.CollectiveKind`'s values)."""


@dataclass(frozen=True)
class CollectiveFit(Record):
    """One collective FSDP issues, ``op`` (``all_gather`` / ``reduce_scatter``), or EP's ``all_to_all``, on a group of
    ``group_size`` ranks: ``alpha_s + bytes / beta_bytes_per_s``, ``bytes`` the full (unsharded) tensor gathered or
    reduce-scattered; for an all-to-all, each rank's whole send buffer ((g-1)/g of it leaves the rank)."""

    op: str = field(metadata=one_of(COLLECTIVE_OPS))
    group_size: int = field(metadata=at_least(2))
    alpha_s: float
    beta_bytes_per_s: float = field(metadata=POSITIVE)
    fit_rel_error: float
    samples: tuple[P2PSample, ...] = ()
    nodes: int = field(default=1, metadata={**at_least(1), **DEFAULT_IF_ABSENT})
    """The nodes the group spans, ``group_size / nodes`` ranks on each (``calibrate --collectives``); profiles
    written before it existed lack it: 1, one node."""

    def time(self, num_bytes: int) -> float:
        return self.alpha_s + num_bytes / self.beta_bytes_per_s


@dataclass(frozen=True)
class Method(Record):
    """How the numbers were taken."""

    warmup: int
    reps: int = field(metadata=at_least(1))
    timer: str  # "perf_counter" (CPU) or "cuda_events"
    threads_per_rank: int | None = field(metadata=at_least(1))
    wall_s: float | None = None
    host: HostLoad | None = field(default=None, metadata=OMIT_IF_NONE)
    workspace_bytes: int | None = field(default=None, metadata={**at_least(0), **OMIT_IF_NONE})
    """What the device's libraries keep allocated through a training step beyond any tensor (cuBLAS's workspace per
    thread that multiplies: the forward's and autograd's), measured by calibration on the device
    (:mod:`ppsim.calibrate.measure.workspace`); ``None`` where nothing such is seen (CPU)."""


@dataclass(frozen=True)
class Profile:
    """A calibration profile. Version 2 (``blocks`` set): per-block costs, a ``layout`` of block kinds, a fixed
    ``stage_overhead``, ``runtime`` overheads and optionally directly measured ``stages`` to check the composition
    against. Version 1 (``blocks`` is ``None``): ``num_stages`` fixed ``stages``."""

    created: str
    device: str
    device_name: str
    torch_version: str
    host: str
    world_size: int
    backend: str | None
    model: ModelConfig
    num_stages: int = 0
    stages: tuple[StageProfile, ...] = ()
    p2p: P2PProfile | None = None
    complete: bool = False
    done: tuple[str, ...] = ()
    method: Method | None = None
    notes: tuple[str, ...] = field(default=())
    blocks: Mapping[str, Block] | None = None
    """Version 2: ``{"embed": ..., "layer": ..., "head": ...}`` (several layer kinds as ``"layer.<kind>"``)."""
    layout: tuple[str, ...] = ()
    """Version 2: the block kind at each model position, in order: ``("embed", "layer", ..., "layer", "head")``."""
    stage_overhead: StageOverhead | None = None
    runtime: RuntimeOverheads | None = None
    source: SourceInfo | None = None
    """Version 3: the measured model's source, flavor, parameter count, attention backend and layer kinds."""
    tensor_parallel_degree: int = 1
    """The tensor-parallel degree the blocks were measured at (1: unsharded layers)."""
    collectives: tuple[CollectiveFit, ...] = ()
    """FSDP's collectives (all-gather, reduce-scatter) and EP's all-to-all per group size, measured beside p2p."""
    expert_parallel_degree: int = 1
    """The expert-parallel degree the MoE layers were measured at (``calibrate --ep``; 1, or absent: unsplit)."""
    cluster: str | None = None
    """The cluster the profile was measured on (``calibrate --cluster``: its preset or file name); ``None``: its own
    host, before clusters were recorded. A profile's measured links replace a cluster's only on that cluster
    (:class:`ppsim.step.pricing.CollectiveCosts`)."""
    entries: tuple[ProfileEntry, ...] = ()
    """The calibration's other passes (``--tp 1,2 --mb-size 1,2``): each (TP degree, microbatch size) but the
    first, which is this profile's own blocks."""
    activation_checkpoint: str = "none"
    """The torchtitan activation-checkpoint mode the blocks were timed under (``calibrate --activation-checkpoint``;
    absent: ``none``). Under ``selective`` or ``full`` each block's B (and FB) holds the backward's rerun of what the
    policy did not save, and I and W are null (:func:`measured_ops`); activation bytes are measured without it."""

    @property
    def ops_measured(self) -> tuple[str, ...]:
        return measured_ops(self.activation_checkpoint)

    def check_activation_checkpoint(self, mode: str, *, source: str = "profile") -> str | None:
        """One line when a job checkpointing activations as ``mode`` is timed by blocks measured under another mode,
        else ``None`` (:func:`checkpoint_mismatch`)."""
        return checkpoint_mismatch(self.activation_checkpoint, mode, source=source)

    @property
    def covers(self) -> tuple[tuple[int, int], ...]:
        """Every (tensor-parallel degree, microbatch size) measured, the profile's own first."""
        return ((self.tensor_parallel_degree, self.model.mb_size), *(e.key for e in self.entries))

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees measured, in increasing order."""
        return tuple(sorted({tp for tp, _ in self.covers}))

    def check_tensor_parallel(self, degree: int, *, source: str = "profile") -> None:
        """One line when a job at tensor-parallel ``degree`` would be simulated with blocks measured at others."""
        have = self.tensor_parallel_degrees
        if degree not in have:
            raise CostError(
                f"profile {source}: measured at tensor_parallel_degree {degrees_text(have)}, the job runs "
                f"{degree}; calibrate at the job's degree (`ppsim calibrate --tp {degree}` with the job's "
                f"--torchtitan-config, or --tp {','.join(map(str, [*have, degree]))}) or set the job's degree to "
                f"{' or '.join(map(str, have))}")

    def check_expert_parallel(self, degree: int, *, source: str = "profile") -> None:
        """One line naming the profile's EP degree when a job at expert-parallel ``degree`` would be simulated with
        MoE layers measured at another (their costs hold that degree's all-to-alls and expert shards)."""
        have = self.expert_parallel_degree
        if degree != have:
            raise CostError(
                f"profile {source}: measured at expert_parallel_degree {have}, the job runs {degree}; calibrate at "
                f"the job's degree (`ppsim calibrate --ep {degree}` with the job's model) or set the job's degree to "
                f"{have}")

    def entry(self, *, tp: int, mb_size: int | None = None, source: str = "profile") -> Profile:
        """This profile as the pass at tensor-parallel degree ``tp`` and microbatch size ``mb_size`` measured it
        (``None``: the job's size if measured, else the first measured at ``tp``); one line naming the degrees it
        has when it has not ``tp``. A profile of one pass at ``tp`` is itself."""
        self.check_tensor_parallel(tp, source=source)
        at_tp = [key for key in self.covers if key[0] == tp]
        key = (tp, mb_size) if (tp, mb_size) in at_tp else at_tp[0]
        if key == self.covers[0]:
            return self if not self.entries else replace(self, entries=())
        chosen = next(e for e in self.entries if e.key == key)
        info = self.source
        if info is not None and "mb_size" in info.options:
            info = replace(info, options={**info.options, "mb_size": chosen.mb_size})
        return replace(self, blocks=chosen.blocks, stage_overhead=chosen.stage_overhead,
                       tensor_parallel_degree=chosen.tensor_parallel_degree,
                       model=replace(self.model, mb_size=chosen.mb_size), source=info, stages=(), num_stages=0,
                       entries=())

    @property
    def version(self) -> int:
        if self.blocks is None:
            return 1
        return 2 if self.source is None else 3

    @property
    def num_layers(self) -> int:
        """Transformer layers between the embedding and the head (version 2 layout; version 1: ``model.layers``)."""
        return len(self.layout) - 2 if self.blocks is not None else self.model.layers

    #: a CPU probe whose ranks (no more than the cores) ran this much slower together than alone shared its cores
    CONTENDED_SCALE = 1.25

    def host_warning(self, source: str) -> str | None:
        """The one-line warning when this profile was calibrated on a busy or unsteady host (see :class:`HostLoad`),
        or on a CPU whose runtime probe found its ranks, each with a core of its own, much slower together than
        alone (other work held cores for part of the calibration)."""
        host = None if self.method is None else self.method.host
        said = None if host is None else host.warning(source)
        if said or host is None or self.device != "cpu" or self.runtime is None:
            return said
        scales = [(k, v) for k, v in self.runtime.compute_scale.items() if 1 < k <= host.num_cpus]
        ranks, scale = max(scales, key=lambda kv: kv[1], default=(0, 1.0))
        if scale <= self.CONTENDED_SCALE:
            return None
        return (f"warning: {source} was calibrated on a busy host (its probe's {ranks} ranks, each with a core of its "
                f"own, computed {scale:.2f} x slower together than alone): every prediction made with it may be "
                "inflated; calibrate again on a quiet host")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA, "version": self.version, "created": self.created, "device": self.device,
            "device_name": self.device_name, "torch_version": self.torch_version, "host": self.host,
            "world_size": self.world_size, "backend": self.backend, "model": self.model.to_dict(),
        }
        if self.source is not None:
            out["source"] = self.source.to_dict()
        if self.blocks is not None:
            out["blocks"] = {name: block.to_dict() for name, block in self.blocks.items()}
            out["layout"] = list(self.layout)
            out["stage_overhead"] = None if self.stage_overhead is None else self.stage_overhead.to_dict()
            out["runtime"] = None if self.runtime is None else self.runtime.to_dict()
        out["num_stages"] = self.num_stages if self.blocks is None else len(self.stages)
        out["stages"] = [s.to_dict() for s in self.stages]
        out.update({
            "p2p": None if self.p2p is None else self.p2p.to_dict(),
            "complete": self.complete, "done": list(self.done),
            "method": None if self.method is None else self.method.to_dict(), "notes": list(self.notes),
        })
        if self.tensor_parallel_degree != 1:
            out["tensor_parallel_degree"] = self.tensor_parallel_degree
        if self.expert_parallel_degree != 1:
            out["expert_parallel_degree"] = self.expert_parallel_degree
        if self.cluster is not None:
            out["cluster"] = self.cluster
        if self.collectives:
            out["collectives"] = [c.to_dict() for c in self.collectives]
        if self.entries:
            out["entries"] = [e.to_dict() for e in self.entries]
        if self.activation_checkpoint != "none":
            out["activation_checkpoint"] = self.activation_checkpoint
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "profile", allow_incomplete: bool = False) -> Profile:
        """Validate and convert; every problem is one :class:`CostError` line naming ``source`` and the field."""
        return _Reader(source).profile(data, allow_incomplete=allow_incomplete)


def load_profile(path: str | os.PathLike[str], *, allow_incomplete: bool = False) -> Profile:
    """Read a profile file. Unless ``allow_incomplete``, a profile still being measured is an error."""
    p = Path(path)
    try:
        if p.is_dir():
            raise CostError(
                f"profile {p}: is a directory; pass the JSON file written by `ppsim calibrate -o FILE.json`")
        if p.exists() and not p.is_file():
            raise CostError(f"profile {p}: is not a regular file; pass the JSON file written by `ppsim calibrate`")
        size = p.stat().st_size
        if size > MAX_PROFILE_BYTES:
            raise CostError(f"profile {p}: {size} bytes is more than a profile can hold ({MAX_PROFILE_BYTES} bytes); "
                            "pass a file written by `ppsim calibrate`")
        with p.open("rb") as fh:
            raw = fh.read(MAX_PROFILE_BYTES + 1)
        if len(raw) > MAX_PROFILE_BYTES:
            raise CostError(f"profile {p}: more than {MAX_PROFILE_BYTES} bytes is more than a profile can hold; "
                            "pass a file written by `ppsim calibrate`")
        text = raw.decode("utf-8")
    except CostError:
        raise
    except FileNotFoundError:
        raise CostError(f"profile {p}: file not found; write one with `ppsim calibrate -o {p}`") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CostError(f"profile {p}: cannot be read ({exc}); pass a file written by `ppsim calibrate`") from None
    return Profile.from_dict(parse_json(text, source=str(p)), source=str(p), allow_incomplete=allow_incomplete)


def parse_json(text: str, *, source: str) -> Any:
    """``json.loads`` that refuses NaN/Infinity and turns every failure (huge integers, deep nesting) into one line."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        return json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise CostError(
            f"profile {source}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "pass a file written by `ppsim calibrate`"
        ) from None
    except RecursionError:
        raise CostError(f"profile {source}: nested too deeply to be a profile; "
                        "pass a file written by `ppsim calibrate`") from None
    except ValueError as exc:  # integers past Python's digit limit, NaN / Infinity literals
        reason = str(exc).split(";")[0].split("\n")[0]
        raise CostError(f"profile {source}: not a valid profile ({reason}); "
                        "pass a file written by `ppsim calibrate`") from None


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write atomically (temporary file + rename)."""
    return write_atomic(path, json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n")


# --- validation -------------------------------------------------------------------------------------------------
_MODEL_KEYS = MODEL_KEYS
_MISSING = object()
_R = TypeVar("_R", bound="DataclassInstance")  # the records read back are dataclasses (fields(cls))


class _Reader:
    """Field-by-field checks with paths like ``stages[2].F.median`` in the messages."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ops: tuple[str, ...] = OPS
        """The timings a complete profile must hold (:func:`measured_ops` of its ``activation_checkpoint``)."""

    def fail(self, where: str, problem: str) -> CostError:
        return CostError(f"profile {self.source}: {where} {problem}; re-run `ppsim calibrate` to write a valid profile")

    def get(self, obj: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> Any:
        value = obj.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return None
            raise self.fail(f"{where}{key}", "is missing")
        return value

    def obj(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(where or "the file", f"must be a JSON object, got {_kind(value)}")
        return value

    def int_(self, value: Any, where: str, *, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(where, f"must be an integer >= {minimum}, got {_shown(value)}")
        if value > MAX_INT:
            raise self.fail(where, f"is {_shown(value)}, more than the largest count accepted ({MAX_INT})")
        return value

    def num(self, value: Any, where: str, *, positive: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and isinstance(value, int) and abs(value) > MAX_INT:
            ok = False
        if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise self.fail(where, f"must be a finite number {'> 0' if positive else '>= 0'}, got {_shown(value)}")
        return float(value)

    def str_(self, value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or (choices is not None and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a string"
            raise self.fail(where, f"must be {expected}, got {_shown(value)}")
        return value

    def bool_(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false, got {_shown(value)}")
        return value

    def list_(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list, got {_kind(value)}")
        return value

    def stat(self, value: Any, where: str) -> Stat:
        d = self.obj(value, where)
        samples = tuple(self.num(s, f"{where}.samples[{i}]") for i, s in enumerate(self.list_(
            self.get(d, "samples", f"{where}."), f"{where}.samples")))
        n = self.int_(self.get(d, "n", f"{where}."), f"{where}.n", minimum=1)
        if samples and n != len(samples):
            raise self.fail(f"{where}.n", f"is {n} but {len(samples)} samples are listed")
        stat = Stat(
            median=self.num(self.get(d, "median", f"{where}."), f"{where}.median"),
            p10=self.num(self.get(d, "p10", f"{where}."), f"{where}.p10"),
            p90=self.num(self.get(d, "p90", f"{where}."), f"{where}.p90"),
            samples=samples, n=n,
        )
        if not stat.p10 <= stat.median <= stat.p90:
            raise self.fail(where, f"needs p10 <= median <= p90, got {stat.p10}, {stat.median}, {stat.p90}")
        return stat

    def model(self, value: Any) -> ModelConfig:
        d = self.obj(value, "model")
        kwargs: dict[str, Any] = {}
        for key in _MODEL_KEYS:
            raw = self.get(d, key, "model.")
            if key == "preset":
                kwargs[key] = self.str_(raw, "model.preset")
            elif key == "dtype":
                kwargs[key] = self.str_(raw, "model.dtype", DTYPE_NAMES)
            else:
                kwargs[key] = self.int_(raw, f"model.{key}", minimum=1)
        try:
            return ModelConfig(**kwargs)
        except PPSimError as exc:
            raise self.fail("model", f"is inconsistent ({exc})") from None

    def measured(self, d: Mapping[str, Any], pre: str, *, allow_incomplete: bool) -> dict[str, Any]:
        """Timings and byte counts shared by a block and a stage."""
        kwargs: dict[str, Any] = self.stats(d, pre, allow_incomplete=allow_incomplete)
        for key in MEASURED.ints:
            raw = self.get(d, key, pre)
            if raw is None and allow_incomplete and key in MEASURED.unmeasured_ints:
                kwargs[key] = None
                continue
            kwargs[key] = self.int_(raw, f"{pre}{key}")
        for key in MEASURED.optional_ints:
            raw = self.get(d, key, pre, optional=True)
            kwargs[key] = None if raw is None else self.int_(raw, f"{pre}{key}")
        act, freed = kwargs["activation_bytes"], kwargs["activation_bytes_freed_by_I"]
        if act is not None and freed is not None and freed > act:
            raise self.fail(f"{pre}activation_bytes_freed_by_I", f"is {freed}, more than activation_bytes {act}")
        return kwargs

    def stage(self, value: Any, index: int, *, allow_incomplete: bool) -> StageProfile:
        where = f"stages[{index}]"
        d = self.obj(value, where)
        pre = f"{where}."
        layers = self.list_(self.get(d, "layers", pre), f"{pre}layers")
        if len(layers) != 2:
            raise self.fail(f"{pre}layers", f"must be [first, last_exclusive], got {_shown(layers)}")
        first = self.int_(layers[0], f"{pre}layers[0]")
        embedding = self.bool_(self.get(d, "has_embedding", pre), f"{pre}has_embedding")
        head = self.bool_(self.get(d, "has_head", pre), f"{pre}has_head")
        # A stage may hold the embedding or the head alone (torchtitan's split gives one when stages outnumber
        # layers), never nothing.
        last = self.int_(layers[1], f"{pre}layers[1]", minimum=first if embedding or head else first + 1)
        return StageProfile(
            stage=self.int_(self.get(d, "stage", pre), f"{pre}stage"),
            layers=(first, last),
            has_embedding=embedding,
            has_head=head,
            **self.measured(d, pre, allow_incomplete=allow_incomplete),
        )

    def block(self, value: Any, name: str, *, allow_incomplete: bool) -> Block:
        where = f"blocks.{name}"
        return Block(**self.measured(self.obj(value, where), f"{where}.", allow_incomplete=allow_incomplete))

    def stage_overhead(self, value: Any, *, allow_incomplete: bool) -> StageOverhead | None:
        if value is None:
            if allow_incomplete:
                return None
            raise self.fail("stage_overhead", "is not measured (null); it may be zero but must be stored")
        d = self.obj(value, "stage_overhead")
        return StageOverhead(**self.stats(d, "stage_overhead.", allow_incomplete=allow_incomplete))

    def stats(self, d: Mapping[str, Any], pre: str, *, allow_incomplete: bool) -> dict[str, Stat | None]:
        """The timings (one :class:`Stat` per operation) of a block, a stage or the stage overhead."""
        out: dict[str, Stat | None] = {}
        for op in MEASURED.stats:
            raw = self.get(d, op, pre)
            if raw is None and not allow_incomplete and op in self.ops:
                raise self.fail(f"{pre}{op}", "is not measured (null)")
            out[op] = None if raw is None else self.stat(raw, f"{pre}{op}")
        return out

    def record(self, cls: type[_R], value: Any, where: str, *, nested: bool = False) -> _R:
        """A :class:`Record` read field by field, each as its type and metadata say (:meth:`field_value`)."""
        d = self.obj(value, where)
        return cls(**{f.name: self.field_value(f, d, where, cls=cls, nested=nested) for f in fields(cls)})

    def field_value(self, f: Any, d: Mapping[str, Any], where: str, *, cls: type, nested: bool) -> Any:
        """One field of a record: ``int``, ``float``, ``str``, ``bool`` (with the metadata's bounds and choices), a
        record, a tuple of records or a table; ``X | None``, tuples and tables with a default may be left out."""
        kind, nullable = _field_kind(f)
        pre, at = f"{where}.", f"{where}.{f.name}"
        if kind.startswith("tuple["):
            return self.records(_RECORDS[kind[6:-6]], self.get(d, f.name, pre, optional=True), at)
        absent_ok = f.metadata.get("default_if_absent", False)
        optional = nullable or f.default_factory is not MISSING or absent_ok
        raw = self.get(d, f.name, pre, optional=optional)
        if raw is None and nullable:
            return None
        if raw is None and absent_ok:
            return f.default
        if kind == "int":
            return self.int_(raw, at, minimum=f.metadata.get("minimum", 0))
        if kind == "float":
            return self.num(raw, at, positive=f.metadata.get("positive", False))
        if kind == "str":
            return self.str_(raw, at, f.metadata.get("choices"))
        if kind == "bool":
            return self.bool_(raw, at)
        if kind in _TABLES:
            return getattr(self, _TABLES[kind])(raw, at)
        if _RECORDS[kind] is cls and nested:
            raise self.fail(at, f"must be null inside {where}")
        return self.record(_RECORDS[kind], raw, at, nested=_RECORDS[kind] is cls)

    def optional(self, cls: type[_R], value: Any, where: str) -> _R | None:
        return None if value is None else self.record(cls, value, where)

    def records(self, cls: type[_R], value: Any, where: str) -> tuple[_R, ...]:
        """A list of records (left out or null: none)."""
        return tuple(self.record(cls, x, f"{where}[{i}]") for i, x in enumerate(self.list_(value or [], where)))

    def scale_table(self, value: Any, where: str) -> dict[int, float]:
        """``{"1": 1.0, "2": 1.6}``: rank counts to factors > 0 (:attr:`RuntimeOverheads.compute_scale`)."""
        scale: dict[int, float] = {}
        for key, factor in self.obj(value, where).items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6 and int(key) >= 1):
                raise self.fail(where, f"key {_shown(key)} must be a rank count >= 1 such as \"2\"")
            scale[int(key)] = self.num(factor, f"{where}.{key}", positive=True)
        if not scale:
            raise self.fail(where, "is empty; give at least {\"1\": 1.0}")
        return scale

    def samples_table(self, value: Any, where: str) -> dict[str, tuple[float, ...]]:
        """``{"name": [seconds, ...]}`` (left out or null: empty)."""
        return {
            self.str_(k, where): tuple(
                self.num(x, f"{where}.{k}[{i}]") for i, x in enumerate(self.list_(v, f"{where}.{k}")))
            for k, v in self.obj(value or {}, where).items()
        }

    def layout(self, value: Any, blocks: Mapping[str, Block], model: ModelConfig) -> tuple[str, ...]:
        names = tuple(self.str_(x, f"layout[{i}]") for i, x in enumerate(self.list_(value, "layout")))
        if len(names) < 3 or names[0] != BLOCK_EMBED or names[-1] != BLOCK_HEAD:
            raise self.fail("layout", f"must be [{BLOCK_EMBED!r}, {BLOCK_LAYER!r} x layers, {BLOCK_HEAD!r}], "
                                      f"got {len(names)} entries starting {_shown(list(names[:2]))}")
        for i, name in enumerate(names):
            if name not in blocks:
                raise self.fail(f"layout[{i}]", f"names block {name!r}, which 'blocks' does not hold")
            if 0 < i < len(names) - 1 and not _is_layer(name):
                raise self.fail(f"layout[{i}]", f"is {name!r}; between embed and head only 'layer' or "
                                                f"'layer.<kind>' blocks may stand")
        if len(names) - 2 != model.layers:
            raise self.fail("layout", f"holds {len(names) - 2} layers but model.layers is {model.layers}")
        return names

    def source_info(self, value: Any, layout: tuple[str, ...], model: ModelConfig) -> SourceInfo:
        d = self.obj(value, "source")
        pre = "source."

        def opt_str(key: str) -> str | None:
            raw = self.get(d, key, pre, optional=True)
            return None if raw is None else self.str_(raw, pre + key)

        kinds_raw = self.list_(self.get(d, "layer_kinds", pre), pre + "layer_kinds")
        layer_kinds = tuple(self.str_(k, f"{pre}layer_kinds[{i}]") for i, k in enumerate(kinds_raw))
        if len(layer_kinds) != model.layers:
            raise self.fail(pre + "layer_kinds", f"lists {len(layer_kinds)} layers but model.layers is {model.layers}")
        single = len(set(layer_kinds)) == 1
        for i, kind in enumerate(layer_kinds):
            want = BLOCK_LAYER if single else f"{BLOCK_LAYER}.{kind}"
            if layout[i + 1] != want:
                raise self.fail(f"layout[{i + 1}]", f"is {layout[i + 1]!r} but source.layer_kinds[{i}] is {kind!r} "
                                                    f"(block {want!r})")
        descriptions = self.obj(self.get(d, "kinds", pre, optional=True) or {}, pre + "kinds")
        options = self.obj(self.get(d, "options", pre, optional=True) or {}, pre + "options")
        return SourceInfo(
            source=self.str_(self.get(d, "source", pre), pre + "source"),
            scheme=self.str_(self.get(d, "scheme", pre), pre + "scheme"),
            family=opt_str("family"), flavor=opt_str("flavor"),
            num_params=self.int_(self.get(d, "num_params", pre), pre + "num_params"),
            attention=self.str_(self.get(d, "attention", pre), pre + "attention"),
            layer_kinds=layer_kinds,
            kinds={self.str_(k, pre + "kinds"): self.str_(v, f"{pre}kinds.{k}") for k, v in descriptions.items()},
            options=dict(options),
        )

    def blocks(self, value: Any, *, allow_incomplete: bool) -> dict[str, Block]:
        d = self.obj(value, "blocks")
        out: dict[str, Block] = {}
        for name, raw in d.items():
            if name not in (BLOCK_EMBED, BLOCK_HEAD) and not _is_layer(name):
                raise self.fail("blocks", f"key {_shown(name)} must be 'embed', 'head', 'layer' or 'layer.<kind>'")
            out[name] = self.block(raw, name, allow_incomplete=allow_incomplete)
        return out

    def profile(self, data: Any, *, allow_incomplete: bool) -> Profile:
        d = self.obj(data, "")
        schema = d.get("schema", _MISSING)
        if schema != SCHEMA:
            shown = "no 'schema' field" if schema is _MISSING else f"schema {schema!r}"
            raise CostError(
                f"profile {self.source}: not a ppsim profile ({shown}, expected {SCHEMA!r}); "
                "pass a file written by `ppsim calibrate`"
            )
        version = d.get("version", _MISSING)
        if isinstance(version, bool) or version not in VERSIONS:
            shown = "no version" if version is _MISSING else f"version {_shown(version)}"
            raise CostError(
                f"profile {self.source}: {shown} is not supported (this ppsim reads versions 1, 2 and 3); "
                "re-run `ppsim calibrate` with this ppsim"
            )
        complete = self.bool_(self.get(d, "complete", ""), "complete")
        done = tuple(self.str_(k, f"done[{i}]") for i, k in enumerate(self.list_(self.get(d, "done", ""), "done")))
        if not complete and not allow_incomplete:
            raise CostError(
                f"profile {self.source}: calibration is incomplete ({len(done)} measurements done); "
                f"finish it with `ppsim calibrate --resume -o {self.source}` and the same options"
            )
        partial_ok = allow_incomplete or not complete
        model = self.model(self.get(d, "model", ""))
        ac = self.str_(d.get("activation_checkpoint", "none"), "activation_checkpoint", AC_MODES)
        ops = self.ops = measured_ops(ac)
        extra: dict[str, Any] = {}
        if version == 1:
            num_stages = self.int_(self.get(d, "num_stages", ""), "num_stages", minimum=1)
            stages = self.list_(self.get(d, "stages", ""), "stages")
        else:
            stages = self.list_(self.get(d, "stages", "", optional=True) or [], "stages")
            num_stages = self.int_(d.get("num_stages", len(stages)), "num_stages")
            blocks = self.blocks(self.get(d, "blocks", ""), allow_incomplete=partial_ok)
            extra = {
                "blocks": blocks,
                "layout": self.layout(self.get(d, "layout", ""), blocks, model),
                "stage_overhead": self.stage_overhead(self.get(d, "stage_overhead", ""), allow_incomplete=partial_ok),
                "runtime": self.optional(RuntimeOverheads, self.get(d, "runtime", ""), "runtime"),
            }
            if version == 3:
                extra["source"] = self.source_info(self.get(d, "source", ""), extra["layout"], model)
            if complete and not (all(b.measured(ops) for b in blocks.values())
                                 and extra["stage_overhead"] is not None and extra["stage_overhead"].measured(ops)):
                raise self.fail("complete", "is true but some block or stage_overhead measurements are null")
        if len(stages) != num_stages:
            raise self.fail("stages", f"lists {len(stages)} stages but num_stages is {num_stages}")
        parsed = tuple(self.stage(s, i, allow_incomplete=partial_ok) for i, s in enumerate(stages))
        for i, st in enumerate(parsed):
            if st.stage != i:
                raise self.fail(f"stages[{i}].stage",
                                f"is {st.stage}; stages must be listed in order 0..{num_stages - 1}")
        if complete and not all(st.measured(ops) for st in parsed):
            raise self.fail("complete", "is true but some stage measurements are null")
        if complete and _all_zero([*(extra.get("blocks") or {}).values(), extra.get("stage_overhead"), *parsed]):
            raise CostError(f"profile {self.source}: every op takes 0 s, so the makespan and bubble would be "
                            "meaningless (the rule --costs F=0,B=0 meets); re-run `ppsim calibrate`")
        world = self.int_(self.get(d, "world_size", ""), "world_size", minimum=1)
        backend = self.get(d, "backend", "")
        return Profile(
            created=self.str_(self.get(d, "created", ""), "created"),
            device=self.str_(self.get(d, "device", ""), "device", DEVICES),
            device_name=self.str_(self.get(d, "device_name", ""), "device_name"),
            torch_version=self.str_(self.get(d, "torch_version", ""), "torch_version"),
            host=self.str_(self.get(d, "host", ""), "host"),
            world_size=world,
            backend=None if backend is None else self.str_(backend, "backend", BACKENDS),
            model=model,
            num_stages=num_stages,
            stages=parsed,
            p2p=self.optional(P2PProfile, self.get(d, "p2p", ""), "p2p"),
            complete=complete,
            done=done,
            method=self.optional(Method, d.get("method"), "method"),
            notes=tuple(self.str_(n, f"notes[{i}]") for i, n in enumerate(self.list_(d.get("notes") or [], "notes"))),
            tensor_parallel_degree=self.int_(d.get("tensor_parallel_degree", 1), "tensor_parallel_degree", minimum=1),
            collectives=self.records(CollectiveFit, d.get("collectives"), "collectives"),
            expert_parallel_degree=self.int_(d.get("expert_parallel_degree", 1), "expert_parallel_degree",
                                             minimum=1),
            cluster=None if d.get("cluster") is None else self.str_(d.get("cluster"), "cluster"),
            entries=self.entries(d.get("entries"), extra.get("blocks"), model=model,
                                 tp=self.int_(d.get("tensor_parallel_degree", 1), "tensor_parallel_degree", minimum=1),
                                 complete=complete, allow_incomplete=partial_ok, ops=ops),
            activation_checkpoint=ac,
            **extra,
        )

    def entries(self, value: Any, blocks: Mapping[str, Block] | None, *, model: ModelConfig, tp: int, complete: bool,
                allow_incomplete: bool, ops: tuple[str, ...] = OPS) -> tuple[ProfileEntry, ...]:
        """The other passes: each a distinct (TP degree, microbatch size), with the same blocks as the first."""
        if value is None:
            return ()
        if blocks is None:
            raise self.fail("entries", "needs a per-block profile (version 2 or 3)")
        seen = {(tp, model.mb_size): "the profile's own blocks"}
        out = []
        for i, raw in enumerate(self.list_(value, "entries")):
            where = f"entries[{i}]"
            d = self.obj(raw, where)
            entry = ProfileEntry(
                tensor_parallel_degree=self.int_(self.get(d, "tensor_parallel_degree", f"{where}."),
                                                 f"{where}.tensor_parallel_degree", minimum=1),
                mb_size=self.int_(self.get(d, "mb_size", f"{where}."), f"{where}.mb_size", minimum=1),
                blocks={name: self.block(b, f"{name} of {where}", allow_incomplete=allow_incomplete)
                        for name, b in self.obj(self.get(d, "blocks", f"{where}."), f"{where}.blocks").items()},
                stage_overhead=self.stage_overhead(self.get(d, "stage_overhead", f"{where}."),
                                                   allow_incomplete=allow_incomplete),
            )
            if entry.key in seen:
                raise self.fail(where, f"measures tensor_parallel_degree {entry.key[0]} and mb_size {entry.key[1]} "
                                       f"again (as {seen[entry.key]}); each pass once")
            seen[entry.key] = where
            if set(entry.blocks) != set(blocks):
                raise self.fail(f"{where}.blocks", f"are {', '.join(sorted(entry.blocks))}, not the profile's "
                                                   f"{', '.join(sorted(blocks))}")
            if complete and not (all(b.measured(ops) for b in entry.blocks.values())
                                 and entry.stage_overhead is not None and entry.stage_overhead.measured(ops)):
                raise self.fail("complete", f"is true but some measurement of {where} is null")
            out.append(entry)
        return tuple(out)


_RECORDS: dict[str, type] = {cls.__name__: cls for cls in Record.__subclasses__()}
"""The records a field may hold, by the name its type annotation gives."""
_TABLES = {"Mapping[int, float]": "scale_table", "Mapping[str, tuple[float, ...]]": "samples_table"}
"""The tables a field may hold, by type annotation: the :class:`_Reader` method that reads each."""


def _field_kind(f: Any) -> tuple[str, bool]:
    """A field's type annotation (a string: this module postpones them) without ``| None``, and whether it had it."""
    kind = f.type.removesuffix(" | None")
    return kind, kind != f.type


def _readable(kind: str) -> bool:
    return kind in ("int", "float", "str", "bool", *_TABLES, *_RECORDS) or (
        kind.startswith("tuple[") and kind.endswith(", ...]") and kind[6:-6] in _RECORDS)


assert all(_readable(_field_kind(f)[0]) for cls in _RECORDS.values() for f in fields(cls)), \
    "a record field of a new type needs its reader (_Reader.field_value, _TABLES)"


def _all_zero(parts: list[Any]) -> bool:
    """Whether the measured ops of these blocks and stages all take 0 (a profile of nothing but zeros)."""
    stats = [getattr(part, op) for part in parts if part is not None for op in ("F", "B", "I", "W", "FB")]
    stats = [st for st in stats if st is not None]
    return bool(stats) and all(st.median == 0 for st in stats)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _is_layer(name: str) -> bool:
    return name == BLOCK_LAYER or (name.startswith(BLOCK_LAYER + ".") and len(name) > len(BLOCK_LAYER) + 1)


def _shown(value: Any) -> str:
    """``repr`` cut to a readable length (a hostile file may hold a 4,000-digit number)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
