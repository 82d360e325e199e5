"""torchtitan 0.3.0 job configs: a config function in a model's ``config_registry`` (``MODULE:CONFIG``, e.g.
``llama3:llama3_debugmodel``) returning a ``Trainer.Config``, with ``--parallelism.KEY VALUE`` overrides.

This module turns such a config into the :class:`ppsim.job.settings.JobSettings` the core reads TOML files into, so
one builder (:func:`ppsim.job.pipeline.job_from_settings`) serves both forms; then it cuts and places the stages with
torchtitan's own functions (:mod:`ppsim.calibrate.torchtitan.split`). torchtitan is imported lazily: without it, one
line names the extra to install.

``MODULE`` is a folder under ``torchtitan.models`` (or ``torchtitan.experiments``) or a full dotted module path, and
``CONFIG`` a function of its ``config_registry``, as torchtitan's own ``--module`` / ``--config`` choose them
(``torchtitan/config/manager.py``). The overrides are parsed by tyro with torchtitan's own rules
(:func:`parse_with_tyro`), as ``torchtitan.train`` parses them; a job TOML without torchtitan installed uses ppsim's
small reader (:func:`ppsim.job.overrides.parse_overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import logging
import os
import re
import sys
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from types import ModuleType
from typing import Any

from ppsim.calibrate.torchtitan.split import (
    TorchtitanMissingError,
    import_torchtitan,
    layers_per_part,
    rank_stage_indices,
    stage_module_names,
    torch_schedule_names,
)
from ppsim.errors import TorchtitanConfigError
from ppsim.job.cache import JobCache, torchtitan_owns
from ppsim.job.overrides import check_override_names, close_matches, override_fields_of
from ppsim.job.pipeline import TorchtitanJob, job_from_settings
from ppsim.job.settings import JobSettings, is_registry_name, read_toml_settings
from ppsim.split import SplitError, SplitSpec, resolve_split

_PREFIXES = ("torchtitan.models", "torchtitan.experiments", "torchtitan.experiments.rl.examples")
__all__ = ["TorchtitanMissingError", "job_of_settings", "load_job", "load_registry_job", "read_job_settings",
           "read_registry_settings"]


def load_job(value: str, overrides: Sequence[str] = (), *, cache: JobCache | None = None,
             **kwargs: Any) -> TorchtitanJob:
    """The pipeline of ``--torchtitan-config VALUE`` with its overrides: ``MODULE:CONFIG`` (torchtitan's config
    registry) or an older release's TOML file (read as :func:`ppsim.job.pipeline.load_torchtitan_job` reads it);
    ``kwargs`` are the command-line values that must agree (:func:`ppsim.job.pipeline.job_from_settings`).
    ``cache``: a config function's job is kept there and read back without torchtitan (:mod:`ppsim.job.cache`).
    The one loader of every command that takes a job config."""
    if cache is None or not cacheable(value):
        return job_of_settings(read_job_settings(value, overrides), **kwargs)
    key = cache.key("job", job=value, overrides=list(overrides), agree=sorted(kwargs.items()))
    _refuse_unknown_keys_early(value, overrides, cache)
    return cache.get_or_build("job", key, lambda: job_of_settings(
        read_registry_settings(value, overrides, cache=cache), **kwargs))


def read_job_settings(value: str, overrides: Sequence[str] = (), *, cache: JobCache | None = None) -> JobSettings:
    """The settings of ``--torchtitan-config VALUE`` (either form) with its overrides applied, without deriving a
    pipeline: what `calibrate` needs (the model and the microbatch shape), which a job without a pipeline has too."""
    if is_registry_name(value):
        return read_registry_settings(value, overrides, cache=cache)
    return read_toml_settings(value, overrides)


def read_registry_settings(value: str, overrides: Sequence[str] = (), *,
                           cache: JobCache | None = None) -> JobSettings:
    """The settings of ``MODULE:CONFIG`` with ``overrides`` applied (typed by torchtitan's dataclass fields and
    checked by their own ``__post_init__``); every problem is one :class:`TorchtitanConfigError` line. With a
    ``cache``, read back when kept (a mistyped key is refused from the kept field names, without torchtitan)."""
    if cache is None or not cacheable(value):
        return _read_registry_settings(value, overrides)
    _refuse_unknown_keys_early(value, overrides, cache)
    key = cache.key("settings", job=value, overrides=list(overrides))
    return cache.get_or_build("settings", key, lambda: _read_registry_settings(value, overrides, cache=cache))


def _read_registry_settings(value: str, overrides: Sequence[str], *, cache: JobCache | None = None) -> JobSettings:
    module_name, config_name = _parse_name(value)
    import_torchtitan(f"--torchtitan-config {value}")
    module = _config_module(value, module_name)
    with converters_set_aside():
        config = _call_config(value, module, config_name)
    if cache is not None:  # the key names alone: enough to refuse a mistyped one next time
        names = {name: bool if kind is bool else object for name, kind in _override_fields(value, config).items()}
        cache.store("fields", cache.key("fields", job=value), names)
    return settings_of_config(value, config, overrides)


def cacheable(value: str) -> bool:
    """A config function of torchtitan's own (a user's module can change without a version to key it by)."""
    return is_registry_name(value) and torchtitan_owns(value.split(":", 1)[0])


def _refuse_unknown_keys_early(value: str, overrides: Sequence[str], cache: JobCache) -> None:
    names = cache.load("fields", cache.key("fields", job=value))
    if names is not None:
        check_override_names(overrides, names, source=value)


def _override_fields(value: str, config: Any) -> dict[str, Any]:
    parallelism, training = _sections(value, config)
    return {**override_fields_of("parallelism", _hints(parallelism)),
            **override_fields_of("training", _hints(training))}


def settings_of_config(value: str, config: Any, overrides: Sequence[str] = ()) -> JobSettings:
    """The settings of a ``Trainer.Config`` (``value`` names it in messages) with ``overrides`` parsed as
    torchtitan's own command line parses them (:func:`parse_with_tyro`). Either generation of torchtitan's batch
    keys is read (:func:`ppsim.job.settings.batch_shape`)."""
    from ppsim.calibrate.torchtitan.checkpointing import mode_of

    parallelism, training = _sections(value, config)
    # ppsim's rules: these two sections, each key once
    check_override_names(overrides, _override_fields(value, config), source=value)
    parallelism, training = parse_with_tyro(value, parallelism, training, overrides)
    notes = _whole_config_check(config, parallelism, training) if overrides else ()
    spec = getattr(config, "model_spec", None)
    family, flavor = getattr(spec, "name", None), getattr(spec, "flavor", None)
    layers = getattr(getattr(spec, "model", None), "layers", None)
    schedule = str(parallelism.pipeline_parallel_schedule)
    return JobSettings(
        source=value, parallelism=_as_dict(parallelism), training=_as_dict(training), in_file=False,
        model_source=f"torchtitan:{family}/{flavor}" if family and flavor else None,
        num_model_layers=len(layers) if isinstance(layers, (list, tuple)) else None,
        known_schedules=torch_schedule_names() + ((schedule,) if _torch_knows(schedule) else ()),
        notes=notes, activation_checkpoint=mode_of(getattr(config, "activation_checkpoint", None)),
    )


def parse_with_tyro(value: str, parallelism: Any, training: Any, overrides: Sequence[str]) -> tuple[Any, Any]:
    """``(parallelism, training)`` with ``overrides`` applied by tyro with torchtitan's own constructor rules
    (``ConfigManager.register_tyro_rules``), as ``torchtitan.train`` parses its command line: the rules cannot
    drift. Each section's ``__post_init__`` checks it; a refusal is one line."""
    if not overrides:
        return parallelism, training
    import tyro
    from torchtitan.config.manager import ConfigManager

    registry = tyro.constructors.ConstructorRegistry()
    ConfigManager.register_tyro_rules(registry)
    sections = dataclasses.make_dataclass("Job", [("parallelism", type(parallelism)), ("training", type(training))])
    shown = io.StringIO()
    try:
        with _quiet(), contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
            parsed = tyro.cli(sections, args=list(overrides), default=sections(parallelism, training),
                              registry=registry)
    except SystemExit:
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {_tyro_message(shown.getvalue())}") from None
    except (ValueError, TypeError) as exc:
        shown_args = " ".join(overrides)
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {shown_args[:120]}: torchtitan refuses it "
                                    f"({_first_line(exc)})") from None
    return parsed.parallelism, parsed.training


