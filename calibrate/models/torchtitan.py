"""``--model torchtitan:FAMILY/FLAVOR``: a model from torchtitan's registries (torchtitan 0.3.0's layout).

``torchtitan.models.<family>.model_registry(flavor)`` gives a ``ModelSpec`` whose ``.model`` is the model's config
dataclass: ``dim``, ``vocab_size``, ``tok_embeddings``, ``layers`` (one ``TransformerBlock`` config per layer),
``norm``, ``lm_head``. ``config.build()`` builds the decoder (children ``tok_embeddings``, ``layers`` -- a
``ModuleDict`` keyed ``"0"``, ``"1"``, ... -- ``norm``, ``lm_head``); its forward passes its input through whatever
is ``None`` or missing, which is how torchtitan's ``_split_module`` makes pipeline stages and how
:func:`build_stage` makes them here: the full model is built once per process from a fixed seed and each stage
keeps deep copies of the modules it holds, under their full-model names.

- **Layer kinds**: layers are compared by their config's structure, ignoring ``param_init`` (torchtitan scales the
  init per layer id) and ``sharding_config``; DeepSeek-V3's dense first layer (``feed_forward``) and its MoE layers
  (``moe``) are two kinds.
- **Attention on CPU**: FlexAttention has no CPU backward, so on CPU each layer's ``inner_attention`` becomes
  torchtitan's ``ScaledDotProductAttention`` (causal) before building; on CUDA the flavor's own backend is kept
  (FlexAttention's masks are made per forward from the sequence positions).
- **Sizes before building**: parameters are counted on the meta device (nothing allocated).

torch and torchtitan are imported inside the functions only; without torchtitan every use is one line naming the
extra to install.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pkgutil
import warnings
from typing import TYPE_CHECKING, Any

from ppsim.calibrate.models import (
    SDPA_ON_CPU,
    TORCHTITAN_EXTRA,
    Estimate,
    ModelOptions,
    ModelSource,
    ModelSourceError,
    kinds_of,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Default microbatch for torchtitan flavors: debug flavors are sized to calibrate in a minute on a CPU;
#: others take torchtitan's usual training sequence length.
DEBUG_SEQ_LEN, DEBUG_MB_SIZE = 128, 2
DEFAULT_SEQ_LEN, DEFAULT_MB_SIZE = 2048, 1
_IGNORED_FIELDS = ("param_init", "sharding_config")
_NOT_FAMILIES = ("common", "utils")
_SHAPE_OPTIONS = ("hidden", "heads", "ffn", "vocab")
_CACHE: dict[Any, Any] = {}
_META: dict[Any, Any] = {}
# torchtitan's MoE asks for float32 autocast, which CPU autocast does not offer (harmless: it runs in float32)
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")


def _torchtitan(what: str) -> Any:
    try:
        import torchtitan.models as models
    except ImportError as exc:
        raise ModelSourceError(f"--model {what}: torchtitan is not installed ({exc.name or exc}); install it with "
                               f"{TORCHTITAN_EXTRA}") from None
    return models


def families() -> list[str]:
    """Family names in torchtitan's model registries (module names; nothing imported)."""
    models = _torchtitan("torchtitan:...")
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__)
                  if m.ispkg and m.name not in _NOT_FAMILIES)


def flavors_of(module: Any) -> dict[str, Any]:
    """The family's flavor table (``llama3_configs``, ``deepseekv3_configs``, ...)."""
    for name in dir(module):
        value = getattr(module, name)
        if name.endswith("_configs") and isinstance(value, dict) and value:
            return value
    return {}


def _family_module(family: str, text: str) -> Any:
    known = families()
    if family not in known:
        raise ModelSourceError(f"--model {text}: unknown torchtitan family {family!r}; use one of "
                               f"{', '.join(known)}")
    try:
        module = importlib.import_module(f"torchtitan.models.{family}")
    except ImportError as exc:
        raise ModelSourceError(f"--model {text}: torchtitan's {family} model does not import here "
                               f"({str(exc).splitlines()[0][:120]}); pick another family") from None
    if not callable(getattr(module, "model_registry", None)) or not flavors_of(module):
        raise ModelSourceError(f"--model {text}: torchtitan's {family} has no model_registry with flavors; "
                               f"use one of {', '.join(k for k in known if k != family)}")
    return module


