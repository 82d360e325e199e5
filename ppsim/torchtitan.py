"""Read a torchtitan job config and say which pipeline it would run: schedule, ranks, microbatches, stages per rank
and split, the way torchtitan's ``pipeline_llm`` / ``_build_pipeline_schedule`` derive them.

A job config comes in two forms, both turned into the same :class:`JobSettings` and then into a
:class:`TorchtitanJob` by :func:`job_from_settings`:

- an older release's TOML file (:func:`read_toml_settings`, plain Python, here);
- torchtitan 0.3.0's config registry (``MODULE:CONFIG``, a function returning a ``Trainer.Config``), read by
  ``ppsim.calibrate.torchtitan.config`` (it imports torchtitan, which imports torch, so it is not part of the core).

Read from ``parallelism``: ``pipeline_parallel_degree`` (or its older name ``pipeline_parallel_size``),
``pipeline_parallel_schedule``, ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size``,
``pipeline_parallel_layers_per_stage``, ``pipeline_parallel_first_stage_less_layers``,
``pipeline_parallel_last_stage_less_layers`` and ``module_fqns_per_model_part`` (its ``layers.N`` names per part
become the split); from ``training``: ``local_batch_size`` and ``seq_len``. Missing keys take torchtitan's defaults.
``--parallelism.KEY VALUE`` / ``--training.KEY VALUE`` overrides of a config function are parsed by tyro with
torchtitan's own rules (``ppsim.calibrate.torchtitan.config``); those of a TOML (and without torchtitan) by
:func:`parse_overrides`, a small reader of the same rules for the types a job TOML holds. Settings ppsim cannot honour (other parallelism dimensions, ...) are returned
as warnings naming the key; the CLI prints them on stderr. Module lists ppsim cannot read are refused.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppsim.errors import PPSimError
from ppsim.model_config import ModelConfig
from ppsim.split import SplitError, SplitSpec, stages_for_layers_per_stage

MAX_CONFIG_BYTES = 4 * 1024 * 1024
DEFAULTS: dict[str, Any] = {
    "pipeline_parallel_degree": 1,
    "pipeline_parallel_schedule": "1F1B",
    "pipeline_parallel_schedule_csv": "",
    "pipeline_parallel_microbatch_size": 1,
    "pipeline_parallel_layers_per_stage": None,
    "pipeline_parallel_first_stage_less_layers": 1,
    "pipeline_parallel_last_stage_less_layers": 1,
    "local_batch_size": 8,
    "seq_len": 2048,
    # the generation after 0.3.0 (torchtitan's main since its PR #4121): a microbatch count, and tokens
    "num_pp_microbatches": 1,
    "num_tokens_per_microbatch_per_dp_rank": 16384,
    "max_context_length": 2048,
}
"""torchtitan's defaults for the keys ppsim reads (both generations of the batch keys)."""
FIELD_TYPES: dict[str, Any] = {
    "parallelism.pipeline_parallel_degree": int,
    "parallelism.pipeline_parallel_schedule": str,
    "parallelism.pipeline_parallel_schedule_csv": str | None,
    "parallelism.pipeline_parallel_microbatch_size": int,
    "parallelism.pipeline_parallel_layers_per_stage": int | None,
    "parallelism.pipeline_parallel_first_stage_less_layers": int,
    "parallelism.pipeline_parallel_last_stage_less_layers": int,
    "parallelism.module_fqns_per_model_part": list[list[str]] | None,
    "training.local_batch_size": int,
    "training.seq_len": int,
    "parallelism.num_pp_microbatches": int,
    "training.num_tokens_per_microbatch_per_dp_rank": int,
    "training.max_context_length": int,
}
"""The types of the keys ppsim reads (torchtitan 0.3.0's ``ParallelismConfig`` / ``TrainingConfig``); they type the
overrides of a TOML job when torchtitan is not installed."""
OVERRIDE_SECTIONS = ("parallelism", "training")
_USED_PARALLELISM = ({k for k in DEFAULTS if k.startswith("pipeline_")}
                     | {"pipeline_parallel_size", "num_pp_microbatches"})
_HARMLESS_PARALLELISM = {
    # off at these values, or not about the pipeline's timing
    "data_parallel_replicate_degree": (1,), "data_parallel_shard_degree": (1, -1), "tensor_parallel_degree": (1,),
    "context_parallel_degree": (1,), "expert_parallel_degree": (1,), "expert_tensor_parallel_degree": (1,),
    "pipeline_parallel_expert_parallel_overlap": (True, False),
    "disable_loss_parallel": (True, False), "enable_async_tensor_parallel": (False,),
    "fsdp_reshard_after_forward": ("default", "always", "never"), "enable_compiled_autograd": (False,),
    "context_parallel_rotate_method": ("allgather", "alltoall"), "context_parallel_load_balancer": ("headtail", None),
    "context_parallel_ptrr_mask_key": (None,), "expert_parallel_comm_backend": ("standard",),
    "enable_fsdp_symm_mem": (False,), "enable_sequence_parallel": (True, False),
    "spmd_backend": ("partial_dtensor", "full_dtensor", "spmd_types"),
}
_CSV_ONLY = ("pipelineschedulesingle", "pipelineschedulemulti", "_pipelinescheduleruntime")
"""torchtitan schedule names that only run a CSV (``pipeline_parallel_schedule_csv``)."""
_FQN_KEYS = ("module_fqns_per_model_part", "pipeline_parallel_module_fqns_per_model_part")
_LAYER_FQN = re.compile(r"^layers\.(\d{1,6})$")
EMBEDDING_MODULES = ("tok_embeddings",)
HEAD_MODULES = ("norm", "output", "lm_head")
"""The non-layer module names of ppsim's model: torchtitan's LLM layout (``output`` before 0.3.0, ``lm_head`` since)."""


