"""The static Gantt (matplotlib): structure checked through its artists, not its pixels."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from viz_helpers import profile_like_costs

from ppsim.costs import StageCosts, parse_costs
from ppsim.formats import read_csv
from ppsim.ir import ActionType
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.viz import gantt, plot_to_file
from ppsim.viz._data import cells as cells_of

ORANGE, GREEN, BLUE = "#f1b238", "#7fd650", "#77befa"
KIND_COLOR = {"F": ORANGE, "B": GREEN, "I": GREEN, "W": BLUE}


@pytest.fixture(scope="module")
def dualpipev(reference_dir: Path):
    return simulate(read_csv(reference_dir / "dualpipev_4ranks_10mb.csv"))


def collection(fig: Figure, gid: str):
    found = [c for ax in fig.axes for c in ax.collections if c.get_gid() == gid]
    return found[0] if found else None


def rect_bounds(coll) -> np.ndarray:
    """``(x0, x1, y_center)`` per rectangle of a PolyCollection."""
    out = []
    for path in coll.get_paths():
        v = path.vertices
        out.append((v[:, 0].min(), v[:, 0].max(), (v[:, 1].min() + v[:, 1].max()) / 2))
    return np.array(out).reshape(-1, 3)


def labels_of(fig: Figure) -> list[tuple[int, str, str]]:
    """``(row, text, digit colour)`` of every microbatch id drawn."""
    coll = collection(fig, "labels")
    if coll is None:
        return []
    rows = [int(round(y)) for y in coll.get_offsets()[:, 1]]
    colors = [to_hex(c) for c in coll.get_facecolors()]
    assert len(rows) == len(coll.texts) == len(colors)
    return list(zip(rows, coll.texts, colors))


def expected_computations(schedule) -> Counter:
    """(group, rank) counts straight from the schedule's actions."""
    counts: Counter = Counter()
    for rank, row in enumerate(schedule.actions):
        for action in row:
            if action.type is ActionType.OVERLAP_F_B:
                counts["pair-F", rank] += 1
                counts["pair-B", rank] += 1
            else:
                counts[action.type.value, rank] += 1
    return counts


def test_one_row_per_rank_labelled_device(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"Device {r}" for r in range(4)]
    assert ax.get_ylim() == (3.5, -0.5)  # rank 0 on top, rows touching
    assert gantt.plot_gantt(dualpipev, row_label="Rank").axes[0].get_yticklabels()[3].get_text() == "Rank 3"


