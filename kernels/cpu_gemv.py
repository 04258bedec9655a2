"""Float32 linear products of a few rows on CPU in C (``cpu_gemv.c``): ``x @ weight.T + bias`` for
1 to :func:`max_rows` rows, on the weight as ``nn.Linear`` holds it.

Why: a decode step of a few sequences is bound by reading the weights from memory, and sgemm reads
them slowly there (~10 GB/s on the 2-core EPYC of issue 22, its LM head having just evicted them).
Measured on that machine, a step's 28 layer products of the issue-22 model plus its 32,000-wide LM
head: 1.24 ms with sgemm and oneDNN's packed head against 0.46 ms here (one row), 1.39 against 0.53
(two), 1.84 against 1.22 (eight rows, the head on oneDNN). A row's result does not depend on the
other rows or the thread count (``cpu_gemv.c``); it differs from sgemm's in the last bits (another
summation order).

Built by :mod:`cpu_build` (cached on disk; where no compiler works, :func:`ready` answers False and
callers keep their own products). It runs with ``torch.get_num_threads()`` threads. The torch
reference is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import functools

import torch

from . import cpu_build


def ready() -> bool:
    """Whether the library is built here (builds it, or loads the cached build, on the first ask)."""
    return cpu_build.gemv_library() is not None


def max_rows() -> int:
    """The most rows one call takes: 16 built for AVX-512, else 8 (0 where the library is not built)."""
    library = cpu_build.gemv_library()
    return _max_rows(library) if library is not None else 0


@functools.cache
def _max_rows(library) -> int:  # per library: the builds for other targets take other counts
    return library.max_rows()


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear_rows` takes these tensors: float32 on the CPU, a 2-D contiguous weight
    (and a 1-D contiguous bias of its rows), ``x``'s last dimension its columns, 1 to
    :func:`max_rows` rows, and the library built."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or not weight.is_contiguous():
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1]
                             or bias.device.type != "cpu" or not bias.is_contiguous()):
        return False
    return 0 < x.numel() <= max_rows() * x.shape[-1]


def try_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`linear_rows` where :func:`supports` takes the tensors, else None (one check, for
    callers that fall back to another product)."""
    if not supports(x, weight, bias):
        return None
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features).contiguous()
    out = x.new_empty(*x.shape[:-1], out_features)
    refused = cpu_build.gemv_library().linear_rows(flat.data_ptr(), weight.data_ptr(),
                                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                                   flat.shape[0], in_features, out_features, torch.get_num_threads())
    if refused:  # supports() let through what the library does not take: never hand back unwritten memory
        raise RuntimeError(f"linear_rows: the C library refused {flat.shape[0]} rows (it takes 1 to {max_rows()})")
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[..., in]``, ``weight`` ``[out, in]``): ``[..., out]``. A
    ValueError for tensors :func:`supports` refuses."""
    out = try_linear_rows(x, weight, bias)
    if out is None:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)} "
                         f"{weight.dtype} (contiguous: {weight.is_contiguous()})"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)} {bias.dtype}")
                         + f": float32 CPU tensors of 1 to {max_rows()} rows only")
    return out