class TorchtitanConfigError(PPSimError):
    """A torchtitan job config that cannot be read, or that contradicts the command line."""


@dataclass(frozen=True)
class BatchKeys:
    """The job keys that set the microbatches, in the generation the job is written in."""

    count: tuple[str, ...]
    """``section.key`` of the keys that decide the microbatch count."""
    size: str
    """The key that decides the microbatch size (samples of ``seq_len`` tokens)."""
    seq_len: str

    def overrides(self, *, seq_len: int, mb_size: int) -> str:
        """The overrides that give a microbatch of ``mb_size`` sequences of ``seq_len`` tokens."""
        size = mb_size if self.size == "parallelism.pipeline_parallel_microbatch_size" else mb_size * seq_len
        return f"--{self.seq_len} {seq_len} --{self.size} {size}"


OLD_KEYS = BatchKeys(count=("training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"),
                     size="parallelism.pipeline_parallel_microbatch_size", seq_len="training.seq_len")
"""torchtitan 0.3.0 and earlier: microbatches = local_batch_size / pipeline_parallel_microbatch_size (samples)."""
NEW_KEYS = BatchKeys(count=("parallelism.num_pp_microbatches",),
                     size="training.num_tokens_per_microbatch_per_dp_rank", seq_len="training.max_context_length")
"""torchtitan after 0.3.0: num_pp_microbatches is the count; a microbatch is num_tokens_per_microbatch_per_dp_rank
tokens, i.e. that / max_context_length samples."""


@dataclass(frozen=True)
class BatchShape:
    """The microbatches of a job, read from either generation of torchtitan's keys."""

    num_microbatches: int
    microbatch_size: int
    local_batch_size: int
    seq_len: int
    keys: BatchKeys = OLD_KEYS


@dataclass(frozen=True)
class JobSettings:
    """A job config's settings, whatever it was read from: ``parallelism`` and ``training`` as key -> value."""

    source: str
    """What the user passed: the TOML path or ``MODULE:CONFIG``."""
    parallelism: Mapping[str, Any]
    training: Mapping[str, Any]
    in_file: bool = True
    """True for a TOML (a fix edits the file), False for a config function (a fix is an override)."""
    model_source: str | None = None
    """``torchtitan:FAMILY/FLAVOR`` for a config function's model."""
    num_model_layers: int | None = None
    """The layer count of the job's model, when the config says (a config function's model does)."""
    known_schedules: tuple[str, ...] | None = None
    """The schedule names the installed torchtitan runs (``None``: the names ppsim knows torch has)."""
    notes: tuple[str, ...] = ()
    """Warnings found while reading (e.g. a check of torchtitan's that the overridden config fails)."""

    def fix(self, *keys: str) -> str:
        """How the user changes ``keys`` (``section.key``): in the file, or with overrides."""
        if self.in_file:
            return f"change {' or '.join(k.split('.')[-1] for k in keys)} in the file"
        return "pass " + " or ".join(f"--{k} VALUE" for k in keys)


@dataclass(frozen=True)
class TorchtitanJob:
    """What torchtitan would run: feed ``schedule, num_ranks, num_microbatches, stages_per_rank`` to
    :func:`ppsim.schedules.load_schedule` and ``split`` to :func:`ppsim.costs.load_costs`."""

    source: str
    schedule: str
    """A ppsim schedule name, or the CSV file torchtitan would load."""
    num_ranks: int
    num_microbatches: int
    stages_per_rank: int | None
    """``None`` for a CSV (the file decides)."""
    split: SplitSpec
    microbatch_size: int
    local_batch_size: int
    seq_len: int
    warnings: tuple[str, ...] = field(default=())
    model_source: str | None = None
    """``torchtitan:FAMILY/FLAVOR`` when the config names its model (a config function), else ``None``."""
    torch_schedule: str = ""
    """The schedule name as torchtitan spells it (``pipeline_parallel_schedule``)."""
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    """Module names per stage as torchtitan builds them (set where torchtitan is installed and the layer count is
    known; ``ppsim.calibrate.torchtitan.split``)."""
    rank_stages: tuple[tuple[int, ...], ...] | None = None
    """Stage indices per rank as torchtitan places them (``_get_pp_rank_to_stage_indices_mapping``)."""
    in_file: bool = True
    batch_keys: BatchKeys = OLD_KEYS
    """The keys the job sets its microbatches with (its torchtitan generation's)."""
    tensor_parallel_degree: int = 1
    """``parallelism.tensor_parallel_degree`` (a profile must be measured at it)."""

    def refusal(self, exc: Exception) -> TorchtitanConfigError:
        """``exc`` (a schedule that cannot run this job) in the job config's words: the keys that set the ranks
        and microbatches, not the command-line options the user did not pass."""
        reason = re.sub(r"^(?:--mb|--ranks|-m|-r)\s+\d+:\s*", "", str(exc)).split("; ")[0]
        keys = ("parallelism.pipeline_parallel_degree", *self.batch_keys.count)
        short = [k.split(".")[-1] for k in keys]
        fix = (f"change {', '.join(short[:-1])} or {short[-1]} in the file to match" if self.in_file
               else "pass " + ", ".join(f"--{k}" for k in keys) + " to match")
        how = (f"local_batch_size {self.local_batch_size} / pipeline_parallel_microbatch_size {self.microbatch_size}"
               if self.batch_keys == OLD_KEYS else f"num_pp_microbatches {self.num_microbatches}")
        return TorchtitanConfigError(
            f"--torchtitan-config {self.source}: {Path(self.schedule).name} with pipeline_parallel_degree "
            f"{self.num_ranks} and {self.num_microbatches} microbatches ({how}) cannot run: {reason}; {fix}"
        )


def is_registry_name(value: str) -> bool:
    """``MODULE:CONFIG`` (a torchtitan config function) rather than a TOML path."""
    return ":" in value and not value.lower().endswith(".toml") and not Path(value).exists()


