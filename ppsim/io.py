"""Files and sizes: the one atomic writer, the writability check, byte sizes in and out.

``write_atomic`` never leaves half a file under the user's name and never destroys what is not ppsim's: a symlink
is written through to its target, a device, FIFO or socket is written into as it is (no rename), a directory is
refused, an existing file keeps its mode (and, for root, its owner), a new file gets the mode ``open()`` would give.
The temporary file lives beside the target and is removed on every exit path (errors, Ctrl-C, SIGTERM, SIGHUP).
Errors name the path the user gave, never the temporary name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import BinaryIO, Union

from ppsim.errors import OutputPathError, SizeError

Content = Union[str, bytes, Callable[[BinaryIO], object]]
"""What to write: text (UTF-8), bytes, or a function that writes into a binary file object."""

MAX_BYTES = 2**63 - 1
"""The largest size ``parse_bytes`` accepts (int64, what the simulator's memory arithmetic holds)."""

_LIVE_TEMPS: set[str] = set()
_HELD_LOCKS: set[str] = set()


# --- writing ----------------------------------------------------------------------------------------------------
def write_atomic(path: str | os.PathLike[str], content: Content, *, option: str = "-o") -> Path:
    """Write ``content`` to ``path`` so that no reader ever sees half a file; returns ``path`` as given.

    ``option`` names the command-line option the path came from, for error messages (``-o``, ``--plot``).
    """
    target = Path(path)
    real, st = _inspect(target, option)
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A device (/dev/null), FIFO or socket: renaming over it would replace it, so write into it as it is.
        try:
            with open(real, "wb") as fh:
                _emit(fh, content)
        except OSError as exc:
            raise _output_error(target, exc, option) from None
        return target
    directory = real.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name[:40]}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise _output_error(target, exc, option) from None
    try:
        with _removed_on_sigterm(tmp):
            with os.fdopen(fd, "wb") as fh:
                _emit(fh, content)
            if st is None:
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the mode open() would
            else:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
                if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                    os.chown(tmp, st.st_uid, st.st_gid)
            os.replace(tmp, real)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _output_error(target, exc, option) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return target


def output_file(text: str | os.PathLike[str]) -> Path:
    """The parser of every output-file option: a name that ends in a separator names a folder (``-o newdir/``), so
    one naming no folder is refused instead of becoming a file called ``newdir`` (an existing folder is refused by
    :func:`check_writable`, which names a file inside it)."""
    if isinstance(text, Path):
        return text
    text = os.fspath(text)
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if text.endswith(seps) and not os.path.isdir(text):
        raise OutputPathError(f"{text!r} ends in {text[-1]!r}, so it names a folder, and no such folder exists; give "
                              f"a file name (e.g. {text.rstrip(''.join(seps)) or 'out'}.json), or create the folder "
                              "and name a file in it")
    target = Path(text)
    with contextlib.suppress(OSError):  # what else is wrong with the path is check_writable's (or the writer's)
        real = Path(os.path.realpath(target))
        _check_takes_bytes(target, real, _stat_or_none(real), option="")
    return target


def progress_path(path: str | os.PathLike[str]) -> Path:
    """Where a command that saves as it goes (``calibrate``) keeps its unfinished work for ``path``: beside it, so
    that ``path`` itself is replaced only by a finished result (an interrupted or failed run never consumes it)."""
    target = Path(path)
    return target.with_name(target.name + ".partial")


@contextlib.contextmanager
def exclusive_writer(path: str | os.PathLike[str], *, option: str = "-o") -> Iterator[None]:
    """Hold the one-writer lock of ``path`` (``.NAME.lock`` beside it, removed on release): a second process that
    would write the same file meanwhile is refused with one line naming the holder, instead of both writing it."""
    import fcntl

    target = Path(path)
    lock = target.with_name(f".{target.name}.lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise _output_error(target, exc, option) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise OutputPathError(f"{option} {_show(target)}: another ppsim process (pid {holder}) is writing it; "
                                  f"wait for it to finish, or choose another {option}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino  # not a lock file its last holder just removed
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    _HELD_LOCKS.add(str(lock))
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode("ascii"))
        except OSError as exc:  # a full disk: one line, and the lock goes with it
            raise _output_error(target, exc, option) from None
        yield
    finally:
        _HELD_LOCKS.discard(str(lock))
        _unlink_quietly(str(lock))
        os.close(fd)


