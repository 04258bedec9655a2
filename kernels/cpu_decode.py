"""CPU paged decode read in C (``cpu_decode.c``): one query token per sequence attends over its
blocks where they lie in the pools, float32, built by the system's C compiler for one layout.

Why C rather than torch ops: the gather-then-SDPA read copies every context key and value out of
the blocks before attending (the keys and values move three times), and FlexAttention compiled by
inductor (this read's predecessor) reads the blocks in place but spends most of its time on
per-block tiles and guards. This loop reads each block once, while it is in cache, for all K/V
heads of the sequence, with an online softmax: on 2 cores at 32 sequences of ~1,100 tokens, keys
coming from DRAM, 1.8-2.0 ms per layer against 2.6-3.0 ms for the compiled FlexAttention read and
~4 ms for the gather read (that first version; the 16-key path of ``cpu_decode.c`` took another 18%
off the engine's decode reads on the long-prompt benchmark).

Built with the prefill read into one library per layout by :mod:`cpu_build` (cached on disk; where
no compiler works, :func:`failure` says why and :func:`ready` answers False: callers keep their
own read). It runs with ``torch.get_num_threads()`` threads.

The torch reference of this read is ``reference.paged_attention_decode_ref``.
"""

from __future__ import annotations

import torch

from . import cpu_build


def failure() -> str | None:
    """Why the C read cannot be built in this process (None while it can)."""
    return cpu_build.failure()


def ready(kv_heads: int, heads_per_kv: int, head_dim: int, block_size: int) -> bool:
    """Whether the read is built for this layout; builds it (or loads the cached build) on the
    first ask."""
    return cpu_build.library((kv_heads, heads_per_kv, head_dim, block_size)) is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors can go to :func:`paged_decode_cpu`: float32 on the CPU, pools in their
    plain ``[blocks, block_size, kv_heads, head_dim]`` layout, and the read built for it."""
    return cpu_build.readable(q, k_cache, v_cache)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[seqs, heads, head_dim]`` over pools ``[blocks, block_size, kv_heads, head_dim]`` through
    ``block_tables`` ``[seqs, width]`` (entries past a sequence's blocks are never read; one that
    is read and lies outside the pool is a ValueError, as is a length outside the table);
    sequence ``i`` sees its last ``sliding_window`` (or all) of ``context_lens[i]`` keys, and
    ``sinks`` (``[heads]``) add a logit per head whose value is zero. Returns ``[seqs, heads,
    head_dim]``. Callers ask :func:`supports` first."""
    library = cpu_build.library_for("paged_decode_cpu", q, k_cache, v_cache)
    return _decode(library, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, sinks)


def try_paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`paged_decode_cpu` where :func:`supports` takes the tensors, else None (one check, for
    callers that fall back to another read)."""
    library = cpu_build.readable_library(q, k_cache, v_cache)
    if library is None:
        return None
    return _decode(library, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, sinks)


def _decode(library, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
            ) -> torch.Tensor:
    seqs, heads, _ = q.shape
    block_size = k_cache.shape[1]
    q = q.contiguous()
    tables, lens = _int32(block_tables), _int32(context_lens)
    sink_logits = None if sinks is None else sinks.to(torch.float32).contiguous()
    if tables.shape[0] != seqs or lens.shape != (seqs,) or (sink_logits is not None and sink_logits.shape != (heads,)):
        raise ValueError(f"paged_decode_cpu: {seqs} queries of {heads} heads, but block_tables {tuple(tables.shape)}, "
                         f"context_lens {tuple(lens.shape)}"
                         + ("" if sink_logits is None else f", sinks {tuple(sink_logits.shape)}"))
    out = torch.empty_like(q)
    if seqs:
        bad = library.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                   lens.data_ptr(), None if sink_logits is None else sink_logits.data_ptr(),
                                   out.data_ptr(), seqs, tables.shape[1], k_cache.shape[0], sliding_window or 0,
                                   scale, torch.get_num_threads())
        if bad:
            raise ValueError(_refusal(bad, tables, lens, block_size, k_cache.shape[0], sliding_window))
    return out


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as contiguous int32 (itself where it is: the engine's metadata is; a ``.to()`` that
    changes nothing costs more than these checks, once per layer)."""
    if tensor.dtype is torch.int32 and tensor.is_contiguous():
        return tensor
    return tensor.to(torch.int32).contiguous()


def _refusal(code: int, tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int,
             window: int | None) -> str:
    """What the C read's check found (its return ``code``), in words."""
    seq = abs(code) - 1
    n = int(lens[seq])
    if code > 0:
        return (f"paged_decode_cpu: sequence {seq} has context length {n}; its table holds {tables.shape[1]} "
                f"blocks of {block_size}")
    first = max(0, n - window) if window else 0
    row = tables[seq].tolist()
    entry = next(b for b in range(first // block_size, -(-n // block_size)) if not 0 <= row[b] < num_blocks)
    return (f"paged_decode_cpu: sequence {seq} reads block {row[entry]} (entry {entry} of its table), outside the "
            f"pool of {num_blocks} blocks")
