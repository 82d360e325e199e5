"""The pipeline a torchtitan job runs: schedule, ranks, microbatches, stages per rank and split, the way torchtitan's
``pipeline_llm`` / ``_build_pipeline_schedule`` derive them from the job's settings (:mod:`ppsim.job.settings`).

Read from ``parallelism``: ``pipeline_parallel_degree`` (or its older name ``pipeline_parallel_size``),
``pipeline_parallel_schedule``, ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size``,
``pipeline_parallel_layers_per_stage``, ``pipeline_parallel_first_stage_less_layers``,
``pipeline_parallel_last_stage_less_layers`` and ``module_fqns_per_model_part`` (its ``layers.N`` names per part
become the split); from ``training``: ``local_batch_size`` and ``seq_len``. Missing keys take torchtitan's defaults.
Settings ppsim neither counts nor times are returned as warnings naming the key; the CLI prints them on stderr. Module
lists ppsim cannot read are refused."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppsim.errors import TorchtitanConfigError
from ppsim.job.overrides import close_matches, shown_value
from ppsim.job.settings import (
    DEFAULTS,
    OLD_KEYS,
    BatchKeys,
    JobSettings,
    batch_keys_of,
    batch_shape,
    pipeline_degree,
    read_toml_settings,
    setting,
)
from ppsim.model_config import ModelConfig
from ppsim.split import SplitError, SplitSpec, stages_for_layers_per_stage

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

_COUNTED_BY_THE_JOB = ("data_parallel_shard_degree", "data_parallel_replicate_degree", "tensor_parallel_degree",
                       "context_parallel_degree", "expert_parallel_degree")
"""Degrees a config function's job counts (memory from its shapes; the step through the profile and FSDP's
collectives) or refuses: never "not honoured" beside a count that honours them."""
_CSV_ONLY = ("pipelineschedulesingle", "pipelineschedulemulti", "_pipelinescheduleruntime")
"""torchtitan schedule names that only run a CSV (``pipeline_parallel_schedule_csv``)."""

_FQN_KEYS = ("module_fqns_per_model_part", "pipeline_parallel_module_fqns_per_model_part")

_LAYER_FQN = re.compile(r"^layers\.(0|[1-9]\d{0,5})$")
"""torchtitan's layer modules: ``layers.N`` with N as ``str(int)`` writes it (``layers.00`` is no module)."""

EMBEDDING_MODULES = ("tok_embeddings",)

HEAD_MODULES = ("norm", "output", "lm_head")
"""The non-layer module names of ppsim's model: torchtitan's LLM layout (``output`` before 0.3.0, ``lm_head`` since)."""


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
    expert_parallel_degree: int = 1
    """``parallelism.expert_parallel_degree`` (a profile must be measured at it)."""
    activation_checkpoint: str | None = None
    """The config's activation-checkpoint mode (:attr:`ppsim.job.settings.JobSettings.activation_checkpoint`;
    ``None``: not read): a profile timed under another mode says so."""

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

    degree = pipeline_degree(settings)
    sched_name: str = get("parallelism", "pipeline_parallel_schedule", str)
    csv: str = get("parallelism", "pipeline_parallel_schedule_csv", str) or ""
    tt_layers_per_stage: int | None = get("parallelism", "pipeline_parallel_layers_per_stage", int, minimum=1)
    input_weight: int = get("parallelism", "pipeline_parallel_first_stage_less_layers", int, minimum=0)
    output_weight: int = get("parallelism", "pipeline_parallel_last_stage_less_layers", int, minimum=0)
    shape = batch_shape(settings)
    mb_size, batch, seq_len, microbatches = (shape.microbatch_size, shape.local_batch_size, shape.seq_len,
                                             shape.num_microbatches)
    _warn_unused(settings, warnings)
    layers = _layer_count(settings, num_layers)
    if degree == 1:
        job = _no_pipeline(settings, layers, warnings)
        _agree(settings, "-r/--ranks", num_ranks, 1)
        _agree(settings, "-m/--mb", num_microbatches, job.num_microbatches)
        if schedule is not None and schedule.lower() not in ("1f1b", "gpipe"):
            raise TorchtitanConfigError(f"-s {schedule}: pipeline_parallel_degree 1 runs no pipeline (one stage, its "
                                        "microbatches as gradient accumulation); drop -s")
        return job

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
        expert_parallel_degree=int(settings.parallelism.get("expert_parallel_degree") or 1),
    )


