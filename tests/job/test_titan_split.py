"""ppsim's plain-Python split and placement agree with torchtitan's own functions (where torchtitan is installed).

``ppsim.split`` serves installs without torchtitan; ``ppsim.calibrate.torchtitan.split`` calls torchtitan's
``_generate_llm_fqn_per_model_part``, ``_get_pipeline_metadata`` and ``_get_pp_rank_to_stage_indices_mapping``.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="needs the torchtitan extra")

from ppsim.calibrate.torchtitan.split import (  # noqa: E402
    layers_per_part,
    pipeline_metadata,
    rank_stage_indices,
    stage_module_names,
)
from ppsim.schedules import get_schedule  # noqa: E402
from ppsim.split import SplitError, default_split, stage_blocks, stages_for_layers_per_stage  # noqa: E402

pytestmark = pytest.mark.torch


def test_default_split_agrees_with_torchtitan_on_the_whole_grid() -> None:
    """Layers 1..64 x stages 1..32 x embedding and head weights 0..3 each: the same layer counts, or both refuse."""
    disagree = []
    for num_layers, num_stages, iw, ow in itertools.product(range(1, 65), range(1, 33), range(4), range(4)):
        try:
            ours: tuple[int, ...] | None = default_split(num_layers, num_stages, input_weight=iw, output_weight=ow)
        except SplitError:
            ours = None
        try:
            theirs: tuple[int, ...] | None = layers_per_part(
                stage_module_names(num_stages, num_layers, input_weight=iw, output_weight=ow))
        except SplitError:
            theirs = None
        if ours != theirs:
            disagree.append((num_layers, num_stages, iw, ow, ours, theirs))
    assert disagree == []


@pytest.mark.parametrize(("num_layers", "num_stages"), [(6, 4), (8, 4), (7, 3), (1, 1), (16, 8)])
def test_module_names_per_stage_agree_with_torchtitan(num_layers: int, num_stages: int) -> None:
    layout = ["tok_embeddings", *(f"layers.{i}" for i in range(num_layers)), "HEAD"]
    ours = stage_blocks(layout, default_split(num_layers, num_stages))
    theirs = stage_module_names(num_stages, num_layers)
    # ppsim's head block is torchtitan's norm + lm_head
    assert [tuple(n for n in part if n not in ("norm", "lm_head")) for part in theirs] == \
           [tuple(n for n in part if n != "HEAD") for part in ours]


@pytest.mark.parametrize(("schedule", "single"), [("1F1B", True), ("GPipe", True), ("Interleaved1F1B", False),
                                                  ("LoopedBFS", False), ("ZBVZeroBubble", False)])
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("layers_per_stage", [1, 2, 3])
def test_stage_count_from_layers_per_stage_agrees_with_torchtitans_metadata(
    schedule: str, single: bool, num_ranks: int, layers_per_stage: int
) -> None:
    for num_layers in range(1, 33):
        parallelism = SimpleNamespace(pipeline_parallel_schedule=schedule,
                                      pipeline_parallel_layers_per_stage=layers_per_stage,
                                      pipeline_parallel_first_stage_less_layers=1,
                                      pipeline_parallel_last_stage_less_layers=1)
        ours = stages_for_layers_per_stage(num_layers, layers_per_stage)
        per_rank_ok = ours % num_ranks == 0 and ((ours // num_ranks == 1) if single else ours // num_ranks >= 2)
        try:
            theirs = pipeline_metadata(parallelism, num_ranks=num_ranks, num_layers=num_layers)[0]
        except SplitError:
            assert not per_rank_ok, (num_layers, ours)
            continue
        assert per_rank_ok and theirs == ours


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3), ("LoopedBFS", 2),
     ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)],
)
@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_ppsim_places_stages_on_ranks_as_torchtitan(schedule: str, stages_per_rank: int, num_ranks: int) -> None:
    """Loop schedules put stage s on rank s % R; V schedules rank r holds r and 2R-1-r: the same as torchtitan."""
    num_microbatches = 2 * num_ranks * stages_per_rank
    sched = get_schedule(schedule, num_ranks, num_microbatches, stages_per_rank)
    ours = tuple(tuple(sorted(sched.stages_of(rank))) for rank in range(num_ranks))
    theirs = rank_stage_indices(schedule, num_ranks=num_ranks, num_stages=num_ranks * stages_per_rank)
    assert ours == tuple(tuple(sorted(stages)) for stages in theirs)
