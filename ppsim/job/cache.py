"""What a torchtitan job's settings, pipeline and shapes cost to read (importing torchtitan and torch, building the
model on the meta device: 5-15 s), kept under the user's cache folder so that asking again answers at once.

An entry is keyed by what decides it: the job (``MODULE:CONFIG``), the overrides, the torchtitan, torch and tyro
versions, and ppsim's own code that reads jobs (each file's size and modification time). Only torchtitan's own config
functions are cached (a user's module may change without a version). An entry is a pickle behind a header holding
its key; one that is unreadable, from another key or from another format is rebuilt, never trusted. A cache folder
that cannot be written is said once (:attr:`JobCache.warning`) and the answer comes without it.

The folder: ``$PPSIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/ppsim``, else ``~/.cache/ppsim``; ``PPSIM_CACHE_DIR=off``
turns the cache off."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

FORMAT = b"ppsim-job-cache 1\n"
_T = TypeVar("_T")
_CODE = ("ppsim/job", "ppsim/split.py", "ppsim/model_config.py", "calibrate/torchtitan", "ppsim/plan.py",
         "ppsim/cli/plan.py")
"""ppsim's code that decides a cached answer (paths inside the installed package's source tree): the job readers,
and the plan's, which read the model's facts into :class:`ppsim.plan.ModelFacts` (the ``plan-job`` entry)."""


def cache_dir() -> Path | None:
    """The cache folder, or ``None`` when ``PPSIM_CACHE_DIR=off``."""
    given = os.environ.get("PPSIM_CACHE_DIR")
    if given is not None:
        return None if given.strip().lower() in ("off", "0", "") else Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ppsim"


def torchtitan_owns(module_name: str) -> bool:
    """``module_name`` is one of torchtitan's own config folders (found without importing torchtitan)."""
    if "." in module_name or not module_name.isidentifier():
        return False
    try:
        spec = importlib.util.find_spec("torchtitan")
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        for group in ("models", "experiments"):
            if (Path(root) / group / module_name / "config_registry.py").is_file():
                return True
    return False


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torchtitan", "torch", "tyro"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def _code_stamp() -> list[tuple[str, int, int]]:
    """Each file of ppsim's job-reading code: (name, size, mtime_ns); the source tree is found from this file."""
    here = Path(__file__).resolve().parent  # ppsim/job
    roots = {"ppsim": here.parent}
    calibrate = importlib.util.find_spec("ppsim.calibrate")
    if calibrate is not None and calibrate.submodule_search_locations:
        roots["calibrate"] = Path(next(iter(calibrate.submodule_search_locations)))
    stamp = []
    for part in _CODE:
        top, _, rest = part.partition("/")
        path = roots.get(top, here.parent) / rest
        files = sorted(path.glob("*.py")) if path.is_dir() else [path]
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue
            stamp.append((f"{top}/{f.relative_to(roots.get(top, here.parent))}", st.st_size, st.st_mtime_ns))
    return stamp


class JobCache:
    """One command's access to the cache (:func:`cache_dir`); :attr:`warning` is set once when it cannot be used."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = cache_dir() if folder is None else folder
        self.warning: str | None = None
        self._common: dict[str, Any] | None = None

    def key(self, kind: str, **parts: Any) -> str:
        if self._common is None:
            self._common = {"versions": _versions(), "code": _code_stamp()}
        text = json.dumps({"kind": kind, **parts, **self._common}, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, kind: str, key: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{kind}-{key[:32]}.pkl"

    def load(self, kind: str, key: str) -> Any:
        """The entry, or ``None`` (absent, or unreadable: then removed so it is rebuilt)."""
        path = self._path(kind, key)
        if path is None or not path.is_file():
            return None
        try:
            data = path.read_bytes()
            head = FORMAT + key.encode() + b"\n"
            if not data.startswith(head):
                raise ValueError("another key or format")
            return pickle.loads(data[len(head):])
        except Exception:  # noqa: BLE001 -- a corrupt, truncated or foreign entry is rebuilt, whatever it raises
            try:
                path.unlink()
            except OSError:
                pass
            return None

    def store(self, kind: str, key: str, value: Any) -> None:
        path = self._path(kind, key)
        if path is None or self.warning is not None:
            return
        from ppsim.io import write_atomic

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, FORMAT + key.encode() + b"\n" + pickle.dumps(value), option="cache")
        except Exception as exc:  # noqa: BLE001 -- the answer stands without the cache; say why once
            self.warning = (f"the job cache folder {self.folder} cannot be written ({str(exc).splitlines()[0][:120]}); "
                            "answering without the cache (set PPSIM_CACHE_DIR to a writable folder, or off)")

    def get_or_build(self, kind: str, key: str, build: Callable[[], _T]) -> _T:
        """The cached value of ``key``, or ``build()``'s, then kept. A refusal (an exception) is not cached."""
        hit = self.load(kind, key)
        if hit is not None:
            return hit
        value = build()
        self.store(kind, key, value)
        return value
