"""Kernel tests: Triton kernels (run by the interpreter on CPU, TRITON_INTERPRET=1 is set in
conftest.py) against the torch references, and the references against a naive dense attention.

Conventions in every case:
* fresh random inputs, seeded per case;
* fp32 kernels are compared with the reference run on float64 copies: ||out-ref||/||ref|| < 1e-5;
* outputs are poisoned with NaN before the call and must come back fully written (finite);
* cache slots that no sequence owns hold NaN, so reading them anywhere would show up;
* block tables are scattered (random permutation of physical blocks), padded past each sequence
  with junk (-1 and out-of-range ids), and some cases share prefix blocks between sequences.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import pytest
import torch

import hf_paged.kernels as K
from hf_paged.kernels import (
    copy_blocks_ref,
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    reshape_and_cache_ref,
)

pytestmark = pytest.mark.skipif(not K.triton_available(), reason="triton not installed")

FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _gen(*case) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(case).encode()))
    return g


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    assert torch.isfinite(out).all(), "output not fully written (NaN poison survived) or non-finite"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol:.1e}"
    return err


# --------------------------------------------------------------------------------------------
# building paged caches
# --------------------------------------------------------------------------------------------
@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32
    context_lens: torch.Tensor  # int32
    k_logical: List[torch.Tensor]  # per seq [ctx, Hkv, D], float64
    v_logical: List[torch.Tensor]


def make_paged(
    ctx_lens: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    g: torch.Generator,
    share: Sequence[Tuple[int, int, int]] = (),
    extra_blocks: int = 3,
) -> Paged:
    """Random paged cache.  ``share`` holds (seq_b, seq_a, n_blocks): the first n_blocks of seq_b
    are seq_a's physical blocks (and so its first n_blocks*block_size tokens are seq_a's)."""
    n_seqs = len(ctx_lens)
    n_blocks = [math.ceil(c / block_size) for c in ctx_lens]
    shared = {b: (a, n) for b, a, n in share}
    for b, (a, n) in shared.items():
        assert n * block_size <= min(ctx_lens[a], ctx_lens[b]) and a < b
    fresh = sum(n_blocks) - sum(n for _, n in shared.values())
    num_phys = fresh + extra_blocks
    perm = torch.randperm(num_phys, generator=g).tolist()
    width = max(n_blocks) + 2
    bt = torch.full((n_seqs, width), -1, dtype=torch.int32)
    # junk past the end of each row: -1 or out-of-range ids, never to be dereferenced
    junk = torch.randint(num_phys + 1000, num_phys + 10**6, (n_seqs, width), generator=g)
    bt = torch.where(torch.rand(n_seqs, width, generator=g) < 0.5, bt, junk.int())
    k_log, v_log = [], []
    for i, c in enumerate(ctx_lens):
        k = torch.randn(c, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(c, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        start = 0
        if i in shared:
            a, n = shared[i]
            bt[i, :n] = bt[a, :n]
            start = n
            k[: n * block_size] = k_log[a][: n * block_size]
            v[: n * block_size] = v_log[a][: n * block_size]
        for b in range(start, n_blocks[i]):
            bt[i, b] = perm.pop()
        k_log.append(k.to(dtype).double())  # logical values exactly representable in dtype
        v_log.append(v.to(dtype).double())
    kc = torch.full((num_phys, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    for i, c in enumerate(ctx_lens):
        t = torch.arange(c)
        blk = bt[i, t // block_size].long()
        kc[blk, t % block_size] = k_log[i].to(dtype)
        vc[blk, t % block_size] = v_log[i].to(dtype)
    return Paged(kc, vc, bt, torch.tensor(ctx_lens, dtype=torch.int32), k_log, v_log)


def dense_attention(q, k, v, qpos, scale, window=None, softcap=None, use_sdpa=False, sinks=None,
                    chunk_size=None):
    """Naive float64 attention of one sequence: q [n, H, D], k/v [T, Hkv, D], qpos [n].
    ``sinks`` [H]: as transformers' gpt-oss ``eager_attention_forward`` (a sink column is
    concatenated to the scores, softmaxed with them, and dropped); ``chunk_size``: a key is
    visible only in its query's chunk (``k // chunk_size == p // chunk_size``)."""
    n, h, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    kpos = torch.arange(k.shape[0])
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask &= kpos[None, :] > qpos[:, None] - window
    if chunk_size:
        mask &= (kpos[None, :] // chunk_size) == (qpos[:, None] // chunk_size)
    if use_sdpa and not softcap and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        ).transpose(0, 1)
    s = torch.einsum("nhd,thd->hnt", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(h, n, 1)], dim=-1)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hnt,thd->nhd", p, v)


def _as64(p: Paged):
    return p.k_cache.double(), p.v_cache.double()