# --- TOML ------------------------------------------------------------------------------------------------------
def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML as a dict; every problem is one :class:`TorchtitanConfigError` line."""
    p = Path(path)
    try:
        if not p.is_file():
            raise TorchtitanConfigError(f"--torchtitan-config {p}: file not found or not a file; pass a config "
                                        "function (e.g. --torchtitan-config llama3:llama3_debugmodel) or an older "
                                        "release's job TOML")
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise TorchtitanConfigError(f"--torchtitan-config {p}: larger than {MAX_CONFIG_BYTES} bytes; "
                                        "a job config is a few kB")
        text = p.read_bytes().decode("utf-8")
    except TorchtitanConfigError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TorchtitanConfigError(
            f"--torchtitan-config {p}: cannot be read ({exc}); pass a UTF-8 TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TorchtitanConfigError(f"--torchtitan-config {p}: not valid TOML ({exc}); fix the file") from None
    except RecursionError:
        raise TorchtitanConfigError(f"--torchtitan-config {p}: nested too deeply to be a job config") from None


def read_toml_settings(path: str | Path, overrides: Sequence[str] = ()) -> JobSettings:
    """An older release's job TOML, with ``--parallelism.KEY VALUE`` overrides applied (typed by
    :data:`FIELD_TYPES`, or by the type of the value the file holds)."""
    source = str(path)
    data = read_toml(path)
    sections = {name: dict(_table(data, name, source)) for name in OVERRIDE_SECTIONS}
    fields_: dict[str, Any] = dict(FIELD_TYPES)
    fields_["parallelism.pipeline_parallel_size"] = int
    for name, table in sections.items():
        for key, value in table.items():
            fields_.setdefault(f"{name}.{key}", _toml_type(value))
    for name, value in parse_overrides(overrides, fields_, source=source).items():
        section, key = name.split(".", 1)
        sections[section][key] = value
    return JobSettings(source=source, parallelism=sections["parallelism"], training=sections["training"],
                       model_source=_toml_model(data, source))


_MODEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FLAVOR = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _toml_model(data: dict[str, Any], source: str) -> str | None:
    """``torchtitan:NAME/FLAVOR`` from an older release's ``[model]`` table (``name``, ``flavor``); ``None`` when
    the file does not name both."""
    table = _table(data, "model", source)
    name, flavor = table.get("name"), table.get("flavor")
    if name is None or flavor is None:
        return None
    if not (isinstance(name, str) and _MODEL_NAME.match(name) and isinstance(flavor, (str, int))
            and _FLAVOR.match(str(flavor))):
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: [model] name {str(name)[:40]!r} / flavor {str(flavor)[:40]!r} is not a "
            "torchtitan model name and flavor (e.g. name = \"llama3\", flavor = \"debugmodel\"); fix the file"
        )
    return f"torchtitan:{name}/{flavor}"


def load_torchtitan_job(path: str | Path, *, overrides: Sequence[str] = (), **agree: Any) -> TorchtitanJob:
    """The pipeline an older release's job TOML describes (:func:`read_toml_settings`, :func:`job_from_settings`,
    which ``agree`` goes to: the command-line values the file must agree with)."""
    return job_from_settings(read_toml_settings(path, overrides), **agree)


# --- settings -> job -------------------------------------------------------------------------------------------
def job_from_settings(
    settings: JobSettings,
    *,
    num_layers: int | None = None,
    model: ModelConfig | None = None,
    schedule: str | None = None,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    stages_per_rank: int | None = None,
    layers_per_stage: int | None = None,
    split: tuple[int, ...] | None = None,
) -> TorchtitanJob:
    """The pipeline a job config describes. ``num_layers`` (from a per-block profile) is needed for
    ``pipeline_parallel_layers_per_stage`` unless the config names its model; ``model`` (the profile's) lets the
    microbatch shape be checked. Values given on the command line must agree with the config (else one
    :class:`TorchtitanConfigError` line)."""
    source = settings.source
    warnings: list[str] = list(settings.notes)

    def get(section: str, key: str, kind: type, *, minimum: int | None = None) -> Any:
        return setting(settings, section, key, kind, minimum=minimum)

    degree = _degree(settings)
    sched_name: str = get("parallelism", "pipeline_parallel_schedule", str)
    csv: str = get("parallelism", "pipeline_parallel_schedule_csv", str) or ""
    tt_layers_per_stage: int | None = get("parallelism", "pipeline_parallel_layers_per_stage", int, minimum=1)
    input_weight: int = get("parallelism", "pipeline_parallel_first_stage_less_layers", int, minimum=0)
    output_weight: int = get("parallelism", "pipeline_parallel_last_stage_less_layers", int, minimum=0)
    shape = batch_shape(settings)
    mb_size, batch, seq_len, microbatches = (shape.microbatch_size, shape.local_batch_size, shape.seq_len,
                                             shape.num_microbatches)
    _warn_unused(settings, warnings)
    if degree < 2:
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: pipeline_parallel_degree is {degree}, so torchtitan runs no pipeline; "
            + ("set [parallelism] pipeline_parallel_degree = 2 or more" if settings.in_file
               else "pass --parallelism.pipeline_parallel_degree 2 (or more)")
        )
    layers = _layer_count(settings, num_layers)

    ppsim_schedule, single, v = _schedule(settings, sched_name, csv)
    if csv and single:
        _check_csv_one_stage_per_rank(settings, sched_name, csv)
    if tt_layers_per_stage is not None:
        try:
            v = _stages_per_rank_from_layers(settings, tt_layers_per_stage, layers, input_weight, output_weight,
                                             degree=degree, sched_name=sched_name, single=single, v=v)
        except SplitError as exc:
            raise in_job_terms(settings, exc) from None
    fqn_key, fqn_split = module_lists_split(settings, num_layers=layers, warnings=warnings)
    if fqn_split is not None:
        # torchtitan builds one stage per listed part, whatever layers_per_stage says
        if len(fqn_split) % degree:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: {fqn_key} lists "
                                        f"{len(fqn_split)} parts, not divisible by pipeline_parallel_degree {degree}; "
                                        + settings.fix(f"parallelism.{fqn_key}"))
        if v is not None:
            v = len(fqn_split) // degree
        if split is not None and tuple(split) != fqn_split:
            raise TorchtitanConfigError(f"--split contradicts {fqn_key} in {source} (layers per "
                                        f"part {','.join(map(str, fqn_split))}); drop --split")
        if tt_layers_per_stage is not None:
            warnings.append(f"parallelism.pipeline_parallel_layers_per_stage = {tt_layers_per_stage} does not "
                            f"decide the split: {fqn_key} does (as in torchtitan's pipeline_llm)")
        split = fqn_split
        tt_layers_per_stage = None
    if model is not None and (model.seq_len, model.mb_size) != (seq_len, mb_size):
        fix = (f"calibrate with --seq-len {seq_len} --mb-size {mb_size}" if settings.in_file else
               f"calibrate with --seq-len {seq_len} --mb-size {mb_size}, or pass "
               + shape.keys.overrides(seq_len=model.seq_len, mb_size=model.mb_size))
        warnings.append(
            f"the profile was measured with seq_len {model.seq_len} x microbatch size {model.mb_size}, the job runs "
            f"{seq_len} x {mb_size}: costs are not rescaled; {fix}"
        )

    # agree with the command line
    _agree(settings, "-s/--schedule", schedule, ppsim_schedule, same=lambda a, b: a.lower() == b.lower())
    _agree(settings, "-r/--ranks", num_ranks, degree)
    _agree(settings, "-m/--mb", num_microbatches, microbatches)
    if v is not None:
        _agree(settings, "-v/--stages-per-rank", stages_per_rank, v)
    _agree(settings, "--layers-per-stage", layers_per_stage, tt_layers_per_stage)
    if split is not None and tt_layers_per_stage is not None:
        raise TorchtitanConfigError(f"--split and pipeline_parallel_layers_per_stage in {source} both decide the "
                                    "split; drop one")
    try:
        spec = SplitSpec(split=split, layers_per_stage=tt_layers_per_stage, input_weight=input_weight,
                         output_weight=output_weight)
    except SplitError as exc:
        raise in_job_terms(settings, exc) from None
    return TorchtitanJob(
        source=source, schedule=ppsim_schedule, num_ranks=degree, num_microbatches=microbatches, stages_per_rank=v,
        split=spec, microbatch_size=mb_size, local_batch_size=batch, seq_len=seq_len, warnings=tuple(warnings),
        model_source=settings.model_source, torch_schedule=sched_name, in_file=settings.in_file,
        batch_keys=shape.keys,
        tensor_parallel_degree=int(settings.parallelism.get("tensor_parallel_degree") or 1),
    )


def setting(settings: JobSettings, section: str, key: str, kind: type, *, minimum: int | None = None) -> Any:
    """``section.key`` of the job (torchtitan's default when absent), checked to be a ``kind`` (an integer at least
    ``minimum``); one :class:`TorchtitanConfigError` line otherwise."""
    table = settings.parallelism if section == "parallelism" else settings.training
    value = table.get(key, DEFAULTS[key])
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and minimum is not None and value < minimum:
        ok = False
    if not ok:
        need = f"an integer >= {minimum}" if kind is int else "a string"
        raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: {section}.{key} = {_shown(value)} must "
                                    f"be {need}; {settings.fix(f'{section}.{key}')}")
    if kind is int and value > 10**9:
        raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: {section}.{key} = {value} is beyond "
                                    f"ppsim's limits; {settings.fix(f'{section}.{key}')}")
    return value


def job_sizes(settings: JobSettings) -> tuple[int, int]:
    """``(seq_len, microbatch size)`` of the job (:func:`batch_shape`), the shape of one microbatch torchtitan
    runs (what `calibrate` and `run` take as ``--seq-len`` / ``--mb-size``)."""
    shape = batch_shape(settings)
    return shape.seq_len, shape.microbatch_size


def batch_keys_of(settings: JobSettings) -> BatchKeys:
    """The generation of batch keys the job is written in; one line if it mixes the two."""
    par, tr = settings.parallelism, settings.training
    new = [f"parallelism.{k}" for k in ("num_pp_microbatches",) if k in par] + [
        f"training.{k}" for k in ("num_tokens_per_microbatch_per_dp_rank", "max_context_length") if k in tr]
    old = [f"parallelism.{k}" for k in ("pipeline_parallel_microbatch_size",) if k in par] + [
        f"training.{k}" for k in ("local_batch_size", "seq_len") if k in tr]
    if new and old:
        raise TorchtitanConfigError(
            f"--torchtitan-config {settings.source}: gives both torchtitan 0.3.0's batch keys ({', '.join(old)}) and "
            f"the later release's ({', '.join(new)}); keep one generation"
            + (" in the file" if settings.in_file else " (drop the overrides of the other)"))
    return NEW_KEYS if new else OLD_KEYS


def batch_shape(settings: JobSettings) -> BatchShape:
    """The job's microbatches, read from either generation of torchtitan's keys: 0.3.0's ``local_batch_size`` /
    ``pipeline_parallel_microbatch_size`` samples of ``seq_len`` tokens, or the later ``num_pp_microbatches``
    microbatches of ``num_tokens_per_microbatch_per_dp_rank`` tokens in sequences of ``max_context_length``."""
    keys = batch_keys_of(settings)

    def get(name: str) -> int:
        section, key = name.split(".")
        return setting(settings, section, key, int, minimum=1)

    seq_len = get(keys.seq_len)
    if keys == OLD_KEYS:
        mb_size, batch = get(keys.size), get("training.local_batch_size")
        if batch % mb_size:
            raise TorchtitanConfigError(
                f"--torchtitan-config {settings.source}: local_batch_size {batch} is not divisible by "
                f"pipeline_parallel_microbatch_size {mb_size} (torchtitan refuses it too); "
                + settings.fix("training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"))
        return BatchShape(num_microbatches=batch // mb_size, microbatch_size=mb_size, local_batch_size=batch,
                          seq_len=seq_len, keys=keys)
    count, tokens = get("parallelism.num_pp_microbatches"), get(keys.size)
    if tokens % seq_len:
        raise TorchtitanConfigError(
            f"--torchtitan-config {settings.source}: num_tokens_per_microbatch_per_dp_rank {tokens} is not a multiple "
            f"of max_context_length {seq_len}: ppsim simulates microbatches of whole sequences; "
            + settings.fix(keys.size, keys.seq_len))
    mb_size = tokens // seq_len
    return BatchShape(num_microbatches=count, microbatch_size=mb_size, local_batch_size=count * mb_size,
                      seq_len=seq_len, keys=keys)


def _warn_unused(settings: JobSettings, warnings: list[str]) -> None:
    """Name every parallelism setting ppsim does not simulate (unless it is off or harmless)."""
    for key, value in settings.parallelism.items():
        if key in _USED_PARALLELISM or key in _FQN_KEYS:
            continue
        if key in _HARMLESS_PARALLELISM and value in _HARMLESS_PARALLELISM[key]:
            continue
        if key == "pipeline_parallel_split_points":
            if value:
                warnings.append(f"parallelism.{key} is not honoured (torchtitan dropped it); use --split with the "
                                "same layers per stage")
            continue
        if not settings.in_file and key not in _HARMLESS_PARALLELISM and not key.startswith("pipeline_"):
            continue  # a config function holds every field of ParallelismConfig: name the dimensions ppsim knows
        if key == "data_parallel_shard_degree" and not settings.in_file:
            warnings.append(f"parallelism.{key} = {_shown(value)}: the step holds FSDP's exposed all-gathers and "
                            "reduce-scatters when a --profile times it; the data-parallel ranks are not simulated")
            continue
        warnings.append(f"parallelism.{key} = {_shown(value)} is not honoured: ppsim simulates the pipeline "
                        "dimension only")


def _layer_count(settings: JobSettings, num_layers: int | None) -> int | None:
    """The model's layer count: the job's model's, which a profile (``num_layers``) must match."""
    own = settings.num_model_layers
    if own is not None and num_layers is not None and own != num_layers:
        model = (settings.model_source or "the job's model").removeprefix("torchtitan:")
        raise TorchtitanConfigError(
            f"--profile models {num_layers} layers but {model} in --torchtitan-config {settings.source} has {own}; "
            f"calibrate that model (--model {settings.model_source or 'torchtitan:FAMILY/FLAVOR'}) or drop --profile"
        )
    return own if own is not None else num_layers


def _schedule(settings: JobSettings, sched_name: str, csv: str) -> tuple[str, bool, int | None]:
    """ppsim's schedule (a name or the CSV), whether it holds one stage per rank, and torchtitan's default stages
    per rank (``None`` for a CSV), as ``_get_pipeline_metadata`` decides them."""
    from ppsim.schedules import all_specs

    source = settings.source
    by_torch = {s.torch_name.lower(): s for s in all_specs() if s.torch_name}
    key = sched_name.lower()
    known = None if settings.known_schedules is None else {n.lower(): n for n in settings.known_schedules}
    if csv:
        csv_path = Path(csv)
        if not csv_path.is_file():
            raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule_csv {csv!r} is not "
                                        "a file (torchtitan resolves it from the working directory); "
                                        + settings.fix("parallelism.pipeline_parallel_schedule_csv"))
        if csv_path.suffix.lower() != ".csv":
            raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule_csv {csv!r}: ppsim "
                                        "reads schedule files named *.csv; give the file a .csv name")
        single = key == "pipelineschedulesingle" or (key in by_torch and by_torch[key].fixed_stages_per_rank == 1)
        return str(csv_path), single, None
    if key in _CSV_ONLY:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule {sched_name!r} needs "
                                    "pipeline_parallel_schedule_csv; give the CSV ("
                                    + settings.fix("parallelism.pipeline_parallel_schedule_csv")
                                    + ") or a named schedule")
    if key in by_torch and (known is None or key in known):
        spec = by_torch[key]
        single = spec.fixed_stages_per_rank == 1
        return spec.name, single, 1 if single else 2
    names = ", ".join(sorted(s.torch_name for s in all_specs() if s.torch_name and (known is None
                                                                                    or s.torch_name.lower() in known)))
    if known is not None and key in known:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule {sched_name!r} is one "
                                    "torchtitan runs but ppsim cannot simulate; export its order as a CSV "
                                    f"(pipeline_parallel_schedule_csv) or use one of {names}")
    raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule {sched_name!r} is not "
                                f"one torchtitan runs that ppsim knows; use one of {names}")