def _tyro_message(text: str) -> str:
    """tyro's boxed error as one line: its first paragraph (between the first two rules)."""
    blocks = re.split(r"\n\s*[-─]{10,}\s*\n", text)
    body = blocks[1] if len(blocks) > 1 else text
    line = " ".join(body.split())
    line = re.sub(r"Error parsing (--\S+): invalid literal for int\(\) with base 10: (.+)$",
                  r"\1 \2: not an integer", line)
    line = re.sub(r"invalid choice (\S+) for argument '(--\S+)'\. Expected one of \((.*)\)\.?$",
                  r"\2 \1: must be one of \3", line)
    line = line if len(line) <= 240 else line[:237] + "..."
    return f"{line} (torchtitan's command line; see its --help)"


def load_registry_job(value: str, *, overrides: Sequence[str] = (), **kwargs: Any) -> TorchtitanJob:
    """The pipeline a config function describes, its stages cut and placed by torchtitan's functions."""
    return job_of_settings(read_registry_settings(value, overrides), **kwargs)


def job_of_settings(settings: JobSettings, **agree: Any) -> TorchtitanJob:
    """The pipeline of a job's settings (:func:`ppsim.job.pipeline.job_from_settings`, which ``agree`` goes to: the
    command-line values the config must agree with); a config function's stages are cut and placed by torchtitan's
    functions (:func:`with_torchtitan_stages`)."""
    job = job_from_settings(settings, **agree)
    if settings.activation_checkpoint is not None:
        job = dataclasses.replace(job, activation_checkpoint=settings.activation_checkpoint)
    if settings.in_file:
        return job
    return with_torchtitan_stages(job, num_layers=settings.num_model_layers or agree.get("num_layers"),
                                  module_lists=settings.parallelism.get("module_fqns_per_model_part"))


