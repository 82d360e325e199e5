"""`ppsim plot` and `ppsim report` through the command line (typer's CliRunner)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

HEADLINE = ["plot", "-s", "DualPipeV", "-r", "4", "-m", "10"]
MAGIC = {".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF", ".html": b"<html"}


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf", ".html"])
def test_plot_writes_each_format_and_prints_its_path(runner, tmp_path, suffix):
    out = tmp_path / f"chart{suffix}"
    dpi = [] if suffix == ".html" else ["--dpi", "60"]  # an html chart has no resolution: --dpi is refused there
    result = runner.invoke(app, [*HEADLINE, "-o", str(out), *dpi])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    head = out.read_bytes()[:200]
    assert head.startswith(MAGIC[suffix]) or (suffix == ".html" and MAGIC[suffix] in head.lower())


def test_plot_default_file_is_schedule_ranks_mb_png_in_the_current_folder(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, HEADLINE)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "DualPipeV_r4_m10.png"
    assert (tmp_path / "DualPipeV_r4_m10.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("flags", [["--memory"], ["--comm"], ["--memory", "--comm"]])
@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_plot_memory_and_comm_options(runner, tmp_path, flags, suffix):
    out = tmp_path / f"c{suffix}"
    dpi = [] if suffix == ".html" else ["--dpi", "60"]
    result = runner.invoke(app, [*HEADLINE, "--costs", "comm=0.2", *flags, "-o", str(out), *dpi])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0


def test_dpi_sets_png_resolution(runner, tmp_path):
    from matplotlib.image import imread

    small, large = tmp_path / "a.png", tmp_path / "b.png"
    assert runner.invoke(app, [*HEADLINE, "-o", str(small), "--dpi", "50"]).exit_code == 0
    assert runner.invoke(app, [*HEADLINE, "-o", str(large), "--dpi", "100"]).exit_code == 0
    w_small, w_large = imread(small).shape[1], imread(large).shape[1]
    assert abs(w_large - 2 * w_small) <= 2


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("chart.jpg", "unknown extension '.jpg'"),
        ("chart", "unknown extension '(none)'"),
        ("no/such/folder/chart.png", "does not exist"),
        (".", "unknown extension"),
    ],
)
def test_plot_bad_output_is_one_line_exit_2(runner, tmp_path, monkeypatch, target, words):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [*HEADLINE, "-o", target])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("Error:")
    assert "Traceback" not in result.output


def test_plot_into_a_folder_named_like_a_file_is_one_line_exit_2(runner, tmp_path):
    folder = tmp_path / "taken.png"
    folder.mkdir()
    result = runner.invoke(app, [*HEADLINE, "-o", str(folder)])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "directory" in result.stderr


def test_report_writes_one_page_with_a_row_for_the_schedule_that_cannot_run(runner, tmp_path):
    out = tmp_path / "report.html"
    args = ["report", "-s", "DualPipeV,1F1B,NoSuchSchedule", "-r", "4", "-m", "10", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    text = out.read_text()
    assert "NoSuchSchedule" in text and "cannot run this configuration" in text
    assert text.count("plotly.js v") == 1


def test_report_needs_an_html_name(runner, tmp_path):
    result = runner.invoke(app, ["report", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(tmp_path / "r.png")])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and ".html" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "after"), [(signal.SIGTERM, 1.2), (signal.SIGINT, 0.8)], ids=["SIGTERM", "SIGINT"])
def test_a_plot_ended_by_a_signal_leaves_no_temporary_file_and_no_partial_png(tmp_path, sig, after):
    # wherever the signal lands (importing, drawing, writing, or after the end) the folder holds the whole
    # figure or nothing: never a hidden .out.png.*.tmp, never a truncated out.png
    out = tmp_path / "out.png"
    proc = subprocess.Popen([sys.executable, "-m", "ppsim.cli", "plot", "-s", "DualPipeV", "-r", "16", "-m", "512",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=after)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        proc.wait(timeout=60)
    assert [p.name for p in tmp_path.iterdir() if p.name != "out.png"] == []
    if out.exists():
        data = out.read_bytes()
        assert data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82")
