"""CPU paged decode through FlexAttention compiled by inductor: the read follows the block tables
inside the generated loop, so no gathered copy of the keys and values is made.

The gather-then-SDPA read (hf_paged's CPU decode) moves every context key and value twice per
layer: once into a contiguous copy, once into the attention. At long contexts that copy is a large
part of the read. Here the pools are handed to ``flex_attention`` whole, as one ``[1, kv_heads,
num_blocks * block_size, head_dim]`` view, with a :class:`BlockMask` that lists each sequence's
physical blocks: all but the last are full, the last is masked past the sequence's length.
Softmax is order-free, so the blocks' physical order does not matter. The query heads of one K/V
head are that head's queries, so each key is read once per K/V head.

Compiling takes seconds (a C++ build), so it never happens on the caller's path: :func:`ready`
starts it on a background thread for a layout (heads, head dim, block size) the first time it is
asked and answers False until it is done; callers keep their own read meanwhile. One compile
serves every batch size, pool size and table width (dynamic shapes). Where inductor cannot compile
(no C++ compiler), :func:`failure` says why and :func:`ready` stays False. The torch reference of
this read is ``reference.paged_attention_decode_ref``.
"""

from __future__ import annotations

import threading

import torch

_compiled = None
_layouts: dict[tuple, str] = {}  # layout -> "compiling" | "ready" | "failed"
_failure: str | None = None
_threads: list[threading.Thread] = []
_lock = threading.Lock()


def failure() -> str | None:
    """Why the compiled read is off in this process (None while it can be used)."""
    return _failure


def ready(kv_heads: int, heads_per_kv: int, head_dim: int, block_size: int, *, wait: bool = False) -> bool:
    """Whether the read is compiled for this layout; the first call starts compiling it in the
    background (``wait``: compile now, in this thread, and answer when done)."""
    layout = (kv_heads, heads_per_kv, head_dim, block_size)
    with _lock:
        state = _layouts.get(layout)
        if state is None and _failure is None:
            _layouts[layout] = state = "compiling"
            if not wait:
                thread = threading.Thread(target=_warm_up, args=(layout,), name="hf_paged-flex-compile", daemon=True)
                _threads.append(thread)
                thread.start()
    if state == "compiling" and wait:
        _warm_up(layout)
    return _layouts.get(layout) == "ready"


def compiling() -> bool:
    """Whether a background compile is still running."""
    return any(thread.is_alive() for thread in _threads)


def wait_for_compiles(timeout: float | None = None) -> None:
    """Wait for the background compiles started so far (a benchmark does, before its timed run,
    as vLLM compiles before it serves)."""
    for thread in list(_threads):
        thread.join(timeout)


@torch.inference_mode()
def _warm_up(layout: tuple) -> None:
    """Compile by running the read once on small tensors of ``layout`` (sizes above 1, so none is
    specialised), under ``inference_mode`` as engine steps run: Dynamo guards on the grad mode,
    and a compile made with gradients on (a new thread's default) would be compiled again by the
    first step that uses it."""
    global _failure
    kv_heads, group, head_dim, block_size = layout
    try:
        tables = torch.tensor([[0, 1], [2, 3], [4, 0]], dtype=torch.int32)
        lens = torch.tensor([block_size + 2, 2 * block_size, 3], dtype=torch.int32)
        pool = torch.zeros(5, block_size, kv_heads, head_dim)
        q = torch.zeros(3, kv_heads * group, head_dim)
        paged_decode_flex(q, pool, pool, decode_block_mask(tables, lens, 5, block_size, group), head_dim**-0.5)
        state = "ready"
    except Exception as error:  # noqa: BLE001 - any compile failure turns the read off
        _failure = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        state = "failed"
    with _lock:
        _layouts[layout] = state


def decode_block_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int,
                      heads_per_kv: int = 1):
    """The :class:`BlockMask` of one decode step: sequence ``i`` sees the first ``context_lens[i]``
    slots of its blocks ``block_tables[i]`` (``[seqs, width]``) in pools of ``num_blocks``
    blocks. Shared by every layer of a step that reads the same block tables."""
    from torch.nn.attention.flex_attention import BlockMask

    seqs, width = block_tables.shape
    lens = context_lens.to(torch.int32)
    used = (lens + block_size - 1) // block_size  # blocks per sequence (>= 1)
    tables = block_tables.to(torch.int32).clamp(min=0)  # padding entries are never read
    # As wide as the pool (flex checks), but only the first ``used`` entries of a row are ever read:
    # the rest stay unwritten, so a step's mask costs the same in a pool of 1,000 or 100,000 blocks.
    full_indices = torch.empty(seqs, 1, 1, num_blocks, dtype=torch.int32)
    full_indices[:, 0, 0, :width] = tables
    partial_indices = torch.empty(seqs, 1, 1, num_blocks, dtype=torch.int32)
    partial_indices[:, 0, 0, :1] = tables.gather(1, (used - 1).long()[:, None])
    last_fill = (lens - (used - 1) * block_size).long()  # visible slots of the last block (int64: see below)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx % block_size < last_fill[b]

    return BlockMask.from_kv_blocks(
        torch.ones(seqs, 1, 1, dtype=torch.int32), partial_indices, (used - 1).view(seqs, 1, 1), full_indices,
        BLOCK_SIZE=(heads_per_kv, block_size), mask_mod=mask_mod,
        seq_lengths=(heads_per_kv, num_blocks * block_size), compute_q_blocks=False)


def paged_decode_flex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """One query per sequence, ``q`` ``[seqs, heads, head_dim]``, over pools ``[num_blocks,
    block_size, kv_heads, head_dim]`` through ``block_mask`` (:func:`decode_block_mask`).
    Returns ``[seqs, heads, head_dim]``. Compiles on first use: callers on a hot path ask
    :func:`ready` first.

    Two inductor (torch 2.13) miscompiles shape this code: a query that is a view of another
    tensor, and an int32 tensor in the mask function, each produce C++ that does not build."""
    global _compiled
    seqs = q.shape[0]
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    keys = k_cache.view(1, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2).expand(seqs, -1, -1, -1)
    values = v_cache.view(1, num_blocks * block_size, kv_heads, v_cache.shape[-1]).transpose(1, 2)
    values = values.expand(seqs, -1, -1, -1)
    with _lock:
        if _compiled is None:
            from torch.nn.attention.flex_attention import flex_attention

            _compiled = torch.compile(flex_attention, dynamic=True)
    query = q.reshape(seqs, kv_heads, -1, head_dim).clone()  # [seqs, kv_heads, group, head_dim], not a view
    out = _compiled(query, keys, values, block_mask=block_mask, scale=scale)
    return out.reshape(seqs, -1, out.shape[-1])