def _model_config(family: str, flavor: str, text: str) -> Any:
    """A fresh copy of the flavor's model config (the registry builds a new one per call)."""
    module = _family_module(family, text)
    flavors = flavors_of(module)
    if flavor not in flavors:
        raise ModelSourceError(f"--model {text}: unknown flavor {flavor!r} of torchtitan's {family}; use one of "
                               f"{', '.join(flavors)}")
    try:
        spec = module.model_registry(flavor)
    except Exception as exc:  # noqa: BLE001 - a registry entry that cannot be made here: one line
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        needs = "needs CUDA, " if _mentions_cuda(reason) else ""
        raise ModelSourceError(f"--model {text}: torchtitan cannot make this flavor here ({needs}{reason}); "
                               "pick another flavor") from None
    config = spec.model
    missing = [f for f in ("dim", "vocab_size", "tok_embeddings", "layers", "norm", "lm_head")
               if not hasattr(config, f)]
    if missing or not isinstance(config.layers, list) or not config.layers:
        raise ModelSourceError(f"--model {text}: {type(config).__qualname__} is not a decoder language model "
                               f"(embedding, layers, norm, head; missing {', '.join(missing) or 'layers'}); "
                               "ppsim pipelines decoder LMs such as torchtitan:llama3/debugmodel")
    return config


def _mentions_cuda(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in ("cuda", "gpu", "hopper", "blackwell", "nccl", "triton"))


# --- structure ---------------------------------------------------------------------------------------------------
def structure_key(obj: Any) -> Any:
    """A hashable summary of a config's structure, ignoring per-layer init and sharding."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__qualname__, *((f.name, structure_key(getattr(obj, f.name)))
                                          for f in dataclasses.fields(obj) if f.name not in _IGNORED_FIELDS))
    if isinstance(obj, (list, tuple)):
        return tuple(structure_key(x) for x in obj)
    if isinstance(obj, dict):
        return tuple(sorted((str(k), structure_key(v)) for k, v in obj.items()))
    if callable(obj):
        return getattr(obj, "__qualname__", type(obj).__qualname__)
    return obj


def _layer_base(layer: Any) -> str:
    if getattr(layer, "moe", None) is not None:
        return "moe"
    if getattr(layer, "feed_forward", None) is not None:
        return "dense"
    return type(layer).__qualname__.split(".")[0].lower()


def _describe_layer(layer: Any) -> str:
    parts = []
    attn = getattr(layer, "attention", None)
    if attn is not None:
        inner = getattr(attn, "inner_attention", None)
        parts.append(f"{type(attn).__qualname__.split('.')[0]} ({getattr(attn, 'n_heads', '?')} heads"
                     + (f", {_attention_name(inner)}" if inner is not None else "") + ")")
    moe = getattr(layer, "moe", None)
    if moe is not None:
        top_k = getattr(getattr(moe, "router", None), "top_k", "?")
        shared = " + shared experts" if getattr(moe, "shared_experts", None) is not None else ""
        parts.append(f"MoE ({getattr(moe, 'num_experts', '?')} experts, top {top_k}{shared})")
    ff = getattr(layer, "feed_forward", None)
    if ff is not None and moe is None:
        hidden = getattr(getattr(ff, "w1", None), "out_features", None)
        parts.append(f"feed-forward ({hidden})" if hidden else "feed-forward")
    return " + ".join(parts) or type(layer).__qualname__


def _attention_name(inner: Any) -> str:
    name = type(inner).__qualname__.split(".")[0]
    return {"FlexAttention": "flex", "ScaledDotProductAttention": "sdpa", "VarlenAttention": "varlen"}.get(name, name)


def _inner_attentions(config: Any) -> list[Any]:
    return [a.inner_attention for a in (getattr(layer, "attention", None) for layer in config.layers)
            if a is not None and getattr(a, "inner_attention", None) is not None]


def _use_sdpa(config: Any) -> None:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        attn = getattr(layer, "attention", None)
        if attn is not None and getattr(attn, "inner_attention", None) is not None:
            attn.inner_attention = ScaledDotProductAttention.Config()


def _set_layers(config: Any, wanted: int | None, text: str) -> None:
    """``--layers``: truncate, or extend by repeating the last layer's config (its kind)."""
    if wanted is None or wanted == len(config.layers):
        return
    if wanted < 1:
        raise ModelSourceError(f"--layers {wanted}: a model needs at least one layer")
    if wanted < len(config.layers):
        config.layers = config.layers[:wanted]
    else:
        config.layers = [*config.layers, *(copy.deepcopy(config.layers[-1])
                                           for _ in range(wanted - len(config.layers)))]


