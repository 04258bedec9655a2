"""The ``"hf_paged"`` attention and mask functions, registered with transformers' interfaces.

They serve the forwards that read K/V straight from the blocks: ``generate()`` on the kernel route
(Triton, CUDA by default) and every engine step. ``generate()`` on the reference route (CPU) does not
use them: its cache's ``update`` returns dense K/V to the model's own attention (see ``cache.py``).

Paged-ness is a property of the call, not of the model. A model keeps its own implementation
(``sdpa``, ``eager``...) and ``config._attn_implementation`` says so, except while such a forward
runs: :func:`paged_call` switches the model's configs to ``"hf_paged"`` for that forward only, the
way transformers' own continuous batching switches implementations for its session. Inside it, a
call whose key/value were stashed by a paged cache reads K/V through block tables; any other call
goes to the implementation the model had (its fallback), with the mask that implementation would
have received.

Read paths of a ``generate()`` call on the kernel route: the kernels read the blocks directly
(``paged_attention_decode`` for one new token per row, ``paged_attention_prefill`` otherwise); where
they cannot (rows with holes, ``output_attentions``), the blocks are gathered into the layout
DynamicCache would hold and the fallback implementation runs on them. An engine step (a
:class:`~hf_paged.channel.PackedStep`) packs many sequences in one row; each attends only to its
own blocks (decode tokens first, then the prefill chunks).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_paged import kernels
from hf_paged.cache import new_columns_valid
from hf_paged.channel import PackedStep, active_cache, in_packed_forward
from hf_paged.kernels import cpu_build, cpu_decode, cpu_ops, cpu_prefill
from hf_paged.kinds import FullAttentionSpec, SlidingWindowSpec

ATTN_IMPLEMENTATION = "hf_paged"
COMPILED_ATTN_IMPLEMENTATION = "hf_paged_compiled"  # the engine's compiled steps (hf_paged.engine.compiled_body)
PAGED_IMPLEMENTATIONS = (ATTN_IMPLEMENTATION, COMPILED_ATTN_IMPLEMENTATION)  # never remembered as a fallback
_fallbacks: dict[int, str] = {}  # id(config) -> implementation; not an attribute, so never saved
_OLD_MODE_NAMES = {"auto": "auto", "reference": "torch", "triton": "triton"}


def set_kernel_mode(mode: str) -> None:
    """Deprecated: use :func:`hf_paged.kernels.set_backend` (``"auto"``, ``"torch"``, ``"triton"``).

    The old names map onto it: ``"auto"`` → ``"auto"``, ``"reference"`` → ``"torch"``,
    ``"triton"`` → ``"triton"``.
    """
    if mode not in _OLD_MODE_NAMES:
        raise ValueError(f"kernel mode must be one of {tuple(_OLD_MODE_NAMES)}, got {mode!r}")
    warnings.warn("hf_paged.set_kernel_mode is deprecated; use hf_paged.kernels.set_backend "
                  f"({_OLD_MODE_NAMES[mode]!r})", DeprecationWarning, stacklevel=2)
    kernels.set_backend(_OLD_MODE_NAMES[mode])


@dataclass
class PagedMask:
    """What the mask function hands to the attention function.

    ``dense`` is exactly what the fallback implementation's mask function returns (used by
    non-paged calls and by the reference read path); ``padding_mask`` is the 2D padding mask
    ``[rows, columns]`` (None: no padding), which tells the cache which new columns are pads.
    """

    dense: torch.Tensor | None
    padding_mask: torch.Tensor | None

    def new_columns_valid(self, q_len: int, columns: int) -> torch.Tensor | None:
        """Validity of the ``q_len`` newest columns, given ``columns`` columns in all."""
        return new_columns_valid(self.padding_mask, q_len, columns)


def _remember_fallback(config, name: str) -> None:
    """Remember what the model runs outside paged forwards: non-paged calls inside them run it too."""
    key = id(config)
    if key not in _fallbacks:
        weakref.finalize(config, _fallbacks.pop, key, None)
    _fallbacks[key] = name


def fallback_implementation(config) -> str | None:
    """The implementation the model had outside its paged forwards (None if unknown, e.g. a copied config)."""
    return _fallbacks.get(id(config))


_switched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its configs to switch


def _switched_configs(model: PreTrainedModel) -> list:
    """The configs a paged forward switches: the model's own and its text decoder's (a vision tower
    of a composite model keeps its implementation: its attention is not cached). Found once per
    model: a forward should not pay for reading configs."""
    configs = _switched.get(model)
    if configs is None or configs[0] is not model.config:
        configs = [model.config]
        text = model.config.get_text_config(decoder=True)
        if text is not model.config:
            configs.append(text)
        _switched[model] = configs
    return configs


def begin_paged_call(model: PreTrainedModel, implementation: str = ATTN_IMPLEMENTATION) -> list[tuple[object, str | None]]:
    """Switch ``model`` to the ``"hf_paged"`` implementation (or ``implementation``); returns what
    :func:`end_paged_call` restores. What each config had is remembered as its fallback (never
    written into the config)."""
    saved = []
    for config in _switched_configs(model):
        current = config._attn_implementation_internal
        if current not in PAGED_IMPLEMENTATIONS and _fallbacks.get(id(config)) != (current or "sdpa"):
            _remember_fallback(config, current or "sdpa")
        saved.append((config, current))
        config._attn_implementation_internal = implementation
    return saved


def end_paged_call(saved: list[tuple[object, str | None]]) -> None:
    for config, implementation in reversed(saved):
        config._attn_implementation_internal = implementation


@contextlib.contextmanager
def paged_call(model: PreTrainedModel, implementation: str = ATTN_IMPLEMENTATION):
    """Run the forwards inside with the ``"hf_paged"`` implementation, or ``implementation`` (nesting is fine)."""
    saved = begin_paged_call(model, implementation)
    try:
        yield
    finally:
        end_paged_call(saved)


def _fallback_attention(module: torch.nn.Module, kwargs: dict) -> Callable:
    name = fallback_implementation(getattr(module, "config", None))
    if name is None:
        name = "eager" if kwargs.get("softcap") is not None else "sdpa"
    if name == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"{type(module).__name__}: no eager_attention_forward to fall back to")
        return functools.partial(_eager_with_additive_mask, eager)
    return ALL_ATTENTION_FUNCTIONS[name]


def _eager_with_additive_mask(eager: Callable, module, query, key, value, attention_mask, **kwargs):
    """Eager functions add the mask to the scores: a boolean (SDPA-style) mask is made additive first."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        additive = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        attention_mask = additive.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, **kwargs)


