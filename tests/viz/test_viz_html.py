"""Interactive HTML (plotly) and the comparison report: traces, hover fields, offline pages."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from viz_helpers import profile_like_costs

from ppsim.costs import parse_costs
from ppsim.formats import read_csv
from ppsim.ir import ActionType
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.viz import interactive, plot_to_file, report

ORANGE, GREEN, BLUE = "#F1B238", "#7FD650", "#77BEFA"


@pytest.fixture(scope="module")
def dualpipev(reference_dir: Path):
    return simulate(read_csv(reference_dir / "dualpipev_4ranks_10mb.csv"))


def bars(fig) -> dict:
    return {t.meta[0]: t for t in fig.data if t.type == "bar"}


def test_one_trace_per_op_kind_not_per_rectangle(dualpipev):
    fig = interactive.gantt_figure(dualpipev)
    traces = bars(fig)
    assert set(traces) == {"F", "B", "I", "W", "pair-F", "pair-B", "pair-border"}
    assert len(fig.data) == 7
    want = Counter()
    for row in dualpipev.schedule.actions:
        for a in row:
            if a.type is ActionType.OVERLAP_F_B:
                want["pair-F"] += 1
                want["pair-B"] += 1
                want["pair-border"] += 1
            else:
                want[a.type.value] += 1
    assert {k: len(t.base) for k, t in traces.items()} == dict(want)
    colors = {k: t.marker.color for k, t in traces.items() if k != "pair-border"}
    assert colors == {"F": ORANGE, "B": GREEN, "I": GREEN, "W": BLUE, "pair-F": ORANGE, "pair-B": GREEN}


def test_bars_sit_at_simulated_times_on_their_rank(dualpipev):
    traces = bars(interactive.gantt_figure(dualpipev))
    s = dualpipev.schedule
    want = sorted(
        (r, dualpipev.starts[r][p], dualpipev.ends[r][p])
        for r, row in enumerate(s.actions) for p, a in enumerate(row) if a.type is ActionType.F
    )
    t = traces["F"]
    base, y = np.asarray(t.base), np.asarray(t.y)
    got = sorted(zip(y.tolist(), base.tolist(), (base + np.asarray(t.x)).tolist()))
    assert np.allclose(np.array(got), np.array(want))


def test_hover_names_action_stage_microbatch_start_end_duration(dualpipev):
    fig = interactive.gantt_figure(dualpipev)
    t = bars(fig)["pair-B"]
    for word in ("stage", "microbatch", "start", "end", "duration"):
        assert word in t.hovertemplate
    row = t.customdata[0]
    action, stage, mb, start, end, duration = row[:6]
    assert action.endswith("OVERLAP_F_B") and f"{stage}B{mb}" in action
    assert end - start == pytest.approx(duration) == pytest.approx(3.0)  # default FB = F + B


def test_digits_in_every_bar_white_for_the_second_chunk(dualpipev):
    fig = interactive.gantt_figure(dualpipev)
    for key, t in bars(fig).items():
        if key == "pair-border":
            continue
        assert list(t.text) == [str(c[2]) for c in t.customdata]
        colors = list(t.textfont.color)
        second = [c[1] >= 4 for c in t.customdata]  # DualPipeV, 4 ranks: stages 4..7 are the V's return
        assert colors == ["#FFFFFF" if w else "#000000" for w in second]


def test_legend_toggles_group_pair_halves_and_border(dualpipev):
    traces = bars(interactive.gantt_figure(dualpipev))
    assert {traces[k].legendgroup for k in ("pair-F", "pair-B", "pair-border")} == {"pair"}
    shown = [t.name for t in traces.values() if t.showlegend is not False]
    assert shown == [
        "Forward", "Backward", "Backward for input", "Backward for weights", "Overlapped forward & backward",
    ]


def test_memory_panel_one_line_per_rank_sharing_the_time_axis(dualpipev):
    fig = interactive.gantt_figure(dualpipev, memory=True)
    mem = [t for t in fig.data if t.meta and t.meta[0] == "memory"]
    assert len(mem) == 4
    assert [int(max(t.y)) for t in mem] == [p.peak_activations for p in dualpipev.per_rank]
    assert {t.xaxis for t in mem} == {"x2"} and fig.layout.xaxis.matches == "x2"  # zooming one zooms both


def test_comm_hand_offs_are_one_trace():
    result = simulate(get_schedule("1F1B", 4, 4), parse_costs("comm=0.5"))
    fig = interactive.gantt_figure(result, comm=True)
    comm = [t for t in fig.data if t.meta and t.meta[0] == "comm"]
    assert len(comm) == 1
    assert np.count_nonzero(~np.isnan(np.asarray(comm[0].x, float))) == 2 * len(result.transfers())


def test_html_file_embeds_plotly_js_and_fetches_nothing(dualpipev, tmp_path):
    path = plot_to_file(dualpipev, tmp_path / "g.html", memory=True)
    text = path.read_text()
    assert text.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]+src=", text)  # the browser test also runs it with the network cut


def test_twenty_thousand_actions_render_small_with_one_trace_per_kind(tmp_path):
    # the time this takes is measured by bench/bench_plot.py, not asserted here
    result = simulate(get_schedule("DualPipeV", 32, 256))
    assert result.schedule.num_actions >= 20_000
    path = plot_to_file(result, tmp_path / "big.html")
    assert path.stat().st_size <= 25 * 2**20
    assert len(interactive.gantt_figure(result).data) <= 7


# -- report ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def entries():
    costs = parse_costs(None)
    out = [(name, simulate(get_schedule(name, 4, 8), costs)) for name in ("1F1B", "DualPipeV", "ZBVZeroBubble")]
    out.append(("Nope", "unknown schedule 'Nope': choose one of ..."))
    return out


def test_report_ranks_by_makespan_and_explains_unbuildable(entries):
    rows = report.summary_rows(entries, None)
    ok = [r for r in rows if "why" not in r]
    makespans = sorted(r.makespan for _, r in entries if not isinstance(r, str))
    assert [float(r["makespan"].split(" ")[0]) for r in ok] == makespans
    assert rows[-1]["schedule"] == "Nope" and "unknown schedule" in rows[-1]["why"]


def test_report_page_is_self_contained_with_plotly_once(entries, tmp_path):
    path = report.write_report(entries, tmp_path / "r.html", costs=parse_costs(None), memory_cap_bytes=None)
    text = path.read_text()
    assert text.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]+src=", text)
    assert text.count("Plotly.newPlot(") == 3 + 2  # a Gantt per runnable schedule + bubble + peak memory
    assert "cannot run this configuration: unknown schedule" in text
    for heading in ("Ranking", "Gantt charts", "Bubble and peak memory per rank", "Costs used", "Versions"):
        assert heading in text


def test_report_gantts_share_one_time_axis(entries):
    results = report.ranked(entries)
    figs = report.gantt_figures(results)
    longest = max(r.makespan for _, r in results)
    assert [tuple(f.layout.xaxis.range) for f in figs] == [(0, longest)] * len(results)


def test_report_with_no_runnable_schedule_still_writes_a_page(tmp_path):
    path = report.write_report([("A", "too few microbatches"), ("B", "odd ranks")], tmp_path / "r.html",
                               costs=parse_costs(None))
    text = path.read_text()
    assert "too few microbatches" in text and "odd ranks" in text


def test_report_flags_memory_cap_only_with_bytes(entries):
    rows = report.summary_rows(entries, 10**9)
    assert all(r["over memory cap"] == "needs a profile" for r in rows if "why" not in r)


def test_report_names_costs_and_versions_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from ppsim.costs import parse_costs\n"
        "from ppsim.schedules import get_schedule\n"
        "from ppsim.simulator import simulate\n"
        "from ppsim.viz.report import write_report\n"
        "c = parse_costs('F=1,B=2,comm=0.25')\n"
        f"write_report([('1F1B', simulate(get_schedule('1F1B', 2, 4), c))], r'{tmp_path / 'r.html'}', costs=c)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    text = (tmp_path / "r.html").read_text()
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    assert f"<td class=\"key\">torch</td><td class=\"key\">{torch_version}</td>" in text
    assert "F=1,B=2,comm=0.25" in text and "<td class=\"key\">comm</td><td class=\"key\">0.25</td>" in text


def test_report_flags_ranks_over_the_memory_cap_with_profile_costs():
    cap = 9 * 2**30
    result = simulate(get_schedule("DualPipeV", 4, 10), profile_like_costs(8), memory_cap_bytes=cap)
    over = [p.rank for p in result.per_rank if p.peak_memory_bytes > cap]
    assert over  # the fixture is built to overflow
    row = report.summary_rows([("DualPipeV", result)], cap)[0]
    assert f"{len(over)} rank(s): {' '.join(map(str, over))}" in row["over memory cap"]
    assert "GiB" in row["peak memory"] and "ms" in row["makespan"]
