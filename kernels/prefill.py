"""Triton varlen causal (flash) attention over a paged KV cache: prefill, chunked prefill, mixed.

Sequence ``i`` has ``n_q = cu[i+1] - cu[i]`` query rows, the last ``n_q`` of its
``context_lens[i]`` tokens; they attend causally to the whole context through the block table
(which covers earlier-cached / shared prefix blocks too).

Rows of a program.  Without GQA packing a program owns ``BLOCK_M`` consecutive tokens of one
query head.  With GQA packing (``PACK_GQA``) it owns ``TOK_M = BLOCK_M // group`` consecutive
tokens of all ``group`` query heads that share one KV head, row ``r`` being token ``r // group``
of head ``r % group``: each K/V tile then serves every head of the group at once, and short
query runs (chunked prefill, decode tokens in a mixed batch) fill a tile with heads instead of
padding rows.  Every row masks with its own token's position.

Work decomposition without a host sync: query tiles of ``TOK_M`` tokens are numbered globally,
sequence ``i`` owning tile indices ``G_i .. G_i + cdiv(n_q_i, TOK_M) - 1`` with
``G_i = cu[i] // TOK_M + i`` (strictly increasing, non-overlapping).  The grid is
``(heads, num_tokens // TOK_M + num_seqs)``, known on the host from shapes alone; each program
finds its sequence by counting the ``G_i <= pid`` (one vector load per 64 sequences) and does
nothing if its tile is past that sequence's queries (its key ranges are made empty).  Tile
indices are visited in reverse so that the long (late) tiles start first, all heads of a tile
together (K/V reuse in L2).

K/V tiles are gathered block-wise: a tile of ``BLOCK_N`` keys is ``BLOCK_N // ROWS`` runs of
``ROWS = min(BLOCK_N, block_size)`` keys that each lie in one cache block, loaded as a
``[runs, ROWS, head_dim]`` tensor (one block-table entry per run, not per key) and reshaped to
``[BLOCK_N, head_dim]``; on sm_90 the reshape is a free view of the shared-memory buffer that
the software pipeline fills with async copies.  Key tiles start at multiples of ``BLOCK_N``.

Per program the key range is split into: a masked head (sliding-window or chunk edge: chunked
local attention, ``chunk_size``, is a lower bound on a row's keys like a window), a run of
unmasked full tiles (no masks, no bounds checks at all), and a masked tail (causal diagonal; the
only loop whose loads are bounds-checked).  Keys before the first row's first visible key are
never read (their blocks may have been given back).  Attention sinks start each row's online
softmax: running max = the head's sink logit, running sum = 1, accumulator 0.  Softmax runs in
base 2 with the scale folded into the exponent's FMA.  Optional (``LAZY``): a row's reference max moves only when it grows by more
than 8 (a factor 2^8, harmless in fp32), and the output accumulator is rescaled only in the
tiles where some row's max moved (a CTA-wide vote), instead of every tile.  Configs may carry
``maxnreg`` (e.g. 128 at 8 warps: two CTAs per SM).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, dot, dot_modes, launch_with_stage_fallback, load_2d,
                      next_pow2, prepare_attention_args)

# sequences per vector load when a program looks up its sequence in cu_seqlens
_SCAN = 64


@triton.jit
def _tanh_fast(x):
    """fp32 tanh, same accuracy class as decode's ``_tanh`` (odd Taylor series near 0, exp form
    elsewhere) but cheaper on the GPU: ``1 - 2 / (2^(2|x| log2 e) + 1)`` uses the flush-to-zero
    ``exp2`` (``exp`` adds denormal fix-ups) and one division (~15% fewer instructions in the
    softcapped prefill loop on sm_90)."""
    ax = tl.abs(x)
    x2 = x * x
    poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    big = 1.0 - 2.0 / (tl.exp2(ax * 2.8853900817779268) + 1.0)  # exp2 -> inf: 1 - 0
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.3, poly, big)


@triton.jit
def _load_kv(k_base, v_base, bt_row, n0, lo, hi,
             stride_kb, stride_kt: tl.constexpr, stride_vb, stride_vt: tl.constexpr, d, dmask,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
             HEAD_DIM_P: tl.constexpr, PAD_D: tl.constexpr, LOAD_MASK: tl.constexpr, LO_MASK: tl.constexpr):
    """K and V rows ``n0 .. n0 + BLOCK_N - 1`` (``n0`` a multiple of ``BLOCK_N``) as
    ``[BLOCK_N, HEAD_DIM_P]`` tiles; keys ``>= hi`` read as 0 when ``LOAD_MASK``, keys ``< lo``
    when ``LO_MASK`` (a sliding window's edge: the blocks before it may have been given back, so
    neither their table entries nor their memory are read).  The tile is
    ``BLOCK_N // ROWS`` runs of ``ROWS`` keys inside one cache block each: whole blocks
    (``ROWS == BLOCK_SIZE``), part of one block (``ROWS == BLOCK_N < BLOCK_SIZE``), or single
    keys (``ROWS == 1``, block sizes that are not powers of two).  The in-block key strides
    are compile-time constants (one value per model): fewer live address registers, which
    matters for the register-capped two-CTAs-per-SM configs (sm_90: 80 instead of 112 bytes
    of spills at 128 x 64 tiles, 8 warps, maxnreg 128)."""
    RUNS: tl.constexpr = BLOCK_N // ROWS
    first = n0 + tl.arange(0, RUNS) * ROWS  # first key of each run
    if LO_MASK or LOAD_MASK:  # a run lies in one block: read its entry if any of its keys is wanted
        if LOAD_MASK and LO_MASK:
            run_mask = (first < hi) & (first + (ROWS - 1) >= lo)
        elif LOAD_MASK:
            run_mask = first < hi
        else:
            run_mask = first + (ROWS - 1) >= lo
        blk = tl.load(bt_row + first // BLOCK_SIZE, mask=run_mask, other=0)
    else:
        blk = tl.load(bt_row + first // BLOCK_SIZE)
    blk = blk.to(tl.int64)
    if ROWS == BLOCK_SIZE:
        t = tl.arange(0, ROWS)[None, :]
    else:
        t = (first % BLOCK_SIZE)[:, None] + tl.arange(0, ROWS)[None, :]
    d3 = d[None, None, :]
    k_ptrs = k_base + (blk * stride_kb)[:, None, None] + (t * stride_kt)[:, :, None] + d3
    v_ptrs = v_base + (blk * stride_vb)[:, None, None] + (t * stride_vt)[:, :, None] + d3
    if LO_MASK or LOAD_MASK:
        key = first[:, None, None] + tl.arange(0, ROWS)[None, :, None]
        if LOAD_MASK and LO_MASK:
            keymask = (key < hi) & (key >= lo)
        elif LOAD_MASK:
            keymask = key < hi
        else:
            keymask = key >= lo
        if PAD_D:
            keymask = keymask & dmask[None, None, :]
        k = tl.load(k_ptrs, mask=keymask, other=0.0)
        v = tl.load(v_ptrs, mask=keymask, other=0.0)
    elif PAD_D:
        k = tl.load(k_ptrs, mask=dmask[None, None, :], other=0.0)
        v = tl.load(v_ptrs, mask=dmask[None, None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return tl.reshape(k, [BLOCK_N, HEAD_DIM_P]), tl.reshape(v, [BLOCK_N, HEAD_DIM_P])


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, pos, cstart,
    k_base, v_base, bt_row, n0, lo, hi,
    scale, qk_scale, softcap, window,
    stride_kb, stride_kt: tl.constexpr, stride_vb, stride_vt: tl.constexpr,
    d, dmask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, LOAD_MASK: tl.constexpr, LO_MASK: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    LAZY: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    k, v = _load_kv(k_base, v_base, bt_row, n0, lo, hi, stride_kb, stride_kt, stride_vb, stride_vt,
                    d, dmask, BLOCK_SIZE, BLOCK_N, ROWS, HEAD_DIM_P, PAD_D, LOAD_MASK, LO_MASK)
    s = dot(q, tl.trans(k), PREC, UPCAST)  # [BLOCK_M, BLOCK_N], raw q.k
    if USE_SOFTCAP:  # capped logits, already in base 2
        s = (softcap * 1.4426950408889634) * _tanh_fast(s * (scale / softcap))
        sc = 1.0
    else:  # scale * log2(e) is applied inside the exponent's FMA below
        sc = qk_scale
    if MASKED:
        n = n0 + tl.arange(0, BLOCK_N)
        vis = n[None, :] <= pos[:, None]
        if USE_WINDOW:
            vis = vis & (n[None, :] > pos[:, None] - window)
        if USE_CHUNK:  # cstart: first key of each row's chunk
            vis = vis & (n[None, :] >= cstart[:, None])
        s = tl.where(vis, s, float("-inf"))
    m_tile = tl.max(s, 1) * sc
    if LAZY:  # move a row's reference max only when it grows by more than 2^8
        m_cand = tl.maximum(m_i, m_tile)
        grow = m_cand > m_i + 8.0
        m_new = tl.where(grow, m_cand, m_i)
    else:
        m_new = tl.maximum(m_i, m_tile)
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key (nor sink) yet
    else:  # every key of the tile is visible to every row: the max is finite
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if LAZY:  # rescale the accumulator only when some row's reference max moved
        if tl.max(grow.to(tl.int32), 0) > 0:
            acc = acc * alpha[:, None]
        acc = acc + dot(p.to(v.dtype), v, PREC, UPCAST)
    else:
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _tile_rows(hp, j, n_q, q_start, GROUP: tl.constexpr, PACK_GQA: tl.constexpr,
               TOK_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per row of tile ``j`` of program head ``hp``: query head, token index in the sequence,
    validity, and token row in q/out."""
    r = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        tok = r // GROUP
        heads = hp * GROUP + r % GROUP
        m = j * TOK_M + tok
        mmask = (m < n_q) & (tok < TOK_M)
    else:
        heads = hp + r * 0
        m = j * TOK_M + r
        mmask = m < n_q
    return heads, m, mmask, (q_start + m).to(tl.int64)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, sinks_ptr,
    scale, softcap, window, chunk, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kh,
    stride_vb, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    stride_kt: tl.constexpr, stride_vt: tl.constexpr,
    GROUP: tl.constexpr, PACK_GQA: tl.constexpr, TOK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, USE_LO: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    LAZY: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HEADS_FIRST: tl.constexpr,
    SCAN: tl.constexpr,
):
    # TOK_M: tokens per tile (BLOCK_M // GROUP when packing the group's heads, else BLOCK_M)
    if HEADS_FIRST:  # grid (heads, tiles): all heads of a tile launch together (K/V reuse in L2)
        hp = tl.program_id(0)
        pid = tl.num_programs(1) - 1 - tl.program_id(1)
    else:  # grid (tiles, heads): only for > 65535 tiles (the y/z grid limit)
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        hp = tl.program_id(1)

    # sequence = (number of i in [0, num_seqs) with cu[i] // TOK_M + i <= pid) - 1
    cnt = pid * 0
    for c0 in range(0, num_seqs, SCAN):
        i = c0 + tl.arange(0, SCAN)
        inb = i < num_seqs
        cu_i = tl.load(cu_ptr + i, mask=inb, other=0)
        cnt += tl.sum((inb & (cu_i // TOK_M + i <= pid)).to(tl.int32), 0)
    seq = cnt - 1
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    j = pid - (q_start // TOK_M + seq)
    ctx = tl.load(ctx_ptr + seq)

    if PACK_GQA:
        kvh = hp
    else:
        kvh = hp // GROUP
    heads, m, mmask, rows = _tile_rows(hp, j, n_q, q_start, GROUP, PACK_GQA, TOK_M, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_P)
    dmask = d < HEAD_DIM
    pos = ctx - n_q + m  # absolute query positions, per row
    cstart = pos * 0
    if USE_CHUNK:
        cstart = pos // chunk * chunk  # first key of each row's chunk
    q = load_2d(q_ptr + rows[:, None] * stride_qt + (heads * stride_qh)[:, None] + d[None, :],
                mmask, dmask, True, HEAD_DIM != HEAD_DIM_P)

    qk_scale = scale * 1.4426950408889634  # work in base 2
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts

    # key tiles start at multiples of BLOCK_N: [k_lo, full_lo) masked head (window / chunk
    # edge), [full_lo, full_hi) keys visible to every row, [full_hi, k_hi) masked tail (diagonal)
    pos_lo = ctx - n_q + j * TOK_M  # first row's position
    pos_hi = tl.minimum(pos_lo + TOK_M, ctx) - 1  # last valid row's position
    k_hi = pos_hi + 1
    full_hi = (pos_lo + 1) // BLOCK_N * BLOCK_N
    k_lo = pos_lo * 0
    full_lo = k_lo
    k_first = k_lo  # the first key any row reads
    if USE_LO:  # a row's first visible key grows with its position: the first row's is the
        # first key read (blocks before it may be given back), the last row's bounds the body
        first_key = k_lo
        last_lo = k_lo
        if USE_WINDOW:
            first_key = tl.maximum(pos_lo - window + 1, 0)
            last_lo = tl.maximum(pos_hi - window + 1, 0)
        if USE_CHUNK:
            first_key = tl.maximum(first_key, pos_lo // chunk * chunk)
            last_lo = tl.maximum(last_lo, pos_hi // chunk * chunk)
        k_first = first_key
        k_lo = first_key // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(first_key, last_lo), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, full_hi)
    # a program past its sequence's queries (grid slack) gets empty key ranges; its rows are
    # all masked (m >= n_q) so it stores nothing
    live = j * TOK_M < n_q
    k_lo = tl.where(live, k_lo, 0)
    full_lo = tl.where(live, full_lo, 0)
    full_hi = tl.where(live, full_hi, 0)
    k_hi = tl.where(live, k_hi, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the online softmax starts from the sink (base 2): max = sink, sum =
        # exp2(sink - sink) = 1, and no value in acc
        m_i = tl.load(sinks_ptr + heads) * 1.4426950408889634
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_P

    if USE_LO:  # masked head: window / chunk edge (all its keys exist: no bounds checks)
        for n0 in range(k_lo, full_lo, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, pos, cstart, k_base, v_base, bt_row, n0, first_key, full_lo,
                scale, qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
                d, dmask, BLOCK_SIZE, BLOCK_N, ROWS, HEAD_DIM_P, PAD_D, True, False, True,
                USE_WINDOW, USE_CHUNK, USE_SOFTCAP, LAZY, PREC, UPCAST)
    for n0 in range(full_lo, full_hi, BLOCK_N):  # unmasked body
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, pos, cstart, k_base, v_base, bt_row, n0, 0, full_hi,
            scale, qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
            d, dmask, BLOCK_SIZE, BLOCK_N, ROWS, HEAD_DIM_P, PAD_D, False, False, False,
            USE_WINDOW, USE_CHUNK, USE_SOFTCAP, LAZY, PREC, UPCAST)
    for n0 in range(full_hi, k_hi, BLOCK_N):  # masked tail: causal diagonal, keys < k_hi
        # (a short window or a chunk can start inside the tail: then keys before it are not
        # read either)
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, pos, cstart, k_base, v_base, bt_row, n0, k_first, k_hi,
            scale, qk_scale, softcap, window, stride_kb, stride_kt, stride_vb, stride_vt,
            d, dmask, BLOCK_SIZE, BLOCK_N, ROWS, HEAD_DIM_P, PAD_D, True, True, USE_LO,
            USE_WINDOW, USE_CHUNK, USE_SOFTCAP, LAZY, PREC, UPCAST)

    o = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    # the row mapping again, from scalars (an opaque 0 keeps the compiler from reusing the
    # first one): per-row pointers and masks are then not held in registers across the loops
    opaque0 = (k_hi < 0).to(tl.int32)
    heads, m, mmask, rows = _tile_rows(hp, j + opaque0, n_q, q_start, GROUP, PACK_GQA, TOK_M,
                                       BLOCK_M)
    optrs = out_ptr + rows[:, None] * stride_ot + (heads * stride_oh)[:, None] + d[None, :]
    if PAD_D:
        tl.store(optrs, o.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & dmask[None, :])
    else:
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def default_prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                           precision: str = "ieee") -> dict:
    """Launch configuration: BLOCK_M / BLOCK_N (query rows / keys per tile), num_warps,
    num_stages, PACK_GQA (pack the query heads of a KV group into a tile; ignored without GQA),
    optionally LAZY (lazy accumulator rescaling) and maxnreg (a register cap, e.g. to fit two
    CTAs per SM).  An explicit ``config`` passed to the kernel updates this dict, except that
    ``maxnreg`` is only taken from the explicit config when one is given."""
    if device.type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PACK_GQA": True}
    if dtype == torch.float32:
        if precision == "tf32":
            return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2,
                    "PACK_GQA": True}
        # ieee fp32 dots run on FMA units and need many registers: small tiles avoid spills
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "PACK_GQA": True}
    if head_dim > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PACK_GQA": True}
    if _capability_major(device) == 9:
        # sm_90: 128 x 64 tiles, 8 warps, registers capped at 128 so that two CTAs share an SM
        # (96 KB of shared memory each, 2 K/V buffers): one CTA's softmax then overlaps the
        # other's wgmma, which Triton cannot do within a CTA.  No spills at head_dim 128
        # (Triton 3.6).  Alternative: 128 x 128 tiles, 5 stages, no cap (one CTA per SM, 225 KB).
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4, "PACK_GQA": True,
                "maxnreg": 128}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4, "PACK_GQA": True}


