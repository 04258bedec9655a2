"""Paged-attention kernels: Triton implementations with a torch reference beside each.

Public entry points (the library's attention function calls these)::

    paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                           sliding_window=None, softcap=None, sinks=None, chunk_size=None, *,
                           backend=None, precision=None, out=None, max_context_len=None) -> out
    paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            sliding_window=None, softcap=None, sinks=None, chunk_size=None, *,
                            backend=None, precision=None, out=None) -> out
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, backend=None) -> None
    copy_blocks(k_caches, v_caches, block_mapping, *, backend=None) -> None

Their signatures here are the documented ones: the torch references (``*_ref``, in
``reference``) and the Triton launchers (``*_triton``, in ``decode``, ``prefill`` and
``cache_ops``) take the same arguments.  ``sinks`` (``[num_heads]``, gpt-oss attention sinks)
and ``chunk_size`` (Llama 4's chunked local attention) are described with the masking semantics
in ``reference``.

Backend: :func:`set_backend` (or the environment variable ``HF_PAGED_KERNEL_BACKEND``, read at
import) is the library's one backend switch: ``"triton"``, ``"torch"``, or ``None`` / ``"auto"``
(the default: Triton when the tensors are on CUDA and triton imports, otherwise the torch
reference).  It decides for these entry points and also, in hf_paged's attention function,
whether a paged call reads K/V through the Triton kernels or through the torch reference path.
A ``backend=`` argument of an entry point overrides it for that call; :func:`use_triton` is the
decision itself.  Forcing Triton on CPU tensors only works under ``TRITON_INTERPRET=1`` (the
tests).

Precision of float32 dots in the Triton kernels: ``precision="ieee"`` (exact fp32, default) or
``"tf32"`` (faster on tensor cores, ~1e-3 relative error); :func:`set_fp32_precision` sets the
default.  fp16/bf16 inputs always use native-precision dots with fp32 accumulation.

Importing this package never imports triton; the Triton modules load on first use.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Optional, Sequence

import torch

from .reference import (
    copy_blocks_ref,
    gather_kv_ref,
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    reshape_and_cache_ref,
)

__all__ = [
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "copy_blocks",
    "paged_attention_decode_ref",
    "paged_attention_prefill_ref",
    "reshape_and_cache_ref",
    "copy_blocks_ref",
    "gather_kv_ref",
    "set_backend",
    "get_backend",
    "use_triton",
    "set_fp32_precision",
    "triton_available",
]

_VALID_BACKENDS = (None, "auto", "triton", "torch")
_backend: Optional[str] = os.environ.get("HF_PAGED_KERNEL_BACKEND") or None
_fp32_precision: str = "ieee"
_triton_ok: Optional[bool] = None


def triton_available() -> bool:
    """True if triton can be imported (checked once)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_ok = True
        except Exception:  # ImportError, or a broken install
            _triton_ok = False
    return _triton_ok


def set_backend(backend: Optional[str]) -> None:
    """The library's backend switch: ``"triton"`` or ``"torch"`` for every call (kernels and
    hf_paged's attention function); ``None``/``"auto"`` restores the default (Triton on CUDA)."""
    global _backend
    if backend not in _VALID_BACKENDS:
        raise ValueError(f"backend must be one of {_VALID_BACKENDS}, got {backend!r}")
    _backend = None if backend == "auto" else backend


def get_backend() -> Optional[str]:
    """The forced backend (``"triton"`` / ``"torch"``), or None for the default."""
    return _backend


def set_fp32_precision(precision: str) -> None:
    """Default dot precision for float32 inputs in the Triton kernels: ``"ieee"`` or ``"tf32"``."""
    global _fp32_precision
    if precision not in ("ieee", "tf32"):
        raise ValueError("precision must be 'ieee' or 'tf32'")
    _fp32_precision = precision


