"""Compatibility path: the builtin model lives in :mod:`ppsim.calibrate.models.builtin` (one home)."""

from ppsim.calibrate.models.builtin import *  # noqa: F401,F403
from ppsim.calibrate.models.builtin import (  # noqa: F401 - private names some callers use
    DTYPES, _place, _seeded, build_full_model, build_stage, build_stage_modules, loss_fn, make_batch, stage_input,
    torch_dtype,
)
from ppsim.model_config import (  # noqa: F401
    MODEL_FIELDS, PRESETS, TINY_VALUES, ModelConfig, get_preset, split_layers,
)
