"""``enable(model)``: the ``cache_implementation="hf_paged"`` flag for ``model.generate``.

transformers has no registry for cache implementations (``GenerationConfig`` validates a fixed
tuple), so the flag is handled by wrapping *this model instance's* ``generate``: without the flag
(and without a :class:`PagedKVCache` passed in) the wrapper calls stock ``generate`` untouched.

Shared prompts (paper §4.4): with ``num_beams=k`` or ``num_return_sequences=n`` stock ``generate``
repeats every prompt before prefill, so each copy would be computed and stored again. Instead the
wrapper prefills the distinct prompts (all but their last token) once, forks each prompt's blocks
to its copies, and hands the pre-filled cache to ``generate``, which then computes only the last
prompt token per copy. The copies share the prompt's blocks; only the partial last block is
copied, on write.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from hf_paged.attention import ATTN_IMPLEMENTATION, fallback_implementation, set_fallback_implementation
from hf_paged.cache import PagedKVCache

CACHE_IMPLEMENTATION = "hf_paged"
_OPTIONS_ATTR = "_hf_paged_options"


def _check_supported(model: PreTrainedModel) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hf_paged.enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{type(model).__name__} computes attention inline instead of through transformers' "
            "AttentionInterface, so its KV cache cannot be paged (hf_paged supports Llama, Mistral, Qwen2/3, "
            "Gemma2/3, GPT-2, OPT, Phi-3, GPT-NeoX and other models that route through AttentionInterface)"
        )
    text_config = model.config.get_text_config(decoder=True)
    PagedKVCache(text_config)  # raises early, naming the config, for unsupported layer structures


def enable(model: PreTrainedModel, block_size: int = 16, num_blocks: int | None = None) -> PreTrainedModel:
    """Make ``model`` paged-capable; calling it again changes the options.

    * sets ``attn_implementation="hf_paged"`` (calls without a paged cache still run the model's
      previous implementation, so training and ordinary ``generate`` are unchanged);
    * wraps this instance's ``generate`` so that ``cache_implementation="hf_paged"`` runs on a
      fresh :class:`PagedKVCache` of ``block_size`` tokens per block and ``num_blocks`` blocks
      (``None``: grow on demand).
    """
    _check_supported(model)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
    current = model.config._attn_implementation
    if current != ATTN_IMPLEMENTATION:
        fallback = current or "sdpa"
        for config in (model.config, model.config.get_text_config(decoder=True)):
            set_fallback_implementation(config, fallback)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model, _OPTIONS_ATTR, {"block_size": block_size, "num_blocks": num_blocks})
    if not isinstance(model.__dict__.get("generate"), types.MethodType):
        model.generate = types.MethodType(_paged_generate, model)
    return model


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`enable`: the previous attention implementation and stock ``generate``."""
    if getattr(model, _OPTIONS_ATTR, None) is None:
        return model
    model.set_attn_implementation(fallback_implementation(model.config) or "sdpa")
    model.__dict__.pop("generate", None)
    delattr(model, _OPTIONS_ATTR)
    return model


def _cache_kwarg_name(model: PreTrainedModel) -> str:
    """``cache`` on transformers >= 5.2x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _paged_generate(self: PreTrainedModel, *args, **kwargs):
    stock_generate = functools.partial(type(self).generate, self)
    flagged = kwargs.get("cache_implementation") == CACHE_IMPLEMENTATION
    config = kwargs.get("generation_config")
    if isinstance(config, GenerationConfig) and config.cache_implementation == CACHE_IMPLEMENTATION:
        config = kwargs["generation_config"] = GenerationConfig.from_dict(config.to_dict())
        config.cache_implementation = None
        flagged = True
    if flagged:
        kwargs.pop("cache_implementation", None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if "cache" in kwargs and _cache_kwarg_name(self) != "cache":  # transformers < 5.2x knows only the old name
        kwargs["past_key_values"] = kwargs.pop("cache")
    created = False
    if flagged:
        if cache is not None and not isinstance(cache, PagedKVCache):
            raise ValueError(
                f"cache_implementation='hf_paged' was given together with a {type(cache).__name__}; pass no cache "
                "(a PagedKVCache is created) or a PagedKVCache"
            )
        if cache is None:
            cache = PagedKVCache(self.config, **getattr(self, _OPTIONS_ATTR))
            kwargs[_cache_kwarg_name(self)] = cache
            created = True
    if not isinstance(cache, PagedKVCache):
        return stock_generate(*args, **kwargs)
    if self.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"a PagedKVCache needs attn_implementation='hf_paged', but the model uses "
            f"'{self.config._attn_implementation}'; call hf_paged.enable(model)"
        )
    try:
        _prefill_shared_prompts(self, cache, args, kwargs)
        result = stock_generate(*args, **kwargs)
    except BaseException:
        if created:
            cache.release()
        raise
    if created and not hasattr(result, "sequences"):  # the caller cannot reach the cache: free it now
        cache.release()
    return result


def _expansion(model: PreTrainedModel, kwargs: dict[str, Any]) -> int:
    config = kwargs.get("generation_config") or model.generation_config
    beams = kwargs.get("num_beams", config.num_beams) or 1
    returns = kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    return max(beams, returns)


def _input_ids(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() else None


def _padding_mask(model: PreTrainedModel, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The 2D mask generate will use (inferred from the pad token when none is given, as generate does)."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return mask
    config = kwargs.get("generation_config") or model.generation_config
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


@torch.no_grad()
def _prefill_shared_prompts(model: PreTrainedModel, cache: PagedKVCache, args: tuple, kwargs: dict[str, Any]) -> None:
    """Compute and store each distinct prompt once (but its last token), then fork it to its copies."""
    expand = _expansion(model, kwargs)
    input_ids = _input_ids(args, kwargs)
    if expand <= 1 or input_ids is None or input_ids.shape[1] < 2 or cache.get_seq_length() > 0:
        return
    mask = _padding_mask(model, input_ids, kwargs)
    if not bool(mask[:, -1].all()):  # right padding: the last column is not every row's last token
        return
    kwargs["attention_mask"] = mask
    prefix_mask = mask[:, :-1]
    position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
    forward_kwargs = {
        "input_ids": input_ids[:, :-1],
        "attention_mask": prefix_mask,
        "position_ids": position_ids,
        _cache_kwarg_name(model): cache,
        "use_cache": True,
    }
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        forward_kwargs["logits_to_keep"] = 1
    model(**forward_kwargs)
    cache.batch_repeat_interleave(expand)
