"""The static Gantt's communication lane (viz/gantt.py, its strips from viz/_data.py's comm_lane): each action's
collectives (EP's all-to-alls) as a thin strip in a lane under its rank's cells, the exposed part strong at the
action's end, the hidden part light from its start."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_hex

from ppsim.costs import parse_costs
from ppsim.ep import ep_step
from ppsim.fsdp import CollectiveCosts, FsdpStep, MeasuredCollective
from ppsim.job.memory import BlockShapes, JobShapes
from ppsim.schedules import get_schedule
from ppsim.simulator import simulate
from ppsim.viz import _data, gantt


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
