"""Pages opened in a real browser (headless Chromium), offline: they render, log no errors, and look right."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.viz import plot_to_file
from ppsim.viz.report import write_report

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium not installed (apt-get install chromium)"),
]

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: a page that needs a CDN fails here
    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
]
PALETTE = {"orange": (0xF1, 0xB2, 0x38), "green": (0x7F, 0xD6, 0x50), "blue": (0x77, 0xBE, 0xFA)}


def chromium(tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    return subprocess.run(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )


def console_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln and ("Uncaught" in ln or "rror" in ln)]


def colour_counts(png: Path) -> dict[str, int]:
    from matplotlib.image import imread

    img = (imread(png)[:, :, :3] * 255).round().astype(int)
    return {
        name: int((np.abs(img - np.array(rgb)).max(axis=2) <= 6).sum()) for name, rgb in PALETTE.items()
    }


REPORT_SCHEDULES = ("1F1B", "ZBVZeroBubble", "DualPipeV")


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pages")
    dualpipev = simulate(get_schedule("DualPipeV", 4, 10))
    # 16 microbatches: on the shared time axis ZBV's and DualPipeV's cells are narrow for "10".."15"
    entries = [(n, simulate(get_schedule(n, 4, 16), dualpipev.costs)) for n in REPORT_SCHEDULES]
    entries.append(("DualPipe", "DualPipe needs an even number of ranks"))
    return {
        "plot": plot_to_file(dualpipev, folder / "plot.html", memory=True),
        "report": write_report(entries, folder / "report.html", costs=dualpipev.costs),
    }


@pytest.fixture(scope="module")
def dumps(pages, tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each page opened once in a 1600 px wide window, its DOM after plotly drew it."""
    folder = tmp_path_factory.mktemp("dumps")
    return {name: chromium(folder, page, "--dump-dom", "--window-size=1600,1200") for name, page in pages.items()}


def test_console_scan_catches_a_broken_page(tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>Plotly.newPlot('x', [])</script></body></html>")
    assert console_errors(chromium(tmp_path, broken, "--dump-dom").stderr)


@pytest.mark.parametrize(("page", "charts"), [("plot", 1), ("report", len(REPORT_SCHEDULES) + 2)])
def test_page_renders_offline_without_console_errors(dumps, page, charts):
    run = dumps[page]
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_errors(run.stderr) == []
    assert run.stdout.count('class="plot-container plotly"') == charts  # plotly drew every chart
    assert "<rect" in run.stdout or "<path" in run.stdout


@pytest.mark.parametrize("page", ["plot", "report"])
def test_screenshot_shows_the_gantt_colours(pages, tmp_path, page):
    shot = tmp_path / f"{page}.png"
    run = chromium(tmp_path, pages[page], f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.is_file(), run.stderr[-2000:]
    counts = colour_counts(shot)
    assert counts["orange"] > 2000 and counts["green"] > 2000 and counts["blue"] > 300, counts


def bar_labels(dom: str) -> list[tuple[str, bool]]:
    """``(text, shown)`` for every label plotly drew inside a bar (a hidden one is scaled to 0)."""
    found = re.findall(r'<text class="bartext[^"]*"[^>]*?transform="([^"]*)"[^>]*>(?:<tspan[^>]*>)?([^<]*)', dom)
    return [(text, "scale(0)" not in transform) for transform, text in found]


def test_report_at_1600_px_shows_two_digit_microbatch_labels(dumps):
    labels = bar_labels(dumps["report"].stdout)
    num_cells = sum(len(a.computations) for n in REPORT_SCHEDULES for row in get_schedule(n, 4, 16).actions
                    for a in row)
    assert len(labels) == num_cells
    assert [text for text, shown in labels if not shown] == []
    assert {text for text, _ in labels} >= {str(m) for m in range(10, 16)}


def test_the_plan_page_draws_its_seconds_and_unit_cost_frontiers_apart_offline(tmp_path):
    """A plan with candidates timed in seconds and others in unit costs: the page opens offline with no console
    error, plotly draws both frontiers (each in its own container, its own unit on its axis), and the launch line
    is on the page whole."""
    from job.test_plan_units import _mixed_plan

    from ppsim.viz.plan_page import render_plan_page

    result = _mixed_plan()
    page = tmp_path / "plan.html"
    page.write_text(render_plan_page(result, job="toy:job"), encoding="utf-8")
    run = chromium(tmp_path, page, "--dump-dom", "--window-size=1400,1200")
    assert run.returncode == 0 and console_errors(run.stderr) == [], run.stderr[-2000:]
    dom = run.stdout
    for panel in ('id="frontier"', 'id="frontier-unit"'):
        at = dom.index(panel)
        assert 'class="plot-container plotly"' in dom[at:at + 400], panel  # plotly drew it
    assert "step (s)" in dom and "relative step (unit costs, not seconds)" in dom
    launch = " ".join(f"<span>{o}</span>" for o in result.best.overrides)
    assert f'<pre class="launch">{launch}</pre>' in dom and "pre.launch { white-space: pre-wrap;" in dom
    shot = tmp_path / "plan.png"
    chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1400,1200")
    assert shot.is_file() and shot.stat().st_size > 10_000
