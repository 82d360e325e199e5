"""ppsim's activation peaks (slots) against torch 2.15's own activation-liveness analysis, a second reference.

``analyze_pipeline_activation_liveness`` (torch >= 2.15) assigns reusable slots to every (stage, microbatch)
activation of a rank's order, live from its forward through its full or weight backward; the number of slots it
needs is the most activations live at once, which is what ppsim's simulator reports as ``peak_activations``. The
test runs only where torch has the analysis.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ppsim.schedules import load_schedule
from ppsim.simulator import simulate

pytestmark = pytest.mark.torch

CASES = [("1F1B", 2, 4, None), ("GPipe", 2, 4, None), ("ZBH1", 2, 4, None), ("ZBH1", 4, 8, None),
         ("ZBVZeroBubble", 2, 4, None), ("ZBVZeroBubble", 4, 8, None), ("Interleaved1F1B", 2, 4, 2),
         ("Interleaved1F1B", 4, 8, 3), ("DualPipeV", 2, 4, None), ("DualPipeV", 4, 10, None),
         ("InterleavedZeroBubble", 2, 4, 2)]


@pytest.mark.parametrize(("name", "ranks", "microbatches", "per_rank"), CASES)
def test_peak_activations_match_torchs_liveness_slots(name: str, ranks: int, microbatches: int,
                                                      per_rank: int | None) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "analyze_pipeline_activation_liveness"):
        pytest.skip("torch before 2.15 has no analyze_pipeline_activation_liveness")
    schedule = load_schedule(name, ranks, microbatches, per_rank)
    order = {r: [schedules._Action.from_str(str(a)) for a in row] for r, row in enumerate(schedule.actions)}
    # the analysis reads the finalized order and the microbatch count; a compute-only order is one
    torch_view = SimpleNamespace(pipeline_order=order, _n_microbatches=schedule.num_microbatches)
    peaks = simulate(schedule).per_rank
    for rank in range(ranks):
        liveness = schedules.analyze_pipeline_activation_liveness(
            torch_view, pp_rank=rank, stage_indices=schedule.stages_of(rank), granularity="stage_microbatch")
        assert peaks[rank].peak_activations == liveness.num_slots, (name, rank)
