"""``--model python:PKG.MODULE:FACTORY``: your own ``nn.Module``, laid out as torchtitan lays out its decoders.

``FACTORY()`` returns either the model, whose children ``tok_embeddings`` (the embedding), ``layers`` (a
``ModuleList``, ``ModuleDict`` or ``Sequential`` of layers), ``norm`` and ``lm_head`` are found by torchtitan's
names, or a pair ``(model, names)`` with ``names`` a dict ``{"embedding": ..., "layers": ..., "norm": ...,
"head": ...}`` of attribute paths (``"norm"`` may be ``None`` when the model has no final norm). Each block is called
with one tensor: ``embedding(tokens)``, ``layer(h)``, ``head(norm(h))`` giving logits ``(mb, seq, vocab)``.

The factory is called under a fixed seed (``torch.manual_seed``), once per process; stages are
:class:`LayoutModel` modules holding deep copies of their blocks under the names ``tok_embeddings``,
``layers.<i>``, ``norm``, ``lm_head`` (the unsplit reference uses the same names). The factory's module is imported
with the current directory on the import path. Shapes are read from a meta-device call (nothing allocated).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ppsim.calibrate.models import Estimate, ModelOptions, ModelSource, ModelSourceError, kinds_of

if TYPE_CHECKING:
    import torch
    from torch import nn

TORCHTITAN_NAMES = {"embedding": "tok_embeddings", "layers": "layers", "norm": "norm", "head": "lm_head"}
DEFAULT_SEQ_LEN, DEFAULT_MB_SIZE = 128, 4
_CACHE: dict[Any, Any] = {}


def _factory(text: str, target: str) -> Any:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelSourceError(f"--model {text}: expected python:PKG.MODULE:FACTORY, e.g. "
                               "python:mypkg.models:make_model")
    added = False
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        added = True
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's file: one line
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"--model {text}: module {module_name!r} does not import ({type(exc).__name__}: "
                               f"{reason}); check the module path (run from the folder holding it)") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ModelSourceError(f"--model {text}: module {module_name!r} has no {attr!r}; name a function that "
                               "returns an nn.Module")
    if not callable(factory):
        raise ModelSourceError(f"--model {text}: {module_name}.{attr} is a {type(factory).__name__}, not callable; "
                               "name a function that returns an nn.Module")
    return factory


def _call(text: str, factory: Any, *, seed: int, meta: bool) -> tuple[Any, dict[str, str | None]]:
    import torch
    from torch import nn

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device("meta" if meta else "cpu"):
                made = factory()
    except Exception as exc:  # noqa: BLE001
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        where = " on the meta device (ppsim sizes the model before building it)" if meta else ""
        raise ModelSourceError(f"--model {text}: the factory raised {type(exc).__name__}{where}: {reason}") from None
    names: Any = None
    if isinstance(made, tuple) and len(made) == 2:
        made, names = made
    if not isinstance(made, nn.Module):
        raise ModelSourceError(f"--model {text}: the factory returned {type(made).__name__}, not an nn.Module; "
                               "return the model, or (model, {'embedding': ..., 'layers': ..., 'norm': ..., "
                               "'head': ...})")
    if names is None:
        names = dict(TORCHTITAN_NAMES)
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(TORCHTITAN_NAMES))
        if unknown:
            raise ModelSourceError(f"--model {text}: block names {unknown} are not among "
                                   f"{', '.join(TORCHTITAN_NAMES)}; name the embedding, layers, norm and head")
        names = {"norm": None, **dict(names)}
        for key in ("embedding", "layers", "head"):
            if key not in names:
                raise ModelSourceError(f"--model {text}: the block names lack {key!r}; give embedding, layers, "
                                       "norm and head")
    else:
        raise ModelSourceError(f"--model {text}: the factory's second value is a {type(names).__name__}; give a "
                               "dict {'embedding': ..., 'layers': ..., 'norm': ..., 'head': ...}")
    return made, names


def _get(model: Any, path: str | None) -> Any:
    if path is None:
        return None
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None) if not part.isdigit() else _index(obj, part)
        if obj is None:
            return None
    return obj


def _index(obj: Any, part: str) -> Any:
    try:
        return obj[int(part)]
    except Exception:  # noqa: BLE001
        return getattr(obj, part, None)


def _blocks(text: str, model: Any, names: dict[str, str | None]) -> tuple[Any, list[Any], Any, Any]:
    from torch import nn

    parts = {key: _get(model, path) for key, path in names.items()}
    children = ", ".join(n for n, _ in model.named_children()) or "none"
    for key in ("embedding", "layers", "head") + (("norm",) if names.get("norm") else ()):
        if not isinstance(parts[key], nn.Module):
            raise ModelSourceError(
                f"--model {text}: {type(model).__name__} has no {key} module at {names[key]!r} (its children: "
                f"{children}); lay it out as tok_embeddings / layers / norm / lm_head, or return (model, names)")
    container = parts["layers"]
    if isinstance(container, nn.ModuleDict):
        layers = list(container.values())
    elif isinstance(container, (nn.ModuleList, nn.Sequential)):
        layers = list(container)
    else:
        raise ModelSourceError(f"--model {text}: {names['layers']!r} is a {type(container).__name__}; the layers "
                               "must be an nn.ModuleList, nn.ModuleDict or nn.Sequential")
    if not layers:
        raise ModelSourceError(f"--model {text}: {names['layers']!r} holds no layer")
    return parts["embedding"], layers, parts["norm"], parts["head"]


def _layout_model(embedding: Any, layers: dict[int, Any], norm: Any, head: Any) -> nn.Module:
    from torch import nn

    class LayoutModel(nn.Module):
        """Blocks called in order: embedding, layers, norm, head (each where held)."""

        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = embedding
            self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
            self.norm = norm
            self.lm_head = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.tok_embeddings is not None:
                x = self.tok_embeddings(x)
            for layer in self.layers.values():
                x = layer(x)
            if self.norm is not None:
                x = self.norm(x)
            if self.lm_head is not None:
                x = self.lm_head(x)
            return x

    return LayoutModel()


# --- resolve -----------------------------------------------------------------------------------------------------
def resolve(target: str, options: ModelOptions, *, device: str = "cpu") -> ModelSource:
    from ppsim.model_config import ModelConfig

    text = f"python:{target}"
    shaped = [f"--{k}" for k in ("hidden", "heads", "ffn", "vocab") if getattr(options, k) is not None]
    if shaped:
        raise ModelSourceError(f"{', '.join(shaped)} with --model {text}: shape options apply to builtin models "
                               "only; the factory fixes its shapes")
    if options.layers is not None:
        raise ModelSourceError(f"--layers with --model {text}: ppsim cannot change a factory's layer count; "
                               "make the factory build the layers you want")
    model, names = _call(text, _factory(text, target), seed=0, meta=True)
    embedding, layers, norm, head = _blocks(text, model, names)
    hidden, vocab = _embedding_shape(text, embedding)
    keys, bases = [], []
    for layer in layers:
        keys.append((type(layer).__qualname__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())))
        bases.append(type(layer).__name__.lower())
    descs = [f"{type(x).__name__} ({sum(p.numel() for p in x.parameters())} parameters)" for x in layers]
    layer_kinds, kind_desc = kinds_of(keys, bases, descs)
    dtype = options.dtype or "float32"
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    seq_len = options.seq_len or DEFAULT_SEQ_LEN
    mb_size = options.mb_size or DEFAULT_MB_SIZE

    def count(m: Any) -> int:
        return 0 if m is None else sum(p.numel() for p in m.parameters())

    total = count(model)
    tokens = seq_len * mb_size
    estimate = Estimate(
        param_bytes=total * item, largest_layer_param_bytes=max(count(x) for x in layers) * item,
        embed_param_bytes=count(embedding) * item, head_param_bytes=(count(norm) + count(head)) * item,
        layer_activation_bytes=tokens * 34 * hidden * item, head_activation_bytes=tokens * vocab * 8,
    )
    config = ModelConfig(preset=text, hidden=hidden, heads=1, ffn=4 * hidden, layers=len(layers), vocab=vocab,
                         seq_len=seq_len, mb_size=mb_size, dtype=dtype)
    return ModelSource(
        text=text, scheme="python", config=config, layer_kinds=layer_kinds, kind_descriptions=kind_desc,
        num_params=total, attention="the factory's", estimate=estimate, device=device,
        family=type(model).__name__, flavor=target, options=options,
    )


def _embedding_shape(text: str, embedding: Any) -> tuple[int, int]:
    weight = getattr(embedding, "weight", None)
    if weight is None or getattr(weight, "dim", lambda: 0)() != 2:
        raise ModelSourceError(f"--model {text}: the embedding ({type(embedding).__name__}) has no 2-D weight "
                               "(vocab x hidden); use an nn.Embedding")
    vocab, hidden = (int(x) for x in weight.shape)
    return hidden, vocab


# --- torch -------------------------------------------------------------------------------------------------------
def _parts(source: ModelSource, *, seed: int, device: Any) -> tuple[Any, list[Any], Any, Any]:
    import torch

    from ppsim.calibrate.models import place
    from ppsim.calibrate.models.transformer import DTYPES

    key = (source.text, seed, str(device))
    if key not in _CACHE:
        _CACHE.clear()
        target = source.text.split(":", 1)[1]
        model, names = _call(source.text, _factory(source.text, target), seed=seed,
                             meta=torch.device(device).type == "meta")
        model = place(model, device=device, dtype=DTYPES[source.config.dtype])
        _CACHE[key] = _blocks(source.text, model, names)
    return _CACHE[key]


def full_module(source: ModelSource, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    return stage_module(source, tuple(range(source.num_layers)), has_embedding=True, has_head=True, seed=seed,
                       device=device)


def stage_module(source: ModelSource, layer_ids: tuple[int, ...], *, has_embedding: bool, has_head: bool,
                seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    embedding, layers, norm, head = _parts(source, seed=seed, device=device)
    return _layout_model(
        copy.deepcopy(embedding) if has_embedding else None,
        {i: copy.deepcopy(layers[i]) for i in layer_ids},
        copy.deepcopy(norm) if has_head and norm is not None else None,
        copy.deepcopy(head) if has_head else None,
    )


def param_name(source: ModelSource, layer_ids: tuple[int, ...], local_name: str) -> str:
    return local_name
