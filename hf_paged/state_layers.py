"""The non-attention layers of hybrid models (linear attention, Mamba/SSM, short convolutions) in a
:class:`~hf_paged.PagedKVCache`.

Such a layer keeps a small fixed-size state per sequence (conv and recurrent states), not K/V per
token: nothing to page. So the paged cache holds it in **transformers' own cache-layer classes**,
built per layer type exactly as ``DynamicCache(config=...)`` builds them
(``DYNAMIC_LAYER_TYPE_MAPPING`` with ``get_layer_types_and_kwargs``'s per-layer arguments). Every
call a model makes on them (``get_conv_state``, ``update_recurrent_state``, ``has_previous_state``,
``is_recording_past``, ``activate_past_recording``, ``is_croppable``, ...) is the ``Cache`` base
class reaching ``cache.layers[i]``: transformers' code, unchanged. What this module adds is small:

* :class:`PagedHybridLayer`, for a layer that is both (``"hybrid"``: a Mamba mixer and attention
  in parallel, e.g. Falcon-H1): transformers' ``LinearAttentionLayer`` for the state, a
  :class:`~hf_paged.channel.PagedLayerView` for the K/V, which stay in blocks;
* batch-level operations the paged cache forwards to its state layers (beam reordering, repeats
  for shared prompts, row selection, crop, reset, copies), each through the layer's own method.

The state API of ``Cache`` (``update_conv_state`` and friends) appeared after transformers 5.17;
without it (:data:`STATE_API` false) hybrid models stay refused and nothing here is used.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import torch
from transformers import Cache, PretrainedConfig
from transformers import cache_utils

from hf_paged.channel import PagedLayerView

#: Whether the installed transformers has the state-layer API hybrid models call on their cache.
STATE_API: bool = all(hasattr(Cache, name) for name in ("update_conv_state", "update_recurrent_state",
                                                        "get_conv_state", "is_recording_past"))

_StateBase = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
_LinearLayer = getattr(cache_utils, "LinearAttentionLayer", None)
_DummyLayer = getattr(cache_utils, "DummyLayer", None)
_MAPPING: dict = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {}) if STATE_API else {}

#: Layer types whose state transformers' classes hold (with the attention part, if any, paged).
STATE_ONLY_TYPES = ("linear_attention", "conv")
HYBRID_TYPES = ("hybrid", "hybrid_sliding")  # state and attention in one layer
NO_CACHE_TYPES = ("dummy",)  # MLP/MoE-only layers, and KV-sharing layers (their spec: hf_paged.kinds.shared)
STATE_LAYER_TYPES = tuple(t for t in STATE_ONLY_TYPES + HYBRID_TYPES + NO_CACHE_TYPES if t in _MAPPING)


def is_state_layer(layer) -> bool:
    """A layer with conv/recurrent state (a transformers linear-attention layer, or a hybrid one)."""
    return _StateBase is not None and isinstance(layer, _StateBase)


def has_state_layers(cache: Cache) -> bool:
    """Whether ``cache`` holds conv/recurrent state beside its K/V (a hybrid model's cache)."""
    return any(is_state_layer(layer) for layer in cache.layers)


def holds_kv(layer) -> bool:
    """A layer whose K/V the paged cache keeps (attention, or the attention half of a hybrid layer)."""
    return isinstance(layer, (PagedLayerView, PagedHybridLayer))


if STATE_API:
    class PagedHybridLayer(_LinearLayer, cache_utils.CacheLayerMixin):
        """A layer that is both: transformers' ``LinearAttentionLayer`` holds its conv/recurrent
        state; its K/V live in the paged cache's blocks (read through a ``PagedLayerView``).

        It is a ``CacheLayerMixin`` as ``LinearAttentionAndFullAttentionLayer`` is, so the ``Cache``
        base class counts it as an attention layer (``is_linear`` false), not a state-only one.
        Batch operations here touch the state only: the cache reindexes the K/V's block tables itself.
        """

        is_compileable = False  # the paged half never is

        def __init__(self, cache, layer_idx: int, sliding_window: int | None, number_of_states: int = 1, **kwargs):
            _LinearLayer.__init__(self, number_of_states=number_of_states)
            self.paged = PagedLayerView(cache, layer_idx, sliding_window)
            self.owner = weakref.proxy(cache)  # weak, as the view's: no cycle keeps a cache's blocks alive

        # the attention half, as PagedLayerView shows it
        keys = property(lambda self: self.paged.keys)
        values = property(lambda self: self.paged.values)
        is_sliding = property(lambda self: self.paged.is_sliding)
        sliding_window = property(lambda self: self.paged.sliding_window)
        is_initialized = property(lambda self: self.paged.is_initialized)

        def get_seq_length(self) -> int:
            return self.paged.get_seq_length()

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.get_mask_sizes(query_length, self.paged.layer_idx)

        def update(self, *args, **kwargs):
            raise RuntimeError("PagedHybridLayer: K/V go through PagedKVCache.update, not the layer")

        # the state half: transformers' own methods (explicit, over CacheLayerMixin's K/V versions)
        reorder_cache = _StateBase.reorder_cache
        crop = _StateBase.crop
        reset = _StateBase.reset
        get_max_length = _StateBase.get_max_length

        def copy_for(self, cache) -> PagedHybridLayer:
            """A copy of the state (tensors cloned) whose K/V view reads ``cache``."""
            clone = object.__new__(type(self))
            clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("paged", "owner")}))
            clone.paged = PagedLayerView(cache, self.paged.layer_idx, self.paged.sliding_window)
            clone.owner = weakref.proxy(cache)
            return clone

        def __repr__(self) -> str:
            return f"PagedHybridLayer({self.paged.layer_idx}, {'sliding' if self.is_sliding else 'full'})"
