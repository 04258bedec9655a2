"""The channel between a cache's ``update()`` and the ``"hf_paged"`` attention function.

It must work on transformers 5.17, whose layers call ``update(k, v, layer_idx)`` without kwargs,
and on newer 5.x:

1. ``StashingCache.update`` only *stashes* the new K/V (and remembers, per thread, which cache
   did) and returns them unchanged;
2. the attention function *claims* them by identity (:meth:`StashingCache.claim`), stores them
   and reads K/V through the block tables that the forward's :class:`AttentionMetadata` carries.

An attention call whose K/V were not stashed by a paged cache (a plain forward, training, a
DynamicCache) is never mistaken for a paged one. If a model does not route attention through
``AttentionInterface``, the stash is left unclaimed and the next cache call raises instead of
letting the model run on partial keys.

Two caches speak through it: :class:`hf_paged.PagedKVCache` (``generate()``: a padded batch of
rows) and the engine's per-step cache, a :class:`PackedStep` (one packed row of many sequences).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import Cache

if TYPE_CHECKING:
    from hf_paged.storage import PagedKVStorage

BLOCK_TABLE_PAD = -1  # block-table entries past a sequence's last block (never read)
_thread = threading.local()


def active_cache() -> StashingCache | None:
    """The paged cache whose ``update`` ran last in this thread (it may have nothing pending)."""
    return getattr(_thread, "cache", None)


def set_active_cache(cache: StashingCache) -> None:
    """Make ``cache`` the one the attention function reads from (``update`` does this)."""
    _thread.cache = cache


def clear_active_cache() -> None:
    """Forget the active cache at the end of a paged forward (so it is not kept alive)."""
    _thread.cache = None


@contextlib.contextmanager
def packed_forward():
    """Marks an engine forward (one packed row of many sequences): masks are not built at all."""
    _thread.packed = True
    try:
        yield
    finally:
        _thread.packed = False


def in_packed_forward() -> bool:
    return getattr(_thread, "packed", False)


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's K/V go and come from, shared by all its layers (host tensors).

    ``slot_mapping`` holds the slot of each new token: ``[rows, q_len]`` for ``generate()``
    (−1: a pad column, not stored), ``[tokens]`` for an engine step. ``block_tables`` is int32
    ``[seqs, max_blocks]`` padded with :data:`BLOCK_TABLE_PAD`; ``context_lens`` (int32) counts
    each sequence's tokens once this forward's are stored; ``cu_seqlens_q`` (int32) delimits the
    queries of the sequences that the varlen prefill reads: every row in ``generate()``, those
    after the first ``num_decode`` (one query token each) in an engine step. ``generate()`` only:
    ``new_valid`` ``[rows, q_len]`` says which new columns are real tokens. Engine steps with
    drafts (speculative decoding): the first ``num_draft_seqs`` sequences after the decoding ones
    are a last token and its draft, whose queries may be read as decode rows, one per token:
    ``draft_tables`` ``[draft tokens, max_blocks]`` (each sequence's table once per token) and
    ``draft_lens`` (each token's context: its own position + 1).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_decode: int = 0
    new_valid: torch.Tensor | None = None
    num_draft_seqs: int = 0
    draft_tables: torch.Tensor | None = None
    draft_lens: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


class DecodeGroup(NamedTuple):
    """Decoding sequences ``first:end`` of an engine step, read together (see ``PackedStep.decode_groups``)."""

    first: int
    end: int
    slots: torch.Tensor  # [seqs, keys]; padding points at slot 0
    mask: torch.Tensor  # additive [seqs, 1, 1, keys]: 0 where visible, -inf on padding


class PagedLayerView:
    """What transformers' ``Cache`` base expects to find in ``cache.layers``; state lives in the cache."""

    is_compileable = False
    supports_early_init = False
    is_croppable = True

    def __init__(self, cache: StashingCache, layer_idx: int, sliding_window: int | None):
        # a weak reference: no cycle, so a cache nobody holds is freed (with its blocks) at once
        self._cache = weakref.proxy(cache)
        self.layer_idx, self.sliding_window = layer_idx, sliding_window
        self.is_sliding = sliding_window is not None
        self.record_past = False  # transformers sets it (assisted decoding): keep what a crop may need

    def activate_past_recording(self, **kwargs) -> None:
        """As ``DynamicSlidingWindowLayer``: until the next ``crop``, keep what a rollback needs
        (``recurrent_states_to_keep``, transformers >= 5.25, concerns recurrent layers only)."""
        self.record_past = True

    @property
    def is_initialized(self) -> bool:
        return self.layer_idx in self._cache.storage.key_pools

    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's keys as ``DynamicCache`` holds them (see ``layer_states``; a copy, read-only in effect)."""
        return self._cache.layer_states(self.layer_idx)[0]

    @property
    def values(self) -> torch.Tensor | None:
        return self._cache.layer_states(self.layer_idx)[1]

    @property
    def dtype(self) -> torch.dtype | None:
        pool = self._cache.storage.key_pools.get(self.layer_idx)
        return None if pool is None else pool.dtype

    @property
    def device(self) -> torch.device | None:
        pool = self._cache.storage.key_pools.get(self.layer_idx)
        return None if pool is None else pool.device

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def __repr__(self) -> str:
        kind = f"sliding({self.sliding_window})" if self.is_sliding else "full"
        return f"PagedLayer({self.layer_idx}, {kind})"


