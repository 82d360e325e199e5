"""A torchtitan job's settings, whatever they were read from: an older release's TOML (:func:`read_toml_settings`,
plain Python, here) or torchtitan 0.3.0's config registry (``MODULE:CONFIG``, a function returning a
``Trainer.Config``, read by ``ppsim.calibrate.torchtitan.config``, which imports torchtitan). Both give one
:class:`JobSettings`; the keys ppsim reads, their types and torchtitan's defaults; the microbatch keys of both
torchtitan generations (:func:`batch_shape`)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppsim.job.overrides import OVERRIDE_SECTIONS, TorchtitanConfigError, parse_overrides, shown_value

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
    activation_checkpoint: str | None = None
    """The config's activation-checkpoint mode (``none``/``selective``/``full``; a config function's), ``None``
    where not read (a TOML)."""

    def fix(self, *keys: str) -> str:
        """How the user changes ``keys`` (``section.key``): in the file, or with overrides."""
        if self.in_file:
            return f"change {' or '.join(k.split('.')[-1] for k in keys)} in the file"
        return "pass " + " or ".join(f"--{k} VALUE" for k in keys)


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
    if "name" not in _table(data, "model", source) and not sections["parallelism"]:
        raise TorchtitanConfigError(
            f"--torchtitan-config {source}: names no model and no pipeline; a job file must name its model "
            "([model] name = \"llama3\", flavor = \"debugmodel\") or torchtitan's pipeline keys ([parallelism] "
            "pipeline_parallel_degree = ...); add them to the file, or pass a config function "
            "(e.g. --torchtitan-config llama3:llama3_debugmodel)")
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
        raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: {section}.{key} = {shown_value(value)} "
                                    f"must be {need}; {settings.fix(f'{section}.{key}')}")
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
def pipeline_degree(settings: JobSettings) -> int:
    par = settings.parallelism
    values = {k: par[k] for k in ("pipeline_parallel_degree", "pipeline_parallel_size") if k in par}
    for k, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
            raise TorchtitanConfigError(f"--torchtitan-config {settings.source}: "
                                        f"parallelism.{k} = {shown_value(value)} "
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
