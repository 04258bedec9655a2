"""Pure-torch reference implementations of the paged-attention kernels.

These are the ground truth the Triton kernels are tested against, and the CPU path of the
library, so they favour clarity but avoid per-token Python loops.  Arithmetic is done in
float32 (or float64 when the inputs are float64); results are returned in the query's dtype.

Cache layout (shared by every function here and by the kernels):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` integer; entry ``b`` of row ``i`` is the
  physical block holding tokens ``b * block_size .. (b + 1) * block_size - 1`` of sequence ``i``.
  Entries past a sequence's last block may hold anything (``-1``, garbage) and are never used.
* a token's *slot* is ``block_id * block_size + offset``.

Masking semantics:

* causal: a query at absolute position ``p`` sees keys at positions ``k <= p``;
* ``sliding_window=W``: additionally ``k > p - W`` (the ``W`` most recent keys, itself included);
* ``chunk_size=C`` (Llama 4's chunked local attention): additionally ``k // C == p // C`` (keys
  of the query's own chunk only); with ``sliding_window`` both conditions hold;
* ``softcap=c``: ``scores = c * tanh(scores / c)``, applied after ``scale`` and before masking;
* ``sinks`` ``[num_heads]`` (gpt-oss attention sinks): one logit per query head that joins each
  row's softmax denominator and carries no value, ``p_j = exp(s_j) / (sum_k exp(s_k) +
  exp(sink_h))``; not scaled, not softcapped.

Blocks before the first key visible to any query of a sequence (sliding window, chunk start)
may have been given back: their block-table entries are never used.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "paged_attention_decode_ref",
    "paged_attention_prefill_ref",
    "reshape_and_cache_ref",
    "copy_blocks_ref",
    "gather_kv_ref",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # half/bfloat16 -> float32; float32 stays; float64 stays (used by the tests as the oracle).
    return torch.promote_types(dtype, torch.float32)


def gather_kv_ref(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> torch.Tensor:
    """Contiguous ``[context_len, num_kv_heads, head_dim]`` view-copy of one sequence's cache."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def _scores_to_probs(
    scores: torch.Tensor, mask: torch.Tensor, softcap: Optional[float],
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softcap -> mask -> softmax over the last dim.  ``mask`` is True where a key is visible.
    ``sinks`` (broadcastable to ``scores[..., :1]``) join the softmax as an extra column that is
    dropped afterwards."""
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_col = sinks.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]


def _group_size(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query heads per KV head (q ``[rows, num_heads, head_dim]``)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    return num_heads // num_kv_heads


def _sinks_grouped(sinks: Optional[torch.Tensor], q: torch.Tensor, num_kv_heads: int,
                   cdt: torch.dtype) -> Optional[torch.Tensor]:
    """``sinks [num_heads]`` as ``[Hkv, G]`` in the compute dtype (None stays None)."""
    if sinks is None:
        return None
    assert sinks.shape == (q.shape[1],), "sinks must be [num_heads]"
    return sinks.to(device=q.device, dtype=cdt).view(num_kv_heads, -1)


def _attend(q, k, v, mask, scale: float, softcap: Optional[float],
            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Masked attention of ``q [B, N, Hkv, G, D]`` (N query tokens, G query heads per KV head)
    over ``k``/``v [B, T, Hkv, D]``; ``mask [B, N, T]`` is True where a key is visible; ``sinks``
    ``[Hkv, G]`` or None.  Returns ``[B, N, Hkv, G, D]``.  Without softcap: one fused SDPA call,
    a group's heads being extra query rows; sinks then ride along as one extra key that every
    row sees, with value 0 and a score equal to the row's sink: q gets an extra coordinate
    holding its head's sink, real keys a 0 there and the sink key ``1 / scale`` (so
    ``scale * q.k = sink``).  With softcap: explicit scores -> softcap -> mask -> softmax (with a
    sink column)."""
    B, N, Hkv, G, D = q.shape
    if softcap is None or softcap <= 0:
        rows = q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * N, D)  # 4D: the fused CPU kernel
        row_mask = mask[:, None, None].expand(-1, -1, G, -1, -1).reshape(B, 1, G * N, -1)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        if sinks is not None:
            sink_rows = sinks[None, :, :, None, None].expand(B, -1, -1, N, 1)
            rows = torch.cat([rows, sink_rows.reshape(B, Hkv, G * N, 1)], dim=-1)
            T = kt.shape[2]
            kt = torch.nn.functional.pad(kt, (0, 1, 0, 1))  # [B, Hkv, T + 1, D + 1], zeros
            kt[:, :, T, D] = 1.0 / scale
            vt = torch.nn.functional.pad(vt, (0, 1, 0, 1))  # value 0 (D + 1: one head dim)
            row_mask = torch.nn.functional.pad(row_mask, (0, 1), value=True)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, kt, vt, attn_mask=row_mask, scale=scale)[..., :D]
        return out.reshape(B, Hkv, G, N, D).permute(0, 3, 1, 2, 4)
    scores = torch.einsum("bnhgd,bthd->bhgnt", q, k) * scale
    sink_col = None if sinks is None else sinks[None, :, :, None, None]
    probs = _scores_to_probs(scores, mask[:, None, None], softcap, sink_col)
    return torch.einsum("bhgnt,bthd->bnhgd", probs, v)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None, softcap=None, sinks=None,
                               chunk_size=None) -> torch.Tensor:
    """The torch path of :func:`hf_paged.kernels.paged_attention_decode` (same arguments): one
    query token per sequence at position ``context_lens[i] - 1``; returns q's shape and dtype.
    Vectorised over sequences: K/V are gathered into ``[num_seqs, max_ctx, kv_heads, head_dim]``.
    """
    num_seqs, num_heads, head_dim = q.shape
    group = _group_size(q, k_cache)
    if num_seqs == 0:
        return torch.empty_like(q)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    ctx = context_lens.to(device=q.device, dtype=torch.long)
    max_ctx = int(ctx.max().item())
    assert int(ctx.min().item()) >= 1, "decode needs context_lens >= 1"
    cdt = _compute_dtype(q.dtype)

    max_blocks = (max_ctx + block_size - 1) // block_size
    pos = torch.arange(max_blocks * block_size, device=q.device)  # [T]
    qpos = ctx - 1
    first = torch.zeros_like(ctx)  # first visible key of each query
    if sliding_window is not None and sliding_window > 0:
        first = torch.clamp(qpos - sliding_window + 1, min=0)
    if chunk_size is not None and chunk_size > 0:
        first = torch.maximum(first, qpos // chunk_size * chunk_size)
    # causal + window + chunk: keys first .. ctx-1; blocks before `first` may be given back
    valid = (pos[None, :] < ctx[:, None]) & (pos[None, :] >= first[:, None])  # [S, T]
    used_block = valid.view(num_seqs, max_blocks, block_size).any(-1)  # [S, B]
    bt = block_tables[:, :max_blocks].to(device=q.device, dtype=torch.long)
    bt = torch.where(used_block, bt, torch.zeros_like(bt))  # never index with junk entries
    # [S, B, bs, Hkv, D] -> [S, T, Hkv, D]; zero what is not visible (may hold NaN/garbage)
    k = k_cache[bt].flatten(1, 2).to(cdt)
    v = v_cache[bt].flatten(1, 2).to(cdt)
    k = torch.where(valid[:, :, None, None], k, 0)
    v = torch.where(valid[:, :, None, None], v, 0)

    qf = q.to(cdt).view(num_seqs, num_kv_heads, group, head_dim)
    out = _attend(qf[:, None], k, v, valid[:, None], scale, softcap,
                  _sinks_grouped(sinks, q, num_kv_heads, cdt))
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                scale, sliding_window=None, softcap=None, sinks=None,
                                chunk_size=None) -> torch.Tensor:
    """The torch path of :func:`hf_paged.kernels.paged_attention_prefill` (same arguments).

    Sequence ``i`` owns query rows ``q[cu[i]:cu[i+1]]``: the last ``n_q`` tokens of its
    ``context_lens[i]`` tokens, so query ``j`` sits at position ``context_lens[i] - n_q + j``.
    Sequences with ``n_q == 0`` are skipped.  Loops over sequences (one matmul pair each).
    """
    num_tokens, num_heads, head_dim = q.shape
    group = _group_size(q, k_cache)
    num_kv_heads = k_cache.shape[2]
    cdt = _compute_dtype(q.dtype)
    use_window = sliding_window is not None and sliding_window > 0
    use_chunk = chunk_size is not None and chunk_size > 0
    sinks_g = _sinks_grouped(sinks, q, num_kv_heads, cdt)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_list = context_lens.tolist()
    for i, ctx in enumerate(ctx_list):
        start, end = cu[i], cu[i + 1]
        n_q = end - start
        if n_q == 0:
            continue
        assert n_q <= ctx, f"sequence {i}: {n_q} queries but context length {ctx}"
        # the first key any query of the sequence sees (that of its first query, at ctx - n_q)
        first = 0
        if use_window:
            first = max(ctx - n_q - sliding_window + 1, 0)
        if use_chunk:
            first = max(first, (ctx - n_q) // chunk_size * chunk_size)
        table = block_tables[i]
        if first >= k_cache.shape[1]:  # blocks before `first` may be given back
            table = table.clone()
            table[: first // k_cache.shape[1]] = 0
        k = gather_kv_ref(k_cache, table, ctx).to(cdt)  # [T, Hkv, D]
        v = gather_kv_ref(v_cache, table, ctx).to(cdt)
        k[:first], v[:first] = 0, 0
        qi = q[start:end].to(cdt).view(n_q, num_kv_heads, group, head_dim)
        qpos = torch.arange(ctx - n_q, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if use_window:
            mask = mask & (kpos[None, :] > qpos[:, None] - sliding_window)
        if use_chunk:
            mask = mask & (kpos[None, :] >= (qpos // chunk_size * chunk_size)[:, None])
        oi = _attend(qi[None], k[None], v[None], mask[None], scale, softcap, sinks_g)[0]
        out[start:end] = oi.reshape(n_q, num_heads, head_dim).to(q.dtype)
    return out


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The torch path of :func:`hf_paged.kernels.reshape_and_cache` (same arguments): write
    ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]`` (in place); slot -1 is skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    if k_cache.is_contiguous() and v_cache.is_contiguous() and (slots.numel() == 0 or int(slots.min()) >= 0):
        # No padding (the engine's case): one index_copy_ per pool, several times faster than index_put.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
        return
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = key[keep].to(k_cache.dtype)
    v_cache[blk, off] = value[keep].to(v_cache.dtype)


def copy_blocks_ref(k_caches, v_caches, block_mapping) -> None:
    """The torch path of :func:`hf_paged.kernels.copy_blocks` (same arguments): for every
    layer, copy block ``src`` onto block ``dst`` for each row ``(src, dst)``.

    All sources are read before any destination is written.  A block must not be both a
    source and a destination in one call (the kernel gives no ordering guarantee for that).
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for cache in list(k_caches) + list(v_caches):
        s, d = src.to(cache.device), dst.to(cache.device)
        cache[d] = cache[s]
