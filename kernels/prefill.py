"""Triton varlen causal (flash) attention over a paged KV cache: prefill, chunked prefill, mixed.

Sequence ``i`` has ``n_q = cu[i+1] - cu[i]`` query rows, the last ``n_q`` of its
``context_lens[i]`` tokens; they attend causally to the whole context through the block table
(which covers earlier-cached / shared prefix blocks too).

Work decomposition without a host sync: query tiles of ``BLOCK_M`` rows are numbered globally,
sequence ``i`` owning tile indices ``G_i .. G_i + cdiv(n_q_i, BLOCK_M) - 1`` with
``G_i = cu[i] // BLOCK_M + i`` (strictly increasing, non-overlapping).  The grid is
``(num_heads, num_tokens // BLOCK_M + num_seqs)``, known on the host from shapes alone; each
program binary-searches ``cu`` for its sequence and does nothing if its tile is past that
sequence's queries (its key ranges are made empty; no branch).  Tile indices are visited in
reverse so that the long (late) tiles start first, all heads of a tile together.

Per program the key range is split into: a masked head (sliding window edge), a run of
unmasked full tiles, and a masked tail (causal diagonal), so most tiles skip the mask math.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .decode import (INTERPRET, _check_cache, _dot, _load_2d, _next_pow2, _tanh,
                     launch_with_stage_fallback)


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, pos,
    k_base, v_base, bt_row, n0, lo, hi,
    qk_scale, softcap, window,
    stride_kb, stride_kt, stride_vb, stride_vt,
    d, dmask,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = (n >= lo) & (n < hi)
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    else:
        nmask = n >= 0  # unused: every key of an unmasked tile exists
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    off = n % BLOCK_SIZE
    k = _load_2d(k_base + (blk * stride_kb + off * stride_kt)[:, None] + d[None, :],
                 nmask, dmask, MASKED, HEAD_DIM != HEAD_DIM_P)
    s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
    if USE_SOFTCAP:
        s = (softcap * 1.4426950408889634) * _tanh(s / softcap)
    if MASKED:
        vis = nmask[None, :] & (n[None, :] <= pos[:, None])
        if USE_WINDOW:
            vis = vis & (n[None, :] > pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_2d(v_base + (blk * stride_vb + off * stride_vt)[:, None] + d[None, :],
                 nmask, dmask, MASKED, HEAD_DIM != HEAD_DIM_P)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr,
    scale, softcap, window, num_seqs, search_iters,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:  # grid (heads, tiles): all heads of a tile launch together (K/V reuse in L2)
        h = tl.program_id(0)
        pid = tl.num_programs(1) - 1 - tl.program_id(1)
    else:  # grid (tiles, heads): only for > 65535 tiles (the y/z grid limit)
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)

    # largest seq in [0, num_seqs) with cu[seq] // BLOCK_M + seq <= pid
    lo = pid * 0
    hi = lo + num_seqs - 1
    for _ in range(search_iters):
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_ptr + mid) // BLOCK_M + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    j = pid - (q_start // BLOCK_M + seq)

    ctx = tl.load(ctx_ptr + seq)
    m = j * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < n_q
    d = tl.arange(0, HEAD_DIM_P)
    dmask = d < HEAD_DIM
    pos = ctx - n_q + m  # absolute query positions
    rows = (q_start + m).to(tl.int64)
    q = _load_2d(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                 mmask, dmask, True, HEAD_DIM != HEAD_DIM_P)

    qk_scale = scale
    if not USE_SOFTCAP:
        qk_scale = scale * 1.4426950408889634
    kvh = h // GROUP
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts

    pos_lo = ctx - n_q + j * BLOCK_M  # first row's position
    pos_hi = tl.minimum(pos_lo + BLOCK_M, ctx) - 1  # last valid row's position
    k_lo = pos_lo * 0
    full_lo = k_lo
    if USE_WINDOW:
        k_lo = tl.maximum(pos_lo - window + 1, 0)
        full_lo = tl.maximum(k_lo, pos_hi - window + 1)
    k_hi = pos_hi + 1
    # keys in [full_lo, pos_lo] are visible to every row of the tile
    n_full = tl.maximum(pos_lo + 1 - full_lo, 0) // BLOCK_N
    full_hi = full_lo + n_full * BLOCK_N
    # a program past its sequence's queries (grid slack) gets empty key ranges; its rows are
    # all masked (m >= n_q) so it stores nothing
    live = j * BLOCK_M < n_q
    k_lo = tl.where(live, k_lo, 0)
    full_lo = tl.where(live, full_lo, 0)
    full_hi = tl.where(live, full_hi, 0)
    k_hi = tl.where(live, k_hi, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)

    if USE_WINDOW:  # masked head: window edge
        for n0 in range(k_lo, full_lo, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, pos, k_base, v_base, bt_row, n0, k_lo, full_lo,
                qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
                d, dmask, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, True,
                USE_WINDOW, USE_SOFTCAP, PREC, UPCAST)
    for n0 in range(full_lo, full_hi, BLOCK_N):  # unmasked body
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, n0, full_lo, full_hi,
            qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
            d, dmask, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, False,
            USE_WINDOW, USE_SOFTCAP, PREC, UPCAST)
    for n0 in range(full_hi, k_hi, BLOCK_N):  # masked tail: causal diagonal
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, n0, full_hi, k_hi,
            qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
            d, dmask, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, True,
            USE_WINDOW, USE_SOFTCAP, PREC, UPCAST)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    optrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    if HEAD_DIM != HEAD_DIM_P:
        tl.store(optrs, o.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & dmask[None, :])
    else:
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def default_prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                           precision: str = "ieee") -> dict:
    if device.type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        if precision == "tf32":
            return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
        # ieee fp32 dots run on FMA units and need many registers: small tiles avoid spills
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
    if head_dim > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    # 5 stages: deep enough for the pipeliner to overlap the K/V tile loads (which depend on a
    # block-table load) with the previous tile's matmuls (sm_90 TTGIR); ~130 KB shared memory,
    # falls back to fewer stages on devices with less
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 5}


def paged_attention_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    precision: str = "ieee",
    config: Optional[dict] = None,
) -> torch.Tensor:
    assert q.dim() == 3
    _check_cache(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape[0] == num_seqs + 1, "cu_seqlens_q must have num_seqs + 1 entries"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        context_lens = context_lens.to(torch.int32).contiguous()
    if cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous():
        cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()

    cfg = default_prefill_config(head_dim, q.dtype, q.device, precision)
    if config:
        cfg.update(config)
    block_m, block_n = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    prec = precision if q.dtype == torch.float32 else "ieee"
    upcast = INTERPRET and q.dtype != torch.float32

    num_progs = num_tokens // block_m + num_seqs
    heads_first = bool(cfg.get("HEADS_FIRST", num_progs <= 65535))
    grid = (num_heads, num_progs) if heads_first else (num_progs, num_heads)
    args = (
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        float(scale), float(softcap) if use_softcap else 1.0,
        int(sliding_window) if use_window else 0, num_seqs, int(num_seqs).bit_length(),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    )
    kwargs = dict(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, PREC=prec, UPCAST=upcast,
        HEADS_FIRST=heads_first,
    )
    key = ("prefill", q.device, q.dtype, head_dim, block_m, block_n, int(cfg["num_warps"]))
    launch_with_stage_fallback(_prefill_kernel, grid, args, kwargs, cfg, key,
                               strict=bool(config))
    return out
