"""torchtitan's activation checkpointing as ppsim applies it: the one home of the mode -> torchtitan policy mapping,
used by ``ppsim run --activation-checkpoint`` (each model part, :mod:`ppsim.calibrate.torchtitan.runner`) and by
``ppsim calibrate --activation-checkpoint`` (each measured unit, :mod:`ppsim.calibrate.measure.harness`), so a
profile's costs are measured under exactly the wrapping the run executes.

``selective`` is torchtitan's ``SelectiveAC`` (per-op SAC: saves the outputs of the ops in
``_get_default_save_ops()``, recomputes every second matmul, force-recomputes the ``moe.router.gate`` shapes),
``full`` its ``FullAC`` (each transformer block rerun whole in its backward); both wrap every block under the
module's ``layers`` with torch's ``checkpoint_wrapper``. The mode names are torch-free
(:data:`ppsim.profile.AC_MODES`). torchtitan is imported inside the functions only.
"""

from __future__ import annotations

import tempfile
from typing import Any

from ppsim.profile import AC_MODES


def ac_config(mode: str) -> Any:
    """torchtitan's activation-checkpointing config for ``mode`` (``none``: ``None``), what its parallelize functions
    take as ``ac_config``."""
    assert mode in AC_MODES, mode
    if mode == "none":
        return None
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return SelectiveAC.Config() if mode == "selective" else FullAC.Config()


def mode_of(config: Any) -> str:
    """The mode of a job config's ``activation_checkpoint`` (torchtitan's policy config, or ``None``); a policy ppsim
    does not apply (``MemoryBudgetAC``: the compiler's) reads as ``none``."""
    name = type(config).__qualname__.split(".")[0].lower() if config is not None else "none"
    return "full" if "full" in name else "selective" if "selective" in name else "none"


def apply_ac(module: Any, mode: str) -> int:
    """Wrap every block of ``module.layers`` with ``mode``'s policy in place, as torchtitan's parallelize functions
    do (``ac_config.build(dump_folder=...).apply(model)``); returns how many blocks were wrapped (0 for ``none`` or a
    module without layers: an embedding or head alone)."""
    config = ac_config(mode)
    if config is None:
        return 0
    layers = getattr(module, "layers", None)
    if layers is None or not len(layers):
        return 0
    with tempfile.TemporaryDirectory(prefix="ppsim-titan-") as dump:
        config.build(dump_folder=dump).apply(module)
    return len(layers)


def count_wrapped(module: Any) -> int:
    """Blocks of ``module`` wrapped by torch's checkpoint wrapper (what :func:`apply_ac` did)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sum(isinstance(m, CheckpointWrapper) for m in module.modules())