def _no_pipeline(settings: JobSettings, layers: int | None, warnings: list[str]) -> TorchtitanJob:
    """``pipeline_parallel_degree`` 1: torchtitan runs no pipeline. A step is its gradient accumulation: ``global
    batch / (local batch x dp_replicate x dp_shard)`` microbatches of ``local_batch_size`` sequences (torchtitan's
    ``Trainer``), each a forward then a backward of the whole model on one stage: ppsim's 1F1B on one rank."""
    source = settings.source
    batch = setting(settings, "training", "local_batch_size", int, minimum=1)
    seq_len = setting(settings, "training", "seq_len", int, minimum=1)
    given = settings.training.get("global_batch_size", -1)
    dp = [int(settings.parallelism.get(k) or 1) for k in ("data_parallel_replicate_degree",
                                                            "data_parallel_shard_degree")]
    if isinstance(given, bool) or not isinstance(given, int):
        raise TorchtitanConfigError(f"--torchtitan-config {source}: training.global_batch_size = {shown_value(given)} "
                                    "must be an integer (-1: local batch x data-parallel degree); "
                                    + settings.fix("training.global_batch_size"))
    steps = 1
    if given > 0:
        if -1 in dp:
            raise TorchtitanConfigError(
                f"--torchtitan-config {source}: training.global_batch_size {given} with data_parallel_shard_degree -1: "
                "the gradient accumulation steps need the data-parallel degree; "
                + settings.fix("parallelism.data_parallel_shard_degree"))
        per_step = batch * dp[0] * dp[1]
        if given % per_step:
            raise TorchtitanConfigError(
                f"--torchtitan-config {source}: training.global_batch_size {given} is not a multiple of "
                f"local_batch_size {batch} x data-parallel degree {dp[0] * dp[1]} (torchtitan refuses it too); "
                + settings.fix("training.global_batch_size", "training.local_batch_size"))
        steps = given // per_step
    warnings.append(f"parallelism.pipeline_parallel_degree = 1: no pipeline; the step is {steps} gradient "
                    f"accumulation microbatch{'es' if steps > 1 else ''} of local_batch_size {batch}, each a forward "
                    "and a backward of the whole model (simulated as 1F1B on one rank)")
    return TorchtitanJob(
        source=source, schedule="1F1B", num_ranks=1, num_microbatches=steps, stages_per_rank=1,
        split=SplitSpec(split=(layers,) if layers is not None else None), microbatch_size=batch,
        local_batch_size=batch * steps, seq_len=seq_len, warnings=tuple(warnings),
        model_source=settings.model_source, torch_schedule="1F1B", in_file=settings.in_file,
        tensor_parallel_degree=int(settings.parallelism.get("tensor_parallel_degree") or 1),
        expert_parallel_degree=int(settings.parallelism.get("expert_parallel_degree") or 1),
    )


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
        if key in _COUNTED_BY_THE_JOB and not settings.in_file:
            continue  # a config function's job memory counts these degrees or refuses them (ppsim.job.memory)
        warnings.append(f"parallelism.{key} = {shown_value(value)} is not honoured: ppsim simulates the pipeline "
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


def _unknown_module(part: int, name: str, expected: int) -> str:
    """``name`` is not one of torchtitan's modules: say so, with the nearest real name."""
    numbered = re.fullmatch(r"layers\.\+?0*(\d{1,6})", name.strip())
    near = (f"layers.{int(numbered.group(1))}" if numbered else
            next(iter(close_matches(name, [*EMBEDDING_MODULES, f"layers.{expected}", *HEAD_MODULES])), None))
    hint = f"; did you mean {near}?" if near else ""
    return (f"part {part} names {shown_value(name)}, which is not a module of torchtitan's model (its modules are "
            f"{', '.join(EMBEDDING_MODULES)}, layers.0, layers.1, ..., {', '.join(HEAD_MODULES)}){hint}")


def split_of_module_names(parts: Any, *, num_layers: int | None = None) -> tuple[int, ...]:
    """Layers per part of a module list laid out as ppsim's model is: the embedding in the first part, consecutive
    ``layers.N`` across the parts, the norm and head in the last; ``ValueError`` naming what does not fit."""
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, (list, tuple)) for p in parts):
        raise ValueError(f"= {shown_value(parts)} is not a list of module-name lists")
    counts: list[int] = []
    expected = 0
    last = len(parts) - 1
    for i, part in enumerate(parts):
        n = 0
        for name in part:
            if not isinstance(name, str):
                raise ValueError(f"part {i} holds {shown_value(name)}, not a module name")
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
                raise ValueError(_unknown_module(i, name, expected))
        if n == 0 and 0 < i < last:
            raise ValueError(f"part {i} holds no layers.N: only the first part (embedding) and the last (norm and "
                             "head) may hold no layer")
        counts.append(n)
    if num_layers is not None and expected != num_layers:
        raise ValueError(f"holds {expected} layers but the profile's model has {num_layers}")
    return tuple(counts)

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
