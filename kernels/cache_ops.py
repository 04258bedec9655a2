"""Triton cache-maintenance kernels: ``reshape_and_cache`` and ``copy_blocks``.

``copy_blocks`` copies the same list of block pairs in every layer's K and V cache in a single
launch over (pair, cache, chunk).  Rather than passing per-layer pointers (int -> pointer
casts), each cache is addressed as an element offset from the first K cache's base pointer: all
caches share one dtype, so the byte distance between any two allocations is a whole number of
elements and ``base + offset[c]`` is cache ``c``'s first element.  This needs no pointer casts and
works the same on a GPU and under the interpreter (where CPU tensors are addressed by their raw
pointers).  The offsets are stored in units of 16 bytes when every distance allows it, so the
compiler can prove alignment and vectorise (16-byte loads/stores in the sm_90 PTX).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._common import ceil_div, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # flattened (head, dim)
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    keep = slot >= 0
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = e // HEAD_DIM
    dd = e % HEAD_DIM
    mask = keep[:, None] & (e < NUM_KV_HEADS * HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    kx = tl.load(key_ptr + t64[:, None] * stride_kt + (h * stride_kh + dd)[None, :], mask=mask)
    vx = tl.load(value_ptr + t64[:, None] * stride_vt + (h * stride_vh + dd)[None, :], mask=mask)
    kdst = k_cache_ptr + (blk * stride_kcb + off * stride_kct)[:, None] + (h * stride_kch + dd)[None, :]
    vdst = v_cache_ptr + (blk * stride_vcb + off * stride_vct)[:, None] + (h * stride_vch + dd)[None, :]
    tl.store(kdst, kx.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vdst, vx.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The Triton path of :func:`hf_paged.kernels.reshape_and_cache` (same arguments)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape[0] == num_tokens
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    block_size = k_cache.shape[1]
    hd = num_kv_heads * head_dim
    block_e = min(next_pow2(hd), 2048)
    block_t = max(1, 4096 // block_e)
    grid = (ceil_div(num_tokens, block_t), ceil_div(hd, block_e))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
    )


@triton.jit
def _copy_blocks_kernel(
    base_ptr, cache_off_ptr, mapping_ptr, block_numel, stride_block,
    CHUNK: tl.constexpr, ALIGN: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    # offset of this cache from base_ptr, stored in units of ALIGN elements so that the compiler
    # knows the alignment (16 bytes when possible) and can vectorise the copy
    base = tl.load(cache_off_ptr + cache) * ALIGN
    e = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = e < block_numel
    x = tl.load(base_ptr + (base + src * stride_block) + e, mask=mask)
    tl.store(base_ptr + (base + dst * stride_block) + e, x, mask=mask)


_offsets_cache: Dict[Tuple, torch.Tensor] = {}


def cache_offsets(caches: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """Offsets of every cache from caches[0] in units of ``align`` elements (``align`` = 16 bytes
    worth when every distance allows it, else 1), memoised per set of allocations: building the
    tensor needs a host->device copy, and the library's caches are long-lived."""
    ref = caches[0]
    key = (ref.device, ref.dtype) + tuple(c.data_ptr() for c in caches)
    hit = _offsets_cache.get(key)
    if hit is None:
        esize = ref.element_size()
        base = ref.data_ptr()
        diffs = [c.data_ptr() - base for c in caches]
        assert all(d % esize == 0 for d in diffs), "cache allocations are not element-aligned"
        align = 16 // esize if all(d % 16 == 0 for d in diffs) and 16 % esize == 0 else 1
        offs = [d // (esize * align) for d in diffs]
        hit = (torch.tensor(offs, dtype=torch.int64, device=ref.device), align)
        if len(_offsets_cache) > 64:
            _offsets_cache.clear()
        _offsets_cache[key] = hit
    return hit


def copy_blocks_triton(k_caches, v_caches, block_mapping) -> None:
    """The Triton path of :func:`hf_paged.kernels.copy_blocks` (same arguments): one launch
    over (pair, cache, chunk), caches addressed by :func:`cache_offsets`."""
    caches = list(k_caches) + list(v_caches)
    if not caches or block_mapping.numel() == 0:
        return
    ref = caches[0]
    for c in caches:
        assert c.shape == ref.shape and c.dtype == ref.dtype and c.device == ref.device, \
            "copy_blocks: all caches must share shape, dtype and device"
        assert c.stride() == ref.stride(), "copy_blocks: all caches must share strides"
        assert c[0].is_contiguous(), "copy_blocks: each block must be contiguous in memory"
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2
    mapping = block_mapping
    if mapping.device != ref.device:
        mapping = mapping.to(ref.device)
    if mapping.dtype != torch.int64 or not mapping.is_contiguous():
        mapping = mapping.to(torch.int64).contiguous()
    offsets, align = cache_offsets(caches)
    block_numel = ref[0].numel()
    chunk = min(next_pow2(block_numel), 4096)
    grid = (mapping.shape[0], len(caches), ceil_div(block_numel, chunk))
    _copy_blocks_kernel[grid](
        ref, offsets, mapping, block_numel, ref.stride(0), CHUNK=chunk, ALIGN=align,
        num_warps=4,
    )
