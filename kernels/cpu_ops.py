"""The torch operators of the few-row library, in C++ against torch's stable ABI (``cpu_ops.cpp``):
``few_row_linear`` (the layers' products of :mod:`cpu_gemv` without Python around them) and
``decode_step_attention`` (a compiled decode step's attention per layer, from a plan the stepping
thread sets: :class:`DecodePlan`, with no Python per layer).

Built into the few-row library by :mod:`cpu_build` where a C++ compiler and torch's headers are at
hand; elsewhere :func:`namespace` answers None (``cpu_build.ops_failure()`` says why) and callers keep
their Python operators, which give the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import numpy as np
import torch

from . import cpu_build


def namespace() -> str | None:
    """The operators' namespace for this target's library (registered on the first ask), or None."""
    library = cpu_build.rows_library()
    return _registered(library) if library is not None else None


_namespaces = itertools.count()
PLAN_FIELDS = 13  # int64 per layer in a decode plan (cpu_ops.cpp)


def _product_shape(x, weight, bias, max_rows, fallback="aten::linear"):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _attention_shape(query, key, value, scale, sliding_window, softcap, sinks):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


@functools.cache
def _registered(library) -> str | None:
    """Registers ``library``'s operators under a namespace of its own (a process may load the
    libraries of several targets; a namespace is defined once)."""
    if not hasattr(library, "register_ops"):
        return None
    name = f"hf_paged_rows{next(_namespaces)}"
    if library.register_ops(name.encode()) or library.decode_plan_fields() != PLAN_FIELDS:
        return None
    torch.library.register_fake(f"{name}::few_row_linear", _product_shape)
    torch.library.register_fake(f"{name}::decode_step_attention", _attention_shape)
    return name


def few_row_linear() -> torch._ops.OpOverload | None:
    """``few_row_linear(x, weight, bias, max_rows, fallback="aten::linear")``: see ``cpu_gemv.linear_op``."""
    name = namespace()
    return None if name is None else getattr(torch.ops, name).few_row_linear.default


def decode_step_attention() -> torch._ops.OpOverload | None:
    """``decode_step_attention(query, key, value, scale, sliding_window, softcap, sinks)``: the
    signature and result of ``hf_paged::packed_step_attention``; a layer of a step with a plan
    (:class:`DecodePlan`) is served in C, any other call goes to that Python operator."""
    name = namespace()
    return None if name is None else getattr(torch.ops, name).decode_step_attention.default


class DecodePlan:
    """The plan of a compiled decode step for ``decode_step_attention``, kept from step to step: one
    row of the C code's fields per layer (``cpu_ops.cpp``, ``set_decode_plan``). :meth:`set_layer`
    when a layer's pools change, :meth:`set_rows` every step for the step's slots, tables and lengths
    of a layer group, then :meth:`start`, and :meth:`end` after the step. Every tensor given must live
    until then (the pools stay in the engine's storage, the step's metadata in its cache)."""

    def __init__(self, num_layers: int):
        self.rows = np.zeros((num_layers, PLAN_FIELDS), dtype=np.int64)
        self._rows_at = self.rows.ctypes.data
        # the library whose operator the engine's graphs call (the plan is that library's, per thread)
        self._library = cpu_build.rows_library()

    def set_layer(self, index: int, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, window: int) -> None:
        """Layer ``index`` reads its float32 pools ``[blocks, block_size, kv_heads, head_dim]`` with
        ``heads`` query heads in ``window`` tokens (0: all), through the C read of their layout
        (``cpu_build.library``, built on the first ask). A ValueError where the read cannot take them."""
        q_like = k_pool.new_empty(0, heads, k_pool.shape[-1])
        read = cpu_build.readable_library(q_like, k_pool, v_pool)
        if read is None:
            problem = cpu_build.mismatch(q_like, k_pool, v_pool) or f"the C read is not built: {cpu_build.failure()}"
            raise ValueError(f"DecodePlan: layer {index}: {problem}")
        blocks, block_size, kv_heads, head_dim = k_pool.shape
        self.rows[index, :9] = [ctypes.cast(read.paged_decode, ctypes.c_void_p).value, k_pool.data_ptr(),
                                v_pool.data_ptr(), blocks, block_size, kv_heads, heads, head_dim, window]

    def set_rows(self, layers: slice | list[int], seqs: int, slots: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor) -> None:
        """``layers`` (one group's; a slice where they follow each other) read ``seqs`` rows: each
        one's new token's slot (int64), its block table (int32 ``[seqs, width]``) and context length
        (int32), all contiguous on the CPU."""
        if not (slots.dtype is torch.int64 and slots.is_contiguous() and slots.shape == (seqs,)
                and tables.dtype is torch.int32 and tables.is_contiguous() and tables.dim() == 2
                and tables.shape[0] == seqs and lens.dtype is torch.int32 and lens.is_contiguous()
                and lens.shape == (seqs,) and slots.is_cpu and tables.is_cpu and lens.is_cpu):
            raise ValueError(f"DecodePlan: slots {tuple(slots.shape)} {slots.dtype}, tables {tuple(tables.shape)} "
                             f"{tables.dtype}, lengths {tuple(lens.shape)} {lens.dtype}: not {seqs} rows of "
                             f"contiguous int64 slots, int32 tables and lengths on the CPU")
        self.rows[layers, 9:] = [slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1]]

    def start(self, seqs: int) -> None:
        """This thread's next compiled step reads ``seqs`` decode rows through the plan."""
        self._library.set_decode_plan(len(self.rows), self._rows_at, seqs)

    def end(self) -> int:
        """Ends this thread's plan; how many layers it served."""
        return self._library.end_decode_plan()


def products_in_c() -> int:
    """How many products this target's ``few_row_linear`` (``cpu_gemv.linear_op``) ran in C in this process
    (for tests)."""
    library = cpu_build.rows_library()
    return library.few_row_products_in_c() if namespace() is not None else 0


def decode_layers_in_c() -> int:
    """How many layers this target's ``decode_step_attention`` served from plans in this process (for tests)."""
    library = cpu_build.rows_library()
    return library.decode_layers_in_c() if namespace() is not None else 0
