"""DualPipe on ppsim's executor: the two model copies' gradients are summed before the check against the unsplit
model (the multi-process run itself is in tests/calibrate/test_run.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from ppsim.calibrate.execute import dualpipe  # noqa: E402
from ppsim.calibrate.execute.numerics import GRAD_RTOL, reference_name  # noqa: E402
from ppsim.calibrate.execute.steps import ExecSpec  # noqa: E402
from ppsim.calibrate.models.builtin import source_for  # noqa: E402
from ppsim.model_config import ModelConfig  # noqa: E402
from ppsim.schedules import get_schedule  # noqa: E402

pytestmark = pytest.mark.torch

SMALL = ModelConfig(preset="custom", hidden=16, heads=2, ffn=32, layers=4, vocab=32, seq_len=8, mb_size=1,
                    dtype="float32")


def _spec(*, synthetic: bool) -> ExecSpec:
    schedule = get_schedule("DualPipe", 2, 4)
    return ExecSpec(schedule=schedule, model=SMALL, synthetic=synthetic,
                    source=None if synthetic else source_for(SMALL))


def _copies_grads(spec: ExecSpec) -> dict[str, Any]:
    """Each chain's stages (built as the executor builds them) run on its half of the batch in one process, every
    microbatch's loss scaled by 1/M; gradients named as the executor gathers them."""
    from ppsim.calibrate.models.transformer import loss_fn, make_batch

    schedule = spec.schedule
    m, per_chain = schedule.num_microbatches, schedule.microbatches_per_pipeline
    tokens, targets = make_batch(spec.model, m, seed=spec.seed)
    grads: dict[str, Any] = {}
    for d, chain in enumerate(schedule.pipelines):
        modules = [dualpipe.stage_module(spec, s, "cpu") for s in chain]
        for i in range(d * per_chain, (d + 1) * per_chain):
            x = tokens.chunk(m)[i]
            for module in modules:
                x = module(x)
            (loss_fn(x, targets.chunk(m)[i]) / m).backward()
        for s, module in zip(chain, modules):
            for name, p in module.named_parameters():
                ref = reference_name(spec.model, len(chain), schedule.position(s), name, synthetic=spec.synthetic,
                                     source=spec.source)
                grads[dualpipe.copy_name(d, ref)] = p.grad.detach().clone()
    return grads


@pytest.mark.parametrize("synthetic", [False, True])
def test_the_two_copies_gradients_summed_match_the_unsplit_model_and_one_copy_alone_does_not(
    synthetic: bool,
) -> None:
    spec = _spec(synthetic=synthetic)
    grads = _copies_grads(spec)
    check = dualpipe.copies_reference(spec, "cpu")
    summed = check(grads)
    tolerance = GRAD_RTOL["float32"] * summed.grad_ref_max_abs
    assert summed.grad_max_abs_diff <= tolerance
    assert any(k.startswith("copy1/") for k in grads)
    dropped = {k: (0 * g if k.startswith("copy1/") else g) for k, g in grads.items()}  # copy 1's gradient lost
    assert check(dropped).grad_max_abs_diff > tolerance
    only_first = {k: g for k, g in grads.items() if not k.startswith("copy1/")}  # copy 1 never gathered
    assert check(only_first).grad_max_abs_diff > tolerance


def test_copy_names_fold_onto_the_reference_names() -> None:
    assert dualpipe.copy_name(0, "layers.0.w") == "layers.0.w"
    assert dualpipe.sum_copies({"a": 1.0, "copy1/a": 2.0, "copy1/b": 3.0}) == {"a": 3.0, "b": 3.0}


def test_dualpipe_is_refused_on_nccl_in_one_line() -> None:
    line = dualpipe.backend_refusal(get_schedule("DualPipe", 2, 4), "nccl")
    assert line is not None and "\n" not in line and "--backend gloo" in line
    assert dualpipe.backend_refusal(get_schedule("DualPipe", 2, 4), "gloo") is None
