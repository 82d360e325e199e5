"""Every schedule that names a torch schedule has torch 2.13's compute-only order, cell for cell (idle slots aside).

The grid is built from the registry at collection time: ranks 1-8 and every stages-per-rank from the schedule's
minimum to 4 (or its fixed value). Each grid point is compared at the microbatch counts where orders change shape
(1 and 2, the rank count and one more, a multiple of the stage count and one more, and the largest, 4 x stages),
and a hypothesis sample draws further counts anywhere in 1 .. 4 x stages. torch's order comes from its schedule
classes built on stub stages, without a process group. Configurations torch refuses are counted; where ppsim
builds them anyway the result must be a valid schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsim.errors import ScheduleConfigError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.schedules import all_specs, get_schedule, get_spec
from ppsim.validate import validate

pytestmark = pytest.mark.torch
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

MAX_RANKS = 8
MAX_STAGES_PER_RANK = 4
MB_PER_STAGE = 4  # microbatches 1 .. MB_PER_STAGE x stages


Key = tuple  # (stage, type value, microbatch), or a tuple of those for an overlapped pair


def _torch_key(action) -> Key:
    if action.sub_actions is not None:
        return tuple(_torch_key(a) for a in action.sub_actions)
    return (action.stage_index, action.computation_type.value, action.microbatch_index)


def _key(action: Action) -> Key:
    if action.sub_actions:
        return tuple(_key(a) for a in action.sub_actions)
    return (action.stage, action.type.value, action.microbatch)


def _cells(keys: list[Key]) -> str:
    """Keys back as torch's cells, for messages."""

    def cell(k: Key) -> str:
        return f"({';'.join(cell(h) for h in k)})OVERLAP_F_B" if isinstance(k[0], tuple) else f"{k[0]}{k[1]}{k[2]}"

    return " ".join(cell(k) for k in keys)


class _StubStage:
    """What torch's schedule constructors read from a stage (the visualizer mocks the same fields)."""

    def __init__(self, num_ranks: int, num_stages: int) -> None:
        self.group_rank = 0
        self.group_size = num_ranks
        self.num_stages = num_stages
        self.submod = None


def _validate_only(self, actions, format="compute_only") -> None:  # noqa: A002 - torch's parameter name
    # torch checks the compute order here, then lowers it to send/recv actions; the lowering does not change the
    # compute order and costs 10x more than everything else, so only the check runs.
    torch_schedules.PipelineScheduleMulti._validate_and_set_stage_mapping(self, actions)


def torch_order(
    torch_name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int
) -> list[list[Key]] | None:
    """torch's compute-only ``pipeline_order`` as keys per rank; ``None`` where torch refuses the configuration."""
    cls = torch_schedules.get_schedule_class(torch_name)
    num_stages = num_ranks * num_stages_per_rank
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        stages = _StubStage(num_ranks, num_stages)
    else:
        stages = [_StubStage(num_ranks, num_stages) for _ in range(num_stages_per_rank)]
    try:
        runtime = torch_schedules._PipelineScheduleRuntime
        with mock.patch.object(runtime, "_prepare_schedule_with_comms", _validate_only):
            schedule = cls(stages, num_microbatches)
    except (ValueError, AssertionError):
        return None
    order = schedule.pipeline_order
    return [[_torch_key(a) for a in order[r] if a is not None and a.is_compute_op] for r in range(num_ranks)]


def ppsim_order(name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int) -> Schedule | None:
    try:
        return get_schedule(name, num_ranks, num_microbatches, num_stages_per_rank)
    except ScheduleConfigError:
        return None


def _stages_per_rank_options(name: str) -> list[int]:
    spec = get_spec(name)
    if spec.fixed_stages_per_rank is not None:
        return [spec.fixed_stages_per_rank]
    return list(range(spec.min_stages_per_rank, MAX_STAGES_PER_RANK + 1))


TORCH_SPECS = [spec.name for spec in all_specs() if spec.torch_name]
GRID = [
    (name, num_ranks, v)
    for name in TORCH_SPECS
    for num_ranks in range(1, MAX_RANKS + 1)
    for v in _stages_per_rank_options(name)
]