def model_spec(source: ModelSource) -> Any:
    """The flavor's torchtitan ``ModelSpec`` (its ``parallelize_fn`` shards a model part as torchtitan trains it)."""
    assert source.family is not None and source.flavor is not None
    return _family_module(source.family, source.text).model_registry(source.flavor)


def num_experts(source: ModelSource) -> int | None:
    """The routed experts of the model's MoE layers (``None``: a dense model)."""
    found = [layer.moe.num_experts for layer in prepared_config(source).layers if getattr(layer, "moe", None)]
    return found[0] if found else None


def moe_layer_ids(source: ModelSource) -> frozenset[int]:
    """The positions of the model's MoE layers (routed experts; empty for a dense model)."""
    return frozenset(i for i, layer in enumerate(prepared_config(source).layers) if getattr(layer, "moe", None))


def prepared_config(source: ModelSource, parallelism: Any = None) -> Any:
    """The flavor's config as this source builds it (layer count, attention backend). ``parallelism``: a torchtitan
    ``ParallelismConfig`` whose sharding plan the config takes (``update_from_config``, as torchtitan does when it
    reads a job: e.g. DeepSeek-V3's routed experts laid out for EP)."""
    assert source.family is not None and source.flavor is not None
    config = _model_config(source.family, source.flavor, source.text)
    _set_layers(config, source.options.layers, source.text)
    if source.device != "cuda":
        _use_sdpa(config)
    if parallelism is not None:
        config.update_from_config(config=_Parallelism(parallelism))
    return config


