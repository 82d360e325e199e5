"""Read a torchtitan job config (TOML) and say which pipeline it would run: schedule, ranks, microbatches, stages
per rank and split, the way torchtitan's ``pipeline_llm`` / ``build_pipeline_schedule`` derive them.

Read from ``[parallelism]``: ``pipeline_parallel_degree`` (or its newer name ``pipeline_parallel_size``),
``pipeline_parallel_schedule``, ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size``,
``pipeline_parallel_layers_per_stage``, ``pipeline_parallel_first_stage_less_layers``,
``pipeline_parallel_last_stage_less_layers`` and ``module_fqns_per_model_part`` (its consecutive ``layers.N`` names
per part become the split); from ``[training]``: ``local_batch_size`` and ``seq_len``. Missing keys take torchtitan's
defaults. Settings ppsim cannot honour (other parallelism dimensions, module lists it cannot read, ...) are returned
as warnings naming the key; the CLI prints them on stderr.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppsim.errors import PPSimError
from ppsim.model_config import ModelConfig
from ppsim.split import SplitSpec, stages_for_layers_per_stage

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
}
"""torchtitan's defaults for the keys ppsim reads."""
_USED_PARALLELISM = {k for k in DEFAULTS if k.startswith("pipeline_")} | {"pipeline_parallel_size"}
_HARMLESS_PARALLELISM = {
    # off at these values, or not about the pipeline's timing
    "data_parallel_replicate_degree": (1,), "data_parallel_shard_degree": (1, -1), "tensor_parallel_degree": (1,),
    "context_parallel_degree": (1,), "expert_parallel_degree": (1,), "expert_tensor_parallel_degree": (1,),
    "pipeline_parallel_expert_parallel_overlap": (True, False),
    "disable_loss_parallel": (True, False), "enable_async_tensor_parallel": (False,),
    "fsdp_reshard_after_forward": ("default", "always", "never"), "enable_compiled_autograd": (False,),
    "context_parallel_rotate_method": ("allgather", "alltoall"), "context_parallel_load_balancer": ("headtail",),
    "expert_parallel_comm_backend": ("standard",),
}
_CSV_ONLY = ("pipelineschedulesingle", "pipelineschedulemulti", "_pipelinescheduleruntime")
"""torchtitan schedule names that only run a CSV (``pipeline_parallel_schedule_csv``)."""