def paged_mask_function(*args, attention_mask: torch.Tensor | None = None, config=None, **kwargs) -> PagedMask:
    """Mask function for ``"hf_paged"``: the fallback's own mask plus the 2D padding mask.

    In an engine forward no mask is built at all: attention is computed per sequence from the
    block tables and lengths (no dense ``[all queries x all keys]`` mask over the packed batch).
    """
    if in_packed_forward():
        return PagedMask(None, None)
    dense_fn = ALL_MASK_ATTENTION_FUNCTIONS[fallback_implementation(config) or "sdpa"]
    dense = dense_fn(*args, attention_mask=attention_mask, config=config, **kwargs)
    return PagedMask(dense, attention_mask)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: PagedMask | torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``AttentionInterface`` entry point: paged if the K/V came from a PagedKVCache, else the fallback."""
    mask = attention_mask if isinstance(attention_mask, PagedMask) else PagedMask(attention_mask, None)
    fallback = _fallback_attention(module, kwargs)
    cache = active_cache()
    layer_idx = cache.claim(key, value) if cache is not None else None
    stores = layer_idx is not None
    if not stores and cache is not None:  # a KV-sharing layer, given its source layer's K/V
        layer_idx = cache.claimed_layer(key, value)
    latent = getattr(cache, "latent_context", None)
    if layer_idx is None and latent is not None and key.shape[2] == int(latent[1][-1]):
        cache.latent_context = None  # an MLA layer of an engine step, over the context it expanded
        return _latent_context_attention(cache, latent[0], query, key, value, **kwargs)
    if layer_idx is None:
        return fallback(module, query, key, value, mask.dense, **kwargs)

    if isinstance(cache, PackedStep):
        return packed_attention(cache, layer_idx, query, key, value, stores, **kwargs)
    q_len = query.shape[2]
    if stores:
        new_valid = (mask.new_columns_valid(q_len, cache.get_seq_length(layer_idx) + q_len)
                     if cache.allocates(layer_idx) else None)
        cache.commit(layer_idx, key, value, new_valid)
    if kernels.use_triton(query) and cache.kernels_applicable and not kwargs.get("output_attentions"):
        return _kernel_attention(cache, layer_idx, query, **kwargs)
    dense_key, dense_value = cache.dense_kv(layer_idx, q_len)
    return fallback(module, query, dense_key, dense_value, mask.dense, **kwargs)


def _scale(kwargs: dict, head_dim: int) -> float:
    scale = kwargs.get("scaling")
    return head_dim**-0.5 if scale is None else scale


def _read_options(cache, layer_idx: int, kwargs: dict) -> dict:
    """What the paged read of a layer needs: its kind's span (:mod:`hf_paged.kinds`: a sliding
    window, a chunk; a group that gives blocks back holds nothing before it, so nothing may read
    there), the model's own sliding window if it passes one, softcap, and attention sinks (gpt-oss
    passes them as ``s_aux``: one logit per head that joins the softmax denominator)."""
    options = dict(cache.specs[layer_idx].read_options())
    if kwargs.get("sliding_window"):
        options["sliding_window"] = kwargs["sliding_window"]
    options["softcap"] = kwargs.get("softcap")
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"]
    return options


def _kernel_attention(cache, layer_idx: int, query: torch.Tensor, **kwargs):
    """Read K/V straight from the blocks with the Triton kernels (no gather into contiguous tensors)."""
    k_pool, v_pool = cache.storage.key_pools[layer_idx], cache.storage.value_pools[layer_idx]
    meta = cache.metadata_for(layer_idx, query.device)
    rows, heads, q_len, head_dim = query.shape
    options = dict(_read_options(cache, layer_idx, kwargs), backend="triton")
    scale = _scale(kwargs, head_dim)
    if q_len == 1:
        out = kernels.paged_attention_decode(
            query[:, :, 0].contiguous(), k_pool, v_pool, meta.block_tables, meta.context_lens, scale, **options)
        return out[:, None].to(query.dtype), None
    valid = meta.new_valid  # [rows, q_len]: pads of left-padded prompts get no query
    tokens = query.transpose(1, 2)[valid]  # [num_valid, heads, head_dim]
    flat = kernels.paged_attention_prefill(
        tokens.contiguous(), k_pool, v_pool, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale,
        **options)
    out = query.new_zeros(rows, q_len, heads, head_dim)
    out[valid] = flat.to(query.dtype)
    return out, None


def packed_attention(step: PackedStep, layer_idx: int, query, key, value, stores: bool = True, **kwargs):
    """An engine step: one packed row ``[1, heads, total_tokens, head_dim]`` of many sequences.

    Decode tokens (one per sequence) come first and go to the decode kernel; the rest (prefill
    chunks) to the varlen prefill kernel. Each sequence attends only to its own blocks. A
    KV-sharing layer (``stores`` False; ``layer_idx`` is its source layer) writes nothing and
    reads its source's blocks. A batch of one-token rows (the decode forward of a model with
    recurrent layers, :mod:`hf_paged.engine.model_runner`) is read as that packed row.
    """
    if query.shape[0] > 1:  # [seqs, heads, 1, head_dim] -> [1, heads, seqs, head_dim], and back
        out, _ = packed_attention(step, layer_idx, query.transpose(0, 2), key.transpose(0, 2),
                                   value.transpose(0, 2), stores, **kwargs)
        return out.transpose(0, 1), None
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    meta = step.metadata_for(layer_idx, q.device)
    storage = step.storage
    if stores:
        new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
        storage.ensure_layer(layer_idx, new_keys, step.num_blocks_for(layer_idx), new_values)
        storage.write(layer_idx, new_keys, new_values, meta.slot_mapping)
    k_pool, v_pool = storage.key_pools[layer_idx], storage.value_pools[layer_idx]
    scale = _scale(kwargs, q.shape[-1])
    if meta.num_decode == q.shape[0] and not meta.num_draft_seqs:
        out = _decode_step_on_cpu(step, layer_idx, q, k_pool, v_pool, meta, scale, kwargs)
        if out is not None:
            return out[None], None
    triton = kernels.use_triton(q)
    options = dict(_read_options(step, layer_idx, kwargs), backend="triton" if triton else "torch")
    tables, lens, cu = meta.block_tables, meta.context_lens, meta.cu_seqlens_q
    q = q.to(k_pool.dtype)
    nd = meta.num_decode
    parts = []
    pools = (k_pool, v_pool, scale, options, triton)
    if nd:
        parts.append(_decode_rows(step, layer_idx, q[:nd], tables[:nd], lens[:nd], *pools))
    t0, s0 = nd, nd  # the first query row and sequence of the prefill read
    if meta.num_draft_seqs:  # drafts (speculative decoding) read as decode rows, as a step decoding each would
        rows = len(meta.draft_lens)
        parts.append(_decode_rows(step, layer_idx, q[nd : nd + rows], meta.draft_tables, meta.draft_lens, *pools,
                                  drafts=True))
        t0, s0 = nd + rows, nd + meta.num_draft_seqs
        cu = cu[meta.num_draft_seqs :] - rows
    if q.shape[0] > t0 and _c_prefill_reads(step, q, k_pool, v_pool, triton, options):
        parts.append(cpu_prefill.paged_prefill_cpu(q[t0:], k_pool, v_pool, tables[s0:], cu, lens[s0:],
                                                   scale, options.get("sliding_window"), options.get("sinks")))
    elif q.shape[0] > t0 and stores and not q.is_cuda and not triton and not _has_span_options(options):
        parts.append(_prefill_by_sdpa(query[0, :, t0:], key[0, :, t0:], value[0, :, t0:], k_pool, v_pool,
                                      tables[s0:], cu, lens[s0:], scale, options.get("sliding_window")))
    elif q.shape[0] > t0:
        parts.append(kernels.paged_attention_prefill(
            q[t0:].contiguous(), k_pool, v_pool, tables[s0:], cu, lens[s0:], scale, **options))
    out = parts[0] if len(parts) == 1 else torch.cat([p.to(query.dtype) for p in parts])
    return out.to(query.dtype)[None], None


def _decode_step_on_cpu(step: PackedStep, layer_idx: int, q: torch.Tensor, k_pool, v_pool, meta, scale: float,
                        kwargs: dict) -> torch.Tensor | None:
    """A step of decode rows only (no prefill, no drafts: most CPU steps) straight to the C read,
    or None where the general path must decide: what it would decide for such a step (the same
    read, the same arguments), with less Python per layer: one-sequence decode steps of the
    issue-22 model 4% faster, four-sequence ones 2% (one engine, this path switched per round)."""
    spec_options = step.specs[layer_idx].read_options()
    if not _c_decode_wanted(step, q, kernels.use_triton(q), kwargs.get("softcap"), spec_options.get("chunk_size")):
        return None
    window = kwargs.get("sliding_window") or spec_options.get("sliding_window")
    return cpu_decode.try_paged_decode_cpu(q, k_pool, v_pool, meta.block_tables, meta.context_lens, scale, window,
                                           kwargs.get("s_aux"))


class DecodePlanner:
    """Plans the compiled steps of an engine for ``cpu_ops.decode_step_attention``: each layer's new
    K/V written and read in C, no Python per layer (a ``cpu_ops.DecodePlan``, kept from step to
    step: only the step's slots, tables and lengths change, and a layer's pools when they are made
    or grow). It plans a step only where :func:`packed_attention` would send every layer to the C
    read (:func:`_decode_step_on_cpu`): decode rows only (no prefill, no drafts), the step's
    ``decode_read`` asking for the C read, every layer a full or sliding-window attention layer
    storing its K/V in float32 CPU pools large enough for the step, of a layout the C read is built
    for, no Triton backend forced, and (``softcap``) no softcap: the plan's read takes none, and the
    operator refuses a layer called with one. ``heads``: each layer's query heads."""

    def __init__(self, specs: list, heads: list[int], softcap: bool = False):
        self.heads = heads
        plain = all(type(spec) in (FullAttentionSpec, SlidingWindowSpec) and spec.stores for spec in specs)
        self.possible = plain and not softcap and bool(specs)
        self.windows = [spec.read_options().get("sliding_window") or 0 for spec in specs] if self.possible else []
        self._plan: cpu_ops.DecodePlan | None = None  # made by attach()
        self._pools: list[tuple] = [(None, None)] * len(specs)  # per layer: the pools its plan row was set from
        self._groups: list[tuple] | None = None  # per layer group: its first layer, its layers (a slice or a list)

    def attach(self) -> bool:
        """Plans steps from now on, for the operator of this target's library (the one a compiled
        body calls: ``cpu_ops.decode_step_attention()``); False where none can be planned."""
        if self.possible and self._plan is None and cpu_ops.namespace() is not None:
            self._plan = cpu_ops.DecodePlan(len(self.heads))
        return self._plan is not None

    def plan(self, step: PackedStep) -> cpu_ops.DecodePlan | None:
        """The step's plan, started (its rows set for this thread's next compiled step), or None."""
        if self._plan is None or not _c_read(step.decode_read):
            return None
        keys, values = step.storage.key_pools, step.storage.value_pools
        for layer_idx, (k_held, v_held) in enumerate(self._pools):
            if keys.get(layer_idx) is not k_held or values.get(layer_idx) is not v_held or k_held is None:
                if not self._set_layer(layer_idx, keys.get(layer_idx), values.get(layer_idx)):
                    return None
        if self._groups is None:
            groups: dict[int, list[int]] = {}
            for layer_idx in range(len(self._pools)):
                groups.setdefault(step.group_index(layer_idx), []).append(layer_idx)
            self._groups = [(layers[0], _as_slice(layers)) for layers in groups.values()]
        seqs = None
        for first, layers in self._groups:
            if keys[first].shape[0] < step.num_blocks_for(first):  # a group's pools grow together
                return None
            meta = step.metadata_for(first, _CPU)
            tokens = meta.slot_mapping.shape[0]
            if meta.num_decode != tokens or meta.num_draft_seqs or tokens != (seqs if seqs is not None else tokens):
                return None
            seqs = tokens
            self._plan.set_rows(layers, seqs, meta.slot_mapping, meta.block_tables, meta.context_lens)
        if not seqs:
            return None
        self._plan.start(seqs)
        return self._plan

    def _set_layer(self, layer_idx: int, k_pool: torch.Tensor | None, v_pool: torch.Tensor | None) -> bool:
        """The plan's row of a layer whose pools are new (made, grown, replaced); False where the C
        read cannot take them."""
        self._pools[layer_idx] = (None, None)
        if k_pool is None or v_pool is None or k_pool.is_cuda or kernels.use_triton(k_pool):
            return False
        try:
            self._plan.set_layer(layer_idx, k_pool, v_pool, self.heads[layer_idx], self.windows[layer_idx])
        except ValueError:  # a layout or dtype the C read does not take: packed_attention reads it
            return False
        self._pools[layer_idx] = (k_pool, v_pool)
        return True