def ep_parallelism(ep: int, tp: int = 1) -> Any:
    """torchtitan's ``ParallelismConfig`` with expert-parallel degree ``ep`` and tensor-parallel degree ``tp`` (what
    the sharding plan reads: without it ``update_from_config`` is never called and ``parallelize`` shards nothing by
    TP)."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(expert_parallel_degree=ep, tensor_parallel_degree=tp)


# --- resolve -----------------------------------------------------------------------------------------------------
def resolve(rest: str, options: ModelOptions, *, device: str = "cpu") -> ModelSource:
    from ppsim.model_config import ModelConfig

    text = f"torchtitan:{rest}"
    family, sep, flavor = rest.partition("/")
    if not sep or not family or not flavor:
        raise ModelSourceError(f"--model {text}: expected torchtitan:FAMILY/FLAVOR, e.g. "
                               "torchtitan:llama3/debugmodel or torchtitan:deepseek_v3/debugmodel")
    shaped = [f"--{k}" for k in _SHAPE_OPTIONS if getattr(options, k) is not None]
    if shaped:
        raise ModelSourceError(f"{', '.join(shaped)} with --model {text}: shape options apply to builtin models "
                               "only; a torchtitan flavor fixes its shapes (pick another flavor, or --layers)")
    config = _model_config(family, flavor, text)
    _set_layers(config, options.layers, text)
    inner = _inner_attentions(config)
    if device == "cuda":
        attention = ", ".join(sorted({_attention_name(a) for a in inner})) or "none"
    else:
        unsupported = sorted({_attention_name(a) for a in inner} - {"flex", "sdpa", "varlen"})
        if unsupported:
            raise ModelSourceError(f"--model {text}: its {', '.join(unsupported)} attention needs CUDA; this is a "
                                   "CPU run (use --device cuda on a GPU machine, or another flavor)")
        _use_sdpa(config)
        attention = SDPA_ON_CPU if inner else "none"
    debug = "debug" in flavor.lower()
    seq_len = options.seq_len or (DEBUG_SEQ_LEN if debug else DEFAULT_SEQ_LEN)
    mb_size = options.mb_size or (DEBUG_MB_SIZE if debug else DEFAULT_MB_SIZE)
    max_seq = _max_seq_len(config)
    if max_seq is not None and seq_len > max_seq:
        raise ModelSourceError(f"--seq-len {seq_len}: torchtitan:{family}/{flavor} handles at most {max_seq} "
                               f"tokens per sequence (its RoPE table); use --seq-len {min(max_seq, 2048)} or less")
    dtype = options.dtype or "float32"
    keys = [structure_key(layer) for layer in config.layers]
    layer_kinds, kind_desc = kinds_of(keys, [_layer_base(x) for x in config.layers],
                                      [_describe_layer(x) for x in config.layers])
    counts = _meta_counts(config, text)
    heads = _heads(config)
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    dim, vocab = int(config.dim), int(config.vocab_size)
    ffn = _ffn(config)
    model = ModelConfig(preset=text, hidden=dim, heads=heads if dim % heads == 0 else 1, ffn=ffn,
                        layers=len(config.layers), vocab=vocab, seq_len=seq_len, mb_size=mb_size, dtype=dtype)
    tokens = seq_len * mb_size
    attn_scores = mb_size * heads * seq_len ** 2 * item * (0 if device == "cuda" else 3)
    estimate = Estimate(
        param_bytes=counts["total"] * item, largest_layer_param_bytes=max(counts["layers"]) * item,
        embed_param_bytes=counts["tok_embeddings"] * item, head_param_bytes=(counts["norm"] + counts["lm_head"]) * item,
        layer_activation_bytes=tokens * (16 * dim + 4 * ffn) * item + attn_scores,
        head_activation_bytes=tokens * vocab * 8, largest_tensor_bytes=counts["largest"] * item,
    )
    notes = []
    if device != "cuda" and inner:
        notes.append(f"attention: {SDPA_ON_CPU}")
    return ModelSource(
        text=text, scheme="torchtitan", config=model, layer_kinds=layer_kinds, kind_descriptions=kind_desc,
        num_params=counts["total"], attention=attention, estimate=estimate, device=device, family=family,
        flavor=flavor, options=options, notes=tuple(notes),
    )


def _max_seq_len(config: Any) -> int | None:
    try:
        value = config.max_seq_len
    except Exception:  # noqa: BLE001 - a config without RoPE
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _heads(config: Any) -> int:
    for layer in config.layers:
        n = getattr(getattr(layer, "attention", None), "n_heads", None)
        if isinstance(n, int) and n > 0:
            return n
    return 1


def _ffn(config: Any) -> int:
    """The widest per-token feed-forward width of any layer (a MoE layer: its experts' width times top-k, plus
    the shared experts), for the activation estimate."""
    widest = 0
    for layer in config.layers:
        ff = getattr(layer, "feed_forward", None)
        moe = getattr(layer, "moe", None)
        width = 0
        if moe is not None:
            inner = getattr(getattr(moe, "routed_experts", None), "inner_experts", None)
            top_k = getattr(getattr(moe, "router", None), "top_k", 1) or 1
            width += (getattr(inner, "hidden_dim", 0) or 0) * top_k
            shared = getattr(moe, "shared_experts", None)
            width += getattr(getattr(shared, "w1", None), "out_features", 0) or 0
        elif ff is not None:
            width = getattr(getattr(ff, "w1", None), "out_features", 0) or 0
        widest = max(widest, width)
    return max(widest, 1)


def _meta_counts(config: Any, text: str) -> dict[str, Any]:
    """Parameter counts per top-level block from a meta-device build (allocates nothing)."""
    import torch

    try:
        with torch.device("meta"):
            model = config.build()
    except Exception as exc:  # noqa: BLE001
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        needs = "needs CUDA, " if _mentions_cuda(reason) else ""
        raise ModelSourceError(f"--model {text}: torchtitan cannot build this flavor here ({needs}{reason}); "
                               "pick another flavor") from None

    def count(module: Any) -> int:
        return 0 if module is None else sum(p.numel() for p in module.parameters())

    return {
        "total": count(model), "tok_embeddings": count(model.tok_embeddings), "norm": count(model.norm),
        "lm_head": count(model.lm_head), "layers": [count(layer) for layer in model.layers.values()],
        "largest": max((p.numel() for layer in model.layers.values() for p in layer.parameters()), default=0),
    }


# --- torch -------------------------------------------------------------------------------------------------------
def _cache_key(source: ModelSource, seed: int, device: Any, parallelism: Any = None) -> Any:
    plan = None if parallelism is None else (parallelism.expert_parallel_degree,
                                             parallelism.enable_sequence_parallel)
    return (source.text, source.options, source.device, seed, str(device), plan)


class _Parallelism:
    """What a model config's ``update_from_config`` reads from a non-trainer caller: the ``parallelism`` field."""

    def __init__(self, parallelism: Any) -> None:
        self.parallelism = parallelism


def _full_model(source: ModelSource, *, seed: int, device: Any, parallelism: Any = None) -> nn.Module:
    """The unsplit model, built once per process for (source, seed, device[, parallelism]). ``parallelism``: a
    torchtitan ``ParallelismConfig`` whose sharding plan the model's config takes first (``update_from_config``:
    e.g. DeepSeek-V3's routed experts sharded over EP); the weights are the same as without it."""
    import torch

    from ppsim.calibrate.models import place
    from ppsim.calibrate.models.transformer import DTYPES

    key = _cache_key(source, seed, device, parallelism)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    _CACHE.clear()  # one model at a time
    config = prepared_config(source, parallelism)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = config.build()
            model.init_states()
    model = place(model, device=device, dtype=DTYPES[source.config.dtype])
    _CACHE[key] = model
    return model


