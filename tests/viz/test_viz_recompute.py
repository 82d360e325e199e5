"""Recomputed backwards are hatched in the static and the interactive Gantt (artists and traces, not pixels)."""

from __future__ import annotations

import numpy as np
import pytest
from test_viz import collection, rect_bounds

from ppsim.costs import parse_costs
from ppsim.recompute import RecomputeSet
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.viz import gantt, interactive
from ppsim.viz._data import RECOMPUTE_LABEL, cells

CHOSEN = RecomputeSet.of([(0, 0), (1, 3), (2, 2), (3, 5)])


@pytest.fixture(scope="module")
def zbh1_result():
    s = get_schedule("ZBH1", 4, 8)
    return simulate(s, parse_costs("F=1,B=2"), recompute=CHOSEN)


@pytest.fixture(scope="module")
def dualpipev_result():
    s = get_schedule("DualPipeV", 4, 10)
    return simulate(s, parse_costs("F=1,B=2,FB=2.5"), recompute=RecomputeSet.full(s))


def test_static_gantt_hatches_exactly_the_recomputed_backwards(zbh1_result) -> None:
    fig = gantt.plot_gantt(zbh1_result)
    hatched = collection(fig, "recompute")
    assert hatched is not None and hatched.get_hatch()
    tl = zbh1_result.timeline()
    want = tl[[(s, m) in CHOSEN and t == "I" for s, m, t in zip(tl.stage, tl.microbatch, tl.type)]]
    got = sorted(map(tuple, rect_bounds(hatched).tolist()))
    expect = sorted(zip(want.start, want.end, want["rank"].astype(float)))
    assert np.allclose(got, expect)
    legend_texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert RECOMPUTE_LABEL in legend_texts


def test_static_gantt_without_recompute_has_no_hatch() -> None:
    fig = gantt.plot_gantt(simulate(get_schedule("ZBH1", 4, 8)))
    assert collection(fig, "recompute") is None
    legend_texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert RECOMPUTE_LABEL not in legend_texts


def test_pairs_hatch_their_backward_half(dualpipev_result) -> None:
    drawn = cells(dualpipev_result)
    assert all(c.recomputed == (c.kind in ("B", "I")) for c in drawn if c.kind != "W")
    assert any(c.recomputed and c.pair for c in drawn)


def test_interactive_gantt_patterns_the_recomputed_bars(zbh1_result) -> None:
    fig = interactive.gantt_figure(zbh1_result)
    found = 0
    for trace in fig.data:
        if not trace.meta or trace.meta[0] not in ("I", "B", "pair-B"):
            continue
        shapes = trace.marker.pattern.shape
        if shapes is None:
            continue
        for shape, custom in zip(shapes, trace.customdata):
            assert (shape == "/") == ((int(custom[1]), int(custom[2])) in CHOSEN)
            found += shape == "/"
    assert found == len(CHOSEN)
