"""Model sources: the model `ppsim calibrate` measures and `ppsim run` executes, named by ``--model SOURCE``.

- ``builtin:NAME`` (:mod:`.builtin`): ppsim's own toy decoder (``tiny``, ``1b``, ``8b``; shape options apply).
- ``torchtitan:FAMILY/FLAVOR`` (:mod:`.torchtitan`): any flavor in torchtitan's model registries
  (``torchtitan:llama3/debugmodel``, ``torchtitan:deepseek_v3/debugmodel``); needs ``pip install "ppsim[torchtitan]"``.
- ``python:PKG.MODULE:FACTORY`` (:mod:`.python_factory`): a callable returning an ``nn.Module`` laid out as
  torchtitan lays out its decoders (embedding, layer container, norm, head), or ``(module, names)``.

:func:`parse_model_source` checks the text and the size options and resolves everything known without building the
model (shapes, layer kinds, parameter count, the attention backend, a memory estimate) into a :class:`ModelSource`:
plain, picklable data (it travels to ``ppsim run``'s worker processes). Its methods build torch modules (torch and
torchtitan are imported inside them only):

- :meth:`ModelSource.build_full` -- the unsplit model (the numerics reference), weights fixed by ``seed``;
- :meth:`ModelSource.build_stage` -- a module holding a subset of the blocks (``layer_ids``, with or without the
  embedding and the head) with the same weights as :meth:`build_full` for the same seed;
- :meth:`ModelSource.reference_name` -- a stage parameter's name in the unsplit model;
- :meth:`ModelSource.stage_input`, :meth:`ModelSource.make_batch`, :meth:`ModelSource.loss_fn`.

For torchtitan's own pipeline helpers (``_pipeline_module_split`` and friends): :meth:`ModelSource.build_full` is
the whole torchtitan model (its own class, children ``tok_embeddings``, ``layers`` keyed ``"0"``.., ``norm``,
``lm_head``; CPU attention already SDPA), and ``ppsim.calibrate.models.torchtitan.prepared_config(source)`` the
config it was built from (layer override and attention substitution applied). Parameter names are torchtitan's, so
stages split by torchtitan compare with :meth:`build_full`'s gradients by name.

The *blocks* of a model are the embedding, each layer and the head (final norm, LM head and the loss). Layers that
differ in structure (DeepSeek-V3's dense first layer and its MoE layers) have different *kinds*; the profile measures
one block per kind (``layer`` when all layers are alike, else ``layer.<kind>``) and records each layer's kind in
order (``layout``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ppsim.errors import PPSimError
from ppsim.model_config import DTYPE_BYTES, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

SCHEMES = ("builtin", "torchtitan", "python")
DEFAULT_SOURCE = "builtin:tiny"
TORCHTITAN_EXTRA = 'pip install "ppsim[torchtitan]"'
SDPA_ON_CPU = "sdpa (FlexAttention has no CPU backward)"
"""The attention note a torchtitan model calibrated or run on CPU carries (output and profile)."""
EXAMPLES = "builtin:tiny, torchtitan:llama3/debugmodel, python:mypkg.models:make_model"


class ModelSourceError(PPSimError):
    """``--model`` names no model that can be built here, or the size options do not fit it."""


@dataclass(frozen=True)
class ModelOptions:
    """Model-size options given on the command line (``None``: the source's default).

    ``seq_len``, ``mb_size``, ``dtype`` and ``layers`` (a layer-count override: torchtitan configs are truncated or
    extended, repeating the last layer's kind) apply to every source; ``hidden``, ``heads``, ``ffn`` and ``vocab``
    to the builtin model only.
    """

    seq_len: int | None = None
    mb_size: int | None = None
    dtype: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    ffn: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        for name in ("seq_len", "mb_size", "layers", "hidden", "heads", "ffn", "vocab"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                opt = name.replace("_", "-")
                raise ModelSourceError(f"--{opt} {value!r}: must be a positive integer")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise ModelSourceError(f"--dtype {self.dtype!r}: unknown dtype; use one of {', '.join(DTYPE_BYTES)}")

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Estimate:
    """Sizes known before building anything (from the config; torchtitan: a meta-device build, which allocates
    nothing)."""

    param_bytes: int
    """All parameters of the model in its dtype."""
    largest_layer_param_bytes: int
    embed_param_bytes: int
    head_param_bytes: int
    layer_activation_bytes: int
    """Bytes autograd keeps for one layer and one microbatch (a rough upper estimate)."""
    head_activation_bytes: int
    """Logits and loss of one microbatch."""
    largest_tensor_bytes: int = 0
    """The largest single parameter tensor of a layer (a backward's transient gradient; 0: not known)."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model`` (see the module docstring). Plain data; the torch work is in the methods."""

    text: str
    """Normalised source text: ``builtin:tiny``, ``torchtitan:llama3/debugmodel``, ``python:pkg.mod:make``."""
    scheme: str
    config: ModelConfig
    """Shapes as the core knows them (``hidden`` = the boundary width, ``layers``, ``vocab``, microbatch, dtype)."""
    layer_kinds: tuple[str, ...]
    """Kind of each layer, in order (``("dense", "moe", "moe", ...)``; one kind: all ``"layer"``)."""
    kind_descriptions: tuple[tuple[str, str], ...]
    """``(kind, what distinguishes it)`` per distinct kind, in first-seen order."""
    num_params: int
    attention: str
    """Attention backend used: ``"sdpa"``, ``"flex"``, or :data:`SDPA_ON_CPU` when substituted on CPU."""
    estimate: Estimate
    device: str = "cpu"
    family: str | None = None
    flavor: str | None = None
    options: ModelOptions = field(default_factory=ModelOptions)
    """The options it was resolved with (what re-resolving it in another process needs)."""
    notes: tuple[str, ...] = ()

    # --- plain facts ---------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct layer kinds, in first-seen order."""
        return tuple(k for k, _ in self.kind_descriptions)

    def block_name(self, layer: int) -> str:
        """The profile block of layer ``layer``: ``layer`` (one kind) or ``layer.<kind>``."""
        return block_name_of(self.layer_kinds[layer], single=len(self.kinds) == 1)

    def layout(self) -> list[str]:
        """The profile's ``layout``: ``["embed", <block of each layer>..., "head"]``."""
        return ["embed", *(self.block_name(i) for i in range(self.num_layers)), "head"]

    def describe(self) -> dict[str, Any]:
        """The profile's ``source`` object (version 3)."""
        return {
            "source": self.text, "scheme": self.scheme, "family": self.family, "flavor": self.flavor,
            "num_params": self.num_params, "attention": self.attention,
            "layer_kinds": list(self.layer_kinds),
            "kinds": {k: d for k, d in self.kind_descriptions},
            "options": self.options.given(),
        }

    def summary(self) -> str:
        """One line for the output: source, parameters, layers by kind, attention."""
        counts = ", ".join(f"{self.layer_kinds.count(k)} {k}" for k in self.kinds)
        return (f"model {self.text}: {fmt_count(self.num_params)} parameters, {self.num_layers} layers ({counts}), "
                f"microbatch {self.config.mb_size}x{self.config.seq_len}, {self.config.dtype}; "
                f"attention: {self.attention}")

    def run_bytes(self, *, num_ranks: int, num_microbatches: int, synthetic: bool) -> int:
        """What a local run of this model on ``num_ranks`` ranks holds (:func:`ppsim.limits.run_memory_bytes`;
        ``synthetic``: sleeping stages that only pass boundary tensors)."""
        from ppsim.limits import run_memory_bytes

        cfg, est = self.config, self.estimate
        tokens = cfg.mb_size * cfg.seq_len
        if synthetic:
            return run_memory_bytes(num_ranks=num_ranks, num_microbatches=num_microbatches,
                                    weight_bytes=2 * cfg.vocab * cfg.hidden * cfg.itemsize,
                                    microbatch_bytes=4 * tokens * cfg.hidden * cfg.itemsize)
        return run_memory_bytes(
            num_ranks=num_ranks, num_microbatches=num_microbatches, weight_bytes=est.param_bytes,
            microbatch_bytes=cfg.layers * est.layer_activation_bytes + est.head_activation_bytes,
            whole_model_bytes=0 if self.scheme == "builtin" else est.param_bytes,
        )

    # --- torch ---------------------------------------------------------------------------------------------------
    def build_full(self, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
        """The unsplit model, weights fixed by ``seed``, placed on ``device`` in the model's dtype."""
        return _backend(self.scheme).full_module(self, seed=seed, device=device)

    def build_stage(self, layer_ids: Sequence[int], *, has_embedding: bool, has_head: bool, seed: int = 0,
                    device: str | torch.device = "cpu", random_weights: bool = False) -> nn.Module:
        """A module holding layers ``layer_ids`` (plus the embedding / final norm + head when asked), with the
        weights :meth:`build_full` gives the same blocks for the same seed. Input: token ids ``(mb, seq)`` with the
        embedding, else hidden states :attr:`ModelConfig.boundary_shape`; output: logits with the head, else hidden
        states. ``device="meta"`` builds shapes only. ``random_weights`` (torchtitan): allocate only this stage,
        cut from a meta-device build, with weights of its own (the whole model is never materialised)."""
        ids = tuple(int(i) for i in layer_ids)
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ModelSourceError(f"layer {i}: the model {self.text} has layers 0..{self.num_layers - 1}")
        extra = {"random_weights": True} if random_weights and self.scheme == "torchtitan" else {}
        return _backend(self.scheme).stage_module(self, ids, has_embedding=has_embedding, has_head=has_head,
                                                 seed=seed, device=device, **extra)

    def reference_name(self, layer_ids: Sequence[int], local_name: str) -> str:
        """Name in :meth:`build_full`'s model of the parameter ``local_name`` of a stage holding ``layer_ids``."""
        return _backend(self.scheme).param_name(self, tuple(layer_ids), local_name)

    def stage_input(self, *, first: bool, seed: int = 0, salt: int = 0,
                    device: str | torch.device = "cpu") -> torch.Tensor:
        """A representative input for one microbatch: token ids when ``first`` (the stage holds the embedding),
        else hidden states of the boundary shape in the model's dtype."""
        import torch

        from ppsim.calibrate.models.transformer import DTYPES

        gen = torch.Generator().manual_seed(seed + 7919 * (salt + 1))
        cfg = self.config
        if first:
            return torch.randint(0, cfg.vocab, (cfg.mb_size, cfg.seq_len), generator=gen).to(device)
        x = torch.randn(cfg.boundary_shape, generator=gen)
        return x.to(device=torch.device(device), dtype=DTYPES[cfg.dtype])

    def make_batch(self, num_microbatches: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets, ``(num_microbatches * mb_size, seq_len)`` int64 each, on CPU."""
        from ppsim.calibrate.models.transformer import make_batch

        return make_batch(self.config, num_microbatches, seed=seed)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over all tokens (mean), in float32."""
        from ppsim.calibrate.models.transformer import loss_fn

        return loss_fn(logits, targets)


def fmt_count(n: int) -> str:
    """``6.16M``, ``70.6B``."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def place(module: nn.Module, *, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """Move ``module`` to ``device`` and cast its floating-point parameters and buffers to ``dtype`` (complex
    buffers such as a RoPE table stay as they are: ``Module.to(dtype)`` would drop their imaginary part)."""
    import torch

    module = module.to(device=torch.device(device))
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def block_name_of(kind: str, *, single: bool) -> str:
    return "layer" if single else f"layer.{kind}"


def parse_model_source(text: str | None = None, options: ModelOptions | None = None, *,
                       device: str = "cpu", preset: str | None = None) -> ModelSource:
    """Resolve ``--model`` (``None``: ``builtin:<preset or tiny>``) with the size ``options`` for ``device``.
    Every mistake is one :class:`ModelSourceError` line; nothing is built (torchtitan configs are counted on the
    meta device)."""
    options = options or ModelOptions()
    if text is None:
        if preset is not None:
            from ppsim.model_config import get_preset

            get_preset(preset)  # the alias's own one-line error
        text = f"builtin:{preset or 'tiny'}"
    elif preset is not None:
        raise ModelSourceError(f"--preset {preset} and --model {text} both given: --preset is an alias of "
                               f"--model builtin:{preset}; pass only --model")
    raw = text.strip()
    scheme, sep, rest = raw.partition(":")
    if not sep:
        scheme, rest = "builtin", raw  # a bare preset name: `--model tiny`
    scheme = scheme.lower()
    if scheme not in SCHEMES or not rest:
        raise ModelSourceError(f"--model {text!r}: expected builtin:NAME, torchtitan:FAMILY/FLAVOR or "
                               f"python:PKG.MODULE:FACTORY, e.g. {EXAMPLES}")
    return _backend(scheme).resolve(rest, options, device=device)


def source_from_profile(data: dict[str, Any], *, device: str) -> ModelSource | None:
    """The model source a version-3 profile's ``source`` object names (``None`` for older profiles)."""
    src = data.get("source") if isinstance(data, dict) else None
    if not isinstance(src, dict) or not isinstance(src.get("source"), str):
        return None
    opts = src.get("options") or {}
    return parse_model_source(src["source"], ModelOptions(**{k: v for k, v in opts.items()
                                                             if k in ModelOptions.__dataclass_fields__}),
                              device=device)


def _backend(scheme: str) -> Any:
    if scheme == "builtin":
        from ppsim.calibrate.models import builtin

        return builtin
    if scheme == "torchtitan":
        from ppsim.calibrate.models import torchtitan

        return torchtitan
    if scheme == "python":
        from ppsim.calibrate.models import python_factory

        return python_factory
    raise AssertionError(scheme)


def drop_cached_models() -> None:
    """Forget the unsplit models kept between builds (torchtitan's and ``python:`` factories'), so that a rank holds
    its job alone while its memory is measured; a later build makes them again."""
    import sys

    for name in ("ppsim.calibrate.models.torchtitan", "ppsim.calibrate.models.python_factory"):
        module = sys.modules.get(name)
        if module is not None:
            module._CACHE.clear()


def kinds_of(keys: Sequence[Any], bases: Sequence[str], descriptions: Sequence[str]
             ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Name the distinct structural ``keys`` of the layers: ``bases[i]`` (e.g. ``dense``/``moe``) when one key has
    that base, ``base``, ``base-2``, ... when several do; a model whose layers are all alike has the one kind
    ``layer``. Returns each layer's kind and ``(kind, description)`` per distinct kind."""
    distinct: list[Any] = []
    for key in keys:
        if key not in distinct:
            distinct.append(key)
    if len(distinct) == 1:
        return tuple("layer" for _ in keys), (("layer", descriptions[0]),)
    first = {key: keys.index(key) for key in distinct}
    names: dict[Any, str] = {}
    used: dict[str, int] = {}
    for key in distinct:
        base = bases[first[key]]
        used[base] = used.get(base, 0) + 1
        names[key] = base if used[base] == 1 else f"{base}-{used[base]}"
    return (tuple(names[k] for k in keys),
            tuple((names[k], descriptions[first[k]]) for k in distinct))
