"""One engine step through the model: every scheduled token of every sequence in one packed row.

``input_ids`` and ``position_ids`` are ``[1, total_tokens]``; a per-step cache carries the
per-sequence metadata (slot of each new token, block tables, context lengths, where the decode
tokens end) to the ``hf_paged`` attention function, which writes the new K/V into their slots and
attends per sequence. No padding, no dense mask. Logits are computed only at the last token of
each sequence that needs a next token.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hf_paged.cache import StashingCache, _layer_structure, _PagedLayerView, packed_forward
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.sequence import Sequence


class PackedStepCache(StashingCache):
    """The cache object of one packed forward: metadata only; K/V live in the engine's storage."""

    packed = True

    def __init__(self, windows: list[int | None], storage, num_blocks: int, metadata: dict[str, torch.Tensor],
                 num_decode: int):
        super().__init__(layers=[_PagedLayerView(self, i, w) for i, w in enumerate(windows)])
        self.storage, self.num_blocks, self.num_decode = storage, num_blocks, num_decode
        self._set_metadata(metadata)

    def decode_groups(self, window: int | None, dtype: torch.dtype) -> list[tuple]:
        """The decoding sequences (sorted longest first by the runner) in groups of similar length,
        each ``(first row, end row, slots [rows, keys], additive mask [rows, 1, 1, keys])``; padding
        points at slot 0 and gets -inf (SDPA on CPU is faster with a float mask than a bool one).
        With a sliding ``window`` only the columns some row of the group can see are gathered.

        Built once per step and shared by all layers: on CPU one gather and one fused SDPA call per
        group replace a per-sequence loop, and groups keep short sequences from paying for the
        longest one's padding."""
        key = ("decode_groups", window, dtype)
        if key not in self._on_device:
            lens = self._metadata["context_lens"][: self.num_decode].long()
            tables = self._metadata["block_tables"]
            bs = self.storage.block_size
            groups = []
            for lo, hi in split_by_length(lens.tolist()):
                longest = int(lens[lo])
                first = max(0, int(lens[hi - 1]) - window) if window else 0
                pos = torch.arange(first, longest)
                table = tables[lo:hi, : -(-longest // bs)].long()
                slots = table.gather(1, (pos // bs).expand(hi - lo, -1)) * bs + pos % bs
                visible = pos[None, :] < lens[lo:hi, None]
                if window:
                    visible &= pos[None, :] > lens[lo:hi, None] - 1 - window
                mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
                groups.append((lo, hi, slots.where(visible, 0), mask[:, None, None, :]))
            self._on_device[key] = groups
        return self._on_device[key]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; masks are not built

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


# Padding a group to its longest sequence costs gather + attention work per key slot; a separate
# group costs a fixed overhead of calls worth about this many key slots (measured on CPU).
GROUP_OVERHEAD_SLOTS = 1024


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


@dataclass
class StepInput:
    seq: Sequence
    start: int  # first token to compute (== tokens already cached)
    count: int

    @property
    def needs_logits(self) -> bool:
        return self.start + self.count == self.seq.num_tokens


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv: KVCacheManager):
        self.model, self.kv = model, kv
        self.config = model.config.get_text_config(decoder=True)
        _, self.windows = _layer_structure(self.config)  # per layer; derived once (reading configs is slow)
        self.device = model.device
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params

    @torch.inference_mode()
    def execute(self, inputs: list[StepInput]) -> tuple[list[StepInput], torch.Tensor]:
        """Run the step. Returns the inputs in the order used (decode tokens first) and the
        float32 logits ``[n, vocab]`` of those with ``needs_logits``, in that order."""
        decode = sorted((x for x in inputs if x.count == 1), key=lambda x: -x.start)  # longest context first
        prefill = [x for x in inputs if x.count > 1]
        ordered = decode + prefill
        bs = self.kv.block_size
        ids, positions, slots, tables, lens, cu, keep = [], [], [], [], [], [0], []
        for x in ordered:
            table = self.kv.block_table(x.seq)
            span = range(x.start, x.start + x.count)
            ids += x.seq.token_ids[x.start : x.start + x.count]
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            tables.append(table)
            lens.append(x.start + x.count)
            if x.count > 1:
                cu.append(cu[-1] + x.count)
            if x.needs_logits:
                keep.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        metadata = {
            "slot_mapping": torch.tensor(slots, dtype=torch.long),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "context_lens": torch.tensor(lens, dtype=torch.int32),
            "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        }
        step_cache = PackedStepCache(self.windows, self.kv.storage, self.kv.num_blocks, metadata, len(decode))
        forward = {
            "input_ids": torch.tensor([ids], device=self.device),
            "position_ids": torch.tensor([positions], device=self.device),
            self._cache_kwarg: step_cache,
            "use_cache": True,
        }
        keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self._logits_to_keep:
            forward["logits_to_keep"] = keep_index
        with packed_forward():
            logits = self.model(**forward).logits[0]
        if not self._logits_to_keep:
            logits = logits.index_select(0, keep_index)
        step_cache._check_no_pending()
        return ordered, logits.float()
