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

Python callers reach the loop through ctypes (:func:`try_linear_rows`); compiled engine steps through
a torch operator in C++ (:func:`linear_op`, ``cpu_ops.cpp``) where it builds: a decode step calls it
for each layer linear, and through Python each call cost ~10 us around a ~3 us loop.
"""

from __future__ import annotations

import functools

import torch

from . import cpu_build, cpu_ops


def ready() -> bool:
    """Whether the library is built here (builds it, or loads the cached build, on the first ask)."""
    return cpu_build.rows_library() is not None


def max_rows() -> int:
    """The most rows one call takes: 16 built for AVX-512, else 8 (0 where the library is not built)."""
    library = cpu_build.rows_library()
    return _max_rows(library) if library is not None else 0


@functools.cache
def _max_rows(library) -> int:  # per library: the builds for other targets take other counts
    return library.max_rows()


def linear_op() -> torch._ops.OpOverload | None:
    """The C++ operator ``few_row_linear(x, weight, bias, max_rows, fallback="aten::linear")`` of this
    target's library (:mod:`cpu_ops`), or None where the library was built without it
    (``cpu_build.ops_failure()`` says why) or not at all. It is ``F.linear(x, weight, bias)``, run in C
    where :func:`supports` takes the tensors and there are at most ``max_rows`` rows (the bits of
    :func:`try_linear_rows`), else by the operator named ``fallback`` (any that takes ``(x, weight, bias)``)."""
    return cpu_ops.few_row_linear()


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear_rows` takes these tensors: float32 on the CPU, a 2-D contiguous weight
    (and a 1-D contiguous bias of its rows), ``x``'s last dimension its columns, 1 to
    :func:`max_rows` rows, and the library built."""
    library = cpu_build.rows_library()
    return library is not None and _fits(x, weight, bias, _max_rows(library))


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, most: int) -> bool:
    """:func:`supports`, the library's ``most`` rows known (the checks every layer product of a
    decode step makes: cheap attribute reads, cheapest and likeliest to fail first)."""
    float32 = torch.float32
    if x.dtype is not float32 or weight.dtype is not float32 or not (x.is_cpu and weight.is_cpu):
        return False
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not 0 < x.numel() <= most * x.shape[-1]:
        return False
    if bias is not None and (bias.dtype is not float32 or bias.shape != weight.shape[:1] or not bias.is_cpu
                             or not bias.is_contiguous()):
        return False
    return weight.is_contiguous()


def try_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`linear_rows` where :func:`supports` takes the tensors, else None (one check, for
    callers that fall back to another product)."""
    library = cpu_build.rows_library()
    if library is None or not _fits(x, weight, bias, most := _max_rows(library)):
        return None
    out_features, in_features = weight.shape
    flat = x.contiguous()
    out = x.new_empty(*x.shape[:-1], out_features)
    rows = flat.numel() // in_features
    if library.linear_rows(flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                           out.data_ptr(), rows, in_features, out_features, torch.get_num_threads()):
        # _fits let through what the library does not take: never hand back unwritten memory
        raise RuntimeError(f"linear_rows: the C library refused {rows} rows (it takes 1 to {most})")
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
