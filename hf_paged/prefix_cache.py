"""Prefix caching inside ``generate()``: one persistent block pool and prefix index per model.

``hf_paged.enable(model, prefix_caching=True)`` gives the model a :class:`PrefixCache`. Every
flagged ``generate()`` then runs on a :class:`PagedKVCache` living in that pool, and its first
forward (:func:`skip_cached_prefix`):

1. computes once, in a forward of their own, the full blocks that several rows of the batch share
   and nobody has cached (when that saves more tokens than it costs);
2. lets each row adopt its longest cached prefix and computes only the columns after it.

Completed forwards index their new full blocks (``PagedKVCache.end_forward``); blocks nobody
holds stay cached until a fixed budget needs them (LRU). The index is the engine's
(:class:`hf_paged.prefix_index.PrefixIndex`), and so are the snapshots.

The first forward is left whole when its outputs cover every position (attentions, hidden
states, ``logits_to_keep`` of 0 or a tensor) or when it carries inputs that are not per-token ids
(embeddings, images): computing from a later column would change what those calls return. With
``logits_to_keep=k`` (assisted decoding's candidates) it keeps at least its last ``k`` columns.
"""

from __future__ import annotations

import weakref
from collections import Counter
from itertools import takewhile

import torch
from transformers import PreTrainedModel

from hf_paged import prefix_snapshot
from hf_paged.cache import KVPool, PagedKVCache, left_padded_rows

PER_COLUMN = ("input_ids", "position_ids", "token_type_ids")  # [..., columns]: sliced with the columns
PASSED_ON = {"attention_mask", "cache_position", "logits_to_keep", "cache", "past_key_values", "use_cache",
             "return_dict", "output_attentions", "output_hidden_states"}