def test_cells_per_colour_match_the_schedule(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    want = expected_computations(dualpipev.schedule)
    groups = {g for g, _ in want}
    assert groups == {"F", "B", "I", "W", "pair-F", "pair-B"}
    for group in groups:
        coll = collection(fig, f"cells:{group}")
        kind = "F" if group in ("F", "pair-F") else ("B" if group == "pair-B" else group)
        assert {to_hex(c) for c in coll.get_facecolors()} == {KIND_COLOR[kind]}
        rows = Counter(int(round(y)) for y in rect_bounds(coll)[:, 2])
        assert rows == {r: n for (g, r), n in want.items() if g == group}


def test_cell_widths_are_simulated_durations_and_idle_is_blank(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    covered = Counter()
    for gid in ("cells:F", "cells:B", "cells:I", "cells:W", "cells:pair-F", "cells:pair-B"):
        for x0, x1, y in rect_bounds(collection(fig, gid)):
            covered[int(round(y))] += x1 - x0
    for stats in dualpipev.per_rank:
        assert covered[stats.rank] == pytest.approx(stats.busy)
    idle = collection(fig, "idle")
    assert {to_hex(c) for c in idle.get_facecolors()} == {"#ffffff"}
    idle_time = Counter()
    for x0, x1, y in rect_bounds(idle):
        idle_time[int(round(y))] += x1 - x0
    for stats in dualpipev.per_rank:
        assert idle_time[stats.rank] == pytest.approx(stats.idle)


def test_overlapped_pairs_share_one_black_border(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    s = dualpipev.schedule
    pairs = [(r, p) for r, row in enumerate(s.actions) for p, a in enumerate(row) if a.type is ActionType.OVERLAP_F_B]
    borders = collection(fig, "pair-borders")
    assert len(borders.get_paths()) == len(pairs) > 0
    assert to_hex(borders.get_edgecolors()[0]) == "#000000"
    assert borders.get_facecolors().size == 0 or all(c[3] == 0 for c in borders.get_facecolors())
    assert all(w == 0 for w in collection(fig, "cells:pair-F").get_linewidths())
    assert all(w == 0 for w in collection(fig, "cells:pair-B").get_linewidths())
    assert all(w > 0 for w in collection(fig, "cells:F").get_linewidths())
    f_half, b_half = rect_bounds(collection(fig, "cells:pair-F")), rect_bounds(collection(fig, "cells:pair-B"))
    for (r, p), (bx0, bx1, by), (fx0, fx1, _), (gx0, gx1, _) in zip(pairs, rect_bounds(borders), f_half, b_half):
        assert (bx0, bx1, by) == pytest.approx((dualpipev.starts[r][p], dualpipev.ends[r][p], r))
        assert fx0 == pytest.approx(bx0) and fx1 == pytest.approx(gx0) and gx1 == pytest.approx(bx1)
        assert fx1 - fx0 == pytest.approx((bx1 - bx0) / 3)  # F : B = 1 : 2 under the default costs


def test_every_cell_shows_its_microbatch_second_chunk_in_white(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    texts = labels_of(fig)
    s = dualpipev.schedule
    num_cells = sum(len(a.computations) for row in s.actions for a in row)
    assert len(texts) == num_cells
    got = Counter(texts)
    centres = sorted(map(tuple, collection(fig, "labels").get_offsets().round(9).tolist()))
    want_centres = sorted(
        (round((dualpipev.starts[r][p] + dualpipev.ends[r][p]) / 2, 9), float(r))
        for r, row in enumerate(s.actions) for p, a in enumerate(row) if a.type is not ActionType.OVERLAP_F_B
    )
    assert [c for c in centres if c in set(want_centres)] == want_centres  # single cells: digit at the centre
    want = Counter()
    for rank, row in enumerate(s.actions):
        for action in row:
            for comp in action.computations:
                white = comp.stage >= s.num_ranks  # DualPipeV: rank r holds stage r and the V's return 2R-1-r
                want[rank, str(comp.microbatch), "#ffffff" if white else "#000000"] += 1
    assert got == want


def test_two_digit_labels_in_narrow_cells_are_set_smaller_not_dropped():
    # W costs half a forward: a W cell is half a unit wide, too narrow for "12" at the chart's label size
    result = simulate(get_schedule("DualPipeV", 4, 16), parse_costs("F=1,B=2,I=1.5,W=0.5,FB=2.5"))
    fig = gantt.plot_gantt(result)
    labels = collection(fig, "labels")
    num_cells = sum(len(a.computations) for row in result.schedule.actions for a in row)
    assert len(labels.texts) == num_cells  # every cell keeps its microbatch id
    w_cells = {(round((c.start + c.end) / 2, 6), c.rank) for c in cells_of(result) if c.group == "W"}
    sizes = {}
    for (x, y), text, size in zip(labels.get_offsets(), labels.texts, labels.fontsizes):
        if (round(x, 6), int(y)) in w_cells:
            sizes.setdefault(len(text), set()).add(size)
    assert max(sizes[2]) < labels.fontsize and min(sizes[2]) >= gantt.MIN_CELL_LABEL_FONT
    assert max(sizes[1]) > max(sizes[2])  # one digit needs less room than two


def test_legend_below_names_kinds_and_digit_colours(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    leg = fig.axes[0].get_legend()
    labels = [t.get_text() for t in leg.get_texts()]
    assert labels == [
        "Forward", "Backward", "Backward for input", "Backward for weights", "Overlapped forward & backward",
        "Microbatch, 1st chunk", "Microbatch, 2nd chunk",
    ]
    fig.canvas.draw()
    legend_box = leg.get_window_extent()
    axes_box = fig.axes[0].get_window_extent()
    assert legend_box.y1 < axes_box.y0  # below the chart


def test_legend_lists_only_what_the_schedule_holds():
    fig = gantt.plot_gantt(simulate(get_schedule("GPipe", 2, 2)))
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["Forward", "Backward"]


def test_dualpipe_reverse_direction_in_white_digits():
    result = simulate(get_schedule("DualPipe", 4, 8))
    fig = gantt.plot_gantt(result)
    s = result.schedule
    texts = labels_of(fig)
    white = sum(color == "#ffffff" for _, _, color in texts)
    want = sum(1 for row in s.actions for a in row for c in a.computations if s.direction(c.stage) == 1)
    assert white == want > 0
    assert "Microbatch, reverse direction" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_title_names_schedule_size_makespan_and_bubble(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    text = " ".join(t.get_text() for t in fig.texts)
    for part in ("dualpipev_4ranks_10mb", "4 ranks", "10 microbatches", "makespan 66 units", "bubble 9.1%"):
        assert part in text


def title_of(fig: Figure):
    return next(t for t in fig.texts if t.get_gid() == "title")


def two_rank_csv(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", encoding="utf-8")
    return path


def test_a_long_schedule_name_wraps_and_stays_inside_a_short_chart(tmp_path):
    name = "sweep_ranks2_mb2_interleaved_variant_with_a_very_long_descriptive_file_name_final_v3.csv"
    fig = gantt.plot_gantt(simulate(read_csv(two_rank_csv(tmp_path, name))))
    fig.canvas.draw()
    title = title_of(fig)
    box, figure_box = title.get_window_extent(), fig.bbox
    assert box.x0 >= figure_box.x0 and box.x1 <= figure_box.x1 and box.y1 <= figure_box.y1
    assert box.y0 > fig.axes[0].get_window_extent().y1  # above the chart, not over it
    lines = title.get_text().split("\n")
    assert len(lines) == 2 and lines[1].startswith("2 ranks, 2 microbatches, makespan")
    assert lines[0].startswith("sweep_ranks2") and lines[0].endswith("final_v3:")


def test_a_short_title_stays_one_line_at_full_size(dualpipev):
    title = title_of(gantt.plot_gantt(dualpipev))
    assert "\n" not in title.get_text() and title.get_fontsize() == 11


def test_a_name_in_a_script_the_fonts_lack_draws_without_a_warning(tmp_path):
    import warnings

    from ppsim.viz import _text

    name = "流水线.csv"
    result = simulate(read_csv(two_rank_csv(tmp_path, name)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)" when it draws boxes
        fig = gantt.plot_gantt(result)
        plot_to_file(result, tmp_path / "cjk.png")
        plot_to_file(result, tmp_path / "cjk.svg")
    text = title_of(fig).get_text()
    if all(_text._fallback_for(ord(ch)) for ch in "流水线"):  # a CJK font is installed: drawn with it
        assert text.startswith("流水线")
    else:  # none is: written as escapes, never as boxes
        assert text.startswith("\\u6d41\\u6c34\\u7ebf")
    assert (tmp_path / "cjk.png").stat().st_size > 0


def test_draws_into_a_given_axes_and_returns_its_figure(dualpipev):
    fig = Figure(figsize=(12, 3))
    ax = fig.add_subplot()
    assert gantt.plot_gantt(dualpipev, ax=ax) is fig
    assert collection(fig, "cells:F") is not None
    assert ax.get_title(loc="left").startswith("dualpipev_4ranks_10mb")


def test_time_axis_in_cost_units_or_scaled_seconds(dualpipev):
    fig = gantt.plot_gantt(dualpipev)
    ax = fig.axes[0]
    assert ax.get_xlim() == pytest.approx((0, 66))
    assert any(t.get_text() == "cost units" for t in ax.texts)
    secs = StageCosts(F=(0.001,), B=(0.002,), I=(0.001,), W=(0.001,), FB=(0.003,), unit="s", source="test")
    result = simulate(dualpipev.schedule, secs)
    ax = gantt.plot_gantt(result).axes[0]
    assert any(t.get_text() == "ms" for t in ax.texts)
    assert ax.xaxis.get_major_formatter()(0.02, 0) == "20"


def test_eight_by_sixty_four_keeps_readable_labels():
    result = simulate(get_schedule("DualPipeV", 8, 64))
    fig = gantt.plot_gantt(result)
    assert labels_of(fig) and collection(fig, "labels").fontsize >= gantt.MIN_LABEL_FONT
    assert fig.get_figwidth() <= gantt.MAX_WIDTH + 2


@pytest.mark.slow
def test_thousands_of_cells_per_row_drop_labels_and_borders():
    result = simulate(get_schedule("DualPipeV", 32, 256))
    fig = gantt.plot_gantt(result)
    assert labels_of(fig) == []
    assert all(w == 0 for w in collection(fig, "cells:F").get_linewidths())
    assert collection(fig, "pair-borders") is None


def test_beyond_the_drawn_cell_limit_rows_are_one_image_of_what_runs_when(monkeypatch):
    result = simulate(get_schedule("ZBH1", 4, 8))
    monkeypatch.setattr(gantt, "MAX_DRAWN_CELLS", 10)
    fig = gantt.plot_gantt(result)
    ax = fig.axes[0]
    assert [c.get_gid() for c in ax.collections] == []  # no rectangles, no digits
    (image,) = [im for im in ax.images if im.get_gid() == "cells:dense"]
    pixels = np.asarray(image.get_array())
    columns = pixels.shape[1]
    assert pixels.shape[0] == 4 and columns >= 100
    assert image.get_extent() == pytest.approx([0, result.makespan, 3.5, -0.5])
    colour = {to_hex(tuple(px[:3] / 255)) for px in pixels.reshape(-1, 4)}
    assert colour == {ORANGE, GREEN, BLUE, "#ffffff"}
    dt = result.makespan / columns
    for rank, row in enumerate(result.schedule.actions):  # the pixel column at each action's middle has its colour
        for pos, action in enumerate(row):
            mid = (result.starts[rank][pos] + result.ends[rank][pos]) / 2
            px = pixels[rank, int(mid / dt)]
            assert to_hex(tuple(px[:3] / 255)) == KIND_COLOR[action.type.value]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["Forward", "Backward for input", "Backward for weights"]


def test_many_ranks_get_a_bounded_figure_with_thinned_row_labels():
    result = simulate(get_schedule("1F1B", 200, 2))
    fig = gantt.plot_gantt(result, labels=False, legend=False)
    assert fig.get_figheight() <= gantt.MAX_GANTT_HEIGHT + 2
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[0] == "Device 0" and 10 < len(ticks) < 200
    dpi = gantt.bounded_dpi(fig, 200)
    w, h = fig.get_size_inches()
    assert w * h * dpi**2 <= gantt.MAX_PIXELS * 1.001 and dpi < 200


def test_memory_panel_has_a_line_per_rank_peaking_at_peak_activations(dualpipev):
    fig = gantt.plot_gantt(dualpipev, memory=True)
    assert len(fig.axes) == 2
    lines = [ln for ln in fig.axes[1].lines if ln.get_gid() == "memory"]
    assert len(lines) == 4
    assert [int(max(ln.get_ydata())) for ln in lines] == [p.peak_activations for p in dualpipev.per_rank]
    assert fig.axes[1].get_xlim() == fig.axes[0].get_xlim()


def test_plot_memory_alone_or_into_a_given_axes(dualpipev):
    fig = gantt.plot_memory(dualpipev)
    assert len([ln for ln in fig.axes[0].lines if ln.get_gid() == "memory"]) == 4
    assert fig.axes[0].get_ylabel() == "Activations held"
    own = Figure()
    ax = own.add_subplot()
    assert gantt.plot_memory(dualpipev, ax=ax) is own


def test_memory_panel_refuses_a_single_given_axes(dualpipev):
    ax = Figure().add_subplot()
    with pytest.raises(ValueError, match="plot_memory"):
        gantt.plot_gantt(dualpipev, ax=ax, memory=True)


def test_comm_arrows_one_per_rank_crossing_hand_off():
    result = simulate(get_schedule("1F1B", 4, 4), parse_costs("comm=0.5"))
    fig = gantt.plot_gantt(result, comm=True)
    quiver = collection(fig, "comm")
    tr = result.transfers()
    assert quiver.N == len(tr) > 0
    assert np.allclose(quiver.U, tr["arrive"] - tr["send"])


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_plot_to_file_picks_the_format_by_extension(dualpipev, tmp_path, suffix, magic):
    path = plot_to_file(dualpipev, tmp_path / f"g{suffix}", dpi=50, memory=False, comm=False)
    assert path == tmp_path / f"g{suffix}"
    assert path.read_bytes().startswith(magic)
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_svg_keeps_text_as_text(dualpipev, tmp_path):
    svg = plot_to_file(dualpipev, tmp_path / "g.svg").read_text()
    assert "Device 3" in svg and "Backward for weights" in svg


def test_headline_plot_path_imports_neither_torch_nor_pandas_nor_pyplot(tmp_path):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from ppsim.cli import app\n"
        f"args = ['plot', '-s', 'DualPipeV', '-r', '4', '-m', '10', '-o', r'{tmp_path / 'x.png'}']\n"
        "r = CliRunner().invoke(app, args)\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib.pyplot') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert (tmp_path / "x.png").is_file()


def test_profile_costs_give_a_bytes_panel_with_the_cap():
    schedule = get_schedule("DualPipeV", 4, 10)
    result = simulate(schedule, profile_like_costs(8), memory_cap_bytes=9 * 2**30)
    fig = gantt.plot_gantt(result, memory=True)
    mem_ax = fig.axes[1]
    assert mem_ax.get_ylabel() == "Memory (GiB)"
    peaks = [max(ln.get_ydata()) for ln in mem_ax.lines if ln.get_gid() == "memory"]
    assert peaks == pytest.approx([p.peak_memory_bytes / 2**30 for p in result.per_rank])
    assert any(ln.get_label() == "cap" and ln.get_ydata()[0] == pytest.approx(9) for ln in mem_ax.lines)
    widths = Counter()
    for x0, x1, _ in rect_bounds(collection(fig, "cells:F")):
        widths[round(x1 - x0, 6)] += 1
    assert len(widths) > 1  # forward cells as wide as their stage's cost, not one size


@pytest.mark.parametrize("costs", ["F=1,B=2,FB=2.5", "F=1.5,I=1,W=0.5,FB=2"])
def test_drawn_cells_are_the_simulators_timeline(reference_dir, costs):
    from ppsim.viz._data import cells

    result = simulate(read_csv(reference_dir / "dualpipev_4ranks_10mb.csv"), parse_costs(costs))
    tl = result.timeline()
    want = sorted(zip(tl["rank"], tl["stage"], tl["microbatch"], tl["type"], tl["half_start"], tl["half_end"]))
    got = sorted((c.rank, c.stage, c.microbatch, c.kind, c.start, c.end) for c in cells(result))
    assert [w[:4] for w in want] == [g[:4] for g in got]
    assert np.allclose([w[4:] for w in want], [g[4:] for g in got])
