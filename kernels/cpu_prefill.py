"""CPU paged prefill read in C (``cpu_prefill.c``): the new tokens of each sequence (a whole prompt,
or a chunk after a past) attend causally over the sequence's blocks where they lie in the pools,
float32, built with the decode read by :mod:`cpu_build` for one layout.

Why C rather than torch's SDPA per sequence: with small heads (a head dim of 32 to 64) torch's
flash kernel for CPU spends more time around its small matrix products than in them, and a chunk
after a past needs its context gathered out of the blocks and a mask. This read tiles the query
heads that share a K/V head together, so each key and value read from a block serves 64 rows,
and works from the blocks directly: on 2 cores, one 1,000-token prompt of 8 heads (2 K/V heads) of
32 attends in ~3.2 ms against ~6.3 ms for torch's flash kernel on contiguous tensors.

The torch reference of this read is ``reference.paged_attention_prefill_ref``.
"""

from __future__ import annotations

import torch

from . import cpu_build


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors can go to :func:`paged_prefill_cpu`: float32 on the CPU, pools in their
    plain ``[blocks, block_size, kv_heads, head_dim]`` layout, a head dim that is a multiple of 4,
    and the read built for the layout (built on the first ask)."""
    return q.dim() == 3 and q.shape[2] % 4 == 0 and cpu_build.readable(q, k_cache, v_cache)


def paged_prefill_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[tokens, heads, head_dim]``: sequence ``i``'s new tokens are rows ``cu_seqlens_q[i] ..
    cu_seqlens_q[i + 1]``, the last of its ``context_lens[i]`` tokens, whose keys and values are
    already in the pools ``[blocks, block_size, kv_heads, head_dim]`` through ``block_tables``
    ``[seqs, width]``. Each new token sees the keys up to its own position (its last
    ``sliding_window`` of them when given); ``sinks`` (``[heads]``) add a logit per head whose value
    is zero. A block outside the pool among those read, or a length the table cannot hold, is a
    ValueError. Returns ``[tokens, heads, head_dim]``. Callers ask :func:`supports` first."""
    if q.dim() == 3 and q.shape[2] % 4:
        raise ValueError(f"paged_prefill_cpu: head dim {q.shape[2]} is not a multiple of 4")
    library = cpu_build.library_for("paged_prefill_cpu", q, k_cache, v_cache)
    tokens, heads, _ = q.shape
    block_size = k_cache.shape[1]
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sink_logits = None if sinks is None else sinks.to(torch.float32).contiguous()
    seqs = tables.shape[0]
    if (cu.shape != (seqs + 1,) or lens.shape != (seqs,) or (seqs and (int(cu[0]) != 0 or int(cu[-1]) != tokens))
            or (sink_logits is not None and sink_logits.shape != (heads,))):
        raise ValueError(f"paged_prefill_cpu: {tokens} queries of {heads} heads, but block_tables "
                         f"{tuple(tables.shape)}, cu_seqlens_q {cu.tolist()}, context_lens {tuple(lens.shape)}"
                         + ("" if sink_logits is None else f", sinks {tuple(sink_logits.shape)}"))
    out = torch.empty_like(q)
    if seqs and tokens:
        bad = library.paged_prefill(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                    cu.data_ptr(), lens.data_ptr(),
                                    None if sink_logits is None else sink_logits.data_ptr(), out.data_ptr(), seqs,
                                    tables.shape[1], k_cache.shape[0], sliding_window or 0, scale,
                                    torch.get_num_threads())
        if bad:
            raise ValueError(_refusal(bad, tables, cu, lens, block_size, k_cache.shape[0], sliding_window))
    return out


def _refusal(code: int, tables: torch.Tensor, cu: torch.Tensor, lens: torch.Tensor, block_size: int,
             num_blocks: int, window: int | None) -> str:
    """What the C read's check found (its return ``code``), in words."""
    if code < -(2**31) + 2:
        return "paged_prefill_cpu: out of memory" if code == -(2**31) + 1 else "paged_prefill_cpu: no read for this layout"
    seq = abs(code) - 1
    n, new = int(lens[seq]), int(cu[seq + 1] - cu[seq])
    if code > 0:
        return (f"paged_prefill_cpu: sequence {seq} has {new} new tokens and context length {n}; its table holds "
                f"{tables.shape[1]} blocks of {block_size}")
    first = max(0, n - new - window + 1) if window else 0
    row = tables[seq].tolist()
    entry = next(b for b in range(first // block_size, -(-n // block_size)) if not 0 <= row[b] < num_blocks)
    return (f"paged_prefill_cpu: sequence {seq} reads block {row[entry]} (entry {entry} of its table), outside the "
            f"pool of {num_blocks} blocks")