class PrefixCache:
    """A model's persistent prefix cache for ``generate()``: what ``hf_paged.prefix_cache(model)`` returns.

    One pool of blocks (``num_blocks`` per layer, or growing when ``None``) shared by every flagged
    call, and the index of the cached ones.
    """

    def __init__(self, model: PreTrainedModel, block_size: int, num_blocks: int | None):
        self.block_size, self.num_blocks = block_size, num_blocks
        self._model = None
        self.bind(model)

    def bind(self, model: PreTrainedModel) -> PrefixCache:
        """Serve ``model``, starting an empty pool when its weights are not those the cached K/V came
        from (``load_state_dict``, an optimizer step, ``.to(dtype or device)``, a deepcopy's own
        tensors): reused stale K/V would silently give other tokens than stock. What is checked
        is each parameter's storage, dtype and in-place write count (``Tensor._version``); a write
        through ``.data`` escapes the count: ``clear()`` after one."""
        version = weights_version(model)
        if self._model is None or self._model() is not model or version != self._weights:
            self.pool = KVPool.for_config(model.config, self.block_size, self.num_blocks, prefix_caching=True)
            self._model, self._weights = weakref.ref(model), version
        return self

    @property
    def index(self):
        return self.pool.prefix

    def new_cache(self) -> PagedKVCache:
        """A cache for one ``generate()`` call, in this pool."""
        return PagedKVCache(self._model().config, self.block_size, self.num_blocks, pool=self.pool)

    def stats(self) -> dict:
        """Lookups (tokens asked for and found cached, over all calls), cached blocks, evictions and
        the pool's blocks (summed over layer groups)."""
        managers = self.pool.blocks.managers
        queried, hit = self.index.queried_tokens, self.index.hit_tokens
        return {
            "queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else 0.0,
            "cached_blocks": sum(m.num_cached_blocks for m in managers),
            "evictions": sum(m.num_evictions for m in managers),
            "blocks_total": sum(m.num_blocks for m in managers),
            "blocks_used": sum(m.num_used_blocks for m in managers),
            "blocks_free": sum(m.num_free_blocks for m in managers),
        }

    @torch.inference_mode()
    def save(self, path) -> int:
        """Write the cached blocks to one safetensors file (the engine's format). Returns the blocks saved."""
        return prefix_snapshot.save_index(path, self._model(), self.index, self.pool.storage)

    @torch.no_grad()  # not inference mode: generate() writes these pools outside it
    def load(self, path) -> int:
        """Add a snapshot's blocks (saved here or by ``LLMEngine.save_prefix_cache``) as cached
        blocks; ``SnapshotError`` and nothing loaded when it does not fit. Returns the blocks loaded."""
        return prefix_snapshot.load_index(path, self._model(), self.index, self.pool.storage)

    def clear(self) -> int:
        """Forget every cached block (blocks held by live caches stay theirs). Returns how many were cached."""
        return self.index.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the block books are inconsistent (used by tests)."""
        self.pool.blocks.check_invariants()


def weights_version(model: PreTrainedModel) -> tuple:
    """What changes when a model's weights do: each parameter's storage, dtype and write count."""
    return tuple((p.data_ptr(), p.dtype, p._version) for p in model.parameters())


def skip_cached_prefix(model: PreTrainedModel, cache: PagedKVCache, kwargs: dict) -> dict | None:
    """The first forward's inputs from the first column some row has not cached (None: compute
    everything as given). See the module docstring."""
    if not _can_skip(cache, kwargs):
        return None
    if cache.shares_prefixes:
        _compute_shared_prefixes(model, cache, kwargs)
    logits_to_keep = kwargs.get("logits_to_keep") or 1  # the forward must cover the positions whose logits are kept
    skip = cache.adopt_prefix(kwargs["input_ids"], kwargs.get("attention_mask"), kwargs["input_ids"].shape[1] - logits_to_keep)
    return _columns(kwargs, skip) if skip else None


def _can_skip(cache: PagedKVCache, kwargs: dict) -> bool:
    input_ids = kwargs.get("input_ids")
    if cache.prefix is None or cache.batch_size != -1 or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return False
    logits_to_keep = kwargs.get("logits_to_keep")
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    if logits_to_keep is not None and (not isinstance(logits_to_keep, int) or logits_to_keep < 1):
        return False  # all positions (0) or chosen ones (a tensor)
    for key, value in kwargs.items():
        if key in PER_COLUMN:
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 2
                                      or value.shape[-1] != input_ids.shape[1]):
                return False
        elif key not in PASSED_ON and (isinstance(value, torch.Tensor) or (isinstance(value, (dict, list, tuple)) and value)):
            return False  # embeddings, images, ...: not per-token ids
    mask = kwargs.get("attention_mask")
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        return False
    mask = mask.to("cpu", torch.bool)
    return bool((mask.cummax(1).values == mask).all())  # left padding only


def _columns(kwargs: dict, start: int, stop: int | None = None, rows: list[int] | None = None) -> dict:
    """``kwargs`` with the per-column inputs cut to columns ``start:stop`` (the mask to ``:stop``) and,
    given ``rows``, the per-row inputs to those rows."""
    out = dict(kwargs)
    batch = kwargs["input_ids"].shape[0]
    for key in (*PER_COLUMN, "attention_mask", "cache_position"):
        value = kwargs.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if rows is not None and value.dim() == 2 and value.shape[0] == batch:
            value = value[rows]
        out[key] = value[..., : stop] if key == "attention_mask" else value[..., start:stop]
    return out


def _compute_shared_prefixes(model: PreTrainedModel, cache: PagedKVCache, kwargs: dict) -> None:
    """Compute once the uncached full blocks several rows share, in a forward of their own (one row
    per distinct shared prefix, on a cache in the same pool), when the main forward then skips more
    tokens than this one computes. Its blocks stay cached for the main forward to adopt."""
    rows = kwargs["input_ids"].shape[0]
    tokens, pads = left_padded_rows(kwargs["input_ids"], kwargs.get("attention_mask"))
    bs, index = cache.block_size, cache.prefix
    keys = [index.keys_of(t, (len(t) - 1) // bs) for t in tokens]
    holders = Counter(k for row_keys in keys for k in row_keys)
    shared = [sum(1 for _ in takewhile(lambda k: holders[k] > 1, row_keys)) for row_keys in keys]
    hits = [len(index.longest_hit(t, len(k))) for t, k in zip(tokens, keys)]
    before = min(pad + h * bs for pad, h in zip(pads, hits))
    after = min(pad + max(h, s) * bs for pad, h, s in zip(pads, hits, shared))
    reps = list({keys[r][shared[r] - 1]: r for r in range(rows) if shared[r] > hits[r]}.values())
    if after <= before or not reps:
        return
    stop = max(pads[r] + shared[r] * bs for r in reps)
    cost = sum(stop - pads[r] - hits[r] * bs for r in reps)
    if rows * (after - before) <= cost:
        return
    warm = PagedKVCache(cache.config, bs, pool=cache.pool)
    warm.shares_prefixes = False
    sub = _columns(kwargs, 0, stop, reps)
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is cache:
            sub[key] = warm
    try:
        model(**sub)
    finally:
        warm.reset()  # its rows go; the blocks stay cached