def with_torchtitan_stages(job: TorchtitanJob, *, num_layers: int | None,
                           module_lists: Any = None) -> TorchtitanJob:
    """``job`` with its stages' module names and rank placement from torchtitan (when the stage count is known:
    not for a CSV, whose file decides), and its split made explicit from those names."""
    if job.stages_per_rank is None or num_layers is None:
        return job
    num_stages = job.num_ranks * job.stages_per_rank
    spec = job.split
    if module_lists:
        names = tuple(tuple(part) for part in module_lists)
    else:
        try:
            names = stage_module_names(num_stages, num_layers, input_weight=spec.input_weight,
                                       output_weight=spec.output_weight)
        except SplitError as exc:
            fix = ("pass a smaller --parallelism.pipeline_parallel_degree"
                   + (" or a single-stage schedule" if job.stages_per_rank > 1 else ""))
            reason = str(exc).rsplit("; ", 1)[0]
            raise TorchtitanConfigError(f"--torchtitan-config {job.source}: {job.num_ranks} ranks x "
                                        f"{job.stages_per_rank} stages per rank: {reason}; {fix}") from None
    counts = layers_per_part(names)
    # ppsim.split computes the same counts (tests/job/test_titan_split.py); torchtitan's are the ones used
    if counts != resolve_split(spec, num_layers, num_stages, schedule=job.schedule):
        spec = SplitSpec(split=counts, input_weight=spec.input_weight, output_weight=spec.output_weight)
    placement = rank_stage_indices(job.torch_schedule, num_ranks=job.num_ranks, num_stages=num_stages)
    return dataclasses.replace(job, split=spec, stage_modules=names, rank_stages=placement)