@functools.lru_cache(maxsize=None)
def _capability_major_of(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _capability_major(device: torch.device) -> int:
    return _capability_major_of(device.index if device.index is not None
                                else torch.cuda.current_device())


def paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                   scale, sliding_window=None, softcap=None, sinks=None,
                                   chunk_size=None, *, out=None,
                                   precision: str = "ieee",
                                   config: Optional[dict] = None) -> torch.Tensor:
    """The Triton path of :func:`hf_paged.kernels.paged_attention_prefill` (same arguments, and
    ``precision`` a name, not None).  ``config`` updates :func:`default_prefill_config` (and
    disables the shared-memory fallback of :func:`launch_with_stage_fallback`)."""
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape[0] == num_seqs + 1, "cu_seqlens_q must have num_seqs + 1 entries"
    q, out, block_tables, context_lens, cu_seqlens_q = prepare_attention_args(
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, int32_tables=True)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0:
        return out

    cfg = default_prefill_config(head_dim, q.dtype, q.device, precision)
    if config:
        cfg.update(config)
        if "maxnreg" not in config:  # a register cap belongs to its tile shape: not inherited
            cfg.pop("maxnreg", None)
    block_m, block_n = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    group = num_heads // num_kv_heads
    pack = bool(cfg.get("PACK_GQA", False)) and 1 < group <= block_m
    tok_m = block_m // group if pack else block_m
    # keys per contiguous run of a K/V tile (see _load_kv)
    rows = min(block_n, block_size) if block_size & (block_size - 1) == 0 else 1
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    use_chunk = chunk_size is not None and chunk_size > 0
    if sinks is not None:
        assert sinks.shape == (num_heads,), "sinks must be [num_heads]"
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    prec, upcast = dot_modes(q.dtype, precision)

    num_progs = num_tokens // tok_m + num_seqs
    grid_heads = num_kv_heads if pack else num_heads
    heads_first = bool(cfg.get("HEADS_FIRST", num_progs <= 65535))
    grid = (grid_heads, num_progs) if heads_first else (num_progs, grid_heads)
    args = (
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        sinks if sinks is not None else out,  # unused without sinks
        float(scale), float(softcap) if use_softcap else 1.0,
        int(sliding_window) if use_window else 0, int(chunk_size) if use_chunk else 1, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    )
    kwargs = dict(
        stride_kt=k_cache.stride(1), stride_vt=v_cache.stride(1),  # constexpr (see _load_kv)
        GROUP=group, PACK_GQA=pack, TOK_M=tok_m, HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, ROWS=rows,
        USE_WINDOW=use_window, USE_CHUNK=use_chunk, USE_LO=use_window or use_chunk,
        USE_SINKS=sinks is not None, USE_SOFTCAP=use_softcap, PREC=prec, UPCAST=upcast,
        HEADS_FIRST=heads_first, SCAN=_SCAN, LAZY=bool(cfg.get("LAZY", False)),
    )
    if cfg.get("maxnreg") and not INTERPRET:
        kwargs["maxnreg"] = int(cfg["maxnreg"])
    key = ("prefill", q.device, q.dtype, head_dim, group, pack, block_m, block_n,
           int(cfg["num_warps"]), cfg.get("maxnreg"))
    launch_with_stage_fallback(_prefill_kernel, grid, args, kwargs, cfg, key,
                               strict=bool(config))
    return out
