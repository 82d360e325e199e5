"""ppsim.io: the one atomic writer (files that are not ppsim's stay intact), the writability check, byte sizes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import OutputPathError, SizeError
from ppsim.io import MemoryCap, check_writable, fmt_bytes, parse_bytes, parse_memory_cap, write_atomic


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name[:40]}."))


# --- the writer -------------------------------------------------------------------------------------------------
def test_new_file_gets_the_umask_mode_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        out = write_atomic(tmp_path / "a.csv", "x\n")
    finally:
        os.umask(old)
    assert out == tmp_path / "a.csv"
    assert (tmp_path / "a.csv").read_text() == "x\n"
    assert stat.S_IMODE((tmp_path / "a.csv").stat().st_mode) == 0o644


def test_existing_file_keeps_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "secret.json"
    target.write_text("old")
    target.chmod(0o600)
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another owner")
def test_existing_file_keeps_its_owner_when_root_writes_it(tmp_path: Path) -> None:
    target = tmp_path / "theirs.csv"
    target.write_text("old")
    os.chown(target, 12345, 23456)
    write_atomic(target, "new")
    assert (target.stat().st_uid, target.stat().st_gid) == (12345, 23456)
    assert target.read_text() == "new"


def test_symlink_is_written_through_to_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real.csv"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink(), "the link itself must stay a link"
    assert real.read_text() == "new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640


def test_fifo_is_written_into_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(timeout=30)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode), "the FIFO must still be a FIFO"
    assert leftovers(tmp_path, "pipe") == []


def test_character_device_is_written_into_not_replaced() -> None:
    write_atomic("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_directory_is_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match=r"^-o .*: is a directory; give a file name such as .*out\.csv$"):
        write_atomic(tmp_path, "x")
    with pytest.raises(OutputPathError, match="is a directory"):
        check_writable(tmp_path)


def test_missing_folder_names_the_users_path_not_the_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "nope" / "out.csv"
    with pytest.raises(OutputPathError) as info:
        write_atomic(target, "x")
    message = str(info.value)
    assert message.startswith(f"-o {target}: folder {target.parent} does not exist")
    assert ".tmp" not in message and "\n" not in message


def test_name_too_long_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / ("n" * 300 + ".csv")
    with pytest.raises(OutputPathError, match="longer than the file system allows; choose a shorter name"):
        write_atomic(target, "x")
    with pytest.raises(OutputPathError, match="choose a shorter name"):
        check_writable(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_folder_is_one_line(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputPathError, match="permission denied; choose a path you can write to"):
            write_atomic(locked / "out.csv", "x")
        with pytest.raises(OutputPathError, match="is not writable"):
            check_writable(locked / "out.csv")
    finally:
        locked.chmod(0o700)


def test_temp_file_is_removed_when_writing_fails(tmp_path: Path) -> None:
    def boom(fh: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "out.png", boom)
    assert list(tmp_path.iterdir()) == []


def test_existing_file_is_untouched_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "keep.csv"
    target.write_text("precious")

    def boom(fh: object) -> None:
        fh.write(b"half")  # type: ignore[attr-defined]
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        write_atomic(target, boom)
    assert target.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.csv"]


def test_sigterm_during_a_write_removes_the_temp_file(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys\n"
        "from ppsim.io import write_atomic\n"
        "def hang(fh):\n"
        "    fh.write(b'partial')\n"
        "    print('writing', flush=True)\n"
        "    signal.pause()\n"
        "write_atomic(sys.argv[1], hang)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out.png")], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"writing\n"
    assert len(list(tmp_path.iterdir())) == 1, "the temp file exists while writing"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_cli_output_onto_a_symlink_writes_the_target(tmp_path: Path) -> None:
    real = tmp_path / "real.csv"
    real.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    result = CliRunner().invoke(app, ["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(link)])
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert real.read_text().startswith("0F0")


def test_cli_output_to_a_directory_exits_2_with_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "is a directory" in result.output


# --- sizes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5e9", 1_500_000_000),
     ("80000000000", 80_000_000_000), ("1024", 1024), ("2kib", 2048), ("7b", 7), ("1.5", 1), ("9223372036854775807",
                                                                                              2**63 - 1)],
)
def test_parse_bytes_accepts_sizes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "rule"),
    [("1e400", "larger than"), ("9223372036854775808", "larger than"), ("0.5", "less than one byte"),
     ("0", "must be positive"), ("-5GB", "must be positive"), ("nan", "not a size"), ("inf", "not a size"),
     ("", "not a size"), ("80 apples", "not a size"), ("\u0668GB", "not a size")],
)
def test_parse_bytes_refuses_with_one_line(text: str, rule: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_bytes(text)
    message = str(info.value)
    assert message.startswith(f"--memory-cap {text!r}: ") and rule in message and "\n" not in message


def test_parse_bytes_passes_none_through() -> None:
    assert parse_bytes(None) is None


def test_memory_cap_in_activations_is_a_distinct_unit() -> None:
    assert parse_memory_cap("8act") == MemoryCap(8, "act")
    assert parse_memory_cap("8 acts") == MemoryCap(8, "act")
    assert str(MemoryCap(8, "act")) == "8act"
    assert parse_memory_cap("80GiB") == MemoryCap(80 * 2**30, "bytes")
    with pytest.raises(SizeError, match="at least 1act"):
        parse_memory_cap("0act")


def test_memory_cap_says_whether_gb_or_gib_was_read() -> None:
    decimal, binary = parse_memory_cap("80GB"), parse_memory_cap("80GiB")
    assert decimal == MemoryCap(80 * 10**9, "bytes") and binary == MemoryCap(80 * 2**30, "bytes")
    assert "80,000,000,000 bytes (GB = 10^9 bytes; write GiB for 2^30)" in decimal.describe()
    assert "85,899,345,920 bytes (GiB = 2^30 bytes)" in binary.describe()


def test_search_and_simulate_read_the_same_cap_type() -> None:
    from ppsim.search import MemoryCap as SearchCap
    from ppsim.search import parse_memory_cap as search_parse

    assert SearchCap is MemoryCap
    for text in ("8act", "1.5act", "80GB", "80GiB", "1e9"):
        assert search_parse(text) == parse_memory_cap(text)


@pytest.mark.parametrize("command", [["simulate"], ["plot", "--memory", "-o", "{tmp}/x.png"]])
def test_cli_memory_cap_in_activations_is_read_by_simulate_and_plot(command: list[str], tmp_path: Path) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    result = CliRunner().invoke(app, [*args, "-s", "1F1B", "-r", "2", "-m", "4", "--memory-cap", "1act"])
    assert result.exit_code == 0, result.output
    assert "not a size" not in result.output


def test_simulate_flags_ranks_over_an_activation_cap() -> None:
    from ppsim import get_schedule, simulate

    result = simulate(get_schedule("1F1B", 2, 4), memory_cap=parse_memory_cap("1act"))
    assert [p.over_memory_cap for p in result.per_rank] == [True, False]
    assert result.over_memory_cap == (0,) and result.memory_cap_bytes is None
    shown = CliRunner().invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--memory-cap", "1act"])
    assert "2 > cap" in shown.output and "memory cap: 1act per rank" in shown.output


def test_cli_memory_cap_overflow_exits_2() -> None:
    result = CliRunner().invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--memory-cap", "1e400"])
    assert result.exit_code == 2
    assert "larger than" in result.output and "Traceback" not in result.output


def test_fmt_bytes() -> None:
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(80 * 2**30) == "80.00 GiB"