# --- hardware-bound converters ---------------------------------------------------------------------------------
_CONVERTERS = (("torchtitan.components.quantization.float8", "Float8LinearConverter"),
               ("torchtitan.components.quantization.float8", "Float8GroupedExpertsConverter"),
               ("torchtitan.components.quantization.mx", "MXLinearConverter"),
               ("torchtitan.components.quantization.mx", "MXGroupedExpertsConverter"))


@contextmanager
def converters_set_aside() -> Iterator[list[str]]:
    """While inside, torchtitan's quantization converters build as no-ops; yields the notes naming each one set
    aside (a job with a float8 converter is then readable on a CPU or a pre-SM89 GPU)."""
    import importlib

    notes: list[str] = []
    saved: list[tuple[type, Any, Any]] = []

    def make_init(name: str) -> Any:
        def init(self: Any, config: Any) -> None:
            self.config, self.enabled = config, False
            notes.append(f"{name} set aside (hardware-bound); its weights are stored in their own dtype, so the "
                         "memory counts them unchanged; the per-matmul low-precision casts are not counted")
        return init

    for module_name, cls_name in _CONVERTERS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        saved.append((cls, cls.__init__, getattr(cls, "convert", None)))
        cls.__init__ = make_init(cls_name)
        cls.convert = lambda self, model_config: model_config
    try:
        yield notes
    finally:
        for cls, init, convert in saved:
            cls.__init__ = init
            if convert is not None:
                cls.convert = convert


# --- reading the config ----------------------------------------------------------------------------------------
def _parse_name(value: str) -> tuple[str, str]:
    match = re.fullmatch(r"([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)", value)
    if match is None:
        raise TorchtitanConfigError(f"--torchtitan-config {value!r}: give MODULE:CONFIG (a torchtitan model folder or "
                                    "dotted module, and a function of its config_registry), e.g. "
                                    "llama3:llama3_debugmodel, or a job .toml file")
    return match.group(1), match.group(2)


def _config_module(value: str, module_name: str) -> ModuleType:
    """The config registry module as torchtitan's ConfigManager finds it: a short name of torchtitan's models or
    experiments (``MODULE.config_registry`` under them), else a module path (its ``.config_registry`` first)."""
    shorts = _short_names()
    if module_name in shorts:
        candidates = [f"{prefix}.{module_name}.config_registry" for prefix in _PREFIXES]
    else:
        candidates = [f"{module_name}.config_registry", module_name]
    for candidate in candidates:
        try:
            with _quiet(), _cwd_importable(module_name not in shorts):
                return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not candidate.startswith(exc.name):
                raise TorchtitanConfigError(f"--torchtitan-config {value}: {candidate} needs {exc.name}, which is "
                                            "not installed; install it") from None
            continue
        except (Exception, SystemExit) as exc:  # noqa: BLE001  (a broken registry module is the user's bug)
            raise TorchtitanConfigError(f"--torchtitan-config {value}: importing {candidate} failed "
                                        f"({type(exc).__name__}: {_first_line(exc)}); fix that module") from None
    models = sorted(_short_names(models_only=True))
    close = close_matches(module_name, sorted(shorts))
    hint = f"did you mean {' or '.join(close)}?" if close else f"torchtitan's models are {', '.join(models)}"
    raise TorchtitanConfigError(f"--torchtitan-config {value}: no config registry module {module_name!r} (neither a "
                                f"torchtitan model nor an importable module); {hint}")


