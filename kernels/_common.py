"""What the Triton modules of ``hf_paged.kernels`` share (private to the package).

Device helpers (``@triton.jit``): :func:`dot`, :func:`load_2d`.  Host helpers: the argument
checks and coercions of the attention launchers (:func:`check_cache`,
:func:`prepare_attention_args`, :func:`dot_modes`), launching with a shared-memory fallback
(:func:`launch_with_stage_fallback`), :func:`sm_count`, :func:`next_pow2` and :func:`ceil_div`.

Like every module of the package except ``__init__``, this one imports triton at import time.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRET",
    "LOG2E",
    "LN2",
    "dot",
    "load_2d",
    "launch_with_stage_fallback",
    "sm_count",
    "next_pow2",
    "ceil_div",
    "check_cache",
    "as_int32",
    "prepare_attention_args",
    "dot_modes",
]

# Under the interpreter, tl.dot on bfloat16 operands computes garbage (numpy has no bfloat16),
# so the kernels upcast their dot operands to fp32 there.  On a GPU operands stay native.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def load_2d(ptrs, rmask, cmask, USE_RMASK: tl.constexpr, USE_CMASK: tl.constexpr):
    """Load a [R, C] tile, masking rows and/or (when the dim is padded) columns only if asked."""
    if USE_RMASK:
        if USE_CMASK:
            return tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=rmask[:, None], other=0.0)
    else:
        if USE_CMASK:
            return tl.load(ptrs, mask=cmask[None, :], other=0.0)
        else:
            return tl.load(ptrs)


# --------------------------------------------------------------------------------------------
# launching
# --------------------------------------------------------------------------------------------
try:  # raised at first launch when a config needs more shared memory than the device has
    from triton.runtime.errors import OutOfResources
except Exception:  # pragma: no cover - very old/new triton
    OutOfResources = RuntimeError

# (kernel name, device, compile-relevant key) -> num_stages that fitted, for default configs
_STAGES_THAT_FIT: dict = {}


def launch_with_stage_fallback(kernel, grid, args, kwargs, cfg: dict, key, strict: bool) -> None:
    """Launch ``kernel``; if the config's software pipeline does not fit in shared memory on this
    device (deep pipelines are tuned for Hopper's 227 KB), retry with fewer stages and remember
    what fitted.  ``strict`` (an explicitly requested config) disables the fallback."""
    stages = int(cfg["num_stages"])
    if not strict:
        stages = _STAGES_THAT_FIT.get(key, stages)
    while True:
        try:
            kernel[grid](*args, **kwargs, num_warps=int(cfg["num_warps"]), num_stages=stages)
            if not strict:
                _STAGES_THAT_FIT[key] = stages
            return
        except Exception as e:  # noqa: BLE001 - filtered below
            fits_problem = isinstance(e, OutOfResources) or "out of resource" in str(e).lower()
            if strict or not fits_problem or stages <= 1:
                raise
            stages -= 1


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); 8 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 8  # interpreter: keep the grid small


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` is a constexpr function in recent Triton:
    ~8 us a call from host code, paid per layer of every step)."""
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# argument checks and coercions of the attention launchers
# --------------------------------------------------------------------------------------------
def check_cache(q, k_cache, v_cache):
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, \
        "k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and equal shape"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q, k_cache and v_cache must share a dtype"
    assert q.shape[-1] == k_cache.shape[3], "head_dim mismatch"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.device == k_cache.device == v_cache.device


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor (itself when it already is one)."""
    if t.dtype != torch.int32 or not t.is_contiguous():
        t = t.to(torch.int32).contiguous()
    return t


def prepare_attention_args(q, k_cache, v_cache, out, block_tables, *lengths,
                           int32_tables: bool = False) -> Tuple[torch.Tensor, ...]:
    """Checks and coercions of an attention launcher's arguments (see
    ``hf_paged.kernels.paged_attention_decode``): q ``[rows, num_heads, head_dim]`` and the caches
    agree (:func:`check_cache`); returns ``(q, out, block_tables, *lengths)`` with q's head dim
    contiguous, ``out`` allocated like q when None (a given one must match q's shape, head dim
    contiguous), block_tables' last dim contiguous (and int32 when ``int32_tables``), and each
    of ``lengths`` (context_lens, cu_seqlens_q) contiguous int32."""
    assert q.dim() == 3
    check_cache(q, k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if int32_tables and block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    return (q, out, block_tables) + tuple(as_int32(t) for t in lengths)


def dot_modes(dtype: torch.dtype, precision: str) -> Tuple[str, bool]:
    """The ``PREC`` and ``UPCAST`` arguments of :func:`dot` for inputs of ``dtype``: the requested
    fp32 precision for float32 inputs ("ieee" for half types, whose dots are native), and
    upcasting of half types to fp32 under the interpreter."""
    prec = precision if dtype == torch.float32 else "ieee"
    upcast = INTERPRET and dtype != torch.float32
    return prec, upcast