def full_module(source: ModelSource, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    import torch

    if torch.device(device).type == "meta":
        return stage_module(source, tuple(range(source.num_layers)), has_embedding=True, has_head=True,
                           seed=seed, device=device)
    return _with_masks(source, copy.deepcopy(_full_model(source, seed=seed, device=device)))


def sharded_full_module(source: ModelSource, parallelism: Any, *, seed: int = 0,
                        device: str | torch.device = "cpu") -> nn.Module:
    """:func:`full_module` with the sharding plan of ``parallelism`` (a torchtitan ``ParallelismConfig``) in its
    modules, ready for the model's parallelize function: what an expert-parallel run needs (torchtitan sets the
    routed experts' EP layout from ``expert_parallel_degree`` when it reads the job)."""
    return _with_masks(source, copy.deepcopy(_full_model(source, seed=seed, device=device, parallelism=parallelism)))


def stage_module(source: ModelSource, layer_ids: tuple[int, ...], *, has_embedding: bool, has_head: bool,
                seed: int = 0, device: str | torch.device = "cpu", random_weights: bool = False) -> nn.Module:
    """torchtitan's ``_split_module`` done on the full model: keep deep copies of the named modules, set the
    embedding / norm / head to ``None`` where the stage does not hold them, drop the other layers.
    ``random_weights``: cut the stage from the meta model and allocate only it, with weights of its own (not
    :func:`full_module`'s): calibration at size."""
    import torch
    from torch import nn


    at_size = random_weights and torch.device(device).type != "meta"
    if torch.device(device).type == "meta" or at_size:
        full = _meta_model(source)
    else:
        full = _full_model(source, seed=seed, device=device)
    stage = copy.copy(full)  # the module object without its children; they are replaced below
    stage._modules = {}
    stage._parameters = dict(full._parameters)
    stage._buffers = dict(full._buffers)
    for name, child in full._modules.items():
        if name == "layers":
            continue
        keep = (name == "tok_embeddings" and has_embedding) or (name in ("norm", "lm_head") and has_head)
        stage._modules[name] = copy.deepcopy(child) if keep and child is not None else None
    stage._modules["layers"] = nn.ModuleDict({str(i): copy.deepcopy(full.layers[str(i)]) for i in layer_ids})
    if at_size:
        _materialise(stage, seed=seed, device=device)
    return _with_masks(source, stage)


def _meta_model(source: ModelSource) -> nn.Module:
    """The whole model on the meta device in the source's dtype (shapes only: a 405B model in seconds, no memory),
    built once per process."""
    import torch

    from ppsim.calibrate.models import place
    from ppsim.calibrate.models.transformer import DTYPES

    key = ("meta", source.text, source.options, source.device)
    cached = _META.get(key)
    if cached is None:
        _META.clear()
        with torch.device("meta"):
            cached = prepared_config(source).build()
        cached = _META[key] = place(cached, device="meta", dtype=DTYPES[source.config.dtype])
    return cached


def _materialise(stage: nn.Module, *, seed: int, device: str | torch.device) -> None:
    """Allocate a stage cut from the meta model on ``device`` and initialise it with torchtitan's own
    ``init_states`` (random weights from ``seed``; the buffers, a RoPE table, as the model makes them). Only this
    stage's blocks are ever allocated: what calibration at size measures one block at a time."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stage.to_empty(device=torch.device(device))
        with torch.no_grad():
            stage.init_states(buffer_device=torch.device(device))


def _with_masks(source: ModelSource, model: nn.Module) -> nn.Module:
    """With FlexAttention (CUDA), make the causal masks from the positions at each forward, as the trainer does."""
    if source.device != "cuda" or "flex" not in source.attention:
        return model
    import types

    import torch

    base = type(model).forward

    def forward(self: Any, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks: Any = None) -> torch.Tensor:
        if attention_masks is None:
            seq = tokens.shape[1]
            pos = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], seq)
            attention_masks = self.get_attention_masks(pos)
        return base(self, tokens, positions, attention_masks)

    model.forward = types.MethodType(forward, model)
    return model


def param_name(source: ModelSource, layer_ids: tuple[int, ...], local_name: str) -> str:
    return local_name  # stages keep the full model's names (layers.<id>...)
