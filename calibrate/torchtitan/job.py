"""A torchtitan job config (``--torchtitan-config MODULE:CONFIG`` or ``FILE.toml``) as the inputs of `ppsim calibrate`
and `ppsim run`.

The job is read by the one loader every command uses (:func:`ppsim.calibrate.torchtitan.config.load_job` /
:func:`~ppsim.calibrate.torchtitan.config.read_job_settings`); this module turns it into what the two commands take:

- :func:`calibration_source` -- the model to measure: the job's own (``torchtitan:FAMILY/FLAVOR`` from a config
  function; a TOML names none, so ``--model`` must), at the job's microbatch shape (``training.seq_len`` x
  ``parallelism.pipeline_parallel_microbatch_size``) unless ``--seq-len`` / ``--mb-size`` replace it (with a note);
- :func:`run_inputs` -- what `ppsim run` executes: the schedule (name or CSV), ranks, microbatches, stages per rank
  and the split (torchtitan's module lists as layers per stage), read as `simulate` reads them, plus the model and
  its shape as for calibrate; ``-s/-r/-m/-v/--split/--layers-per-stage`` given as well must agree with the job.

A ``--model`` that names another model than the job's, or a ``--profile`` measured on another model or shape, is one
:class:`~ppsim.errors.TorchtitanConfigError` line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ppsim.errors import PPSimError, TorchtitanConfigError
from ppsim.job.pipeline import TorchtitanJob
from ppsim.job.settings import OLD_KEYS, JobSettings, batch_keys_of, job_sizes

if TYPE_CHECKING:
    from ppsim.calibrate.models import ModelOptions, ModelSource


@dataclass(frozen=True)
class JobRun:
    """`ppsim run`'s inputs from a job config (the fields of :class:`ppsim.calibrate.execute.run.RunOptions` it sets),
    typed: the model is a resolved :class:`ModelSource`, not text to parse again."""

    job: TorchtitanJob
    source: ModelSource
    """The model to run, resolved once (the job's, at its microbatch shape and layer count)."""
    split: str | None
    """Layers per stage, ``"N,N,..."`` (the job's split resolved for its stage count: module lists, layers per
    stage and the first and last stages' weights), or ``None`` for ppsim's default split (the same as torchtitan's
    default)."""
    notes: tuple[str, ...]
    """``warning:`` / ``note:`` lines for stderr."""

    @property
    def schedule(self) -> str:
        return self.job.schedule

    def in_job_terms(self, exc: PPSimError) -> PPSimError:
        """A refusal of the run's ``-r R -m M`` (too many actions, ranks or bytes for this machine) with the job's
        keys that set them; any other error as it is."""
        if re.match(r"^(\S+ )?-r \d+", str(exc)) is None:
            return exc
        source = self.job.source
        keys = ("parallelism.pipeline_parallel_degree", self.job.batch_keys.count[0], self.job.batch_keys.seq_len)
        fix = (f"change {', '.join(k.split('.')[-1] for k in keys[:2])} or {keys[2].split('.')[-1]} in the file"
               if self.job.in_file else f"pass --{keys[0]}, --{keys[1]} or --{keys[2]}")
        return PPSimError(f"{exc} (-r and -m come from --torchtitan-config {source}: {fix})")

    @property
    def num_ranks(self) -> int:
        return self.job.num_ranks

    @property
    def num_microbatches(self) -> int:
        return self.job.num_microbatches

    @property
    def stages_per_rank(self) -> int | None:
        return self.job.stages_per_rank


# --- calibrate ---------------------------------------------------------------------------------------------------
def calibration_source(value: str, overrides: Sequence[str] = (), *, model: str | None, preset: str | None,
                       options: ModelOptions, device: str = "cpu") -> tuple[ModelSource, tuple[str, ...]]:
    """The model `calibrate --torchtitan-config VALUE` measures, resolved (nothing built), and the notes to print."""
    from ppsim.calibrate.torchtitan.config import read_job_settings

    settings = read_job_settings(value, overrides)
    notes = [f"warning: {line}" for line in settings.notes]
    text = job_model(settings, model=model, preset=preset)
    sized, size_notes = job_options(settings, options)
    source = _resolve(settings, text, sized, device=device, layers_given=options.layers is not None, notes=notes)
    return source, (*notes, *size_notes)


def job_model(settings: JobSettings, *, model: str | None, preset: str | None) -> str:
    """The ``--model`` text of the job's model: the config function's, which ``--model`` / ``--preset`` must name
    too, as must the model an older release's TOML names in ``[model]``; a TOML without one needs ``--model`` (or
    ``--preset``)."""
    given = model if model is not None else (None if preset is None else f"builtin:{preset}")
    own = settings.model_source
    if own is None:
        if given is None:
            raise TorchtitanConfigError(
                f"--torchtitan-config {settings.source}: a job TOML without [model] name and flavor names no model "
                "ppsim can build; pass --model, e.g. --model torchtitan:llama3/debugmodel, or add them to the file"
            )
        return given
    if given is not None and _normalised(given) != _normalised(own):
        option = f"--model {model}" if model is not None else f"--preset {preset} (builtin:{preset})"
        raise TorchtitanConfigError(
            f"{option} contradicts --torchtitan-config {settings.source}, whose model is {own}; drop "
            f"{option.split(' ')[0]} (the job's model is used) or pass a job config of that model"
        )
    return own


def job_options(settings: JobSettings, options: ModelOptions) -> tuple[ModelOptions, tuple[str, ...]]:
    """``options`` with the job's microbatch shape where ``--seq-len`` / ``--mb-size`` are not given; a given one
    that differs from the job's replaces it, with a note."""
    seq_len, mb_size = job_sizes(settings)
    keys = batch_keys_of(settings)
    notes = []
    for option, given, key, own in (
        ("--seq-len", options.seq_len, keys.seq_len, seq_len),
        ("--mb-size", options.mb_size, keys.size if keys == OLD_KEYS else f"{keys.size} / {keys.seq_len}", mb_size),
    ):
        if given is not None and given != own:
            notes.append(f"note: {option} {given} replaces {key} {own} of --torchtitan-config {settings.source}")
    sized = replace(options, seq_len=options.seq_len or seq_len, mb_size=options.mb_size or mb_size)
    return sized, tuple(notes)


def _resolve(settings: JobSettings, text: str, options: ModelOptions, *, device: str, layers_given: bool,
             notes: list[str]) -> ModelSource:
    """The model source, with the job's own layer count where the config changed its flavor's (and ``--layers``
    is not given)."""
    from ppsim.calibrate.models import parse_model_source

    source = parse_model_source(text, options, device=device)
    own = settings.num_model_layers
    if own is not None and not layers_given and source.num_layers != own:
        notes.append(f"note: the model of --torchtitan-config {settings.source} has {own} layers ({text} has "
                     f"{source.num_layers}): {own} are measured")
        source = parse_model_source(text, replace(options, layers=own), device=device)
    return source


def _normalised(text: str) -> str:
    scheme, sep, rest = text.strip().partition(":")
    if not sep:
        return f"builtin:{text.strip()}"
    return f"{scheme.lower()}:{rest}"


# --- run ---------------------------------------------------------------------------------------------------------
def run_inputs(
    value: str,
    overrides: Sequence[str] = (),
    *,
    options: ModelOptions,
    model: str | None = None,
    preset: str | None = None,
    profile: Path | None = None,
    schedule: str | None = None,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    stages_per_rank: int | None = None,
    split: str | None = None,
    layers_per_stage: int | None = None,
    device: str = "cpu",
    allow_large: bool = False,
) -> JobRun:
    """What `ppsim run --torchtitan-config VALUE` executes (see the module docstring). With ``profile`` the job's
    model and microbatch shape must be the profile's (the prediction comes from it)."""
    from ppsim.calibrate.torchtitan.config import job_of_settings, read_job_settings
    from ppsim.split import parse_split

    settings = read_job_settings(value, overrides)
    prof = None if profile is None else _profile_model(profile)
    if settings.model_source is None and model is None and preset is None and prof is not None and prof[0]:
        model = prof[0]  # a TOML names no model: the profile's runs
    text = job_model(settings, model=model, preset=preset)
    sized, size_notes = job_options(settings, options)
    notes: list[str] = []
    if prof is not None:
        _check_profile(settings, profile, prof, text, sized)
        num_layers = prof[3]
    else:
        num_layers = None
    source = _resolve(settings, text, sized, device=device, layers_given=options.layers is not None, notes=notes)
    if num_layers is None:
        num_layers = source.num_layers
    job = job_of_settings(
        settings, num_layers=num_layers, schedule=schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank, layers_per_stage=layers_per_stage,
        split=None if split is None else parse_split(split),
    )
    counts = _stage_split(job, num_layers, allow_large=allow_large)
    return JobRun(
        job=job, source=source,
        split=None if counts is None else ",".join(map(str, counts)),
        notes=(*(f"warning: {w}" for w in job.warnings), *notes, *size_notes),
    )


def _profile_model(path: Path) -> tuple[str | None, int, int, int]:
    """``(model source text or None, seq_len, mb_size, layers)`` of a profile."""
    from ppsim.profile import load_profile

    prof = load_profile(path)
    text = None if prof.source is None else prof.source.source
    return text, prof.model.seq_len, prof.model.mb_size, prof.model.layers


def _check_profile(settings: JobSettings, path: Path | None, prof: tuple[str | None, int, int, int], text: str,
                   options: ModelOptions) -> None:
    """A profile of another model, or of another microbatch shape, would predict another job: refused."""
    own_text, seq_len, mb_size, _ = prof
    again = (f"calibrate with the same --torchtitan-config {settings.source} and overrides"
             if settings.model_source is not None else f"calibrate --model {text} at that shape")
    if own_text is not None and _normalised(own_text) != _normalised(text):
        raise TorchtitanConfigError(f"--profile {path}: measured on {own_text} but --torchtitan-config "
                                    f"{settings.source} runs {text}; {again}, or drop --profile")
    if (seq_len, mb_size) != (options.seq_len, options.mb_size):
        fix = ("" if settings.in_file else
               ", or pass " + batch_keys_of(settings).overrides(seq_len=seq_len, mb_size=mb_size))
        raise TorchtitanConfigError(
            f"--profile {path}: measured at seq_len {seq_len} x microbatch size {mb_size} but --torchtitan-config "
            f"{settings.source} runs {options.seq_len} x {options.mb_size}; {again}{fix}"
        )


def _stage_split(job: TorchtitanJob, num_layers: int, *, allow_large: bool) -> tuple[int, ...] | None:
    """Layers per stage of ``job`` for its schedule's stage count (the first and last stages' weights applied), or
    ``None`` where ppsim's default split is the job's. A schedule that cannot run the job is refused in the job's
    words."""
    from ppsim.compare import build
    from ppsim.split import SplitSpec, resolve_split

    try:
        sched, _ = build(job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank,
                         allow_large=allow_large)
    except PPSimError as exc:
        raise job.refusal(exc) from None
    if job.split == SplitSpec():
        return None
    return resolve_split(job.split, num_layers, len(sched.pipelines[0]),
                         schedule=f"{sched.name} with {sched.num_ranks} ranks")
