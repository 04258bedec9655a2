"""``enable(model)``: paged ``generate()`` through the ``cache_implementation="hf_paged"`` flag.

transformers has no registry for cache implementations, so hf_paged adds two narrow hooks when it
is imported, and nothing else on transformers' classes:

1. ``GenerationConfig`` validation accepts ``"hf_paged"`` (it is appended to transformers' tuple of
   cache implementations), so the flag can live wherever generation options live: a ``generate``
   keyword, ``generation_config=``, ``model.generation_config``, a ``generation_config.json``, a
   pipeline's generate options.
2. ``GenerationMixin._prepare_cache_for_generation``: when the merged generation config asks for
   ``"hf_paged"``, an enabled model gets a fresh :class:`PagedKVCache` (a model that was never
   enabled gets an error saying so). Every other call goes to transformers' own code unchanged.
   Hooking cache preparation (not ``generate``) makes every route into ``generate`` work,
   ``GenerationMixin.generate(model, ...)`` and subclasses calling ``super().generate`` included.

``enable`` itself adds torch forward hooks to that one model. A forward given a ``PagedKVCache``
opens on it with its padding mask: on the reference route (CPU) the cache's ``update`` returns
the K/V a ``DynamicCache`` would and the model's own attention runs, unchanged; on the kernel route
(Triton) the forward runs with the ``"hf_paged"`` attention implementation (``attention.paged_call``),
which reads the blocks. Every other forward is stock, and ``model.config._attn_implementation``
reads as before outside kernel-route forwards.

Prefix caching (``enable(model, prefix_caching=True)``, :mod:`hf_paged.prefix_cache`): the first
forward of a flagged call starts after the columns every row finds cached in the model's
persistent pool.

Shared prompts (paper §4.4): with ``num_beams=k`` or ``num_return_sequences=n`` stock ``generate``
repeats every prompt k times before the first forward. The first forward of a paged call instead
runs the distinct prompts once and forks each prompt's blocks to its copies; the LM head alone runs
on the repeated hidden states, so the logits come from a matrix of the shape stock uses and are
bit-identical (the decoder layers compute a row the same whatever the batch; the LM head on one
row per prompt would not: a matrix-vector product rounds differently). Calls that ask for
attentions or hidden states compute every copy, as stock does, so those outputs match too.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import configuration_utils as generation_configuration

from hf_paged import attention, kernels, state_layers
from hf_paged.block_manager import check_block_options
from hf_paged.cache import PagedKVCache
from hf_paged.channel import StashingCache, clear_active_cache
from hf_paged.model_info import cache_kwarg, check_supported, kernel_route_problem, layer_structure
from hf_paged.prefix_cache import PrefixCache, skip_cached_prefix

CACHE_IMPLEMENTATION = "hf_paged"
_OPTIONS_ATTR = "_hf_paged_options"


@dataclass
class _Options:
    """What ``enable`` set on one model (an attribute of the model instance, never saved)."""

    block_size: int
    num_blocks: int | None
    kernel_route_problem: object = None  # why the kernels never read this model (None: they may, where Triton runs)
    prefix: PrefixCache | None = None  # with prefix_caching=True
    hooks: list = field(default_factory=list)
    calls: dict[int, _PagedForward] = field(default_factory=dict)  # by thread: its paged forward in flight


def enable(model: PreTrainedModel, block_size: int = 16, num_blocks: int | None = None,
           prefix_caching: bool = False) -> PreTrainedModel:
    """Make ``model`` paged-capable; calling it again changes the options.

    ``cache_implementation="hf_paged"`` then runs ``generate`` on a fresh :class:`PagedKVCache` of
    ``block_size`` tokens per block and ``num_blocks`` blocks (``None``: grow on demand), and any
    forward given a ``PagedKVCache`` is paged. Everything else the model does stays stock.

    With ``prefix_caching=True`` every flagged call shares one persistent pool of ``num_blocks``
    blocks per layer instead (:func:`prefix_cache`): a row adopts the cached blocks of its
    prompt's longest cached prefix and computes only the rest, rows of one batch that share a
    prefix compute it once, and cached blocks nobody holds are evicted in LRU order when the
    budget needs them. Changing any option starts an empty prefix cache.
    """
    check_supported(model)
    check_block_options(block_size, num_blocks)
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
    if prefix_caching:
        layer_types, _ = layer_structure(model.config.get_text_config(decoder=True))
        if any(t in state_layers.STATE_ONLY_TYPES + state_layers.HYBRID_TYPES for t in layer_types):
            raise ValueError(f"prefix_caching=True: {type(model).__name__} has non-attention (recurrent) layers, "
                             "whose state at a prefix's end is not kept in blocks; use prefix_caching=False")
    options = getattr(model, _OPTIONS_ATTR, None)
    if options is None:
        options = _Options(block_size, num_blocks)
        options.hooks = [
            model.register_forward_pre_hook(_before_forward, with_kwargs=True),
            model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True),
        ]
        setattr(model, _OPTIONS_ATTR, options)
    same = (options.block_size, options.num_blocks) == (block_size, num_blocks)
    options.block_size, options.num_blocks = block_size, num_blocks
    options.kernel_route_problem = kernel_route_problem(model)
    if not prefix_caching:
        options.prefix = None
    elif options.prefix is None or not same:
        options.prefix = PrefixCache(model, block_size, num_blocks)
    return model


def prefix_cache(model: PreTrainedModel) -> PrefixCache:
    """The prefix cache of a model enabled with ``prefix_caching=True``: ``stats()``, ``save(path)``,
    ``load(path)``, ``clear()``."""
    options = getattr(model, _OPTIONS_ATTR, None)
    if options is None or options.prefix is None:
        raise ValueError(f"{type(model).__name__} has no prefix cache: call "
                         "hf_paged.enable(model, prefix_caching=True) first")
    return options.prefix.bind(model)


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`enable`: the model is stock again."""
    options = getattr(model, _OPTIONS_ATTR, None)
    if options is not None:
        for handle in options.hooks:
            handle.remove()
        delattr(model, _OPTIONS_ATTR)
    return model