def _check_csv_one_stage_per_rank(settings: JobSettings, sched_name: str, csv: str) -> None:
    """A single-stage schedule class builds one stage per rank: a CSV placing more on a rank cannot load."""
    from ppsim.formats import read_schedule_file

    rows = read_schedule_file(csv).rows
    for rank, row in enumerate(rows):
        stages = sorted({a.stage for a in row if a is not None and a.stage >= 0}
                        | {sub.stage for a in row if a is not None for sub in a.sub_actions})
        if len(stages) > 1:
            raise TorchtitanConfigError(
                f"--torchtitan-config {settings.source}: pipeline_parallel_schedule {sched_name!r} builds one stage "
                f"per rank but pipeline_parallel_schedule_csv {csv!r} holds {len(stages)} on rank {rank} (stages "
                f"{', '.join(map(str, stages[:4]))}{' ...' if len(stages) > 4 else ''}), so torchtitan could not load "
                "it; name a multi-stage class (PipelineScheduleMulti) or give a one-stage-per-rank CSV ("
                + settings.fix("parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_schedule_csv")
                + ")")


def _stages_per_rank_from_layers(
    settings: JobSettings, lps: int, layers: int | None, input_weight: int, output_weight: int, *, degree: int,
    sched_name: str, single: bool, v: int | None,
) -> int | None:
    """Stages per rank from ``pipeline_parallel_layers_per_stage``, refused where torchtitan refuses it."""
    source = settings.source
    if layers is None:
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: pipeline_parallel_layers_per_stage needs the model's layer count; "
            "pass --profile with a per-block profile of the model"
        )
    total = stages_for_layers_per_stage(layers, lps, input_weight=input_weight, output_weight=output_weight)
    what = f"{layers} layers with pipeline_parallel_layers_per_stage {lps} give {total} stages"
    fix = settings.fix("parallelism.pipeline_parallel_layers_per_stage")
    if total % degree:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, not divisible by "
                                    f"pipeline_parallel_degree {degree} (torchtitan refuses it); {fix}")
    per_rank = total // degree
    if single and per_rank != 1:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, {per_rank} per rank, but "
                                    f"{sched_name} holds one stage per rank; use layers per stage "
                                    f"{math.ceil((layers + input_weight + output_weight) / degree)}")
    if not single and per_rank < 2:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, 1 per rank, but {sched_name} needs "
                                    f"at least 2 per rank; lower pipeline_parallel_layers_per_stage ({fix})")
    if v is not None and sched_name.lower() in ("zbvzerobubble", "dualpipev") and per_rank != 2:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, {per_rank} per rank, but "
                                    f"{sched_name} is a V of exactly 2 stages per rank; {fix}")
    return per_rank if v is not None else None


