"""The cache object of one engine forward: metadata only; K/V live in the engine's storage.

Built by the model runner from a ``SchedulerOutput`` and read by the ``hf_paged`` attention
function through the :class:`~hf_paged.channel.PackedStep` protocol.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from hf_paged.channel import BLOCK_TABLE_PAD, AttentionMetadata, DecodeGroup, PackedStep, set_active_cache
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.kinds import KVSpec, MLAAttentionSpec
from hf_paged.layer_groups import LayerGroup, group_of_layers
from hf_paged.storage import PagedKVStorage

# Padding a group to its longest sequence costs gather + attention work per key slot; a separate
# group costs a fixed overhead of calls worth about this many key slots (measured on CPU).
GROUP_OVERHEAD_SLOTS = 1024


class PackedStepCache(PackedStep):
    """One packed forward ``[1, total_tokens]``: positions come from ``position_ids`` and no mask
    is built, so the cache reports no past and asks for no mask columns. Each layer group has its
    own metadata (slots and block tables), built on first use."""

    def __init__(self, specs: list[KVSpec | None], groups: list[LayerGroup], storage: PagedKVStorage,
                 step: SchedulerOutput, positions: torch.Tensor | None = None, *, decode_read: str = "auto",
                 prefill_read: str = "auto"):
        super().__init__([None if spec is None else spec.window for spec in specs])
        self.decode_read, self.prefill_read = decode_read, prefill_read  # see PackedStep
        self.storage, self._step, self.specs = storage, step, specs
        self._positions = positions  # [total_tokens] on the model's device (see get_seq_length)
        self._past: torch.Tensor | None = None
        self._context_slots: dict[tuple, torch.Tensor] = {}
        self.latent_context: tuple[int, torch.Tensor] | None = None  # MLA: (layer, cu_seqlens_k) of update's return
        self._group_of = group_of_layers(groups, specs)
        self._metadata_of: dict[int, AttentionMetadata] = {}
        self._moved: dict[tuple, AttentionMetadata] = {}
        self._decode_groups: dict[tuple, list[DecodeGroup]] = {}

    def group_index(self, layer_idx: int) -> int:
        """The layer group (index into the step's groups) that a layer's K/V belong to."""
        return self._group_of[layer_idx]

    def num_blocks_for(self, layer_idx: int) -> int:
        return self._step.groups[self._group_of[layer_idx]].num_blocks

    def _group_metadata(self, group: int) -> AttentionMetadata:
        if group not in self._metadata_of:
            self._metadata_of[group] = step_metadata(self._step, group)
        return self._metadata_of[group]

    def metadata_for(self, layer_idx: int, device: torch.device) -> AttentionMetadata:
        """The step's metadata for a layer's group on ``device`` (moved once per group and device)."""
        key = (self._group_of[layer_idx], device)
        if key not in self._moved:
            self._moved[key] = self._group_metadata(key[0]).to(device)
        return self._moved[key]

    def decode_groups(self, layer_idx: int, window: int | None, dtype: torch.dtype,
                      chunk_size: int | None = None, drafts: bool = False) -> list[DecodeGroup]:
        """The decoding sequences (sorted longest first by the scheduler) in groups of similar
        length; padding points at slot 0 and gets -inf in the additive mask (SDPA on CPU is
        faster with a float mask than a bool one). With a sliding ``window`` only the columns
        some row of the group can see are gathered, and with ``chunk_size`` only those of the
        rows' current chunks.

        Built once per step and shared by all layers: on CPU one gather and one fused SDPA call per
        group replace a per-sequence loop, and groups keep short sequences from paying for the
        longest one's padding. In float16 and bfloat16 a group holds sequences of one length only:
        SDPA's rounding there depends on how far a row is padded (masked keys change its blocking),
        so padding would make a sequence's tokens depend on the batch it ran in.

        ``drafts``: the rows of the sequences with drafts instead (``AttentionMetadata.draft_lens``),
        in groups of one length each, as a decode step would read each of them."""
        key = (self._group_of[layer_idx], window, dtype, chunk_size, drafts)
        if key not in self._decode_groups:
            meta = self._group_metadata(key[0])
            lens = (meta.draft_lens if drafts else meta.context_lens[: meta.num_decode]).long()
            all_tables = meta.draft_tables if drafts else meta.block_tables
            bs = self.storage.block_size
            groups = []
            exact = drafts or dtype in (torch.float16, torch.bfloat16)
            for lo, hi in (equal_runs if exact else split_by_length)(lens.tolist()):
                longest = int(lens[lo])
                first = max(0, int(lens[hi - 1]) - window) if window else 0
                if chunk_size:
                    first = max(first, (int(lens[hi - 1]) - 1) // chunk_size * chunk_size)
                pos = torch.arange(first, longest)
                table = all_tables[lo:hi, : -(-longest // bs)].long()
                slots = table.gather(1, (pos // bs).expand(hi - lo, -1)) * bs + pos % bs
                visible = pos[None, :] < lens[lo:hi, None]
                if window:
                    visible &= pos[None, :] > lens[lo:hi, None] - 1 - window
                if chunk_size:
                    visible &= pos[None, :] >= (lens[lo:hi, None] - 1) // chunk_size * chunk_size
                mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
                groups.append(DecodeGroup(lo, hi, slots.where(visible, 0), mask[:, None, None, :]))
            self._decode_groups[key] = groups
        return self._decode_groups[key]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attention layers: stash for the attention function (:mod:`hf_paged.channel`). MLA layers
        (:mod:`hf_paged.kinds.mla`): store the new latents now and return every sequence's cached
        latent context, packed one sequence after another in step order (``[1, 1, sum(context),
        width]``), which the model expands into K/V; ``latent_context`` tells the attention
        function where each sequence's keys start."""
        if not isinstance(self.specs[layer_idx], MLAAttentionSpec):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.check_no_pending()
        new_k, new_v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [tokens, 1, width]
        meta = self.metadata_for(layer_idx, new_k.device)
        self.storage.ensure_layer(layer_idx, new_k, self.num_blocks_for(layer_idx), new_v)
        self.storage.write(layer_idx, new_k, new_v, meta.slot_mapping)
        slots = self.context_slots(layer_idx, new_k.device)
        k_rows, v_rows = self.storage.slot_rows(layer_idx)
        keys, values = k_rows.index_select(0, slots), v_rows.index_select(0, slots)
        cu_k = torch.nn.functional.pad(meta.context_lens.cumsum(0), (1, 0))
        self.latent_context = (layer_idx, cu_k)
        set_active_cache(self)
        return keys.transpose(0, 1)[None].to(key_states.dtype), values.transpose(0, 1)[None].to(value_states.dtype)

    def context_slots(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        """The slot of every context token of every sequence of the step, in step order (once per
        layer group and device)."""
        key = (self._group_of[layer_idx], device)
        if key not in self._context_slots:
            meta = self._group_metadata(key[0])
            bs = self.storage.block_size
            parts = []
            for table, length in zip(meta.block_tables.long(), meta.context_lens.tolist()):
                pos = torch.arange(length)
                parts.append(table[pos // bs] * bs + pos % bs)
            self._context_slots[key] = torch.cat(parts).to(device)
        return self._context_slots[key]

    def get_seq_length(self, layer_idx: int | None = None) -> torch.Tensor | int:
        """Asked for a layer: per packed token, the tokens of its sequence before it minus its index
        in the row (``[total_tokens]``), what a layer that counts positions as ``arange(q_len) +
        cache.get_seq_length(self.layer_idx)`` (Llama 4's ``attn_temperature_tuning``) needs to get
        each token's own position. Asked without a layer (a model sizing its positions or masks): 0,
        as a step's positions come from ``position_ids`` and no mask is built."""
        if self._positions is None or layer_idx is None:
            return 0
        if self._past is None:
            self._past = self._positions - torch.arange(len(self._positions), device=self._positions.device)
        return self._past

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0


def split_by_length(lengths: list[int], overhead: int = GROUP_OVERHEAD_SLOTS) -> list[tuple[int, int]]:
    """Split ``lengths`` (sorted, longest first) into contiguous groups ``[lo, hi)``: a group is
    split where that saves the most padded slots, as long as the saving beats ``overhead``."""
    if not lengths:
        return []
    best_saving, cut = 0, 0
    for k in range(1, len(lengths)):
        saving = (len(lengths) - k) * (lengths[0] - lengths[k])
        if saving > best_saving:
            best_saving, cut = saving, k
    if best_saving <= overhead:
        return [(0, len(lengths))]
    head = split_by_length(lengths[:cut], overhead)
    return head + [(lo + cut, hi + cut) for lo, hi in split_by_length(lengths[cut:], overhead)]


def equal_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``lengths`` (sorted) as contiguous groups ``[lo, hi)`` of equal values: no padding at all."""
    runs, lo = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != lengths[lo]:
            runs.append((lo, i))
            lo = i
    return runs


def host_tensor(values, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host tensor of a flat sequence of ints, through numpy: ``torch.tensor`` reads a list of
    ints about 3x slower (130 us against 45 us for 2,300 ints), and a step makes several."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64 if dtype == torch.long else np.int32))


def step_metadata(step: SchedulerOutput, group: int) -> AttentionMetadata:
    """The attention metadata of one layer group for a step (host tensors)."""
    blocks = step.groups[group]
    width = max(len(t) for t in blocks.block_tables)
    padded = itertools.chain.from_iterable(t + (BLOCK_TABLE_PAD,) * (width - len(t)) for t in blocks.block_tables)
    prefill_counts = [s.num_tokens for s in step.sequences[step.num_decode :]]
    tables = host_tensor(list(padded), torch.int32).view(len(blocks.block_tables), width)
    meta = AttentionMetadata(
        slot_mapping=host_tensor(blocks.slot_mapping),
        block_tables=tables,
        context_lens=host_tensor(step.context_lens, torch.int32),
        cu_seqlens_q=host_tensor([0, *itertools.accumulate(prefill_counts)], torch.int32),
        num_decode=step.num_decode,
    )
    if not step.has_drafts:
        return meta
    drafted = step.sequences[step.num_decode : step.num_decode + step.num_drafted]
    rows = torch.repeat_interleave(torch.arange(step.num_decode, step.num_decode + len(drafted)),
                                   torch.tensor([s.num_tokens for s in drafted]))
    lens = [p + 1 for s in drafted for p in range(s.start, s.start + s.num_tokens)]
    return dataclasses.replace(meta, num_draft_seqs=len(drafted), draft_tables=tables.index_select(0, rows),
                               draft_lens=host_tensor(lens, torch.int32))