_CPU = torch.device("cpu")


def _as_slice(layers: list[int]) -> slice | list[int]:
    """``layers`` as a slice where they follow each other (numpy assigns a slice's rows faster)."""
    return slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else layers


def _decode_rows(step: PackedStep, layer_idx: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 k_pool, v_pool, scale, options: dict, triton: bool, drafts: bool = False) -> torch.Tensor:
    """Query rows that each read one context (``tables`` / ``lens``: a row each): the step's
    decoding sequences, or (``drafts``) the rows of its drafts. On the CPU without softcap
    :func:`_decode_on_cpu`, else the decode kernel."""
    if not q.is_cuda and not triton and not options["softcap"]:
        return _decode_on_cpu(step, layer_idx, q, k_pool, v_pool, scale, options, drafts)
    return kernels.paged_attention_decode(q.contiguous(), k_pool, v_pool, tables, lens, scale, **options)


def _c_read(read: str) -> bool:
    """Whether a step's ``decode_read`` / ``prefill_read`` asks for the C read: ``"c"``, or
    ``"auto"`` on a CPU where it was measured faster than torch's reads (:func:`cpu_build.auto_reads`)."""
    return read == "c" or (read == "auto" and cpu_build.auto_reads())


def _c_decode_wanted(step: PackedStep, q: torch.Tensor, triton: bool, softcap: float | None,
                     chunk_size: int | None) -> bool:
    """Whether an engine step's decode rows ask for the C read over the blocks
    (:mod:`hf_paged.kernels.cpu_decode`; it reads them where it takes their tensors, see
    ``try_paged_decode_cpu``): the step's ``decode_read``, on the CPU, without softcap or chunks."""
    return _c_read(step.decode_read) and not q.is_cuda and not triton and not softcap and not chunk_size


