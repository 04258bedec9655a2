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
* ``softcap=c``: ``scores = c * tanh(scores / c)``, applied after ``scale`` and before masking.
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
    scores: torch.Tensor, mask: torch.Tensor, softcap: Optional[float]
) -> torch.Tensor:
    """softcap -> mask -> softmax over the last dim.  ``mask`` is True where a key is visible."""
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _group_size(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query heads per KV head (q ``[rows, num_heads, head_dim]``)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    return num_heads // num_kv_heads


def _attend(q, k, v, mask, scale: float, softcap: Optional[float]) -> torch.Tensor:
    """Masked attention of ``q [B, N, Hkv, G, D]`` (N query tokens, G query heads per KV head)
    over ``k``/``v [B, T, Hkv, D]``; ``mask [B, N, T]`` is True where a key is visible.  Returns
    ``[B, N, Hkv, G, D]``.  Without softcap: one fused SDPA call, a group's heads being extra
    query rows; with it, explicit scores -> softcap -> mask -> softmax."""
    B, N, Hkv, G, D = q.shape
    if softcap is None or softcap <= 0:
        rows = q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * N, D)  # 4D: the fused CPU kernel
        row_mask = mask[:, None, None].expand(-1, -1, G, -1, -1).reshape(B, 1, G * N, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=row_mask, scale=scale)
        return out.view(B, Hkv, G, N, D).permute(0, 3, 1, 2, 4)
    scores = torch.einsum("bnhgd,bthd->bhgnt", q, k) * scale
    probs = _scores_to_probs(scores, mask[:, None, None], softcap)
    return torch.einsum("bhgnt,bthd->bnhgd", probs, v)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None, softcap=None) -> torch.Tensor:
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
    valid = pos[None, :] < ctx[:, None]  # [S, T]
    if sliding_window is not None and sliding_window > 0:  # blocks before the window may be given back
        valid = valid & (pos[None, :] > (ctx[:, None] - 1 - sliding_window))
    used_block = valid.view(num_seqs, max_blocks, block_size).any(-1)  # [S, B]
    bt = block_tables[:, :max_blocks].to(device=q.device, dtype=torch.long)
    bt = torch.where(used_block, bt, torch.zeros_like(bt))  # never index with junk entries
    # [S, B, bs, Hkv, D] -> [S, T, Hkv, D]; zero what is past the context (may hold NaN/garbage)
    k = k_cache[bt].flatten(1, 2).to(cdt)
    v = v_cache[bt].flatten(1, 2).to(cdt)
    k = torch.where(valid[:, :, None, None], k, 0)
    v = torch.where(valid[:, :, None, None], v, 0)

    qf = q.to(cdt).view(num_seqs, num_kv_heads, group, head_dim)
    mask = valid
    if sliding_window is not None and sliding_window > 0:
        qpos = ctx - 1
        mask = mask & (pos[None, :] > (qpos[:, None] - sliding_window))
    out = _attend(qf[:, None], k, v, mask[:, None], scale, softcap)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                scale, sliding_window=None, softcap=None) -> torch.Tensor:
    """The torch path of :func:`hf_paged.kernels.paged_attention_prefill` (same arguments).

    Sequence ``i`` owns query rows ``q[cu[i]:cu[i+1]]``: the last ``n_q`` tokens of its
    ``context_lens[i]`` tokens, so query ``j`` sits at position ``context_lens[i] - n_q + j``.
    Sequences with ``n_q == 0`` are skipped.  Loops over sequences (one matmul pair each).
    """
    num_tokens, num_heads, head_dim = q.shape
    group = _group_size(q, k_cache)
    num_kv_heads = k_cache.shape[2]
    cdt = _compute_dtype(q.dtype)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_list = context_lens.tolist()
    for i, ctx in enumerate(ctx_list):
        start, end = cu[i], cu[i + 1]
        n_q = end - start
        if n_q == 0:
            continue
        assert n_q <= ctx, f"sequence {i}: {n_q} queries but context length {ctx}"
        table, first = block_tables[i], 0
        if sliding_window is not None and sliding_window > 0:  # blocks before the window may be given back
            first = max(ctx - n_q - sliding_window + 1, 0)
            table = table.clone()
            table[: first // k_cache.shape[1]] = 0
        k = gather_kv_ref(k_cache, table, ctx).to(cdt)  # [T, Hkv, D]
        v = gather_kv_ref(v_cache, table, ctx).to(cdt)
        k[:first], v[:first] = 0, 0
        qi = q[start:end].to(cdt).view(n_q, num_kv_heads, group, head_dim)
        qpos = torch.arange(ctx - n_q, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None and sliding_window > 0:
            mask = mask & (kpos[None, :] > qpos[:, None] - sliding_window)
        oi = _attend(qi[None], k[None], v[None], mask[None], scale, softcap)[0]
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
