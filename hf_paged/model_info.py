"""What hf_paged needs to know about a transformers model, derived in one place.

Whether it can be paged, its layer structure (full or sliding attention, and each window), the
bytes one token of KV takes, which keyword its forward takes the cache under, and its EOS ids.
The cache, ``enable()``, the engine and the benchmarks all ask here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(model: PreTrainedModel) -> None:
    """Raise, naming the class, unless ``model``'s attention and layers can be paged."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hf_paged.enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{type(model).__name__} computes attention inline instead of through transformers' "
            "AttentionInterface, so its KV cache cannot be paged (hf_paged supports Llama, Mistral, Qwen2/3, "
            "Gemma2/3, GPT-2, OPT, Phi-3, GPT-NeoX and other models that route through AttentionInterface)"
        )
    layer_structure(model.config.get_text_config(decoder=True))


def layer_structure(config: PretrainedConfig) -> tuple[list[str], list[int | None]]:
    """Per-layer (type, sliding window), derived the way ``DynamicCache(config=...)`` derives it.

    Reading configs is slow: callers on a hot path derive this once and keep it.
    """
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, dict):  # transformers < 5.24: one dict for all layers
        layer_kwargs = [layer_kwargs] * len(layer_types)
    if getattr(config, "num_kv_shared_layers", 0) or len(layer_types) != config.num_hidden_layers:
        raise NotImplementedError(
            f"{type(config).__name__}: layers that reuse another layer's KV cache are not supported by PagedKVCache"
        )
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise NotImplementedError(
            f"{type(config).__name__}: PagedKVCache supports {SUPPORTED_LAYER_TYPES} layers, not {unsupported}"
        )
    windows = [kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(layer_types, layer_kwargs)]
    return list(layer_types), windows


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes over all layers of ``config`` (a text config) in ``dtype``."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * (torch.finfo(dtype).bits // 8)


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
