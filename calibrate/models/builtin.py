"""``--model builtin:NAME``: ppsim's own toy decoder (:mod:`ppsim.calibrate.models.transformer`), presets ``tiny``, ``1b``,
``8b`` with the shape options. Resolving needs no torch; the modules are built by :mod:`ppsim.calibrate.models.transformer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppsim.model_config import MODEL_FIELDS, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ppsim.calibrate.models import ModelOptions, ModelSource

def resolve(name: str, options: ModelOptions, *, device: str = "cpu") -> ModelSource:
    """``builtin:NAME`` with the size options: the preset's shapes, ``custom`` when an option changed them."""
    from ppsim.calibrate.models import ModelSourceError
    from ppsim.model_config import PRESETS

    key = name.strip().lower()
    if key not in PRESETS:
        raise ModelSourceError(f"--model builtin:{name}: unknown builtin model; use one of "
                               f"{', '.join('builtin:' + p for p in PRESETS)}")
    base = PRESETS[key]
    changes = {k: v for k, v in options.given().items() if getattr(base, k) != v}
    config = base.replace(preset="custom", **changes) if changes else base
    return source_for(config, device=device, options=options, name=key)


def source_for(config: ModelConfig, *, device: str = "cpu", options: ModelOptions | None = None,
               name: str | None = None) -> ModelSource:
    """The builtin source of ``config`` (a preset's shapes, or ``custom`` ones)."""
    from ppsim.calibrate.models import Estimate, ModelOptions, ModelSource
    from ppsim.model_config import PRESETS

    if options is None:
        base = PRESETS.get(config.preset)
        if base is not None and base == config:
            options = ModelOptions()
        else:  # custom shapes: the options that rebuild them from tiny
            base = PRESETS["tiny"]
            options = ModelOptions(**{k: getattr(config, k) for k in (*MODEL_FIELDS, "dtype")
                                      if getattr(config, k) != getattr(base, k)})
    if name is None:
        name = config.preset if config.preset in PRESETS else "tiny"
    h, f, v, item = config.hidden, config.ffn, config.vocab, config.itemsize
    layer_params = 4 * h * h + 3 * h * f + 2 * h
    tokens = config.mb_size * config.seq_len
    attn_scores = config.mb_size * config.heads * config.seq_len ** 2 * item * (0 if device == "cuda" else 3)
    estimate = Estimate(
        param_bytes=(config.layers * layer_params + 2 * v * h + h) * item,
        largest_layer_param_bytes=layer_params * item, embed_param_bytes=v * h * item,
        head_param_bytes=(v * h + h) * item,
        layer_activation_bytes=tokens * (12 * h + 4 * f) * item + attn_scores,
        head_activation_bytes=tokens * v * 8,
    )
    return ModelSource(
        text=f"builtin:{name}", scheme="builtin", config=config,
        layer_kinds=("layer",) * config.layers,
        kind_descriptions=(("layer", f"attention ({config.heads} heads) + SwiGLU MLP ({config.ffn})"),),
        num_params=estimate.param_bytes // item, attention="sdpa", estimate=estimate, device=device,
        family="builtin", flavor=config.preset, options=options,
    )


def full_module(source: ModelSource, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    from ppsim.calibrate.models.transformer import build_full_model

    return build_full_model(source.config, seed=seed, device=device)


def stage_module(source: ModelSource, layer_ids: tuple[int, ...], *, has_embedding: bool, has_head: bool,
                seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    import torch

    from ppsim.calibrate.models.transformer import StageModule, place_on_device

    config = source.config
    first = layer_ids[0] if layer_ids else 0
    span = (first, first + len(layer_ids))

    def make() -> StageModule:
        return StageModule(config, span, has_embedding=has_embedding, has_head=has_head, seed=seed,
                           layer_ids=layer_ids)

    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return place_on_device(make(), config, device)
    return place_on_device(make(), config, device)


def param_name(source: ModelSource, layer_ids: tuple[int, ...], local_name: str) -> str:
    if local_name.startswith("layers."):
        _, idx, rest = local_name.split(".", 2)
        return f"layers.{layer_ids[int(idx)]}.{rest}"
    return local_name