def first_visible_key(ctx: int, n_q: int, window=None, chunk_size=None) -> int:
    """The first key any of a sequence's last ``n_q`` queries sees (that of its first query)."""
    p0, first = ctx - n_q, 0
    if window:
        first = max(p0 - window + 1, 0)
    if chunk_size:
        first = max(first, p0 // chunk_size * chunk_size)
    return first


def give_back(p: Paged, nqs, window=None, chunk_size=None, table_entry: int = -1) -> torch.Tensor:
    """Blocks before each sequence's first visible key given back: their cache contents become
    NaN (reading any of their keys would show) and, unless ``table_entry`` is None, their
    block-table entries become ``table_entry`` (-1: dereferencing one would read outside the
    cache).  Returns the new block table (the cache is changed in place).  No block sharing."""
    bt = p.block_tables.clone()
    bs = p.k_cache.shape[1]
    gone = 0
    for i, (c, n) in enumerate(zip(p.context_lens.tolist(), nqs)):
        nb = first_visible_key(c, n, window, chunk_size) // bs
        blk = bt[i, :nb].long()
        p.k_cache[blk], p.v_cache[blk] = float("nan"), float("nan")
        if table_entry is not None:
            bt[i, :nb] = table_entry
        gone += nb
    assert gone > 0, "the case gives nothing back"
    return bt


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
# (head_dim, block_size, num_kv_heads, group, ctx_lens, share, window, softcap, num_splits, tile)
DECODE_CASES = [
    (64, 16, 2, 1, [1, 15, 16, 17, 64], (), None, None, None, None),
    (80, 8, 1, 4, [1, 7, 8, 9, 29], (), None, None, 3, 16),
    (96, 32, 1, 7, [31, 32, 33, 70], ((3, 1, 1),), None, None, None, None),
    (128, 16, 2, 4, [5, 40, 100], ((2, 1, 2),), 8, None, 2, None),
    (64, 8, 2, 4, [1, 3, 50], (), 20, 5.0, 4, 16),
    (80, 16, 1, 7, [17, 33, 48], (), None, 30.0, 2, 32),
    (96, 8, 1, 1, [9, 24, 2], (), 1, None, None, None),  # window of 1: only its own key
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"hd{c[0]}-bs{c[1]}-g{c[3]}")
def test_decode_fp32(case):
    from hf_paged.kernels.decode import paged_attention_decode_triton

    hd, bs, hkv, group, ctx, share, window, softcap, splits, tile = case
    g = _gen("decode", case)
    p = make_paged(ctx, bs, hkv, hd, torch.float32, g, share)
    q = torch.randn(len(ctx), hkv * group, hd, generator=g)
    scale = hd**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_decode_triton(
        q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, scale, window, softcap,
        out=out, num_splits=splits, config={"TILE": tile} if tile else None,
    )
    kc, vc = _as64(p)
    ref = paged_attention_decode_ref(q.double(), kc, vc, p.block_tables, p.context_lens, scale,
                                     window, softcap)
    check_close(out, ref, FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half(dtype):
    case = (128, 16, 2, 4, [1, 17, 70], ((2, 1, 1),), None, None)
    hd, bs, hkv, group, ctx, share, window, softcap = case
    g = _gen("decode-half", case, str(dtype))
    p = make_paged(ctx, bs, hkv, hd, dtype, g, share)
    q = torch.randn(len(ctx), hkv * group, hd, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    res = K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                   hd**-0.5, out=out, backend="triton")
    assert res is out and out.dtype == dtype
    kc, vc = _as64(p)
    ref = paged_attention_decode_ref(q.double(), kc, vc, p.block_tables, p.context_lens,
                                     hd**-0.5)
    check_close(out, ref, HALF_TOL[dtype])


def test_decode_public_api_allocates_output():
    g = _gen("decode-api")
    p = make_paged([5, 20], 8, 2, 64, torch.float32, g)
    q = torch.randn(2, 4, 64, generator=g)
    out = K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables.long(),
                                   p.context_lens.long(), 0.125, backend="triton")
    ref = K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_close(out, ref, FP32_TOL)


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
# (head_dim, block_size, num_kv_heads, group, [(ctx, n_q)...], share, window, softcap, config)
# configs: None = the CPU default (32x32 tiles, GQA heads packed into a tile, PACK_GQA=True)
PREFILL_CASES = [
    (64, 16, 1, 4, [(40, 40), (9, 0), (70, 20), (5, 1)], (), None, None, None),
    (80, 8, 1, 7, [(17, 17), (33, 10), (8, 8), (12, 0)], (), 6, None, {"BLOCK_M": 16}),
    # BLOCK_N < block_size: a key tile is part of one cache block
    (96, 32, 2, 1, [(33, 33), (65, 5)], (), None, 4.0, {"BLOCK_N": 16}),
    (128, 16, 1, 4, [(48, 48), (60, 28)], ((1, 0, 2),), None, None, {"PACK_GQA": False}),
    (64, 8, 2, 2, [(1, 1), (30, 30), (45, 13)], ((2, 1, 3),), 9, 10.0,
     {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS_FIRST": False}),  # the > 65535-tiles grid layout
    # window wider than a tile: masked head + unmasked body + masked tail all in use
    (64, 8, 1, 2, [(70, 70), (90, 30), (20, 20)], (), 37, None,
     {"BLOCK_M": 16, "BLOCK_N": 16, "LAZY": True}),
    (80, 16, 1, 3, [(50, 50), (33, 1)], (), 100, 2.0, None),  # window >= context: no effect
    # block size not a power of two: K/V gathered key by key
    (64, 12, 1, 4, [(40, 40), (30, 7)], (), None, None, {"BLOCK_M": 32, "BLOCK_N": 16}),
]


def _cu(nqs):
    cu = torch.zeros(len(nqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(nqs).cumsum(0)
    return cu


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"hd{c[0]}-bs{c[1]}-g{c[3]}")
def test_prefill_fp32(case):
    from hf_paged.kernels.prefill import paged_attention_prefill_triton

    hd, bs, hkv, group, seqs, share, window, softcap, cfg = case
    ctx = [c for c, _ in seqs]
    nqs = [n for _, n in seqs]
    g = _gen("prefill", case)
    p = make_paged(ctx, bs, hkv, hd, torch.float32, g, share)
    cu = _cu(nqs)
    q = torch.randn(int(cu[-1]), hkv * group, hd, generator=g)
    out = torch.full_like(q, float("nan"))
    scale = hd**-0.5
    paged_attention_prefill_triton(q, p.k_cache, p.v_cache, p.block_tables, cu, p.context_lens,
                                   scale, window, softcap, out=out, config=cfg)
    kc, vc = _as64(p)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, p.block_tables, cu, p.context_lens,
                                      scale, window, softcap)
    check_close(out, ref, FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half(dtype):
    seqs = [(33, 33), (50, 7), (4, 0)]
    g = _gen("prefill-half", str(dtype))
    p = make_paged([c for c, _ in seqs], 16, 1, 64, dtype, g)
    cu = _cu([n for _, n in seqs])
    q = torch.randn(int(cu[-1]), 4, 64, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    K.paged_attention_prefill(q, p.k_cache, p.v_cache, p.block_tables, cu, p.context_lens,
                              0.125, softcap=20.0, out=out, backend="triton")
    kc, vc = _as64(p)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, p.block_tables, cu, p.context_lens,
                                      0.125, softcap=20.0)
    check_close(out, ref, HALF_TOL[dtype])


@pytest.mark.parametrize("pack", [True, False])
def test_prefill_lazy_rescale_growing_logits(pack):
    """Logits that grow along the context (~7 in base 2 per 16-key tile) move the running max
    by more than the lazy threshold (a factor 2^8) every tile or two: LAZY's skipped and taken
    accumulator rescales both happen (skipping them all fails this test)."""
    from hf_paged.kernels.prefill import paged_attention_prefill_triton

    hd, bs, group = 64, 16, 4
    seqs = [(100, 100), (90, 33)]
    g = _gen("prefill-lazy", pack)
    p = make_paged([c for c, _ in seqs], bs, 1, hd, torch.float32, g)
    u = torch.randn(hd, generator=g)
    u = u / u.norm()
    for i, (c, _) in enumerate(seqs):  # k[t] += 0.3 * sqrt(hd) * t * u (0.3 per key in q.k*scale)
        t = torch.arange(c)
        blk = p.block_tables[i, t // bs].long()
        p.k_cache[blk, t % bs] += (0.3 * hd**0.5 * t[:, None] * u)[:, None, :]
    cu = _cu([n for _, n in seqs])
    q = torch.randn(int(cu[-1]), group, hd, generator=g) * 0.1 + u
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": pack, "LAZY": True}
    paged_attention_prefill_triton(q, p.k_cache, p.v_cache, p.block_tables, cu, p.context_lens,
                                   hd**-0.5, out=out, config=cfg)
    kc, vc = _as64(p)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, p.block_tables, cu, p.context_lens,
                                      hd**-0.5)
    check_close(out, ref, FP32_TOL)


def test_prefill_single_token_matches_decode():
    """A decode token is a prefill sequence with n_q = 1 (mixed batches)."""
    g = _gen("prefill-vs-decode")
    p = make_paged([1, 19, 40], 8, 2, 64, torch.float32, g)
    q = torch.randn(3, 8, 64, generator=g)
    cu = _cu([1, 1, 1])
    a = K.paged_attention_prefill(q, p.k_cache, p.v_cache, p.block_tables, cu, p.context_lens,
                                  0.125, sliding_window=16, backend="triton")
    b = K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 0.125,
                                 sliding_window=16, backend="triton")
    check_close(a, b, FP32_TOL)


@pytest.mark.parametrize("seed", range(10))
def test_random_shapes_fp32(seed):
    """Random mixes of the axes above (alignments of windows/tiles/blocks the fixed cases miss)."""
    from hf_paged.kernels.decode import paged_attention_decode_triton
    from hf_paged.kernels.prefill import paged_attention_prefill_triton

    g = _gen("random", seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    hd, bs, group = pick([64, 80, 96, 128]), pick([8, 16, 32]), pick([1, 4, 7])
    window = pick([None, None, int(torch.randint(1, 60, (1,), generator=g))])
    softcap = pick([None, None, 5.0])
    ctx = torch.randint(1, 80, (3,), generator=g).tolist()
    nqs = [int(torch.randint(0, c + 1, (1,), generator=g)) for c in ctx]
    nqs[seed % 3] = ctx[seed % 3]  # always one whole-context prefill
    p = make_paged(ctx, bs, 1, hd, torch.float32, g)
    kc, vc = _as64(p)
    scale = hd**-0.5
    # prefill
    cu = _cu(nqs)
    q = torch.randn(int(cu[-1]), group, hd, generator=g)
    cfg = {"BLOCK_M": pick([16, 32]), "BLOCK_N": pick([16, 32])}
    gv = _gen("random-variant", seed)  # its own stream: the shapes above stay as they were
    cfg["PACK_GQA"] = bool(torch.randint(2, (1,), generator=gv))
    cfg["LAZY"] = bool(torch.randint(2, (1,), generator=gv))
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill_triton(q, p.k_cache, p.v_cache, p.block_tables, cu, p.context_lens,
                                   scale, window, softcap, out=out, config=cfg)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, p.block_tables, cu, p.context_lens,
                                      scale, window, softcap)
    check_close(out, ref, FP32_TOL)
    # decode
    qd = torch.randn(3, group, hd, generator=g)
    out = torch.full_like(qd, float("nan"))
    paged_attention_decode_triton(qd, p.k_cache, p.v_cache, p.block_tables, p.context_lens, scale,
                                  window, softcap, out=out, num_splits=pick([1, 2, 5]),
                                  config={"TILE": pick([16, 32])})
    ref = paged_attention_decode_ref(qd.double(), kc, vc, p.block_tables, p.context_lens, scale,
                                     window, softcap)
    check_close(out, ref, FP32_TOL)


# --------------------------------------------------------------------------------------------
# attention sinks and chunked local attention (Triton vs the float64 reference)
# --------------------------------------------------------------------------------------------
def _sinks(heads: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(heads, generator=g) + 1.0  # comparable to the scores: they matter


# (head_dim, block_size, num_kv_heads, group, ctx_lens, window, softcap, sinks, chunk_size,
#  num_splits, given_back): given_back None (nothing), -1 (table entries -1 and blocks NaN) or
#  "nan" (entries kept, blocks NaN) for the blocks before each query's first visible key
DECODE_SINK_CHUNK_CASES = [
    (32, 4, 2, 2, [1, 6, 7, 23, 40], None, None, True, None, 1, None),
    (32, 8, 1, 4, [3, 30, 57], None, 5.0, True, None, 3, None),  # split-K: the sink once
    (32, 4, 2, 2, [5, 6, 19, 40], None, None, False, 6, 2, -1),  # chunk ends inside a block
    (64, 8, 1, 2, [9, 50, 90], None, None, True, 48, 3, "nan"),  # a chunk over 3 splits
    (32, 4, 1, 2, [7, 13, 30], 5, None, True, 8, 2, -1),  # chunk + window
]


@pytest.mark.parametrize("case", DECODE_SINK_CHUNK_CASES,
                         ids=lambda c: f"sinks{int(c[7])}-chunk{c[8]}-w{c[5]}-splits{c[9]}")
def test_decode_sinks_chunk_fp32(case):
    from hf_paged.kernels.decode import paged_attention_decode_triton

    hd, bs, hkv, group, ctx, window, softcap, sinks, chunk, splits, gb = case
    g = _gen("decode-sink-chunk", case)
    p = make_paged(ctx, bs, hkv, hd, torch.float32, g)
    bt = p.block_tables if gb is None else give_back(
        p, [1] * len(ctx), window, chunk, None if gb == "nan" else gb)
    q = torch.randn(len(ctx), hkv * group, hd, generator=g)
    snk = _sinks(hkv * group, g) if sinks else None
    if softcap:
        snk = snk.to(torch.bfloat16)  # any float dtype
    out = torch.full_like(q, float("nan"))
    paged_attention_decode_triton(q, p.k_cache, p.v_cache, bt, p.context_lens, hd**-0.5, window,
                                  softcap, snk, chunk, out=out, num_splits=splits,
                                  config={"TILE": 16})
    kc, vc = _as64(p)
    ref = paged_attention_decode_ref(q.double(), kc, vc, bt, p.context_lens, hd**-0.5, window,
                                     softcap, snk, chunk)
    check_close(out, ref, FP32_TOL)


# (head_dim, block_size, num_kv_heads, group, [(ctx, n_q)...], window, softcap, sinks,
#  chunk_size, config, given_back)
PREFILL_SINK_CHUNK_CASES = [
    (32, 8, 1, 4, [(40, 40), (9, 0), (30, 7)], None, None, True, None, None, None),
    # chunk 6 ends inside blocks of 4 and inside the query runs of (30, 30) and (9, 4)
    (32, 4, 2, 2, [(30, 30), (9, 4), (40, 7)], None, None, True, 6,
     {"BLOCK_M": 16, "BLOCK_N": 16}, -1),
    # chunk wider than a tile: masked head, unmasked body and masked tail all in use; 36 is no
    # multiple of the 8 tokens of a query tile, so some tiles straddle a chunk boundary
    (32, 8, 1, 2, [(100, 100), (70, 20)], None, 2.0, True, 36,
     {"BLOCK_M": 16, "BLOCK_N": 16, "LAZY": True}, "nan"),
    (32, 8, 2, 1, [(50, 50), (33, 9)], 10, None, False, 16,
     {"BLOCK_M": 16, "BLOCK_N": 16, "PACK_GQA": False}, -1),  # chunk + window
    # block size not a power of two (keys gathered one by one)
    (32, 12, 1, 2, [(40, 40), (27, 5)], None, None, True, 10, {"BLOCK_M": 16, "BLOCK_N": 16}, -1),
]


@pytest.mark.parametrize("case", PREFILL_SINK_CHUNK_CASES,
                         ids=lambda c: f"bs{c[1]}-sinks{int(c[7])}-chunk{c[8]}-w{c[5]}")
def test_prefill_sinks_chunk_fp32(case):
    from hf_paged.kernels.prefill import paged_attention_prefill_triton

    hd, bs, hkv, group, seqs, window, softcap, sinks, chunk, cfg, gb = case
    ctx = [c for c, _ in seqs]
    nqs = [n for _, n in seqs]
    g = _gen("prefill-sink-chunk", case)
    p = make_paged(ctx, bs, hkv, hd, torch.float32, g)
    bt = p.block_tables if gb is None else give_back(
        p, nqs, window, chunk, None if gb == "nan" else gb)
    cu = _cu(nqs)
    q = torch.randn(int(cu[-1]), hkv * group, hd, generator=g)
    snk = _sinks(hkv * group, g) if sinks else None
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill_triton(q, p.k_cache, p.v_cache, bt, cu, p.context_lens, hd**-0.5,
                                   window, softcap, snk, chunk, out=out, config=cfg)
    kc, vc = _as64(p)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, bt, cu, p.context_lens, hd**-0.5,
                                      window, softcap, snk, chunk)
    check_close(out, ref, FP32_TOL)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter, on NaN
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_negative_control_sinks_chunk(kind):
    """The Triton kernels without the sinks, or without chunk_size, are rejected by the
    reference that has them; and the given-back (NaN) blocks of the cases above are read,
    and show, as soon as chunk_size is ignored."""
    g = _gen("neg-sink-chunk", kind)
    seqs = [(30, 30), (9, 4), (40, 7)] if kind == "prefill" else [(19, 1), (40, 1), (9, 1)]
    ctx, nqs = [c for c, _ in seqs], [n for _, n in seqs]
    p = make_paged(ctx, 4, 2, 32, torch.float32, g)
    cu = _cu(nqs)
    q = torch.randn(int(cu[-1]), 4, 32, generator=g)
    snk = _sinks(4, g)
    kc, vc = _as64(p)

    def run(bt, sinks, chunk):
        if kind == "decode":
            return K.paged_attention_decode(q, p.k_cache, p.v_cache, bt, p.context_lens, 0.2,
                                            sinks=sinks, chunk_size=chunk, backend="triton")
        return K.paged_attention_prefill(q, p.k_cache, p.v_cache, bt, cu, p.context_lens, 0.2,
                                         sinks=sinks, chunk_size=chunk, backend="triton")

    def ref(bt, sinks, chunk):
        f = paged_attention_decode_ref if kind == "decode" else (
            lambda *a, **kw: paged_attention_prefill_ref(*a[:4], cu, *a[4:], **kw))
        return f(q.double(), kc, vc, bt, p.context_lens, 0.2, sinks=sinks, chunk_size=chunk)

    want = ref(p.block_tables, snk, 6)
    check_close(run(p.block_tables, snk, 6), want, FP32_TOL)  # the positive check
    no_sink = run(p.block_tables, None, 6)
    assert rel_err(no_sink, want) > 10 * FP32_TOL
    with pytest.raises(AssertionError):
        check_close(no_sink, want, FP32_TOL)
    no_chunk = run(p.block_tables, snk, None)
    assert rel_err(no_chunk, want) > 10 * FP32_TOL
    with pytest.raises(AssertionError):
        check_close(no_chunk, want, FP32_TOL)
    # blocks before the chunk start given back as NaN (table entries kept)
    bt = give_back(p, nqs, chunk_size=6, table_entry=None)
    check_close(run(bt, snk, 6), want, FP32_TOL)
    assert not torch.isfinite(run(bt, snk, None)).all()


# --------------------------------------------------------------------------------------------
# the references against naive dense attention (so they can't share a kernel's mistake)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 3.0), (12, 8.0)])
def test_references_vs_dense(window, softcap):
    g = _gen("ref-dense", window, softcap)
    ctx = [1, 8, 9, 30, 25]
    nqs = [1, 8, 4, 30, 0]
    p = make_paged(ctx, 8, 2, 32, torch.float64, g, share=((3, 2, 1),))
    hd, heads = 32, 6
    scale = 0.3
    kc, vc = p.k_cache, p.v_cache
    # decode
    qd = torch.randn(len(ctx), heads, hd, generator=g, dtype=torch.float64)
    got = paged_attention_decode_ref(qd, kc, vc, p.block_tables, p.context_lens, scale, window,
                                     softcap)
    for i, c in enumerate(ctx):
        want = dense_attention(qd[i : i + 1], p.k_logical[i], p.v_logical[i],
                               torch.tensor([c - 1]), scale, window, softcap, use_sdpa=True)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-10, atol=1e-10)
    # prefill
    cu = _cu(nqs)
    qp = torch.randn(int(cu[-1]), heads, hd, generator=g, dtype=torch.float64)
    got = paged_attention_prefill_ref(qp, kc, vc, p.block_tables, cu, p.context_lens, scale,
                                      window, softcap)
    for i, (c, n) in enumerate(zip(ctx, nqs)):
        if n == 0:
            continue
        want = dense_attention(qp[cu[i] : cu[i + 1]], p.k_logical[i], p.v_logical[i],
                               torch.arange(c - n, c), scale, window, softcap, use_sdpa=True)
        torch.testing.assert_close(got[cu[i] : cu[i + 1]], want, rtol=1e-10, atol=1e-10)


# (window, softcap, sinks, chunk_size): block size 4, so chunk 6 ends inside a block
SINK_CHUNK_REF_CASES = [
    (None, None, True, None),  # sinks alone
    (None, None, False, 6),  # chunk alone
    (None, None, True, 6),  # chunk + sinks
    (3, None, False, 6),  # chunk + sliding window (window inside a chunk)
    (9, None, True, 6),  # window wider than a chunk: the chunk decides
    (None, 3.0, True, None),  # softcap + sinks (the explicit-scores path)
    (5, 2.0, True, 8),  # everything
]


@pytest.mark.parametrize("window,softcap,sinks,chunk", SINK_CHUNK_REF_CASES,
                         ids=lambda c: str(c))
def test_references_vs_dense_sinks_chunk(window, softcap, sinks, chunk):
    """Sinks and chunked local attention, GQA (4 query heads on 2 KV heads), block size 4 with
    chunk 6: chunk boundaries fall inside blocks and inside prefills' query runs; blocks before
    each sequence's first visible key are given back (-1 entries, NaN contents)."""
    g = _gen("ref-dense-sink-chunk", window, softcap, sinks, chunk)
    ctx = [1, 6, 9, 30, 25, 13]
    nqs = [1, 6, 4, 30, 0, 2]  # (9, 4): queries at 5..8 straddle the boundary at 6
    hd, heads, hkv, scale = 16, 4, 2, 0.3
    p = make_paged(ctx, 4, hkv, hd, torch.float64, g)
    snk = (torch.randn(heads, generator=g) + 1.0) if sinks else None  # float32: cast by the refs
    # decode (one query per sequence, at ctx - 1)
    bt = give_back(p, [1] * len(ctx), window, chunk) if (window or chunk) else p.block_tables
    qd = torch.randn(len(ctx), heads, hd, generator=g, dtype=torch.float64)
    got = paged_attention_decode_ref(qd, p.k_cache, p.v_cache, bt, p.context_lens, scale, window,
                                     softcap, snk, chunk)
    assert torch.isfinite(got).all()
    for i, c in enumerate(ctx):
        want = dense_attention(qd[i : i + 1], p.k_logical[i], p.v_logical[i],
                               torch.tensor([c - 1]), scale, window, softcap, sinks=snk,
                               chunk_size=chunk)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-10, atol=1e-10)
    # prefill (fresh cache: decode's give-back went further than prefill's)
    p = make_paged(ctx, 4, hkv, hd, torch.float64, g)
    bt = give_back(p, nqs, window, chunk) if (window or chunk) else p.block_tables
    cu = _cu(nqs)
    qp = torch.randn(int(cu[-1]), heads, hd, generator=g, dtype=torch.float64)
    got = paged_attention_prefill_ref(qp, p.k_cache, p.v_cache, bt, cu, p.context_lens, scale,
                                      window, softcap, sinks=snk, chunk_size=chunk)
    assert torch.isfinite(got).all()
    for i, (c, n) in enumerate(zip(ctx, nqs)):
        if n == 0:
            continue
        want = dense_attention(qp[cu[i] : cu[i + 1]], p.k_logical[i], p.v_logical[i],
                               torch.arange(c - n, c), scale, window, softcap, sinks=snk,
                               chunk_size=chunk)
        torch.testing.assert_close(got[cu[i] : cu[i + 1]], want, rtol=1e-10, atol=1e-10)


def test_references_negative_control_sinks_chunk():
    """Dropping the sinks, or chunk_size, is rejected by the oracle that has them."""
    g = _gen("ref-neg-sink-chunk")
    ctx, nqs = [9, 30], [4, 30]
    p = make_paged(ctx, 4, 2, 16, torch.float64, g)
    snk = torch.randn(4, generator=g, dtype=torch.float64) + 1.0
    cu = _cu(nqs)
    q = torch.randn(int(cu[-1]), 4, 16, generator=g, dtype=torch.float64)
    tol = 1e-10

    def oracle(sinks, chunk):
        return torch.cat([dense_attention(q[cu[i] : cu[i + 1]], p.k_logical[i], p.v_logical[i],
                                          torch.arange(c - n, c), 0.3, sinks=sinks,
                                          chunk_size=chunk)
                          for i, (c, n) in enumerate(zip(ctx, nqs))])

    def ref(sinks, chunk):
        return paged_attention_prefill_ref(q, p.k_cache, p.v_cache, p.block_tables, cu,
                                           p.context_lens, 0.3, sinks=sinks, chunk_size=chunk)

    check_close(ref(snk, 6), oracle(snk, 6), tol)  # the positive check, for contrast
    assert rel_err(ref(None, 6), oracle(snk, 6)) > 10 * tol
    assert rel_err(ref(snk, None), oracle(snk, 6)) > 10 * tol
    with pytest.raises(AssertionError):
        check_close(ref(None, 6), oracle(snk, 6), tol)
    qd = q[:2]
    want = torch.cat([dense_attention(qd[i : i + 1], p.k_logical[i], p.v_logical[i],
                                      torch.tensor([c - 1]), 0.3, sinks=snk, chunk_size=6)
                      for i, c in enumerate(ctx)])
    got = paged_attention_decode_ref(qd, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 0.3,
                                     sinks=snk, chunk_size=6)
    check_close(got, want, tol)
    for s_, c_ in ((None, 6), (snk, None)):
        got = paged_attention_decode_ref(qd, p.k_cache, p.v_cache, p.block_tables,
                                         p.context_lens, 0.3, sinks=s_, chunk_size=c_)
        assert rel_err(got, want) > 10 * tol


def test_reference_half_inputs_computed_in_fp32():
    g = _gen("ref-half")
    p = make_paged([20], 8, 1, 16, torch.bfloat16, g)
    q = torch.randn(1, 2, 16, generator=g).to(torch.bfloat16)
    got = paged_attention_decode_ref(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 0.25)
    want = dense_attention(q.double(), p.k_logical[0], p.v_logical[0], torch.tensor([19]), 0.25)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 5e-3


# --------------------------------------------------------------------------------------------
# negative controls: the comparison must be able to fail
# --------------------------------------------------------------------------------------------
def test_negative_control_wrong_block_table():
    g = _gen("neg-bt")
    p = make_paged([40, 40], 8, 2, 64, torch.float32, g)
    q = torch.randn(2, 4, 64, generator=g)
    bad = p.block_tables.clone()
    bad[0, [1, 2]] = bad[0, [2, 1]]  # swap two blocks of sequence 0
    out = K.paged_attention_decode(q, p.k_cache, p.v_cache, bad, p.context_lens, 0.125,
                                   backend="triton")
    kc, vc = _as64(p)
    ref = paged_attention_decode_ref(q.double(), kc, vc, p.block_tables, p.context_lens, 0.125)
    # a swap only permutes keys; decode attends to all of them, so softmax is order-invariant
    # (an honest reminder that decode without a window can't see block order) ...
    assert rel_err(out, ref) < 1e-5
    # ... but with a sliding window, or for prefill, the order matters:
    out = K.paged_attention_decode(q, p.k_cache, p.v_cache, bad, p.context_lens, 0.125,
                                   sliding_window=20, backend="triton")
    ref = paged_attention_decode_ref(q.double(), kc, vc, p.block_tables, p.context_lens, 0.125,
                                     sliding_window=20)
    assert rel_err(out, ref) > 1e-2
    with pytest.raises(AssertionError):
        check_close(out, ref, FP32_TOL)
    # pointing at another sequence's block changes the keys themselves
    bad2 = p.block_tables.clone()
    bad2[0, 0] = p.block_tables[1, 0]
    out = K.paged_attention_decode(q, p.k_cache, p.v_cache, bad2, p.context_lens, 0.125,
                                   backend="triton")
    ref = paged_attention_decode_ref(q.double(), kc, vc, p.block_tables, p.context_lens, 0.125)
    assert rel_err(out, ref) > 1e-2


def test_negative_control_off_by_one_context():
    g = _gen("neg-ctx")
    seqs = [(17, 17), (30, 6)]
    p = make_paged([c for c, _ in seqs], 8, 1, 64, torch.float32, g)
    cu = _cu([n for _, n in seqs])
    q = torch.randn(int(cu[-1]), 2, 64, generator=g)
    short = p.context_lens - 1
    out = K.paged_attention_prefill(q, p.k_cache, p.v_cache, p.block_tables, cu, short, 0.125,
                                    backend="triton")
    kc, vc = _as64(p)
    ref = paged_attention_prefill_ref(q.double(), kc, vc, p.block_tables, cu, p.context_lens,
                                      0.125)
    assert rel_err(out, ref) > 1e-2
    with pytest.raises(AssertionError):
        check_close(out, ref, FP32_TOL)
    qd = torch.randn(2, 2, 64, generator=g)
    out = K.paged_attention_decode(qd, p.k_cache, p.v_cache, p.block_tables, short, 0.125,
                                   backend="triton")
    ref = paged_attention_decode_ref(qd.double(), kc, vc, p.block_tables, p.context_lens, 0.125)
    assert rel_err(out, ref) > 1e-2


def test_negative_control_unwritten_output_is_caught():
    out = torch.randn(4, 4)
    out[2, 3] = float("nan")
    with pytest.raises(AssertionError):
        check_close(out, torch.randn(4, 4), 1.0)


# --------------------------------------------------------------------------------------------
# cache ops
# --------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize(
    "dtype,hkv,hd,bs",
    [(torch.float32, 2, 64, 16), (torch.bfloat16, 3, 80, 8), (torch.float16, 1, 96, 32)],
)
def test_reshape_and_cache(dtype, hkv, hd, bs):
    g = _gen("rac", str(dtype), hkv, hd, bs)
    nblocks, ntok = 7, 23
    kc = torch.randn(nblocks, bs, hkv, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, hd, generator=g).to(dtype)
    slots = torch.randperm(nblocks * bs, generator=g)[:ntok]
    slots[[0, 5, 17]] = -1  # padding tokens
    key = torch.randn(ntok, hkv, hd, generator=g).to(dtype)
    val = torch.randn(ntok, hkv, hd, generator=g).to(dtype)
    k_before, v_before = kc.clone(), vc.clone()
    K.reshape_and_cache(key, val, kc, vc, slots, backend="triton")
    # touched slots equal the inputs
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(_bits(kc[s // bs, s % bs]), _bits(key[keep]))
    assert torch.equal(_bits(vc[s // bs, s % bs]), _bits(val[keep]))
    # untouched slots bitwise unchanged
    untouched = torch.ones(nblocks * bs, dtype=torch.bool)
    untouched[s] = False
    assert torch.equal(_bits(kc.flatten(0, 1)[untouched]), _bits(k_before.flatten(0, 1)[untouched]))
    assert torch.equal(_bits(vc.flatten(0, 1)[untouched]), _bits(v_before.flatten(0, 1)[untouched]))
    # and the reference agrees bit for bit
    kr, vr = k_before.clone(), v_before.clone()
    reshape_and_cache_ref(key, val, kr, vr, slots)
    assert torch.equal(_bits(kr), _bits(kc)) and torch.equal(_bits(vr), _bits(vc))


def test_reshape_and_cache_noncontiguous_input():
    g = _gen("rac-nc")
    kc = torch.randn(4, 8, 2, 64, generator=g)
    vc = torch.randn(4, 8, 2, 64, generator=g)
    qkv = torch.randn(5, 3, 2, 64, generator=g)  # key/value are strided views of a fused qkv
    key, val = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 9, 31, -1, 12])
    kr, vr = kc.clone(), vc.clone()
    K.reshape_and_cache(key, val, kc, vc, slots, backend="triton")
    reshape_and_cache_ref(key, val, kr, vr, slots)
    assert torch.equal(kr, kc) and torch.equal(vr, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks(dtype):
    g = _gen("copy", str(dtype))
    layers, nblocks, shape = 3, 12, (8, 2, 80)
    ks = [torch.randn(nblocks, *shape, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn(nblocks, *shape, generator=g).to(dtype) for _ in range(layers)]
    perm = torch.randperm(nblocks, generator=g)
    mapping = torch.stack([perm[:4], perm[4:8]], 1)  # 4 pairs, sources and dests disjoint
    mapping = torch.cat([mapping, torch.stack([perm[:1], perm[8:9]], 1)])  # one source twice
    before = [t.clone() for t in ks + vs]
    K.copy_blocks(ks, vs, mapping, backend="triton")
    expected = [t.clone() for t in before]
    for t in expected:  # independent of copy_blocks_ref: one block at a time
        for src, dst in mapping.tolist():
            t[dst] = t[src]
    for got, want in zip(ks + vs, expected):
        assert torch.equal(_bits(got), _bits(want))
    ref = [t.clone() for t in before]
    copy_blocks_ref(ref[:layers], ref[layers:], mapping)
    for got, want in zip(ks + vs, ref):
        assert torch.equal(_bits(got), _bits(want))


def test_copy_blocks_unaligned_views():
    """Caches that are views at odd element offsets of one buffer (no 16-byte alignment)."""
    g = _gen("copy-unaligned")
    shape = (6, 8, 1, 16)
    n = math.prod(shape)
    buf = torch.randn(4 * (n + 1) + 1, generator=g)
    caches = [buf[1 + i * (n + 1) : 1 + i * (n + 1) + n].view(shape) for i in range(4)]
    from hf_paged.kernels.cache_ops import cache_offsets

    assert cache_offsets(caches)[1] == 1  # distances not a multiple of 16 bytes
    mapping = torch.tensor([[0, 3], [5, 1]])
    before = [c.clone() for c in caches]
    gaps = [0] + [1 + i * (n + 1) + n for i in range(4)]  # elements between the caches
    gaps_before = buf[gaps].clone()
    K.copy_blocks(caches[:2], caches[2:], mapping, backend="triton")
    for got, b in zip(caches, before):
        want = b.clone()
        want[3], want[1] = b[0], b[5]
        assert torch.equal(got, want)
    assert torch.equal(buf[gaps], gaps_before)



def test_copy_blocks_rejects_mismatched_layers():
    ks = [torch.zeros(4, 8, 1, 16), torch.zeros(5, 8, 1, 16)]
    with pytest.raises(AssertionError):
        K.copy_blocks(ks, ks, torch.tensor([[0, 1]]), backend="triton")


# --------------------------------------------------------------------------------------------
# an end-to-end chain: reshape_and_cache -> prefill (chunked) -> decode, vs dense attention
# --------------------------------------------------------------------------------------------
def test_chain_cache_prefill_decode():
    g = _gen("chain")
    bs, hkv, heads, hd, T = 8, 2, 4, 64, 21
    nblocks = 6
    kc = torch.full((nblocks, bs, hkv, hd), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    bt = torch.randperm(nblocks, generator=g)[:4].int()[None]
    k = torch.randn(T, hkv, hd, generator=g)
    v = torch.randn(T, hkv, hd, generator=g)
    q = torch.randn(T, heads, hd, generator=g)
    slots = (bt[0, torch.arange(T) // bs] * bs + torch.arange(T) % bs).long()
    outs = []
    for lo, hi in [(0, 12), (12, 20)]:  # two prefill chunks
        K.reshape_and_cache(k[lo:hi], v[lo:hi], kc, vc, slots[lo:hi], backend="triton")
        outs.append(K.paged_attention_prefill(
            q[lo:hi], kc, vc, bt, torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([hi], dtype=torch.int32), 0.125, backend="triton"))
    K.reshape_and_cache(k[20:], v[20:], kc, vc, slots[20:], backend="triton")
    outs.append(K.paged_attention_decode(q[20:], kc, vc, bt, torch.tensor([T], dtype=torch.int32),
                                         0.125, backend="triton"))
    got = torch.cat(outs)
    want = dense_attention(q.double(), k.double(), v.double(), torch.arange(T), 0.125)
    check_close(got, want, FP32_TOL)


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------
def test_dispatch_defaults_to_reference_on_cpu(monkeypatch):
    import hf_paged.kernels.reference as R

    calls = []
    orig = R.paged_attention_decode_ref

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(K, "paged_attention_decode_ref", spy)
    g = _gen("dispatch")
    p = make_paged([3], 8, 1, 16, torch.float32, g)
    q = torch.randn(1, 1, 16, generator=g)
    K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 1.0)
    assert calls == [1]
    K.set_backend("triton")
    try:
        K.paged_attention_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, 1.0)
        assert calls == [1]  # forced: the reference was not called
    finally:
        K.set_backend(None)
    with pytest.raises(ValueError):
        K.set_backend("cuda")


def test_import_without_triton():
    """CPU-only installs without triton: import and the reference path must still work."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hf_paged.kernels as K\n"
        "assert not K.triton_available()\n"
        "kc = torch.randn(2, 4, 1, 8); vc = torch.randn(2, 4, 1, 8)\n"
        "out = K.paged_attention_decode(torch.randn(1, 2, 8), kc, vc,\n"
        "    torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), 0.3)\n"
        "assert out.shape == (1, 2, 8) and torch.isfinite(out).all()\n"
        "K.reshape_and_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), kc, vc, torch.tensor([3]))\n"
        "K.copy_blocks([kc], [vc], torch.tensor([[0, 1]]))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