else:
    class PagedHybridLayer:  # never built: without the state API hybrid models are refused
        """Placeholder where transformers lacks the state-layer API (see :data:`STATE_API`)."""


# ---------------------------------------------------------------------------------------- building
def build_state_layers(cache: Cache, config: PretrainedConfig, layer_types: Sequence[str],
                       windows: Sequence[int | None]) -> None:
    """Replace the ``PagedLayerView`` of each state, hybrid and MLP-only layer of ``cache.layers``
    by the layer ``DynamicCache(config=config)`` would build there (hybrid: :class:`PagedHybridLayer`).
    Pure attention models are left as they are (and their config is not read again)."""
    if not any(t in STATE_LAYER_TYPES for t in layer_types):
        return
    kwargs = cache_utils.get_layer_types_and_kwargs(config)[1]
    for i, layer_type in enumerate(layer_types):
        if layer_type in HYBRID_TYPES:
            cache.layers[i] = PagedHybridLayer(cache, i, windows[i], kwargs[i].get("number_of_states", 1))
        elif layer_type in STATE_LAYER_TYPES:
            cache.layers[i] = _MAPPING[layer_type](**kwargs[i])


def copy_state_layers(source: Cache, clone: Cache) -> None:
    """Give ``clone`` (a fork of ``source``, with fresh ``PagedLayerView``s) copies of ``source``'s
    state layers: a fork continues on its own, and states are small (a copy costs little)."""
    for i, layer in enumerate(source.layers):
        if isinstance(layer, PagedHybridLayer):
            clone.layers[i] = layer.copy_for(clone)
        elif not isinstance(layer, PagedLayerView):
            clone.layers[i] = copy.deepcopy(layer)


# ---------------------------------------------------------------------------------------- batch operations
def reorder_states(layers: Sequence, index: torch.Tensor | Sequence[int]) -> None:
    """Row ``i`` of every state becomes old row ``index[i]`` (beam search, row selection): each
    layer's own ``reorder_cache`` (an ``index_select`` of its conv and recurrent states)."""
    index = torch.as_tensor(index, dtype=torch.long)
    for layer in layers:
        if is_state_layer(layer):
            layer.reorder_cache(index)


def repeat_states(layers: Sequence, repeats: int) -> None:
    """Each row of every state becomes ``repeats`` rows (shared prompts: a prompt for its beams or
    samples). transformers' linear-attention layers have no ``batch_repeat_interleave`` (a
    ``DynamicCache`` of them raises AttributeError there); repeating rows is a reorder with each
    index repeated, which their own ``reorder_cache`` does. A layer that has the method uses it."""
    for layer in layers:
        if not is_state_layer(layer):
            continue
        if hasattr(layer, "batch_repeat_interleave") and not isinstance(layer, PagedHybridLayer):
            layer.batch_repeat_interleave(repeats)
        elif (rows := _state_rows(layer)) is not None:
            layer.reorder_cache(torch.arange(rows).repeat_interleave(repeats))


def select_states(layers: Sequence, indices: torch.Tensor | Sequence[int]) -> None:
    """Keep rows ``indices`` of every state (``batch_select_indices``), as :func:`repeat_states`
    does: the layer's own method if it has one, else its ``reorder_cache``."""
    for layer in layers:
        if not is_state_layer(layer):
            continue
        if hasattr(layer, "batch_select_indices") and not isinstance(layer, PagedHybridLayer):
            layer.batch_select_indices(indices)
        else:
            layer.reorder_cache(torch.as_tensor(indices, dtype=torch.long))


def crop_states(layers: Sequence, tokens_to_remove: int) -> None:
    """Each state layer's own ``crop`` (it raises as in ``DynamicCache`` unless the layer records its
    past, and cannot roll a recurrent state back). Called before the paged K/V are cropped, so a
    refusal leaves the cache as it was."""
    for layer in layers:
        if is_state_layer(layer):
            layer.crop(tokens_to_remove)


def reset_states(layers: Sequence) -> None:
    """Each state layer's own ``reset`` (states zeroed, no previous state), as ``DynamicCache.reset``."""
    for layer in layers:
        if is_state_layer(layer):
            layer.reset()


def attention_layer_index(layers: Sequence, layer_idx: int) -> int:
    """The layer whose length ``get_seq_length(layer_idx)`` reports, as the ``Cache`` base class
    decides it: the layer itself if it holds K/V; for layer 0 of another kind the first layer that
    does; any other state or MLP-only layer has no length (``ValueError``, as stock)."""
    if layer_idx >= len(layers) or holds_kv(layers[layer_idx]):
        return layer_idx
    if layer_idx != 0:
        raise ValueError(f"You called `get_seq_length` on layer index {layer_idx}, but this layer is a "
                         f"{type(layers[layer_idx]).__name__} layer, which does not track sequence length.")
    return next((i for i, layer in enumerate(layers) if holds_kv(layer)), 0)


def _state_rows(layer) -> int | None:
    """Rows (batch size) of a state layer's first initialized state, None before its first update."""
    for states in (layer.conv_states, layer.recurrent_states):
        for state in states.values():
            if state is not None:
                return state.shape[0]
    return None