# --- module lists ----------------------------------------------------------------------------------------------
def module_lists_split(settings: JobSettings, *, num_layers: int | None = None,
                       warnings: list[str] | None = None) -> tuple[str, tuple[int, ...] | None]:
    """``(key, layers per part)`` from torchtitan's explicit module lists (``[["tok_embeddings", "layers.0"],
    ...]``; ``key`` the spelling read), or ``(key, None)`` when the config gives none. Lists ppsim cannot simulate
    exactly are refused in one line naming the key; a job giving both spellings gets a warning naming the one used."""
    given = [(k, settings.parallelism[k]) for k in _FQN_KEYS if settings.parallelism.get(k)]
    if not given:
        return _FQN_KEYS[0], None
    key, parts = given[0]
    if len(given) > 1 and warnings is not None:
        same = "the same lists" if given[0][1] == given[1][1] else "different lists"
        warnings.append(f"parallelism.{key} and parallelism.{given[1][0]} are both given ({same}): ppsim uses "
                        f"{key} (torchtitan 0.3.0's name); drop {given[1][0]}")
    fix = settings.fix(f"parallelism.{key}") + " or use --split with the same layers per stage"
    try:
        counts = split_of_module_names(parts, num_layers=num_layers)
    except ValueError as exc:
        raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: parallelism.{key} {exc}; {fix}") from None
    return key, counts


