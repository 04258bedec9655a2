"""Triton flash-decoding kernel over a paged KV cache.

One query token per sequence.  Grid: ``(num_seqs, num_kv_heads, num_splits)``.  A program owns
one (sequence, KV head) pair and one contiguous segment of that sequence's visible keys; the
``group = num_heads // num_kv_heads`` query heads that share the KV head are packed into the M
dimension of one tile (padded to 16 for ``tl.dot``), so every K/V block is read once per KV head.
Tokens are processed ``TILE`` at a time (several cache blocks gathered through the block table).
Each program keeps an fp32 running max / sum; with more than one split it writes a normalised
partial output and its log-sum-exp, and a second small kernel merges the splits.

Attention sinks: split 0 starts its running max at the head's sink logit and its running sum at
1 (the sink's own term, with no value), so the sink sits in split 0's log-sum-exp and the merge
counts it exactly once.  Chunked local attention (like a sliding window) only moves the first
visible key: the splits cover ``[start, ctx)`` and blocks before ``start`` are never read.

This module imports triton at import time; ``hf_paged.kernels`` only imports it lazily.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (dot, dot_modes, launch_with_stage_fallback, load_2d, next_pow2,
                      prepare_attention_args, sm_count)


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """fp32 tanh accurate to a few ulp: odd Taylor series near 0, exp form elsewhere."""
    ax = tl.abs(x)
    x2 = x * x
    poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.3, poly, big)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr, sinks_ptr,
    scale, softcap, window, chunk, num_splits,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pp,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(ctx_ptr + seq)
    # visible keys of the query at position ctx-1: [start, ctx); blocks before start may have
    # been given back and are never read
    start = ctx * 0
    if USE_WINDOW:
        start = tl.maximum(ctx - window, 0)
    if USE_CHUNK:  # the query's chunk
        start = tl.maximum(start, tl.maximum(ctx - 1, 0) // chunk * chunk)
    seg = tl.cdiv(tl.cdiv(ctx - start, num_splits), TILE) * TILE
    seg_lo = start + split * seg
    seg_hi = tl.minimum(seg_lo + seg, ctx)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = load_2d(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                gmask, dmask, True, HEAD_DIM != HEAD_DIM_P)

    qk_scale = scale
    if not USE_SOFTCAP:
        qk_scale = scale * 1.4426950408889634  # work in base 2

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    if USE_SINKS:  # split 0 starts its online softmax from the sink (base 2): max = sink,
        # sum = exp2(sink - sink) = 1, no value; the other splits do not see it, so the merge of
        # the splits' log-sum-exps counts it once
        sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for t0 in range(seg_lo, seg_hi, TILE):
        tok = t0 + tl.arange(0, TILE)
        tmask = tok < seg_hi
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
        k = load_2d(k_base + (blk * stride_kb + off * stride_kt)[:, None] + d[None, :],
                    tmask, dmask, True, HEAD_DIM != HEAD_DIM_P)
        s = dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [GROUP_P, TILE]
        if USE_SOFTCAP:
            s = (softcap * 1.4426950408889634) * _tanh(s / softcap)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_2d(v_base + (blk * stride_vb + off * stride_vt)[:, None] + d[None, :],
                    tmask, dmask, True, HEAD_DIM != HEAD_DIM_P)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # an empty segment gives zeros, not NaN
    omask = gmask[:, None] & dmask[None, :]
    if SINGLE_SPLIT:
        optrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        pptrs = (part_o_ptr + seq.to(tl.int64) * stride_ps + heads[:, None] * stride_ph
                 + split * stride_pp + d[None, :])
        tl.store(pptrs, o, mask=omask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # base 2
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_ls + heads * stride_lh + split, lse,
                 mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pp,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    smask = sp < num_splits
    dmask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq.to(tl.int64) * stride_ls + h * stride_lh + sp, mask=smask,
                  other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the first split always holds the query's own key
    w = tl.exp2(lse - m)
    w = w / tl.sum(w, 0)
    o = tl.load(part_o_ptr + seq.to(tl.int64) * stride_ps + h * stride_ph
                + sp[:, None] * stride_pp + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=dmask)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------
def pick_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, tile: int,
                    num_sms: int, min_tokens_per_split: int = 256) -> int:
    """Enough programs to fill the GPU (about 2 per SM), each with >= min_tokens_per_split keys.

    Measured on an H200 (benchmarks/RESULTS.md): at 64 sequences x 8 KV heads one split per
    (sequence, head) was fastest at 1k-16k context; splitting pays when there are few pairs.
    """
    pairs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * num_sms // pairs)
    most = max(1, -(-max_context_len // max(tile, min_tokens_per_split)))
    return int(max(1, min(want, most, 128)))


def default_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"TILE": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:  # fp32 dots are register hungry: 8 warps keeps them unspilled
        return {"TILE": 32, "num_warps": 8, "num_stages": 2}
    # (64, 4 warps, 3 stages) was the fastest of the sweep at 1k, 4k and 16k context on an H200
    # (bf16, 32/8 heads, head_dim 128; benchmarks/RESULTS.md)
    return {"TILE": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 3}


def paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  sliding_window=None, softcap=None, sinks=None,
                                  chunk_size=None, *, out=None,
                                  precision: str = "ieee", max_context_len: Optional[int] = None,
                                  num_splits: Optional[int] = None,
                                  config: Optional[dict] = None) -> torch.Tensor:
    """The Triton path of :func:`hf_paged.kernels.paged_attention_decode` (same arguments, and
    ``precision`` a name, not None).  ``num_splits`` overrides the split-K heuristic
    (:func:`pick_num_splits`), ``config`` updates :func:`default_decode_config` (and disables
    the shared-memory fallback of :func:`launch_with_stage_fallback`)."""
    q, out, block_tables, context_lens = prepare_attention_args(
        q, k_cache, v_cache, out, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return out

    cfg = default_decode_config(head_dim, q.dtype, q.device)
    if config:
        cfg.update(config)
    tile = int(cfg["TILE"])
    if max_context_len is None:  # an upper bound known without a device sync
        max_context_len = block_tables.shape[1] * block_size
    if sliding_window is not None and sliding_window > 0:
        max_context_len = min(max_context_len, int(sliding_window))
    else:
        sliding_window = None
    use_chunk = chunk_size is not None and chunk_size > 0
    if use_chunk:  # visible keys: at most one chunk
        max_context_len = min(max_context_len, int(chunk_size))
    if sinks is not None:
        assert sinks.shape == (num_heads,), "sinks must be [num_heads]"
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, num_kv_heads, max_context_len, tile,
                                     sm_count(q.device))
    num_splits = max(1, int(num_splits))
    use_softcap = softcap is not None and softcap > 0

    head_dim_p = max(16, next_pow2(head_dim))
    group_p = max(16, next_pow2(group))
    single = num_splits == 1
    if single:
        part_o = out  # unused
        part_lse = out
        sps = sph = spp = sls = slh = 0
    else:
        part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), device=q.device,
                             dtype=torch.float32)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), device=q.device,
                               dtype=torch.float32)
        sps, sph, spp = part_o.stride(0), part_o.stride(1), part_o.stride(2)
        sls, slh = part_lse.stride(0), part_lse.stride(1)
    prec, upcast = dot_modes(q.dtype, precision)

    grid = (num_seqs, num_kv_heads, num_splits)
    args = (
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse,
        sinks if sinks is not None else out,  # unused without sinks
        float(scale), float(softcap) if use_softcap else 1.0,
        int(sliding_window) if sliding_window else 0, int(chunk_size) if use_chunk else 1,
        num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        sps, sph, spp, sls, slh,
    )
    kwargs = dict(
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, TILE=tile,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=use_softcap, SINGLE_SPLIT=single,
        USE_SINKS=sinks is not None, USE_CHUNK=use_chunk,
        PREC=prec, UPCAST=upcast,
    )
    key = ("decode", q.device, q.dtype, head_dim, group, block_size, tile, int(cfg["num_warps"]))
    launch_with_stage_fallback(_decode_kernel, grid, args, kwargs, cfg, key, strict=bool(config))
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, num_splits,
            sps, sph, spp, sls, slh,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=max(2, next_pow2(num_splits)),
            num_warps=4 if head_dim_p * num_splits >= 2048 else 2,
        )
    return out
