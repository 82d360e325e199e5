"""The static Gantt's communication lane (viz/gantt.py): each action's collectives (EP's all-to-alls) as a thin strip
at the bottom of its rank's row, the exposed part strong at the action's end, the hidden part light from its start."""

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
from ppsim.viz import gantt


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
    rows = np.round((strong[:, 2] + strong[:, 3]) / 2 - gantt.COMM_LANE[0] - (gantt.COMM_LANE[1] -
                                                                             gantt.COMM_LANE[0]) / 2)
    assert set(rows.tolist()) == {0.0, 1.0} and np.all(strong[:, 3] - strong[:, 2] < 0.2)  # a thin strip per row
    assert to_hex(_collection(fig, "comm-exposed").get_facecolors()[0]) == gantt.COMM_EXPOSED
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert gantt.COMM_LABELS[0] in labels and gantt.COMM_LABELS[1] not in labels


def test_dualpipevs_pairs_draw_their_hidden_all_to_alls_light() -> None:
    result = _result("DualPipeV", 0.1)  # 4 stages of one MoE layer: 0.2 a direction under a pair of 3: hidden
    fig = gantt.plot_gantt(result)
    light = _bounds(_collection(fig, "comm-hidden"))
    pairs = sum(a.type.name == "OVERLAP_F_B" for row in result.schedule.actions for a in row)
    assert pairs and len(light) == pairs and (light[:, 1] - light[:, 0]).tolist() == pytest.approx([0.4] * pairs)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert gantt.COMM_LABELS[1] in labels


def test_a_step_without_collectives_has_no_lane() -> None:
    fig = gantt.plot_gantt(simulate(get_schedule("1F1B", 2, 4)))
    assert _collection(fig, "comm-exposed") is None and _collection(fig, "comm-hidden") is None