_INTERNAL_NAMES = (
    (re.compile(r"^input_weight (\S+):"), "parallelism.pipeline_parallel_first_stage_less_layers = \\1"),
    (re.compile(r"^output_weight (\S+):"), "parallelism.pipeline_parallel_last_stage_less_layers = \\1"),
    (re.compile(r"^--layers-per-stage (\S+):"), "parallelism.pipeline_parallel_layers_per_stage = \\1"),
)


def in_job_terms(settings: JobSettings, exc: Exception) -> TorchtitanConfigError:
    """A split refusal (:class:`ppsim.split.SplitError`) about a value the job set, in the job's own keys rather
    than ppsim's option names (``input_weight``, ``--layers-per-stage``)."""
    text = str(exc).split("; ")[0]
    key = None
    for pattern, replacement in _INTERNAL_NAMES:
        if pattern.match(text):
            key = replacement.split(" ")[0]
            text = pattern.sub(replacement + ":", text)
            break
    fix = settings.fix(key) if key else settings.fix("parallelism.pipeline_parallel_layers_per_stage",
                                                      "parallelism.module_fqns_per_model_part")
    return TorchtitanConfigError(f"--torchtitan-config {settings.source}: {text}; {fix}")


def split_of_module_names(parts: Any, *, num_layers: int | None = None) -> tuple[int, ...]:
    """Layers per part of a module list laid out as ppsim's model is: the embedding in the first part, consecutive
    ``layers.N`` across the parts, the norm and head in the last; ``ValueError`` naming what does not fit."""
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, (list, tuple)) for p in parts):
        raise ValueError(f"= {_shown(parts)} is not a list of module-name lists")
    counts: list[int] = []
    expected = 0
    last = len(parts) - 1
    for i, part in enumerate(parts):
        n = 0
        for name in part:
            if not isinstance(name, str):
                raise ValueError(f"part {i} holds {_shown(name)}, not a module name")
            match = _LAYER_FQN.match(name)
            if match is not None:
                if int(match.group(1)) != expected:
                    raise ValueError(f"part {i} lists {name} where layers.{expected} comes next: ppsim simulates "
                                     "consecutive layers.N in order")
                expected += 1
                n += 1
            elif name in EMBEDDING_MODULES:
                if i != 0:
                    raise ValueError(f"part {i} holds {name}: ppsim places the embedding on the first stage only")
            elif name in HEAD_MODULES:
                if i != last:
                    raise ValueError(f"part {i} holds {name}: ppsim places the norm and head on the last stage only")
            else:
                raise ValueError(f"part {i} names {_shown(name)}, a module ppsim cannot simulate (it knows "
                                 f"{', '.join(EMBEDDING_MODULES)}, layers.N, {', '.join(HEAD_MODULES)})")
        if n == 0 and 0 < i < last:
            raise ValueError(f"part {i} holds no layers.N: only the first part (embedding) and the last (norm and "
                             "head) may hold no layer")
        counts.append(n)
    if num_layers is not None and expected != num_layers:
        raise ValueError(f"holds {expected} layers but the profile's model has {num_layers}")
    return tuple(counts)


