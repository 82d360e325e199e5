"""The calibration profile: what `ppsim calibrate` writes and the simulator reads (schema in docs/profile.md).

Plain Python (no torch). :func:`load_profile` turns every malformed file into one :class:`CostError` line naming
the file, the field and the fix; :func:`save_profile` writes atomically, so a killed calibration never leaves half
a file. A profile in progress has ``complete: false``, ``null`` for what is not measured yet and lists the finished
measurement keys in ``done`` (what ``--resume`` skips).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppsim.errors import CostError
from ppsim.io import write_atomic

SCHEMA = "ppsim.profile"
VERSION = 1
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
OPS = ("F", "B", "I", "W", "FB")
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


@dataclass(frozen=True)
class ModelInfo:
    """The model the profile was measured on (``ppsim.calibrate.model.ModelConfig`` as plain data)."""

    preset: str
    hidden: int
    heads: int
    ffn: int
    layers: int
    vocab: int
    seq_len: int
    mb_size: int
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _MODEL_KEYS}


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
    activation_bytes_allocator: int | None = None
    """CUDA only: allocator bytes still held after a forward (what the runtime keeps until backward)."""
    peak_bytes_allocator: int | None = None
    """CUDA only: allocator peak above the pre-forward level over one forward + backward."""

    @property
    def is_measured(self) -> bool:
        return all(getattr(self, op) is not None for op in OPS) and self.activation_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stage": self.stage, "layers": list(self.layers),
            "has_embedding": self.has_embedding, "has_head": self.has_head,
        }
        for op in OPS:
            stat = getattr(self, op)
            out[op] = None if stat is None else stat.to_dict()
        for key in _STAGE_INT_KEYS + _STAGE_OPTIONAL_INT_KEYS:
            out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class P2PSample:
    bytes: int
    median_s: float
    p10_s: float
    p90_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "median_s": self.median_s, "p10_s": self.p10_s, "p90_s": self.p90_s}


@dataclass(frozen=True)
class P2PPair:
    """The fit for one pair of neighbouring ranks (``src`` -> ``dst``)."""

    src: int
    dst: int
    alpha_s: float
    beta_bytes_per_s: float
    fit_rel_error: float
    samples: tuple[P2PSample, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src, "dst": self.dst, "alpha_s": self.alpha_s, "beta_bytes_per_s": self.beta_bytes_per_s,
            "fit_rel_error": self.fit_rel_error, "samples": [s.to_dict() for s in self.samples],
        }


@dataclass(frozen=True)
class P2PProfile:
    """Point-to-point cost ``alpha_s + bytes / beta_bytes_per_s`` (cross-rank only); with several rank pairs, the
    slowest pair's fit (a pipeline waits on its slowest link) and every pair in ``pairs``."""

    alpha_s: float
    beta_bytes_per_s: float
    fit_rel_error: float
    measured: bool
    samples: tuple[P2PSample, ...]
    pairs: tuple[P2PPair, ...] = ()

    def time(self, num_bytes: int) -> float:
        return self.alpha_s + num_bytes / self.beta_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha_s": self.alpha_s, "beta_bytes_per_s": self.beta_bytes_per_s, "fit_rel_error": self.fit_rel_error,
            "measured": self.measured, "samples": [s.to_dict() for s in self.samples],
            "pairs": [p.to_dict() for p in self.pairs],
        }


@dataclass(frozen=True)
class Method:
    """How the numbers were taken."""

    warmup: int
    reps: int
    timer: str  # "perf_counter" (CPU) or "cuda_events"
    threads_per_rank: int | None
    wall_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "warmup": self.warmup, "reps": self.reps, "timer": self.timer,
            "threads_per_rank": self.threads_per_rank, "wall_s": self.wall_s,
        }


@dataclass(frozen=True)
class Profile:
    created: str
    device: str
    device_name: str
    torch_version: str
    host: str
    world_size: int
    backend: str | None
    model: ModelInfo
    num_stages: int
    stages: tuple[StageProfile, ...]
    p2p: P2PProfile | None
    complete: bool
    done: tuple[str, ...] = ()
    method: Method | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "version": VERSION, "created": self.created, "device": self.device,
            "device_name": self.device_name, "torch_version": self.torch_version, "host": self.host,
            "world_size": self.world_size, "backend": self.backend, "model": self.model.to_dict(),
            "num_stages": self.num_stages, "stages": [s.to_dict() for s in self.stages],
            "p2p": None if self.p2p is None else self.p2p.to_dict(),
            "complete": self.complete, "done": list(self.done),
            "method": None if self.method is None else self.method.to_dict(), "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "profile", allow_incomplete: bool = False) -> Profile:
        """Validate and convert; every problem is one :class:`CostError` line naming ``source`` and the field."""
        return _Reader(source).profile(data, allow_incomplete=allow_incomplete)