def _call_config(value: str, module: ModuleType, config_name: str) -> Any:
    fn = getattr(module, config_name, None)
    if fn is not None and not _is_config_function(fn):
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {module.__name__}.{config_name} is not a config "
                                    "function (a Python function taking no arguments that returns a Trainer.Config); "
                                    "name one of its config functions")
    if fn is None:
        available = [n for n in dir(module) if not n.startswith("_") and n[:1].islower()
                     and _is_config_function(getattr(module, n))
                     and getattr(getattr(module, n), "__module__", "") == module.__name__]
        close = close_matches(config_name, available)
        listed = close or available[:8]
        hint = ("did you mean " + " or ".join(f"{module_short(module)}:{n}" for n in close) + "?") if close else (
            "its config functions are " + ", ".join(listed) + (" ..." if len(available) > len(listed) else ""))
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {module.__name__} has no config function "
                                    f"{config_name!r}; {hint}")
    try:
        with _quiet():
            return fn()
    except SystemExit as exc:
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {config_name}() called sys.exit({exc.code!r}) "
                                    "instead of returning a Trainer.Config; fix the config function") from None
    except Exception as exc:  # noqa: BLE001  (the config function is the user's code)
        raise TorchtitanConfigError(f"--torchtitan-config {value}: {config_name}() raised {type(exc).__name__}: "
                                    f"{_first_line(exc)}; fix the config function or pick another") from None


def _is_config_function(obj: Any) -> bool:
    """A Python function callable without arguments (builtins such as ``os.abort`` are never called)."""
    if not inspect.isfunction(obj):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def module_short(module: ModuleType) -> str:
    name = module.__name__.removesuffix(".config_registry")
    for prefix in _PREFIXES:
        if name.startswith(prefix + ".") and "." not in name[len(prefix) + 1:]:
            return name[len(prefix) + 1:]
    return name


def _sections(value: str, config: Any) -> tuple[Any, Any]:
    parallelism = getattr(config, "parallelism", None)
    training = getattr(config, "training", None)
    if not (dataclasses.is_dataclass(parallelism) and dataclasses.is_dataclass(training)):
        raise TorchtitanConfigError(f"--torchtitan-config {value}: returned {type(config).__name__}, not a "
                                    "Trainer.Config with parallelism and training; name a training config function")
    return parallelism, training


def _hints(obj: Any) -> dict[str, Any]:
    """Each init field's type (an annotation that does not resolve takes no override: ``Any`` is refused)."""
    try:
        hints = typing.get_type_hints(type(obj))
    except Exception:  # noqa: BLE001  (a forward reference torchtitan's module cannot resolve)
        hints = {}
    return {f.name: hints.get(f.name, f.type if not isinstance(f.type, str) else Any)
            for f in dataclasses.fields(obj) if f.init}


def _whole_config_check(config: Any, parallelism: Any, training: Any) -> tuple[str, ...]:
    """torchtitan's checks across sections (``Trainer.Config.__post_init__``) on the overridden config: a failure
    is a warning (the pipeline is still the one simulated), naming what torchtitan's command line would need."""
    try:
        with _quiet():
            dataclasses.replace(config, parallelism=parallelism, training=training)
    except (ValueError, TypeError) as exc:
        return (f"torchtitan would refuse this job as overridden ({_first_line(exc)}); ppsim simulates its "
                "pipeline anyway",)
    return ()


def _as_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _torch_knows(schedule: str) -> bool:
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        get_schedule_class(schedule)
    except ValueError:
        return False
    return True


def _short_names(*, models_only: bool = False) -> frozenset[str]:
    """The module short names torchtitan's ConfigManager accepts (its models, and its experiments)."""
    from torchtitan.models import _supported_models

    if models_only:
        return frozenset(_supported_models)
    try:
        from torchtitan.experiments import _supported_experiments
    except ImportError:
        _supported_experiments = frozenset()
    return frozenset(_supported_models) | frozenset(_supported_experiments)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


@contextmanager
def _cwd_importable(wanted: bool) -> Iterator[None]:
    """A dotted module is found from the working directory too, as ``python -m torchtitan.train`` finds it."""
    added = wanted and "" not in sys.path and os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())


@contextmanager
def _quiet() -> Iterator[None]:
    """torchtitan logs on the root logger while configs are built, and a config function may print: the CLI prints
    only its own lines, and stdout (``--json``) only ppsim's output."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        logging.disable(previous)