# --- overrides -------------------------------------------------------------------------------------------------
def parse_overrides(args: Sequence[str], fields: Mapping[str, Any], *, source: str = "") -> dict[str, Any]:
    """``--SECTION.KEY VALUE`` tokens -> ``{"SECTION.KEY": typed value}``, with torchtitan's (tyro's) command-line
    rules: ``--k VALUE`` or ``--k=VALUE``; ``-`` and ``_`` alike in names; a bool is a flag (``--k`` sets it,
    ``--SECTION.no_KEY`` clears it); ``None`` for an optional; a ``list[str]`` is one comma-separated value, a
    ``list[list[str]]`` several (``--parallelism.module_fqns_per_model_part tok_embeddings,layers.0 layers.1,norm``).
    ``fields`` maps ``SECTION.KEY`` to its type annotation. Unknown keys (with close matches), a missing or
    mistyped value and a key given twice are one :class:`TorchtitanConfigError` line each (ppsim refuses the repeat
    that tyro would resolve by keeping the last)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, annotation, negated = _override_name(token, fields, source)
        has_value, value = "=" in token, token.partition("=")[2]
        section, _, key = name.partition(".")
        if name in out:
            raise TorchtitanConfigError(f"--{name} given twice; give it once")
        if _is_bool(annotation):
            if has_value:
                raise TorchtitanConfigError(f"--{token[2:]}: --{name} is a flag and takes no value (torchtitan's "
                                            f"command line): pass --{name} to set it, --{section}.no_{key} to clear it")
            out[name] = not negated
            continue
        if _is_nested_list(annotation):
            values = [value] if has_value else []
            while not has_value and i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if not values:
                raise TorchtitanConfigError(f"--{name} needs a value: module names per part, each part "
                                            f"comma-separated, e.g. --{name} tok_embeddings,layers.0 layers.1,norm")
            out[name] = _convert(name, values, annotation)
            continue
        if not has_value:
            if i >= len(args) or (args[i].startswith("--") and not _is_number(args[i])):
                raise TorchtitanConfigError(f"--{name} needs a value ({_type_name(annotation)}); e.g. "
                                            f"--{name} {_example(annotation)}")
            value = args[i]
            i += 1
        out[name] = _convert(name, [value], annotation)
    return out


def check_override_names(args: Sequence[str], fields: Mapping[str, Any], *, source: str = "") -> None:
    """ppsim's rules on the override names, before tyro reads the values: only ``--parallelism.KEY`` and
    ``--training.KEY``, known keys (else the close ones), each once, no stray value first."""
    seen: set[str] = set()
    for i, token in enumerate(args):
        if not token.startswith("--") and i > 0:
            continue  # a value: tyro reads it
        name = _override_name(token, fields, source)[0]
        if name in seen:
            raise TorchtitanConfigError(f"--{name} given twice; give it once")
        seen.add(name)


def _override_name(token: str, fields: Mapping[str, Any], source: str) -> tuple[str, Any, bool]:
    """``(SECTION.KEY, its type, negated)`` of an override token (``--parallelism.no_KEY`` negates a flag)."""
    if not token.startswith("--") or "." not in token.split("=", 1)[0]:
        raise TorchtitanConfigError(_stray(token))
    name = token[2:].partition("=")[0].replace("-", "_")
    section, _, key = name.partition(".")
    if section not in OVERRIDE_SECTIONS:
        raise TorchtitanConfigError(
            f"--{name}: ppsim reads only --parallelism.KEY and --training.KEY overrides (the settings that shape "
            "the pipeline); drop it")
    annotation = fields.get(name)
    if annotation is None and key.startswith("no_") and _is_bool(fields.get(f"{section}.{key[3:]}")):
        return f"{section}.{key[3:]}", fields[f"{section}.{key[3:]}"], True
    if annotation is None:
        raise TorchtitanConfigError(_unknown(name, fields, source))
    return name, annotation, False


def extra_overrides(args: Sequence[str], *, job_given: bool, option_names: Sequence[str],
                    command: str) -> list[str]:
    """The extra arguments of a command that takes --torchtitan-config (``args``; ``job_given``: whether it was
    passed): job config overrides, which need the config; anything else is a mistyped option (with the close names
    of ``option_names``) or a stray value, refused in one line (click would have, without the extra arguments)."""
    args = list(args)
    if not args:
        return []
    first = args[0]
    if first.startswith("--") and "." in first.split("=", 1)[0]:
        if not job_given:
            raise TorchtitanConfigError(f"{first.split('=', 1)[0]} overrides a torchtitan job config key: pass "
                                        "--torchtitan-config MODULE:CONFIG (or job.toml) with it")
        return args
    if first.startswith("-"):
        close = difflib.get_close_matches(first.split("=", 1)[0], list(option_names), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; see `{command} --help`"
        raise TorchtitanConfigError(f"no such option: {first}{hint}")
    raise TorchtitanConfigError(f"unexpected argument {first!r}: this command takes options only; see "
                                f"`{command} --help`")


def override_fields_of(section: str, annotations: Mapping[str, Any]) -> dict[str, Any]:
    """``{"SECTION.KEY": annotation}`` for :func:`parse_overrides`, from a dataclass's resolved annotations."""
    return {f"{section}.{key}": value for key, value in annotations.items()}