def abandon_writes() -> None:
    """Remove this process's temporary files and writer locks, for a process about to end without unwinding (a
    Ctrl-C that cannot wait for the main thread): what was written whole stays, nothing half-written is left."""
    for path in [*_LIVE_TEMPS, *_HELD_LOCKS]:
        _unlink_quietly(path)


def check_distinct(paths: Iterable[tuple[str, str | os.PathLike[str] | None]]) -> None:
    """Refuse two options that name one file, ``(option, path)`` pairs, outputs and inputs alike: an output over an
    input (``export -s my.csv -o my.csv --format json``) would replace what the command reads, and two outputs
    would replace each other. Paths are compared after symlinks are followed; ``None`` is skipped."""
    seen: dict[str, str] = {}
    for option, path in paths:
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise OutputPathError(f"{option} {_show(Path(path))}: the same file as {seen[real]}; give each its own "
                                  "file (an output never replaces an input or another output)")
        seen[real] = option


def reserve_new(path: str | os.PathLike[str], *, refusal: str, option: str = "-o") -> Path:
    """Create ``path`` as an empty file, only if nothing is there (``O_EXCL``: no race with another writer), for a
    file whose name ppsim chose: what a user keeps under that name is never replaced. ``refusal`` is the one-line
    error when the name is taken. Write it later with :func:`write_atomic`; :func:`release_unused` removes it if it
    is still empty."""
    target = Path(path)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        raise OutputPathError(refusal) from None
    except OSError as exc:
        raise _output_error(target, exc, option) from None
    os.close(fd)
    return target


def release_unused(path: str | os.PathLike[str]) -> None:
    """Remove a file :func:`reserve_new` created if nothing was written into it."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_size == 0:
            os.unlink(path)


def check_writable(path: str | os.PathLike[str], *, option: str = "-o", example: str = "out.csv") -> None:
    """Refuse, before any work is done, an output path that ``write_atomic`` could not write."""
    target = Path(path)
    real, st = _inspect(target, option, example=example)
    if st is not None and not stat.S_ISREG(st.st_mode):
        _check_takes_bytes(target, real, st, option=option)  # /dev/full
        return  # a device or FIFO is written into directly; its folder need not be writable
    if st is not None and not os.access(real, os.W_OK):
        raise OutputPathError(
            f"{option} {_show(target)}: the file is read-only; make it writable or choose another path"
        )
    parent = real.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"{option} {_show(target)}: folder {_show(parent)} does not exist; create it or choose another path"
        )
    if not os.access(parent, os.W_OK):
        raise OutputPathError(f"{option} {_show(target)}: folder {_show(parent)} is not writable; choose another path")
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(real.name)) > name_max:
        raise OutputPathError(
            f"{option} {_show(target)}: the file name is longer than this file system allows ({name_max} bytes); "
            "choose a shorter name"
        )
    _check_takes_bytes(target, real, st, option=option)


PROBE_BYTES = 4096
"""What the writability check writes into a temporary file beside the target (one file-system block): a full disk
or an exceeded quota is refused before any work, not after it."""


def _check_takes_bytes(target: Path, real: Path, st: os.stat_result | None, *, option: str) -> None:
    """Refuse a target that cannot take bytes: a character device such as /dev/full (a write of no bytes, which
    changes nothing on /dev/null or a terminal), or a folder whose file system is full (a small temporary file
    beside the target, removed at once). A FIFO or socket is left alone (opening one may wait for its reader)."""
    if st is not None and not stat.S_ISREG(st.st_mode):
        if not stat.S_ISCHR(st.st_mode):
            return
        try:
            fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # what opening it says is the writer's to report
        try:
            _write_probe(fd, b"")
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                where = f"{option} {_show(target)}" if option else _show(target)
                raise OutputPathError(f"{where}: the device takes no bytes (it is always full, as /dev/full is); "
                                      "choose a file") from None
            _refuse_full(target, exc, option)
        finally:
            os.close(fd)
        return
    if not real.parent.is_dir():
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name[:40]}.", suffix=".probe", dir=real.parent)
    except OSError as exc:
        _refuse_full(target, exc, option)
        return
    try:
        _write_probe(fd, b"\0" * PROBE_BYTES)
    except OSError as exc:
        _refuse_full(target, exc, option)
    finally:
        os.close(fd)
        _unlink_quietly(tmp)


def _write_probe(fd: int, data: bytes) -> None:
    os.write(fd, data)


def _refuse_full(target: Path, exc: OSError, option: str) -> None:
    """Raise the one-line error of a write that failed for want of space (or a read-only file system)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        raise _output_error(target, exc, option) from None