def is_enabled(model: PreTrainedModel) -> bool:
    return getattr(model, _OPTIONS_ATTR, None) is not None


# ---------------------------------------------------------------------- hooks on transformers
def _accept_flag_in_generation_configs() -> None:
    if CACHE_IMPLEMENTATION not in generation_configuration.ALL_CACHE_IMPLEMENTATIONS:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS += (CACHE_IMPLEMENTATION,)


_stock_prepare_cache = GenerationMixin._prepare_cache_for_generation


@functools.wraps(_stock_prepare_cache)
def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """transformers' cache preparation, plus ``cache_implementation="hf_paged"``."""
    flagged = generation_config.cache_implementation == CACHE_IMPLEMENTATION
    if flagged and not is_enabled(self) and getattr(generation_config, "is_assistant", False):
        generation_config.cache_implementation = None  # an assistant inherited the flag: its default cache
        flagged = False
    if not flagged:
        result = _stock_prepare_cache(self, generation_config, model_kwargs, *args, **kwargs)
        _note_prompt_copies(model_kwargs.get(cache_kwarg(self)), generation_config)
        return result
    if not is_enabled(self):
        raise ValueError(f"cache_implementation='hf_paged' needs hf_paged.enable(model) first "
                         f"({type(self).__name__} was not enabled)")
    name = cache_kwarg(self)
    cache = model_kwargs.get(name)
    if cache is not None and not isinstance(cache, PagedKVCache):
        raise ValueError(
            f"cache_implementation='hf_paged' was given together with a {type(cache).__name__}; pass no cache "
            "(a PagedKVCache is created) or a PagedKVCache"
        )
    if generation_config.use_cache is False:
        return None
    if cache is None:
        options = getattr(self, _OPTIONS_ATTR)
        cache = model_kwargs[name] = (options.prefix.bind(self).new_cache() if options.prefix is not None
                                      else PagedKVCache(self.config, options.block_size, options.num_blocks))
        if getattr(generation_config, "is_assistant", False):  # as stock marks an assistant's new cache: its
            cache.activate_past_recording()                    # drafts are rolled back (transformers 5.17)
    _note_prompt_copies(cache, generation_config)
    return None


def _note_prompt_copies(cache, generation_config) -> None:
    """Tell a fresh paged cache how many copies of each prompt ``generate`` will send. A call that
    returns scores or logits computes every copy, as stock does: a forward of fewer rows may round
    differently in the last bits (matmuls of a few rows, MoE routing, a head's transform before the
    output embeddings), which tokens practically never show but those outputs would."""
    if isinstance(cache, PagedKVCache) and cache.get_seq_length() == 0:
        exact = generation_config.output_scores or generation_config.output_logits
        cache.prompt_copies = 1 if exact else max(generation_config.num_beams or 1,
                                                  generation_config.num_return_sequences or 1)


_accept_flag_in_generation_configs()
GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation


# ---------------------------------------------------------------------- forward hooks of an enabled model
@dataclass
class _PagedForward:
    saved: list | None  # the attention implementations to restore (kernel route and engine steps)
    cache: StashingCache
    copies: int = 1  # > 1: the distinct prompts run once, forked to this many copies after
    lm_head_hook: Any = None


def _paged_cache(kwargs: dict) -> StashingCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, StashingCache) else None