def test_grid_covers_every_torch_schedule() -> None:
    torch_names = {get_spec(name).torch_name for name in TORCH_SPECS}
    assert {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"} <= torch_names
    for torch_name in torch_names:
        torch_schedules.get_schedule_class(torch_name)  # raises if torch lacks it


def _check_torch_1f1b_last_rank(ours: Schedule, theirs: list[Key]) -> None:
    """torch 2.13's defect: its last rank is ours with every forward one microbatch later (no F0, an F for m)."""
    last = ours.actions[-1]
    shifted = [_key(replace(a, microbatch=a.microbatch + 1)) if a.type is ActionType.F else _key(a) for a in last]
    stage, m = ours.num_stages - 1, ours.num_microbatches
    assert theirs != [_key(a) for a in last], "torch fixed Schedule1F1B's last rank: compare every rank now"
    assert theirs == shifted, f"torch's last rank {_cells(theirs)}"
    assert (stage, "F", 0) not in theirs and (stage, "F", m) in theirs


def edge_microbatch_counts(num_ranks: int, num_stages_per_rank: int) -> list[int]:
    """The counts where schedules change shape: the smallest, the rank count, multiples of the stages, the largest."""
    num_stages = num_ranks * num_stages_per_rank
    largest = MB_PER_STAGE * num_stages
    counts = {1, 2, num_ranks, num_ranks + 1, 2 * num_ranks + 1, num_stages, num_stages + 1, 2 * num_stages, largest}
    return sorted(m for m in counts if 1 <= m <= largest)


def compare_with_torch(name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int) -> str:
    """Checks one configuration; returns ``"compared"``, ``"refused_by_torch"`` or ``"built_beyond_torch"``."""
    torch_name = get_spec(name).torch_name
    assert torch_name is not None
    config = f"{name} ranks={num_ranks} mb={num_microbatches} stages/rank={num_stages_per_rank}"
    theirs = torch_order(torch_name, num_ranks, num_microbatches, num_stages_per_rank)
    ours = ppsim_order(name, num_ranks, num_microbatches, num_stages_per_rank)
    if theirs is None:
        if ours is None:
            return "refused_by_torch"
        assert validate(ours) == [], f"{config}: torch refuses it and ppsim's order is invalid"
        return "built_beyond_torch"
    assert ours is not None, f"{config}: torch accepts it but ppsim refuses"
    rows = [[_key(a) for a in row] for row in ours.actions]
    if torch_name == "1F1B":
        _check_torch_1f1b_last_rank(ours, theirs[-1])
        assert validate(ours) == [], f"{config}: ppsim's order is invalid"
        rows, theirs = rows[:-1], theirs[:-1]
    for rank, (mine, torchs) in enumerate(zip(rows, theirs, strict=True)):
        assert mine == torchs, f"{config}: rank {rank} is {_cells(mine)}, torch has {_cells(torchs)}"
    return "compared"


def test_edge_counts_cover_the_smallest_a_multiple_a_non_multiple_and_the_largest() -> None:
    assert edge_microbatch_counts(4, 2) == [1, 2, 4, 5, 8, 9, 16, 32]
    assert edge_microbatch_counts(1, 1) == [1, 2, 3, 4]
    for r, v in [(3, 1), (5, 3), (8, 4)]:
        counts = edge_microbatch_counts(r, v)
        assert counts[0] == 1 and counts[-1] == MB_PER_STAGE * r * v
        assert any(m % r == 0 for m in counts) and any(m % r for m in counts)


@pytest.mark.parametrize(
    ("name", "num_ranks", "num_stages_per_rank"), GRID, ids=[f"{n}-r{r}-v{v}" for n, r, v in GRID]
)
def test_order_equals_torch_at_edge_microbatch_counts(
    name: str, num_ranks: int, num_stages_per_rank: int, record_property
) -> None:
    outcomes = Counter(
        compare_with_torch(name, num_ranks, m, num_stages_per_rank)
        for m in edge_microbatch_counts(num_ranks, num_stages_per_rank)
    )
    for outcome in ("compared", "refused_by_torch", "built_beyond_torch"):
        record_property(outcome, outcomes[outcome])
    assert outcomes["compared"] > 0, (
        f"{name} ranks={num_ranks} stages/rank={num_stages_per_rank}: torch refused every edge mb count"
    )


grid_configs = st.sampled_from(GRID).flatmap(
    lambda g: st.tuples(st.just(g), st.integers(1, MB_PER_STAGE * g[1] * g[2]))
)


@settings(max_examples=60, deadline=None)
@given(grid_configs)
def test_order_equals_torch_at_sampled_microbatch_counts(config) -> None:
    (name, num_ranks, num_stages_per_rank), num_microbatches = config
    compare_with_torch(name, num_ranks, num_microbatches, num_stages_per_rank)


class _RecordingStage(_StubStage):
    """A stage whose compute calls are recorded and whose communication is empty."""

    def __init__(self, num_ranks: int, rank: int) -> None:
        super().__init__(num_ranks, num_ranks)
        self.stage_index = rank
        self.is_first, self.is_last = rank == 0, rank == num_ranks - 1
        self.calls: list[Key] = []

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.calls.append((self.stage_index, "F", mb))

    def backward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.calls.append((self.stage_index, "B", mb))

    def get_fwd_recv_ops(self, mb: int) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, *args) -> None:
        pass

    def release_fwd_send_outputs(self, mb: int) -> None:  # torch 2.15: the outputs dropped once the send is waited
        pass


def torch_executed_order(torch_name: str, num_ranks: int, num_microbatches: int) -> list[list[Key]]:
    """The computations torch's single-stage schedule actually runs on each rank (its ``step`` path)."""
    cls = torch_schedules.get_schedule_class(torch_name)
    rows = []
    for rank in range(num_ranks):
        stage = _RecordingStage(num_ranks, rank)
        schedule = cls(stage, num_microbatches)
        with mock.patch.object(schedule, "_initialize_stage"):
            schedule._step_microbatches()
        rows.append(stage.calls)
    return rows


SINGLE_STAGE = [(name, r) for name in TORCH_SPECS if get_spec(name).fixed_stages_per_rank == 1 for r in (1, 2, 4, 7)]


@pytest.mark.parametrize(("name", "num_ranks"), SINGLE_STAGE, ids=[f"{n}-r{r}" for n, r in SINGLE_STAGE])
def test_single_stage_order_is_what_torch_executes(name: str, num_ranks: int) -> None:
    # torch's 1F1B pipeline_order is wrong on the last rank, but its step() runs ppsim's order on every rank.
    torch_name = get_spec(name).torch_name
    for m in range(num_ranks, 3 * num_ranks + 2):
        ours = [[_key(a) for a in row] for row in get_schedule(name, num_ranks, m).actions]
        assert ours == torch_executed_order(torch_name, num_ranks, m), f"{name} ranks={num_ranks} mb={m}"