class TorchtitanConfigError(PPSimError):
    """A torchtitan job config that cannot be read, or that contradicts the command line."""


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

    def refusal(self, exc: Exception) -> TorchtitanConfigError:
        """``exc`` (a schedule that cannot run this job) in the job config's words: the keys that set the ranks
        and microbatches, not the command-line options the user did not pass."""
        reason = re.sub(r"^(?:--mb|--ranks|-m|-r)\s+\d+:\s*", "", str(exc)).split("; ")[0]
        return TorchtitanConfigError(
            f"--torchtitan-config {self.source}: {Path(self.schedule).name} with pipeline_parallel_degree "
            f"{self.num_ranks} and {self.num_microbatches} microbatches (local_batch_size {self.local_batch_size} / "
            f"pipeline_parallel_microbatch_size {self.microbatch_size}) cannot run: {reason}; change "
            "pipeline_parallel_degree, local_batch_size or pipeline_parallel_microbatch_size in the file to match"
        )


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML as a dict; every problem is one :class:`TorchtitanConfigError` line."""
    p = Path(path)
    try:
        if not p.is_file():
            raise TorchtitanConfigError(f"--torchtitan-config {p}: file not found or not a file; pass torchtitan's "
                                        "job TOML, e.g. --torchtitan-config llama3_8b.toml")
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


def load_torchtitan_job(
    path: str | Path,
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
    """The pipeline a torchtitan job config describes. ``num_layers`` (from a per-block profile) is needed only for
    ``pipeline_parallel_layers_per_stage``; ``model`` (the profile's) lets the microbatch shape be checked. Values
    given on the command line must agree with the file (else one :class:`TorchtitanConfigError` line)."""
    source = str(path)
    data = read_toml(path)
    par = _table(data, "parallelism", source)
    train = _table(data, "training", source)
    warnings: list[str] = []

    def get(table: dict[str, Any], section: str, key: str, kind: type, *, minimum: int | None = None) -> Any:
        value = table.get(key, DEFAULTS[key])
        if value is None:
            return None
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if ok and minimum is not None and value < minimum:
            ok = False
        if not ok:
            need = f"an integer >= {minimum}" if kind is int else "a string"
            raise TorchtitanConfigError(f"--torchtitan-config {source}: [{section}] {key} = {_shown(value)} must be "
                                        f"{need}; fix the file")
        if kind is int and value > 10**9:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: [{section}] {key} = {value} is beyond "
                                        "ppsim's limits; fix the file")
        return value

    degree = _degree(par, source)
    sched_name: str = get(par, "parallelism", "pipeline_parallel_schedule", str)
    csv: str = get(par, "parallelism", "pipeline_parallel_schedule_csv", str) or ""
    mb_size: int = get(par, "parallelism", "pipeline_parallel_microbatch_size", int, minimum=1)
    tt_layers_per_stage: int | None = get(par, "parallelism", "pipeline_parallel_layers_per_stage", int, minimum=1)
    input_weight: int = get(par, "parallelism", "pipeline_parallel_first_stage_less_layers", int, minimum=0)
    output_weight: int = get(par, "parallelism", "pipeline_parallel_last_stage_less_layers", int, minimum=0)
    batch: int = get(train, "training", "local_batch_size", int, minimum=1)
    seq_len: int = get(train, "training", "seq_len", int, minimum=1)

    for key, value in par.items():
        if key in _USED_PARALLELISM:
            continue
        if key in _HARMLESS_PARALLELISM and value in _HARMLESS_PARALLELISM[key]:
            continue
        if key in _FQN_KEYS:
            continue
        if key == "pipeline_parallel_split_points":
            if value:
                warnings.append(f"[parallelism] {key} is not honoured (torchtitan dropped it); use --split with the "
                                "same layers per stage")
            continue
        warnings.append(f"[parallelism] {key} = {_shown(value)} is not honoured: ppsim simulates the pipeline "
                        "dimension only")
    if degree < 2:
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: pipeline_parallel_degree is {degree}, so torchtitan runs no pipeline; "
            "set [parallelism] pipeline_parallel_degree = 2 or more"
        )
    if batch % mb_size:
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: local_batch_size {batch} is not divisible by "
            f"pipeline_parallel_microbatch_size {mb_size} (torchtitan refuses it too); change either"
        )
    microbatches = batch // mb_size

    # the schedule and how many stages each rank holds, as pipeline_llm decides them
    from ppsim.schedules import all_specs

    by_torch = {s.torch_name.lower(): s for s in all_specs() if s.torch_name}
    key = sched_name.lower()
    if csv:
        csv_path = Path(csv)
        if not csv_path.is_file():
            raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule_csv {csv!r} is not "
                                        "a file (torchtitan resolves it from the working directory); fix the path")
        ppsim_schedule = str(csv_path)
        v: int | None = None
        single = key == "pipelineschedulesingle" or (key in by_torch and by_torch[key].fixed_stages_per_rank == 1)
    elif key in _CSV_ONLY:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule {sched_name!r} needs "
                                    "pipeline_parallel_schedule_csv; give the CSV or a named schedule")
    elif key in by_torch:
        spec = by_torch[key]
        ppsim_schedule = spec.name
        single = spec.fixed_stages_per_rank == 1
        v = 1 if single else 2
    else:
        names = ", ".join(sorted(s.torch_name for s in all_specs() if s.torch_name))
        raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_schedule {sched_name!r} is not "
                                    f"one torchtitan runs that ppsim knows; use one of {names}")
    if tt_layers_per_stage is not None:
        if num_layers is None:
            raise TorchtitanConfigError(
                f"--torchtitan-config {source}: pipeline_parallel_layers_per_stage needs the model's layer count; "
                "pass --profile with a per-block profile of the model"
            )
        total = stages_for_layers_per_stage(num_layers, tt_layers_per_stage, input_weight=input_weight,
                                            output_weight=output_weight)
        what = (f"{num_layers} layers with pipeline_parallel_layers_per_stage {tt_layers_per_stage} give {total} "
                f"stages")
        if total % degree:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, not divisible by "
                                        f"pipeline_parallel_degree {degree} (torchtitan refuses it); change either")
        per_rank = total // degree
        if single and per_rank != 1:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, {per_rank} per rank, but "
                                        f"{sched_name} holds one stage per rank; use layers per stage "
                                        f"{math.ceil((num_layers + input_weight + output_weight) / degree)}")
        if not single and per_rank < 2:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, 1 per rank, but {sched_name} needs "
                                        "at least 2 per rank; lower pipeline_parallel_layers_per_stage")
        if v is not None and key in ("zbvzerobubble", "dualpipev") and per_rank != 2:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: {what}, {per_rank} per rank, but "
                                        f"{sched_name} is a V of exactly 2 stages per rank; change "
                                        "pipeline_parallel_layers_per_stage")
        if v is not None:
            v = per_rank
    fqn_split = _fqn_split(par, source, warnings)
    if fqn_split is not None:
        # torchtitan builds one stage per listed part, whatever layers_per_stage says
        if len(fqn_split) % degree:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: module_fqns_per_model_part lists "
                                        f"{len(fqn_split)} parts, not divisible by pipeline_parallel_degree {degree}; "
                                        "fix the file")
        if v is not None:
            v = len(fqn_split) // degree
        if split is not None and tuple(split) != fqn_split:
            raise TorchtitanConfigError(f"--split contradicts module_fqns_per_model_part in {source} (layers per "
                                        f"part {','.join(map(str, fqn_split))}); drop --split")
        if num_layers is not None and sum(fqn_split) != num_layers:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: module_fqns_per_model_part holds "
                                        f"{sum(fqn_split)} layers but the profile's model has {num_layers}; "
                                        "use the profile of this model")
        split = fqn_split
        tt_layers_per_stage = None
    if model is not None and (model.seq_len, model.mb_size) != (seq_len, mb_size):
        warnings.append(
            f"the profile was measured with seq_len {model.seq_len} x microbatch size {model.mb_size}, the job runs "
            f"{seq_len} x {mb_size}: costs are not rescaled; calibrate with --seq-len {seq_len} --mb-size {mb_size}"
        )

    # agree with the command line
    _agree(source, "-s/--schedule", schedule, ppsim_schedule, same=lambda a, b: a.lower() == b.lower())
    _agree(source, "-r/--ranks", num_ranks, degree)
    _agree(source, "-m/--mb", num_microbatches, microbatches)
    if v is not None:
        _agree(source, "-v/--stages-per-rank", stages_per_rank, v)
    _agree(source, "--layers-per-stage", layers_per_stage, tt_layers_per_stage)
    if split is not None and tt_layers_per_stage is not None:
        raise TorchtitanConfigError(f"--split and pipeline_parallel_layers_per_stage in {source} both decide the "
                                    "split; drop one")
    spec = SplitSpec(split=split, layers_per_stage=tt_layers_per_stage, input_weight=input_weight,
                     output_weight=output_weight)
    return TorchtitanJob(
        source=source, schedule=ppsim_schedule, num_ranks=degree, num_microbatches=microbatches, stages_per_rank=v,
        split=spec, microbatch_size=mb_size, local_batch_size=batch, seq_len=seq_len, warnings=tuple(warnings),
    )


_FQN_KEYS = ("module_fqns_per_model_part", "pipeline_parallel_module_fqns_per_model_part")
_LAYER_FQN = re.compile(r"^layers\.(\d{1,6})$")


def _fqn_split(par: dict[str, Any], source: str, warnings: list[str]) -> tuple[int, ...] | None:
    """Layers per part from torchtitan's explicit module lists (``[["tok_embeddings", "layers.0"], ...]``), or
    ``None`` when absent or not readable as consecutive ``layers.N`` (then named in ``warnings``)."""
    given = [(k, par[k]) for k in _FQN_KEYS if par.get(k)]
    if not given:
        return None
    key, parts = given[0]
    counts: list[int] = []
    expected = 0
    ok = isinstance(parts, list) and len(parts) >= 1 and all(isinstance(p, list) for p in parts)
    for part in parts if ok else []:
        n = 0
        for name in part:
            match = _LAYER_FQN.match(name) if isinstance(name, str) else None
            if match is None:
                continue
            if int(match.group(1)) != expected:
                ok = False
                break
            expected += 1
            n += 1
        counts.append(n)
    if not ok:
        warnings.append(f"[parallelism] {key} is not honoured: ppsim reads consecutive 'layers.N' names per part; "
                        "use --split with the same layers per stage")
        return None
    return tuple(counts)


def _degree(par: dict[str, Any], source: str) -> int:
    values = {k: par[k] for k in ("pipeline_parallel_degree", "pipeline_parallel_size") if k in par}
    for k, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
            raise TorchtitanConfigError(f"--torchtitan-config {source}: [parallelism] {k} = {_shown(value)} must be "
                                        "an integer in 1..100000; fix the file")
    if len(set(values.values())) > 1:
        raise TorchtitanConfigError(f"--torchtitan-config {source}: pipeline_parallel_degree and "
                                    "pipeline_parallel_size disagree; keep one")
    return next(iter(values.values()), DEFAULTS["pipeline_parallel_degree"])


def _table(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise TorchtitanConfigError(f"--torchtitan-config {source}: [{name}] must be a table; fix the file")
    return table


def _agree(source: str, option: str, given: Any, from_file: Any, *, same: Any = None) -> None:
    if given is None:
        return
    equal = same(given, from_file) if same is not None and from_file is not None else given == from_file
    if not equal:
        shown = "not set" if from_file is None else str(from_file)
        raise TorchtitanConfigError(
            f"{option} {given} contradicts {source}, which gives {shown}; "
            f"drop {option.split('/')[0]} or change the file"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