def _stat_or_none(real: Path) -> os.stat_result | None:
    try:
        return os.stat(real)
    except FileNotFoundError:
        return None


def _inspect(target: Path, option: str, *, example: str = "out.csv") -> tuple[Path, os.stat_result | None]:
    """The real path behind ``target`` (symlinks followed) and its status, or None when nothing is there yet."""
    if str(target) in ("", "."):
        raise OutputPathError(f"{option} {str(target)!r}: give a file name such as {example}")
    try:
        real = Path(os.path.realpath(target))
        st = os.stat(real)
    except FileNotFoundError:
        return real, None
    except OSError as exc:
        raise _output_error(target, exc, option) from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputPathError(
            f"{option} {_show(target)}: is a directory; give a file name such as {_show(target / example)}"
        )
    return real, st


def _emit(fh: BinaryIO, content: Content) -> None:
    if isinstance(content, str):
        fh.write(content.encode("utf-8"))
    elif isinstance(content, (bytes, bytearray, memoryview)):
        fh.write(content)
    else:
        content(fh)


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_CLEANUP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""Signals that end the process by default: the temporary file is removed before the process dies of them."""


@contextlib.contextmanager
def _removed_on_sigterm(tmp: str) -> Iterator[None]:
    """Remove ``tmp`` if SIGTERM or SIGHUP arrives meanwhile (only where no one else handles the signal)."""
    _LIVE_TEMPS.add(tmp)
    installed = []
    if threading.current_thread() is threading.main_thread():
        for signum in _CLEANUP_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, _on_sigterm)
                    installed.append(signum)
    try:
        yield
    finally:
        _LIVE_TEMPS.discard(tmp)
        for signum in installed:
            signal.signal(signum, signal.SIG_DFL)


def _on_sigterm(signum: int, frame: object) -> None:
    for tmp in list(_LIVE_TEMPS):
        _unlink_quietly(tmp)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as without the handler


def _show(path: Path | str, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 4:]}"


def _output_error(target: Path, exc: OSError, option: str) -> OSError | OutputPathError:
    """A one-line user error for the usual causes; any other OSError again, naming the user's path."""
    where = f"{option} {_show(target)}" if option else _show(target)  # the option is prefixed by the caller
    parent = _show(target.parent if str(target.parent) else Path("."))
    reasons = {
        errno.ENAMETOOLONG: "the file name is longer than the file system allows; choose a shorter name",
        errno.EACCES: "permission denied; choose a path you can write to",
        errno.EPERM: "operation not permitted; choose a path you can write to",
        errno.ENOENT: (f"folder {parent} does not exist; create it or choose another path"
                       if not Path(parent).is_dir() else
                       f"folder {parent} does not accept new files (a virtual file system such as /proc); choose "
                       "another path"),
        errno.ENOTDIR: f"{parent} is not a folder; choose another path",
        errno.EISDIR: "is a directory; give a file name",
        errno.EROFS: "the file system is read-only; choose another path",
        errno.ENOSPC: "no space left on the device; free some space or choose another folder",
        errno.EDQUOT: "disk quota exceeded; free some space or choose another folder",
        errno.ELOOP: "too many levels of symbolic links; fix the link or choose another path",
        errno.ENXIO: "cannot be opened for writing (a socket, or a device without a reader); choose a file",
    }
    reason = reasons.get(exc.errno or 0)
    if reason is None:
        return OSError(exc.errno, exc.strerror or str(exc), str(target))
    return OutputPathError(f"{where}: {reason}")


# --- sizes ------------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_SIZE_RE = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*(?:([kmgtp]i?)b?|(b))?\s*$",
                      re.IGNORECASE | re.ASCII)
_ACT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*acts?\s*$", re.IGNORECASE | re.ASCII)