def _c_prefill_reads(step: PackedStep, q: torch.Tensor, k_pool, v_pool, triton: bool, options: dict) -> bool:
    """Whether an engine step's prefill chunks go to the C read over the blocks
    (:mod:`hf_paged.kernels.cpu_prefill`): float32 pools on the CPU, ``step.prefill_read`` asking
    for it (:func:`_c_read`), causal attention in an optional sliding window with optional sinks (no
    softcap or chunk), and the read built for the layout. Half precision keeps stock's SDPA (batch
    invariance)."""
    return (_c_read(step.prefill_read) and not triton and not options.get("softcap")
            and not options.get("chunk_size") and cpu_prefill.supports(q, k_pool, v_pool))


def _has_span_options(options: dict) -> bool:
    """Whether a read needs more than causal attention in a sliding window (a chunk, softcap or sinks)."""
    return any(options.get(name) is not None for name in ("chunk_size", "softcap", "sinks"))


def _prefill_by_sdpa(query, key, value, k_pool, v_pool, tables, cu_seqlens_q, context_lens, scale,
                     sliding_window: int | None = None):
    """CPU prefill for an engine step, one SDPA call per sequence in the model's dtype, made as stock
    transformers' ``sdpa_attention_forward`` makes it for one unpadded prompt: a chunk with no past
    attends over its own new keys (no gather) with ``is_causal`` and grouped heads, or, when a
    sliding window shorter than the prompt needs a mask, with the causal window mask and repeated
    K/V heads; a chunk after a past attends over its gathered context with a causal (window) mask.
    So a prompt's attention has stock's bits whatever else the step holds: in bfloat16 and float16
    the float32 reference's rounding differs from SDPA's in the last bit, which flips greedy tokens.

    ``query`` ``[heads, tokens, head_dim]``, ``key``/``value`` ``[kv_heads, tokens, head_dim]`` (the
    packed row's prefill part); returns ``[tokens, heads, head_dim]``."""
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    heads, tokens, _ = query.shape
    out = query.new_empty(tokens, heads, value.shape[-1])
    block_size = k_pool.shape[1]
    for i, ctx in enumerate(lens):
        q0, q1 = cu[i], cu[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        if n == ctx:  # the whole sequence is new: its keys are this step's
            k, v = key[None, :, q0:q1], value[None, :, q0:q1]
        else:
            blocks = tables[i, : -(-ctx // block_size)].long()
            k = k_pool[blocks].flatten(0, 1)[:ctx].transpose(0, 1)[None].to(query.dtype)
            v = v_pool[blocks].flatten(0, 1)[:ctx].transpose(0, 1)[None].to(query.dtype)
        mask = None
        if n != ctx or (sliding_window and ctx >= sliding_window):  # stock skips the mask only below the window
            q_pos = torch.arange(ctx - n, ctx, device=query.device)[:, None]
            k_pos = torch.arange(ctx, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window:
                mask &= k_pos > q_pos - sliding_window
        groups = heads // k.shape[1]
        if mask is not None and groups > 1:  # with a mask stock repeats K/V heads rather than grouping
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            query[None, :, q0:q1], k, v, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale,
            enable_gqa=k.shape[1] != heads)[0].transpose(0, 1)
    return out


def _latent_context_attention(step: PackedStep, layer_idx: int, query, key, value, **kwargs):
    """An MLA layer in an engine step: ``key``/``value`` ``[1, heads, sum(context), dim]`` are what
    the model expanded from the sequences' cached latents (:meth:`PackedStepCache.update`), one
    sequence after another; each sequence's queries attend causally over its own stretch. One
    SDPA call per sequence: the cost is the expansion of every context per layer and step."""
    meta = step.metadata_for(layer_idx, query.device)
    cu_k = torch.nn.functional.pad(meta.context_lens.long().cumsum(0), (1, 0)).tolist()
    nd = meta.num_decode
    cu_q = list(range(nd + 1)) + [nd + int(c) for c in meta.cu_seqlens_q[1:].tolist()]
    scale = _scale(kwargs, query.shape[-1])
    out = query.new_empty(query.shape[2], query.shape[1], value.shape[-1])
    for i in range(len(cu_k) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        q, k, v = query[0, :, q0:q1], key[0, :, k0:k1], value[0, :, k0:k1]
        n_q, n_k = q1 - q0, k1 - k0
        mask = None
        if n_q > 1:  # queries are the last n_q of the n_k tokens
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out[None], None


def _decode_on_cpu(step: PackedStep, layer_idx: int, q, k_pool, v_pool, scale, options: dict, drafts: bool = False):
    """CPU decode for an engine step (``drafts``: the rows of its sequences with drafts, each read as
    a decode row, ``AttentionMetadata.draft_tables`` / ``draft_lens``). Float32 pools go to the C read over the blocks
    (:mod:`hf_paged.kernels.cpu_decode`: no gathered copy) where it is built and the layer needs
    no chunked attention (``step.decode_read`` "auto"). Otherwise, per group of similar-length
    sequences, one gather of their keys and values (slot indices built once per step, shared by
    all layers) and one fused SDPA call with a key-padding mask. Attention sinks join as one more
    key of zeros whose additive mask is the head's sink logit: its score is the sink, its value
    adds nothing."""
    num_seqs, heads, head_dim = q.shape
    kv_heads, group = k_pool.shape[2], heads // k_pool.shape[2]
    if _c_decode_wanted(step, q, False, options.get("softcap"), options.get("chunk_size")):
        meta = step.metadata_for(layer_idx, q.device)
        tables, lens = (meta.draft_tables, meta.draft_lens) if drafts else (meta.block_tables, meta.context_lens)
        out = cpu_decode.try_paged_decode_cpu(q, k_pool, v_pool, tables[:num_seqs], lens[:num_seqs], scale,
                                              options.get("sliding_window"), options.get("sinks"))
        if out is not None:
            return out
    k_rows, v_rows = k_pool.view(-1, kv_heads * head_dim), v_pool.view(-1, kv_heads * head_dim)
    sinks = options.get("sinks")
    parts = []
    for lo, hi, slots, mask in step.decode_groups(layer_idx, options.get("sliding_window"), q.dtype,
                                                  options.get("chunk_size"), drafts):
        flat = slots.reshape(-1)  # index_select of [kv_heads * head_dim] rows: ~4x faster than tensor[slots]
        shape = (hi - lo, slots.shape[1], kv_heads, head_dim)
        keys = k_rows.index_select(0, flat).view(shape).transpose(1, 2)  # [seqs, kv_heads, T, head_dim]
        values = v_rows.index_select(0, flat).view(shape).transpose(1, 2)
        if sinks is not None:
            keys, values, mask = _with_sink_key(keys, values, mask, sinks, group)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].view(hi - lo, kv_heads, group, head_dim), keys, values, attn_mask=mask,
            scale=scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(num_seqs, heads, head_dim)


def _with_sink_key(keys, values, mask, sinks, group: int):
    """``keys``/``values`` ``[seqs, kv_heads, T, head_dim]`` and their additive mask ``[seqs, 1, 1, T]``
    with one key of zeros appended, masked by each query head's sink logit (``[kv_heads, group]``)."""
    seqs, kv_heads, _, head_dim = keys.shape
    zeros = keys.new_zeros(seqs, kv_heads, 1, head_dim)
    sink_column = sinks.to(mask.dtype).view(1, kv_heads, group, 1).expand(seqs, -1, -1, -1)
    mask = torch.cat([mask.expand(-1, kv_heads, group, -1), sink_column], dim=-1)
    return torch.cat([keys, zeros], dim=2), torch.cat([values, zeros], dim=2), mask


def register() -> None:
    """Register ``"hf_paged"`` with both interfaces (the mask one as a classmethod: global mapping)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask_function)


register()