class StashingCache(Cache):
    """A transformers ``Cache`` whose ``update`` stashes and whose K/V the attention function claims."""

    storage: PagedKVStorage

    def __init__(self, windows: list[int | None]):
        super().__init__(layers=[PagedLayerView(self, i, w) for i, w in enumerate(windows)])
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._claimed: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # this forward's claims (KV sharing)
        self.set_metadata(None)

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------ metadata
    @property
    def metadata(self) -> AttentionMetadata | None:
        return self._metadata

    def set_metadata(self, metadata: AttentionMetadata | None) -> None:
        """The metadata of the forward that follows (None: none yet, or out of date)."""
        self._metadata, self._on_device = metadata, {}

    def metadata_on(self, device: torch.device) -> AttentionMetadata:
        """This forward's metadata on ``device``, moved once (layers may sit on different devices)."""
        if device not in self._on_device:
            self._on_device[device] = self._metadata.to(device)
        return self._on_device[device]

    # ------------------------------------------------------------------ the channel
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Stash this layer's new K/V for the ``hf_paged`` attention call that follows."""
        self.check_no_pending()
        self._pending = (layer_idx, key_states, value_states)
        set_active_cache(self)
        return key_states, value_states

    def check_no_pending(self) -> None:
        """Raise if a layer stashed K/V that its attention never claimed (and forget them)."""
        if self._pending is not None:
            layer_idx = self._pending[0]
            self._pending = None
            raise RuntimeError(
                f"PagedKVCache: layer {layer_idx} stored K/V but its attention never read them. The model must run "
                "with attn_implementation='hf_paged' (call hf_paged.enable(model)) and route attention through "
                "transformers' AttentionInterface."
            )

    def claim(self, key: torch.Tensor, value: torch.Tensor) -> int | None:
        """If ``key``/``value`` are what ``update`` just stashed, take them: returns the layer index."""
        pending = self._pending
        if pending is None or pending[1] is not key or pending[2] is not value:
            return None
        self._pending = None
        self._claimed.append(pending)
        return pending[0]

    def claimed_layer(self, key: torch.Tensor, value: torch.Tensor) -> int | None:
        """The layer that claimed ``key``/``value`` earlier in this forward: a KV-sharing layer
        (:mod:`hf_paged.kinds.shared`) attends with its source layer's K/V objects, and so reads
        that layer's blocks. None: not a source's K/V."""
        return next((layer for layer, k, v in self._claimed if k is key and v is value), None)

    def forget_claims(self) -> None:
        """A forward is over: drop the references to its layers' new K/V."""
        self._claimed = []

    def drop_pending(self) -> None:
        """Forget stashed K/V without complaint (the cache is being reset)."""
        self._pending = None
        self._claimed = []

    def layer_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A layer's K/V in ``DynamicCache``'s layout, where the cache has one (else ``(None, None)``)."""
        return None, None


class PackedStep(StashingCache, abc.ABC):
    """The cache of one engine forward: one packed row ``[1, total_tokens]`` of many sequences.

    This is what the attention function reads an engine step through: the new K/V go to
    ``storage`` at the layer group's ``metadata_for(layer).slot_mapping``; decode tokens come
    first (``metadata.num_decode``) and are read in :meth:`decode_groups` on CPU; the rest go to
    the varlen prefill kernel.

    ``decode_read`` chooses the CPU decode read: ``"c"`` reads float32 pools with the C read
    (:mod:`hf_paged.kernels.cpu_decode`) where it is built, ``"gather"`` always copies the
    sequences' keys and values out of the blocks for SDPA (:meth:`decode_groups`).
    ``prefill_read`` chooses the CPU prefill read: ``"c"`` reads float32 pools with the C read
    (:mod:`hf_paged.kernels.cpu_prefill`) where it is built, ``"sdpa"`` calls SDPA per sequence as
    stock does for one prompt. ``"auto"`` (both): the C reads on x86 CPUs with AVX2 or AVX-512
    (``cpu_build.auto_reads``: where they were measured faster than torch's reads), else torch's.
    """

    storage: PagedKVStorage
    decode_read: str = "auto"
    prefill_read: str = "auto"

    @abc.abstractmethod
    def num_blocks_for(self, layer_idx: int) -> int:
        """Blocks the layer's pool must have (its layer group's pool size)."""

    @abc.abstractmethod
    def metadata_for(self, layer_idx: int, device: torch.device) -> AttentionMetadata:
        """The step's metadata for the layer's group (slots and block tables), on ``device``."""

    @abc.abstractmethod
    def decode_groups(self, layer_idx: int, window: int | None, dtype: torch.dtype,
                      chunk_size: int | None = None, drafts: bool = False) -> list[DecodeGroup]:
        """The decoding sequences in groups of similar length, each with its slots (in the
        layer's group) and mask (``window``: the layer's sliding window; ``chunk_size``: its
        chunked local attention; ``drafts``: the rows of the sequences with drafts instead)."""