@dataclass(frozen=True)
class MemoryCap:
    """A per-rank memory cap: ``amount`` activations (``unit="act"``, written ``8act``) or bytes (``unit="bytes"``).

    One activation is what :func:`ppsim.simulator` counts in ``peak_activations``: one microbatch's saved
    activations of one stage (a fraction, ``1.5act``, when recomputed activations keep a part of one). A rank
    holding several stages (chunks) holds one per chunk and microbatch. ``written`` is the text the user gave
    (not compared), so :meth:`describe` can say how it was read.
    """

    amount: float
    unit: str = "act"
    written: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.amount:g}act" if self.unit == "act" else f"{int(self.amount)}B"

    @property
    def bytes(self) -> int | None:
        """The cap in bytes, or ``None`` for a cap in activations."""
        return int(self.amount) if self.unit == "bytes" else None

    def exceeded_by(self, *, peak_activations: float, peak_bytes: int | None) -> bool:
        """Whether a rank with these peaks is over the cap (a byte cap with unknown bytes flags nothing)."""
        if self.unit == "act":
            return peak_activations > self.amount + 1e-9
        return peak_bytes is not None and peak_bytes > self.amount

    def describe(self) -> str:
        """How the cap was read, e.g. ``80GB = 80,000,000,000 bytes (GB = 10^9 bytes; GiB = 2^30)``."""
        if self.unit == "act":
            return f"{self} per rank (activations, the unit of peak_activations)"
        shown = self.written.strip() or str(self)
        m = _SIZE_RE.match(self.written)
        prefix = (m.group(2) or "").lower() if m else ""
        if prefix.endswith("i"):
            base = f"{prefix[0].upper()}iB = 2^{10 * ('kmgtp'.index(prefix[0]) + 1)} bytes"
        elif prefix:
            base = (f"{prefix.upper()}B = 10^{3 * ('kmgtp'.index(prefix) + 1)} bytes; "
                    f"write {prefix.upper()}iB for 2^{10 * ('kmgtp'.index(prefix) + 1)}")
        else:
            base = "bytes"
        return f"{shown} = {int(self.amount):,} bytes ({base}) per rank"


def parse_bytes(text: str | None, *, option: str = "--memory-cap") -> int | None:
    """A size in bytes from ``80GiB``, ``512MB``, ``1.5e9`` or ``80000000000`` (``None`` passes through).

    Refuses (one line) anything malformed, non-finite, negative, zero, under one byte, or above ``MAX_BYTES``.
    """
    if text is None:
        return None
    fix = "give a positive size in bytes such as 80000000000, 80GB or 80GiB"
    shown = _quoted(text)
    too_large = (f"{option} {shown}: larger than {MAX_BYTES} bytes (8 EiB), the largest size ppsim represents; "
                 f"{fix}")
    m = _SIZE_RE.match(text)
    if m is None:
        raise SizeError(f"{option} {shown}: not a size; {fix}")
    try:
        value = Decimal(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    except (InvalidOperation, ArithmeticError):  # 1e1000000 overflows the decimal context
        if m.group(1).startswith("-"):
            raise SizeError(f"{option} {shown}: must be positive; {fix}") from None
        raise SizeError(too_large) from None
    if not value.is_finite() or value > MAX_BYTES:
        raise SizeError(too_large)
    if value <= 0:
        raise SizeError(f"{option} {shown}: must be positive; {fix}")
    if value < 1:
        raise SizeError(f"{option} {shown}: less than one byte; {fix}")
    return int(value)


def _quoted(text: str, limit: int = 40) -> str:
    """A user's value for a one-line message: quoted, a long one cut in the middle with its length."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:16]!r}...{text[-8:]!r} ({len(text):,} characters)"


def parse_memory_cap(text: str | None, *, option: str = "--memory-cap") -> MemoryCap | None:
    """A cap in bytes (see :func:`parse_bytes`: ``80GB`` is 10^9-byte units, ``80GiB`` 2^30) or in activations per
    rank, written ``8act`` (``None`` passes through). Every command reads ``--memory-cap`` with this function."""
    if text is None:
        return None
    m = _ACT_RE.match(text)
    if m is None:
        return MemoryCap(parse_bytes(text, option=option) or 0, "bytes", written=text)
    whole = m.group(1).split(".")[0].lstrip("0")
    if len(whole) > 12 or len(m.group(1)) > 40:  # thousands of digits are slow to convert; no rank holds 10**12
        raise SizeError(f"{option} {_quoted(text)}: more than 10**12 activations per rank or too many digits; give a "
                        "count such as 8act")
    count = float(m.group(1)) if "." in m.group(1) else int(whole or "0")
    if count < 1:
        raise SizeError(f"{option} {text!r}: an activation cap must be at least 1act; e.g. 8act")
    return MemoryCap(count, "act", written=text)


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``: binary units, two decimals (bytes below 1 KiB as a whole number)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
