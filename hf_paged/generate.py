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
import types
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from hf_paged import attention
from hf_paged.block_manager import check_block_options
from hf_paged.cache import PagedKVCache
from hf_paged.model_info import cache_kwarg, check_supported, takes_logits_to_keep, token_id_list

CACHE_IMPLEMENTATION = "hf_paged"
_OPTIONS_ATTR = "_hf_paged_options"


def enable(model: PreTrainedModel, block_size: int = 16, num_blocks: int | None = None) -> PreTrainedModel:
    """Make ``model`` paged-capable; calling it again changes the options.

    * sets ``attn_implementation="hf_paged"`` (calls without a paged cache still run the model's
      previous implementation, so training and ordinary ``generate`` are unchanged);
    * wraps this instance's ``generate`` so that ``cache_implementation="hf_paged"`` runs on a
      fresh :class:`PagedKVCache` of ``block_size`` tokens per block and ``num_blocks`` blocks
      (``None``: grow on demand).
    """
    check_supported(model)
    check_block_options(block_size, num_blocks)
    attention.install(model)
    setattr(model, _OPTIONS_ATTR, {"block_size": block_size, "num_blocks": num_blocks})
    if not isinstance(model.__dict__.get("generate"), types.MethodType):
        model.generate = types.MethodType(_paged_generate, model)
    return model


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`enable` (or an engine's attention install): the previous attention
    implementation and stock ``generate``."""
    attention.uninstall(model)
    if getattr(model, _OPTIONS_ATTR, None) is not None:
        model.__dict__.pop("generate", None)
        delattr(model, _OPTIONS_ATTR)
    return model


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
    cache_name = cache_kwarg(self)
    if "cache" in kwargs and cache_name != "cache":  # transformers < 5.2x knows only the old name
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
            kwargs[cache_name] = cache
            created = True
    if not isinstance(cache, PagedKVCache):
        return stock_generate(*args, **kwargs)
    if self.config._attn_implementation != attention.ATTN_IMPLEMENTATION:
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
    pad = config.pad_token_id
    if pad is not None and pad not in token_id_list(config.eos_token_id) and bool((input_ids == pad).any()):
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
        cache_kwarg(model): cache,
        "use_cache": True,
    }
    if takes_logits_to_keep(model):
        forward_kwargs["logits_to_keep"] = 1
    model(**forward_kwargs)
    cache.batch_repeat_interleave(expand)