def use_triton(tensor: torch.Tensor, backend: Optional[str] = None) -> bool:
    """Whether a call on ``tensor`` runs the Triton kernels: an explicit ``backend``
    (``"triton"``/``"torch"``) wins, else the switch of :func:`set_backend`, else Triton when
    ``tensor`` is on CUDA and triton imports.  Raises ValueError for an unknown backend name and
    RuntimeError when Triton is forced but triton cannot be imported."""
    choice = backend if backend not in (None, "auto") else _backend
    if choice not in _VALID_BACKENDS:
        raise ValueError(f"backend must be one of {_VALID_BACKENDS}, got {choice!r}")
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' was requested but triton cannot be imported")
        return True
    return tensor.is_cuda and triton_available()


@functools.lru_cache(maxsize=None)
def _launcher(launcher: str):
    """The Triton launcher ``"module:function"`` of this package, its module imported once
    (``importlib.import_module`` costs ~10 us a call: two per layer of every engine step on a GPU,
    where steps are bound by host work)."""
    module, name = launcher.split(":")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def _dispatch(tensor, backend, launcher: str, reference, args, out=None, **launch_options):
    """Run one operation on ``args``: the Triton ``launcher`` (``"module:function"`` of this
    package, imported on first use) with ``out=`` (when given) and ``launch_options``, or the
    torch ``reference``, whose result is copied into ``out`` when one is given."""
    if use_triton(tensor, backend):
        fn = _launcher(launcher)
        if out is not None:
            launch_options["out"] = out
        return fn(*args, **launch_options)
    res = reference(*args)
    if out is None:
        return res
    out.copy_(res)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    *,
    backend: Optional[str] = None,
    precision: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
    max_context_len: Optional[int] = None,
) -> torch.Tensor:
    """Single-token decode attention over a paged cache (flash-decoding on the Triton path).

    q ``[num_seqs, num_heads, head_dim]``; the query of sequence ``i`` sits at position
    ``context_lens[i] - 1`` and its own K/V must already be in the cache.  ``context_lens[i]``
    must be >= 1 (not checked, to avoid a device sync; the Triton path returns zeros for 0).
    ``max_context_len`` (optional, host int) is only a hint for how many splits to use; without
    it the bound ``block_tables.shape[1] * block_size`` is used.
    """
    return _dispatch(
        q, backend, "decode:paged_attention_decode_triton", paged_attention_decode_ref,
        (q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap, sinks,
         chunk_size), out,
        precision=precision or _fp32_precision, max_context_len=max_context_len,
    )


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    *,
    backend: Optional[str] = None,
    precision: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Varlen causal attention (prefill, chunked prefill, mixed batches) over a paged cache.

    q ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns rows ``cu[i]:cu[i+1]``, the last
    ``n_q`` tokens of its ``context_lens[i]`` tokens (``0 <= n_q <= context_lens[i]``).
    """
    return _dispatch(
        q, backend, "prefill:paged_attention_prefill_triton", paged_attention_prefill_ref,
        (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window,
         softcap, sinks, chunk_size), out, precision=precision or _fp32_precision,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place.
    Slot ``-1`` is skipped (padding)."""
    _dispatch(key, backend, "cache_ops:reshape_and_cache_triton", reshape_and_cache_ref,
              (key, value, k_cache, v_cache, slot_mapping))


def copy_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> None:
    """Copy block ``src`` onto ``dst`` for every ``(src, dst)`` row of ``block_mapping`` in every
    layer's K and V cache, in one launch on the Triton path.  All caches must share shape, dtype,
    strides and device; no block may be both a source and a destination in one call."""
    caches = list(k_caches) + list(v_caches)
    if not caches:
        return
    _dispatch(caches[0], backend, "cache_ops:copy_blocks_triton", copy_blocks_ref,
              (k_caches, v_caches, block_mapping))


if __name__ == "kernels":  # a checkout's root is on sys.path: that name is Hugging Face's package
    from ._top_level_name import give_name_to_installed_package

    give_name_to_installed_package()
