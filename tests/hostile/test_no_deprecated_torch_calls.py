"""Hostile inputs, sixth pass: ppsim's own collective calls use torch's current names, so a calibration prints no
``FutureWarning: torch.distributed.reduce_scatter_tensor is deprecated`` (torch 2.13 deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` for ``all_gather_single`` / ``reduce_scatter_single``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
def test_the_collectives_timing_warns_of_no_deprecated_torch_call(one_rank_world: None) -> None:
    from ppsim.calibrate.measure import comm

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        times = comm._collectives(1, 0, sizes=[4096], warmup=1, reps=1, device="cpu",
                                  ops=("all_gather", "reduce_scatter"))
    assert set(times) == {"all_gather", "reduce_scatter"} and all(times[op][4096] for op in times)
