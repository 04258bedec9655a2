"""What hf_paged needs to know about a transformers model, derived in one place.

Whether it can be paged (the rule: :mod:`hf_paged.model_support`), its layer structure (full or
sliding attention, and each window), the bytes one token of KV takes, which keyword its forward
takes the cache under, and its EOS ids. The cache, ``enable()``, the engine and the benchmarks all ask here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from hf_paged import kinds
from hf_paged.kinds import KVSpec


def check_supported(model: PreTrainedModel) -> None:
    """Raise, naming the class, unless ``model``'s layers can be paged (on generate()'s reference route).

    ``TypeError`` for something that is not a ``PreTrainedModel``, ``NotImplementedError`` with the
    reason otherwise; the rule is :func:`hf_paged.model_support.reference_problem`.
    """
    from hf_paged import model_support  # not at import: `python -m hf_paged.model_support` runs it as __main__

    model_support.check_supported(model)


def kernel_route_problem(model: PreTrainedModel):
    """Why ``generate()`` reads ``model`` on the reference route even where Triton runs (a
    :class:`~hf_paged.model_support.Support`), or None: :func:`hf_paged.model_support.kernel_route_problem`."""
    from hf_paged import model_support

    return model_support.kernel_route_problem(model)


def check_engine_supported(model: PreTrainedModel) -> None:
    """What ``LLMEngine`` asks: :func:`check_supported`, then ``ValueError`` for a model that only
    ``generate()`` can page (hybrid layers, attention the engine cannot read;
    :func:`hf_paged.model_support.classify_routes`)."""
    from hf_paged import model_support

    model_support.check_engine_supported(model)


def layer_kinds(config: PretrainedConfig) -> tuple[list[str], list[KVSpec | None]]:
    """Per-layer (type, kind spec), derived the way ``DynamicCache(config=...)`` derives the layers
    (a spec is None for a layer without K/V: state-space, convolution, MLP-only; see :mod:`hf_paged.kinds`).

    Raises ``NotImplementedError`` for layers the paged cache cannot hold (see
    :func:`hf_paged.model_support.layer_problem`). Reading configs is slow: callers on a hot path
    derive this once and keep it.
    """
    from hf_paged import model_support

    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    problem = model_support.layer_problem(config, layer_types)
    if problem is not None:
        raise NotImplementedError(f"{type(config).__name__}: PagedKVCache cannot hold these layers: {problem}")
    if isinstance(layer_kwargs, dict):  # transformers < 5.24: one dict for all layers
        layer_kwargs = [layer_kwargs] * len(layer_types)
    return list(layer_types), kinds.layer_specs(config, list(layer_types), list(layer_kwargs))


def state_kinds(config: PretrainedConfig) -> list[kinds.RecurrentStateSpec | None]:
    """Per layer, its recurrent-state spec (None: no conv / recurrent state), derived the way
    ``DynamicCache(config=...)`` derives its layers (see :mod:`hf_paged.kinds.recurrent`)."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, dict):  # transformers < 5.24: one dict for all layers
        layer_kwargs = [layer_kwargs] * len(layer_types)
    return kinds.state_specs(config, list(layer_types), list(layer_kwargs))


def layer_structure(config: PretrainedConfig) -> tuple[list[str], list[int | None]]:
    """Per-layer (type, window): the tokens of the past each layer's cache keeps as ``DynamicCache``
    keeps them (a sliding window, a chunk size; None: all, or no K/V). See :func:`layer_kinds`."""
    layer_types, specs = layer_kinds(config)
    return layer_types, [None if spec is None else spec.window for spec in specs]


def layer_configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """One config per decoder layer of ``config`` (a text config): a heterogeneous config's
    per-layer views (Gemma 4), else ``config`` itself for every layer."""
    try:
        return list(config.per_layer_config)
    except Exception:  # noqa: BLE001 - configs without per-layer views
        return [config] * config.num_hidden_layers


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, layer_ids: Iterable[int] | None = None) -> int:
    """Bytes of K and V one token takes over all layers of ``config`` (a text config), or those of
    ``layer_ids``, in ``dtype``: each layer's kind says (:meth:`hf_paged.kinds.KVSpec.bytes_per_token`;
    an MLA layer stores a latent and a rotary key, a KV-sharing layer nothing, a layer without K/V
    nothing). Heterogeneous configs (Gemma 4: another head size on full-attention layers) are
    read layer by layer."""
    layers = layer_configs(config)
    try:
        specs = layer_kinds(config)[1]
    except NotImplementedError:  # layers the cache cannot hold: count every layer as full attention
        specs = [kinds.FullAttentionSpec()] * len(layers)
    ids = range(len(layers)) if layer_ids is None else layer_ids
    size = torch.finfo(dtype).bits // 8
    return sum(specs[i].bytes_per_token(layers[i], size) for i in ids if specs[i] is not None)


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's positions cover (None when the config does not say)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The keyword ``model.forward`` takes the cache under: ``cache`` on transformers >= 5.2x,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def takes_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether ``model.forward`` can compute logits at chosen positions only."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def token_id_list(ids: int | Iterable[int] | None) -> list[int]:
    """An EOS setting (None, one id, or several) as a list of ids."""
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def eos_token_ids(model: PreTrainedModel, tokenizer=None) -> list[int]:
    """The model's EOS ids: its generation config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return token_id_list(eos)
