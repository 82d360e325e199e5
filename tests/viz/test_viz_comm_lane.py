"""The communication lane of the static Gantt (viz/gantt.py) and the interactive one (viz/interactive.py), both
drawing viz/_data.py's comm_lane: each action's collectives (EP's all-to-alls) as a thin strip in a lane under its
rank's cells, the exposed part strong at the action's end, the hidden part light from its start."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_hex
from step_helpers import ep_step

from ppsim.costs import parse_costs
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.step.model import Step as FsdpStep
from ppsim.step.pricing import CollectiveCosts, MeasuredCollective
from ppsim.viz import _data, gantt, interactive


def _collection(fig, gid):  # type: ignore[no-untyped-def]
    found = [c for ax in fig.axes for c in ax.collections if c.get_gid() == gid]
    return found[0] if found else None


def _bounds(coll) -> np.ndarray:  # type: ignore[no-untyped-def]
    """``(x0, x1, y0, y1)`` per rectangle."""
    return np.array([(p.vertices[:, 0].min(), p.vertices[:, 0].max(), p.vertices[:, 1].min(),
                      p.vertices[:, 1].max()) for p in coll.get_paths()]).reshape(-1, 4)


def _result(name: str, a2a_s: float):  # type: ignore[no-untyped-def]
    schedule = get_schedule(name, 2, 4)
    costs = parse_costs("F=1,B=2,FB=3")
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (1,)),), saved_bytes=0) for i in range(4)}
    shapes = JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=0, moe_layers=tuple(blocks), moe_top_k=1,
                       moe_tokens=1, dim=1)
    per = 4 // len(schedule.pipelines[0])
    modules = [tuple(f"layers.{i}" for i in range(s * per, (s + 1) * per)) for s in range(len(schedule.pipelines[0]))]
    measured = CollectiveCosts(measured=(MeasuredCollective("all_to_all", 2, ((1, a2a_s), (2, a2a_s)), 1e30),))
    step = ep_step(FsdpStep(schedule=schedule, extra_s={}), costs, shapes=shapes, stage_modules=modules, ep=2,
                   costs=measured)
    return step.simulate(lambda extra: simulate(schedule, costs, extra_s=extra))


def test_an_eager_step_draws_only_exposed_strips_each_ending_with_its_action() -> None:
    result = _result("1F1B", 0.1)
    fig = gantt.plot_gantt(result)
    strong = _bounds(_collection(fig, "comm-exposed"))
    assert _collection(fig, "comm-hidden") is None
    assert len(strong) == sum(len(row) for row in result.schedule.actions)  # every F and B holds MoE layers
    ends = sorted(e for row in result.ends for e in row)
    assert sorted(strong[:, 1].tolist()) == pytest.approx(ends)
    assert (strong[:, 1] - strong[:, 0]).tolist() == pytest.approx([4 * 0.1] * len(strong))  # 2 layers x 2
    lane = _data.LANE_ROWS.lane
    assert lane is not None
    rows = strong[:, 2] - lane[0]
    assert set(np.round(rows, 9).tolist()) == {0.0, 1.0}  # in each rank's lane ...
    assert np.allclose(strong[:, 3] - strong[:, 2], lane[1] - lane[0]) and lane[1] - lane[0] < 0.2  # ... thin
    assert to_hex(_collection(fig, "comm-exposed").get_facecolors()[0]).upper() == _data.COMM_COLORS["exposed"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert _data.COMM_LABELS["exposed"] in labels and _data.COMM_LABELS["hidden"] not in labels


def test_the_lane_sits_under_the_cells_which_keep_their_height() -> None:
    result = _result("DualPipeV", 0.1)
    fig = gantt.plot_gantt(result)
    cells = np.concatenate([_bounds(_collection(fig, f"cells:{g}")) for g in ("F", "pair-F")])
    lane = _bounds(_collection(fig, "comm-lane"))
    ranks = np.round(cells[:, 2] + 0.5)
    assert np.all(cells[:, 3] <= ranks + _data.LANE_ROWS.compute[1] + 1e-9)  # cells end above ...
    assert np.allclose(lane[:, 2], np.arange(2) + _data.LANE_ROWS.lane[0])  # ... the lane's track, one per rank
    assert lane[:, 1].tolist() == pytest.approx([result.makespan] * 2)
    plain = gantt.plot_gantt(simulate(get_schedule("DualPipeV", 2, 4), parse_costs("F=1,B=2,FB=3")))
    row_in = fig.axes[0].get_position().height * fig.get_figheight() / 2
    plain_row_in = plain.axes[0].get_position().height * plain.get_figheight() / 2
    compute = _data.LANE_ROWS.compute[1] - _data.LANE_ROWS.compute[0]
    assert row_in * compute == pytest.approx(plain_row_in)  # a cell as tall as without the lane


def test_dualpipevs_pairs_draw_their_hidden_all_to_alls_light() -> None:
    result = _result("DualPipeV", 0.1)  # 4 stages of one MoE layer: 0.2 a direction under a pair of 3: hidden
    fig = gantt.plot_gantt(result)
    light = _bounds(_collection(fig, "comm-hidden"))
    pairs = sum(a.type.name == "OVERLAP_F_B" for row in result.schedule.actions for a in row)
    assert pairs and len(light) == pairs and (light[:, 1] - light[:, 0]).tolist() == pytest.approx([0.4] * pairs)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert _data.COMM_LABELS["hidden"] in labels


def test_a_step_without_collectives_has_no_lane() -> None:
    fig = gantt.plot_gantt(simulate(get_schedule("1F1B", 2, 4)))
    assert all(_collection(fig, gid) is None for gid in ("comm-exposed", "comm-hidden", "comm-lane"))


def _lane_traces(fig) -> dict:  # type: ignore[no-untyped-def]
    return {t.meta[0]: t for t in fig.data if t.type == "bar" and str(t.meta[0]).startswith("comm-")}


def test_the_html_lane_holds_each_actions_comm_spans_hidden_and_exposed() -> None:
    result = _result("DualPipeV", 0.75)  # 1.5 a direction: hidden under a pair's backward (2), 0.5 out of its F (1)
    spans = result.comm_spans
    assert any(0 < s.exposed < s.total for s in spans.values()) and any(s.exposed == s.total for s in spans.values())
    traces = _lane_traces(interactive.gantt_figure(result))
    assert set(traces) == {"comm-lane", "comm-hidden", "comm-exposed"}
    lane = _data.LANE_ROWS.lane
    assert lane is not None
    drawn: dict[tuple[int, str], dict[str, float]] = {}
    for part in ("hidden", "exposed"):
        t = traces[f"comm-{part}"]
        assert t.marker.color == _data.COMM_COLORS[part] and t.name == _data.COMM_LABELS[part] and t.showlegend
        assert t.width == pytest.approx(lane[1] - lane[0])
        for y, length, row in zip(t.y, t.x, t.customdata):
            kind, action, total, exposed, hidden, rank = row
            assert kind == "all-to-all" and y == pytest.approx(rank + (lane[0] + lane[1]) / 2)
            assert hidden == pytest.approx(total - exposed)
            drawn.setdefault((rank, action), {"total": total, "exposed": exposed})[part] = length
    want = {(rank, str(result.schedule.actions[rank][pos])): span for (rank, pos), span in spans.items()}
    assert set(drawn) == set(want)
    for key, span in want.items():
        got = drawn[key]
        assert (got["total"], got["exposed"]) == pytest.approx((span.total, span.exposed))
        assert got.get("exposed", 0.0) == pytest.approx(span.exposed)  # the bars' lengths: exposed ...
        assert got.get("hidden", 0.0) == pytest.approx(span.total - span.exposed)  # ... and hidden
    for word in ("total", "exposed", "hidden"):
        assert word in traces["comm-exposed"].hovertemplate


def test_the_html_and_the_static_lane_draw_the_same_strips() -> None:
    result = _result("DualPipeV", 0.75)
    fig = gantt.plot_gantt(result)
    traces = _lane_traces(interactive.gantt_figure(result))
    for part in ("hidden", "exposed"):
        static = _bounds(_collection(fig, f"comm-{part}"))
        t = traces[f"comm-{part}"]
        html = np.array([(b, b + x) for b, x in zip(t.base, t.x)])
        assert sorted(map(tuple, static[:, :2].round(9))) == sorted(map(tuple, html.round(9)))
        assert to_hex(_collection(fig, f"comm-{part}").get_facecolors()[0]).upper() == t.marker.color


def test_the_html_cells_sit_above_the_lane_and_rank_labels_on_them() -> None:
    result = _result("DualPipeV", 0.1)
    fig = interactive.gantt_figure(result)
    f = next(t for t in fig.data if t.meta[0] == "F")
    compute = _data.LANE_ROWS.compute
    assert f.width == pytest.approx(compute[1] - compute[0])
    assert {round(y - _data.LANE_ROWS.centre, 9) for y in f.y} == {0.0, 1.0}
    assert list(fig.layout.yaxis.tickvals) == pytest.approx([r + _data.LANE_ROWS.centre for r in range(2)])
    assert all(row[7] in (0, 1) for row in f.customdata) and "customdata[7]" in f.hovertemplate  # the rank


def test_without_collectives_the_html_has_no_lane_and_cells_fill_their_rows() -> None:
    fig = interactive.gantt_figure(simulate(get_schedule("DualPipeV", 2, 4)))
    assert not _lane_traces(fig)
    f = next(t for t in fig.data if t.meta[0] == "F")
    assert f.width == 1.0 and set(f.y) == {0, 1} and list(fig.layout.yaxis.tickvals) == [0, 1]


def test_fsdps_spans_name_their_kinds_for_the_hover() -> None:
    from ppsim.ir import ActionType

    schedule = get_schedule("Interleaved1F1B", 2, 4, 2)
    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (250,)),), saved_bytes=0) for i in range(4)}
    shapes = JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=0, param_dtype="float32",
                       reduce_dtype="float32")
    measured = CollectiveCosts(measured=tuple(MeasuredCollective(op, 2, ((1000, 1.0), (2000, 2.0)), 1000)
                                              for op in ("all_gather", "reduce_scatter")))
    from step_helpers import fsdp_step

    step = fsdp_step(schedule, shapes=shapes, stage_modules=[(f"layers.{i}",) for i in range(4)], dp_shard=2,
                     costs=measured)
    kinds = {step.schedule.actions[r][p].type: span.kinds for (r, p), span in step.comm_spans.items()}
    assert kinds == {ActionType.UNSHARD: ("all_gather",), ActionType.REDUCE_GRAD: ("reduce_scatter",)}
    result = step.simulate(lambda extra: simulate(step.schedule, parse_costs("F=1,B=2"), extra_s=extra))
    words = {s.kind_words for s in _data.comm_lane(result)}
    assert words == {"all-gather", "reduce-scatter"}


def test_the_title_says_how_much_of_each_kind_was_exposed() -> None:
    result = _result("DualPipeV", 0.75)
    a2a = result.collectives["all_to_all"]
    assert 0 < a2a.exposed_s < a2a.total_s
    words = f"all-to-all {a2a.exposed_s:.4g} of {a2a.total_s:.4g} units exposed"
    assert _data.title(result).endswith(", " + words)
    assert interactive.gantt_figure(result).layout.title.text == _data.title(result)
    assert "exposed" not in _data.title(simulate(get_schedule("DualPipeV", 2, 4)))