def _stray(token: str) -> str:
    shown = _shown(token).strip("'\"")
    if token.startswith("-"):
        return (f"no such option: {shown}; see --help (job config keys are overridden as --parallelism.KEY VALUE or "
                "--training.KEY VALUE)")
    return f"unexpected argument {_shown(token)}: options take the form --name VALUE; see --help"


def close_matches(word: str, options: Sequence[str]) -> list[str]:
    """The options a typo of ``word`` most likely meant: the very close ones if any, else up to three close ones."""
    return (difflib.get_close_matches(word, options, n=3, cutoff=0.9)
            or difflib.get_close_matches(word, options, n=3, cutoff=0.6))


def _unknown(name: str, fields: Mapping[str, Any], source: str) -> str:
    section = name.split(".", 1)[0]
    same = [k for k in fields if k.startswith(section + ".")]
    close = close_matches(name, same)
    where = f" in --torchtitan-config {source}" if source else ""
    hint = (f"did you mean {' or '.join('--' + c for c in close)}?" if close
            else f"the {section} keys are listed by torchtitan's --help")
    return f"--{name}: no such key{where}; {hint}"


def _origin(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(annotation), typing.get_args(annotation)


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    origin, args = _origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return annotation, False


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _is_nested_list(annotation: Any) -> bool:
    inner, _ = _strip_optional(annotation)
    origin, args = _origin(inner)
    return origin is list and bool(args) and typing.get_origin(args[0]) is list


def _is_number(text: str) -> bool:
    return re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", text) is not None


def _convert(name: str, values: list[str], annotation: Any) -> Any:
    """``values`` (the command-line tokens) as ``annotation``; one line naming the key and type otherwise."""
    inner, optional = _strip_optional(annotation)
    if optional and values == ["None"]:
        return None
    bad = TorchtitanConfigError(f"--{name} {_shown(' '.join(values))}: not {_type_name(annotation)}; e.g. "
                                f"--{name} {_example(annotation)}")
    origin, args = _origin(inner)
    if origin is list:
        item = args[0] if args else str
        if typing.get_origin(item) is list:
            return [[s for s in v.split(",") if s] for v in values]
        if len(values) != 1 or item is not str:
            raise bad
        return [s for s in values[0].split(",") if s]
    if origin in (typing.Union, types.UnionType):
        for option in args:  # e.g. float | int: the first that takes the value
            try:
                return _convert(name, values, option)
            except TorchtitanConfigError:
                continue
        raise bad
    text = values[0]
    if inner is int:
        if re.fullmatch(r"[+-]?\d{1,18}", text.strip()) is None:
            raise bad
        return int(text)
    if inner is float:
        try:
            number = float(text)
        except ValueError:
            raise bad from None
        if not math.isfinite(number):
            raise bad
        return number
    if inner is str:
        return text
    raise TorchtitanConfigError(f"--{name}: a {_type_name(annotation)} setting ppsim cannot take from the command "
                                "line; set it in the config")


def _type_name(annotation: Any) -> str:
    inner, optional = _strip_optional(annotation)
    origin, args = _origin(inner)
    if _is_nested_list(inner):
        text = "module-name lists"
    elif origin is list:
        text = "a comma-separated list"
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(_type_name(a) for a in args)
    else:
        text = {int: "an integer", float: "a number", str: "a string", bool: "a flag"}.get(inner, str(inner))
    return f"{text} or None" if optional else text


def _example(annotation: Any) -> str:
    inner, _ = _strip_optional(annotation)
    origin, args = _origin(inner)
    if origin is list:
        return "a,b"
    if origin in (typing.Union, types.UnionType):
        return _example(args[0])
    return {int: "2", float: "1.0", str: "NAME"}.get(inner, "VALUE")


def _toml_type(value: Any) -> Any:
    """The override type of a key the TOML holds but ppsim does not read."""
    if isinstance(value, bool):
        return bool
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list[str]
    return object  # refused by _convert: set it in the file


# --- helpers ---------------------------------------------------------------------------------------------------
def _degree(settings: JobSettings) -> int:
    par = settings.parallelism
    values = {k: par[k] for k in ("pipeline_parallel_degree", "pipeline_parallel_size") if k in par}
    for k, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
            raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: parallelism.{k} = {_shown(value)} "
                                        f"must be an integer in 1..100000; {settings.fix(f'parallelism.{k}')}")
    if len(set(values.values())) > 1:
        raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: pipeline_parallel_degree and "
                                    "pipeline_parallel_size disagree; keep one")
    return next(iter(values.values()), DEFAULTS["pipeline_parallel_degree"])


def _table(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise TorchtitanConfigError(f"--torchtitan-config {source}: [{name}] must be a table; fix the file")
    return table


_AGREE_KEYS = {
    "-s/--schedule": ("parallelism.pipeline_parallel_schedule",),
    "-r/--ranks": ("parallelism.pipeline_parallel_degree",),
    "-m/--mb": OLD_KEYS.count,
    "-v/--stages-per-rank": ("parallelism.pipeline_parallel_layers_per_stage",),
    "--layers-per-stage": ("parallelism.pipeline_parallel_layers_per_stage",),
}


def _agree(settings: JobSettings, option: str, given: Any, from_config: Any, *, same: Any = None) -> None:
    if given is None:
        return
    equal = same(given, from_config) if same is not None and from_config is not None else given == from_config
    if not equal:
        shown = "not set" if from_config is None else str(from_config)
        keys = batch_keys_of(settings).count if option == "-m/--mb" else _AGREE_KEYS[option]
        change = "change the file" if settings.in_file else settings.fix(*keys)
        raise TorchtitanConfigError(
            f"{option} {given} contradicts {settings.source}, which gives {shown}; "
            f"drop {option.split('/')[0]} or {change}"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