def _uses_kernels(model: PreTrainedModel, kwargs: dict) -> bool:
    """Whether this forward's K/V are read by the Triton kernels (the backend switch, the device)."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    return kernels.use_triton(inputs if isinstance(inputs, torch.Tensor) else next(model.parameters()))


def _before_forward(model: PreTrainedModel, args: tuple, kwargs: dict):
    """Open a paged forward: a ``PagedKVCache`` on the reference route needs nothing switched (its
    ``update`` returns dense K/V to the model's own attention); the kernel route and engine steps
    run the ``"hf_paged"`` attention implementation for this forward.

    Every forward first closes what an interrupted one left open in its thread (a forward never
    runs inside another of the same model): torch runs ``always_call`` hooks when a forward raises
    an ``Exception``, not on Ctrl-C (``KeyboardInterrupt``), which would leave the LM head
    repeating rows for every later call, stock ones too."""
    options = getattr(model, _OPTIONS_ATTR)
    abandoned = options.calls.pop(threading.get_ident(), None)
    if abandoned is not None:
        _close(abandoned, output=None)
    cache = _paged_cache(kwargs)
    if cache is None:
        return None
    paged_cache = isinstance(cache, PagedKVCache)
    distinct = _distinct_prompt_kwargs(model, cache, args, kwargs) if paged_cache else None
    inputs = distinct or kwargs
    if paged_cache and not args:  # a prefix cache: skip the columns every row has cached (first forward)
        inputs = skip_cached_prefix(model, cache, inputs) or inputs
    problem = options.kernel_route_problem
    use_kernels = not paged_cache or (problem is None and cache.kernel_route_problem is None
                                      and _uses_kernels(model, kwargs))
    call = _PagedForward(attention.begin_paged_call(model) if use_kernels else None, cache)
    options.calls[threading.get_ident()] = call
    if paged_cache:
        cache.stock_layout = problem is not None and not problem.reads_latent  # see PagedKVCache.begin_forward
        cache.contiguous_kv = model.config._attn_implementation != "sdpa"
        cache.begin_forward(inputs.get("attention_mask"), use_kernels, inputs.get("input_ids"))
    if distinct is None:
        return None if inputs is kwargs else (args, inputs)
    call.copies = copies = cache.prompt_copies
    owner = threading.get_ident()

    def repeat_rows(module, inputs):  # this thread's forward only (another may use the model meanwhile)
        return (inputs[0].repeat_interleave(copies, 0), *inputs[1:]) if threading.get_ident() == owner else None

    call.lm_head_hook = model.get_output_embeddings().register_forward_pre_hook(repeat_rows)
    return args, inputs


def _after_forward(model: PreTrainedModel, args: tuple, kwargs: dict, output):
    options = getattr(model, _OPTIONS_ATTR, None)
    call = options.calls.pop(threading.get_ident(), None) if options is not None else None
    return None if call is None else _close(call, output)


def _close(call: _PagedForward, output):
    """Undo what the forward's opening did; ``output`` None: the forward raised."""
    cache = call.cache
    if call.saved is not None:
        attention.end_paged_call(call.saved)
    if isinstance(cache, PagedKVCache):
        cache.end_forward(completed=output is not None)
    clear_active_cache()
    if call.copies == 1:
        return None
    call.lm_head_hook.remove()
    cache.prompt_copies = 1
    if output is None:
        return None
    cache.batch_repeat_interleave(call.copies)
    rows = cache.batch_size // call.copies
    for key, value in output.items():  # every per-row output but the logits (already repeated)
        if key != "logits" and isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            output[key] = value.repeat_interleave(call.copies, 0)
    return output


def _distinct_prompt_kwargs(model: PreTrainedModel, cache: PagedKVCache, args: tuple, kwargs: dict) -> dict | None:
    """The first forward's inputs with each prompt once, if it is safe and worth it (else None)."""
    copies = cache.prompt_copies
    if copies <= 1 or args or cache.get_seq_length() > 0 or model.get_output_embeddings() is None:
        return None
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return None  # those outputs are per copy: compute every copy, as stock does
    if state_layers.has_state_layers(cache):
        # Hybrid models compute every copy, as stock does. Their linear-attention layers' torch
        # kernels do not give a row the same bits in a smaller batch (Qwen3.5's gated delta rule:
        # logits 1e-6 apart), so running the distinct prompts once would not be exact.
        return None
    inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not isinstance(inputs, torch.Tensor) or inputs.shape[0] % copies:
        return None
    rows = inputs.shape[0]
    distinct = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, (dict, list, tuple)) and value:
            return None  # e.g. pre-encoded images (mm_encoder_outputs), expanded per copy: left as they are
        if isinstance(value, torch.Tensor) and value.dim():
            if value.shape[0] != rows:
                return None  # a per-image (or other) tensor: not safe to thin out
            first = value[::copies]
            if not torch.equal(first.repeat_interleave(copies, 0), value):
                return None
            distinct[key] = first
    return distinct