def load_profile(path: str | os.PathLike[str], *, allow_incomplete: bool = False) -> Profile:
    """Read a profile file. Unless ``allow_incomplete``, a profile still being measured is an error."""
    p = Path(path)
    if p.is_dir():
        raise CostError(f"profile {p}: is a directory; pass the JSON file written by `ppsim calibrate -o FILE.json`")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CostError(f"profile {p}: file not found; write one with `ppsim calibrate -o {p}`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostError(f"profile {p}: cannot be read ({exc}); pass a file written by `ppsim calibrate`") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostError(
            f"profile {p}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "pass a file written by `ppsim calibrate`"
        ) from None
    return Profile.from_dict(data, source=str(p), allow_incomplete=allow_incomplete)


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write atomically (temporary file + rename)."""
    return write_atomic(path, json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n")


# --- validation -------------------------------------------------------------------------------------------------
_MODEL_KEYS = ("preset", "hidden", "heads", "ffn", "layers", "vocab", "seq_len", "mb_size", "dtype")
_STAGE_INT_KEYS = ("activation_bytes", "activation_bytes_freed_by_I", "param_bytes", "grad_bytes",
                   "optimizer_bytes", "output_bytes")
_STAGE_OPTIONAL_INT_KEYS = ("activation_bytes_allocator", "peak_bytes_allocator")
_MISSING = object()


class _Reader:
    """Field-by-field checks with paths like ``stages[2].F.median`` in the messages."""

    def __init__(self, source: str) -> None:
        self.source = source

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
            raise self.fail(where, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def num(self, value: Any, where: str, *, positive: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (positive and value == 0):
            raise self.fail(where, f"must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        return float(value)

    def str_(self, value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or (choices is not None and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a string"
            raise self.fail(where, f"must be {expected}, got {value!r}")
        return value

    def bool_(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false, got {value!r}")
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

    def model(self, value: Any) -> ModelInfo:
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
        return ModelInfo(**kwargs)

    def stage(self, value: Any, index: int, *, allow_incomplete: bool) -> StageProfile:
        where = f"stages[{index}]"
        d = self.obj(value, where)
        pre = f"{where}."
        layers = self.list_(self.get(d, "layers", pre), f"{pre}layers")
        if len(layers) != 2:
            raise self.fail(f"{pre}layers", f"must be [first, last_exclusive], got {layers!r}")
        first = self.int_(layers[0], f"{pre}layers[0]")
        last = self.int_(layers[1], f"{pre}layers[1]", minimum=first + 1)
        kwargs: dict[str, Any] = {
            "stage": self.int_(self.get(d, "stage", pre), f"{pre}stage"),
            "layers": (first, last),
            "has_embedding": self.bool_(self.get(d, "has_embedding", pre), f"{pre}has_embedding"),
            "has_head": self.bool_(self.get(d, "has_head", pre), f"{pre}has_head"),
        }
        for op in OPS:
            raw = self.get(d, op, pre)
            if raw is None and not allow_incomplete:
                raise self.fail(f"{pre}{op}", "is not measured (null)")
            kwargs[op] = None if raw is None else self.stat(raw, f"{pre}{op}")
        for key in _STAGE_INT_KEYS:
            raw = self.get(d, key, pre)
            if raw is None and key.startswith("activation") and allow_incomplete:
                kwargs[key] = None
                continue
            kwargs[key] = self.int_(raw, f"{pre}{key}")
        for key in _STAGE_OPTIONAL_INT_KEYS:
            raw = self.get(d, key, pre, optional=True)
            kwargs[key] = None if raw is None else self.int_(raw, f"{pre}{key}")
        act, freed = kwargs["activation_bytes"], kwargs["activation_bytes_freed_by_I"]
        if act is not None and freed is not None and freed > act:
            raise self.fail(f"{pre}activation_bytes_freed_by_I", f"is {freed}, more than activation_bytes {act}")
        return StageProfile(**kwargs)

    def sample(self, value: Any, where: str) -> P2PSample:
        d = self.obj(value, where)
        pre = f"{where}."
        return P2PSample(
            bytes=self.int_(self.get(d, "bytes", pre), f"{pre}bytes"),
            median_s=self.num(self.get(d, "median_s", pre), f"{pre}median_s"),
            p10_s=self.num(self.get(d, "p10_s", pre), f"{pre}p10_s"),
            p90_s=self.num(self.get(d, "p90_s", pre), f"{pre}p90_s"),
        )

    def samples(self, d: Mapping[str, Any], where: str) -> tuple[P2PSample, ...]:
        raw = self.get(d, "samples", f"{where}.", optional=True) or []
        return tuple(self.sample(s, f"{where}.samples[{i}]") for i, s in enumerate(self.list_(raw, f"{where}.samples")))

    def fit(self, d: Mapping[str, Any], where: str) -> tuple[float, float, float]:
        pre = f"{where}."
        return (
            self.num(self.get(d, "alpha_s", pre), f"{pre}alpha_s"),
            self.num(self.get(d, "beta_bytes_per_s", pre), f"{pre}beta_bytes_per_s", positive=True),
            self.num(self.get(d, "fit_rel_error", pre), f"{pre}fit_rel_error"),
        )

    def p2p(self, value: Any) -> P2PProfile | None:
        if value is None:
            return None
        d = self.obj(value, "p2p")
        alpha, beta, err = self.fit(d, "p2p")
        pairs = []
        for i, raw in enumerate(self.list_(self.get(d, "pairs", "p2p.", optional=True) or [], "p2p.pairs")):
            where = f"p2p.pairs[{i}]"
            pd = self.obj(raw, where)
            a, b, e = self.fit(pd, where)
            pairs.append(P2PPair(
                src=self.int_(self.get(pd, "src", f"{where}."), f"{where}.src"),
                dst=self.int_(self.get(pd, "dst", f"{where}."), f"{where}.dst"),
                alpha_s=a, beta_bytes_per_s=b, fit_rel_error=e, samples=self.samples(pd, where),
            ))
        return P2PProfile(
            alpha_s=alpha, beta_bytes_per_s=beta, fit_rel_error=err,
            measured=self.bool_(self.get(d, "measured", "p2p."), "p2p.measured"),
            samples=self.samples(d, "p2p"), pairs=tuple(pairs),
        )

    def method(self, value: Any) -> Method | None:
        if value is None:
            return None
        d = self.obj(value, "method")
        threads = self.get(d, "threads_per_rank", "method.", optional=True)
        wall = self.get(d, "wall_s", "method.", optional=True)
        return Method(
            warmup=self.int_(self.get(d, "warmup", "method."), "method.warmup"),
            reps=self.int_(self.get(d, "reps", "method."), "method.reps", minimum=1),
            timer=self.str_(self.get(d, "timer", "method."), "method.timer"),
            threads_per_rank=None if threads is None else self.int_(threads, "method.threads_per_rank", minimum=1),
            wall_s=None if wall is None else self.num(wall, "method.wall_s"),
        )

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
        if version != VERSION:
            shown = "no version" if version is _MISSING else f"version {version!r}"
            raise CostError(
                f"profile {self.source}: {shown} is not supported (this ppsim reads version {VERSION}); "
                "re-run `ppsim calibrate` with this ppsim"
            )
        complete = self.bool_(self.get(d, "complete", ""), "complete")
        done = tuple(self.str_(k, f"done[{i}]") for i, k in enumerate(self.list_(self.get(d, "done", ""), "done")))
        if not complete and not allow_incomplete:
            raise CostError(
                f"profile {self.source}: calibration is incomplete ({len(done)} measurements done); "
                f"finish it with `ppsim calibrate --resume -o {self.source}` and the same options"
            )
        num_stages = self.int_(self.get(d, "num_stages", ""), "num_stages", minimum=1)
        stages = self.list_(self.get(d, "stages", ""), "stages")
        if len(stages) != num_stages:
            raise self.fail("stages", f"lists {len(stages)} stages but num_stages is {num_stages}")
        partial_ok = allow_incomplete or not complete
        parsed = tuple(self.stage(s, i, allow_incomplete=partial_ok) for i, s in enumerate(stages))
        for i, st in enumerate(parsed):
            if st.stage != i:
                raise self.fail(f"stages[{i}].stage",
                                f"is {st.stage}; stages must be listed in order 0..{num_stages - 1}")
        if complete and not all(st.is_measured for st in parsed):
            raise self.fail("complete", "is true but some stage measurements are null")
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
            model=self.model(self.get(d, "model", "")),
            num_stages=num_stages,
            stages=parsed,
            p2p=self.p2p(self.get(d, "p2p", "")),
            complete=complete,
            done=done,
            method=self.method(d.get("method")),
            notes=tuple(self.str_(n, f"notes[{i}]") for i, n in enumerate(self.list_(d.get("notes") or [], "notes"))),
        )


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )
