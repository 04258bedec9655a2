"""Executes a ``SchedulerOutput``: storage first (grow, swaps, copies), then one packed forward.

``input_ids`` and ``position_ids`` are ``[1, total_tokens]``; a per-step cache carries the
per-sequence metadata (slot of each new token, block tables, context lengths, where the decode
tokens end) to the ``hf_paged`` attention function, which writes the new K/V into their slots and
attends per sequence. No padding, no dense mask. Logits are computed only at the last token of
each sequence that needs a next token. The runner holds the K/V storage and decides nothing.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_paged.attention import paged_call
from hf_paged.channel import clear_active_cache, packed_forward
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.step_cache import PackedStepCache
from hf_paged.layer_groups import layer_groups
from hf_paged.model_info import cache_kwarg, layer_kinds, takes_logits_to_keep
from hf_paged.storage import PagedKVStorage


class ModelRunner:
    """Runs steps of ``model`` on the device pools in ``storage`` (and the CPU ``swap_storage``)."""

    def __init__(self, model: PreTrainedModel, storage: PagedKVStorage, swap_storage: PagedKVStorage,
                 swap_space_blocks: int | list[int] = 0):
        self.model, self.storage, self.swap_storage = model, storage, swap_storage
        _, self.specs = layer_kinds(model.config.get_text_config(decoder=True))  # derived once: configs are slow
        self.groups = layer_groups(self.specs)  # the KV cache manager's groups, in its order
        self.swap_space_blocks = (list(swap_space_blocks) if isinstance(swap_space_blocks, (list, tuple))
                                  else [swap_space_blocks] * len(self.groups))  # per group
        self.device = model.device
        self._cache_kwarg = cache_kwarg(model)
        self._logits_to_keep = takes_logits_to_keep(model)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        """Run the step. Returns float32 logits ``[n, vocab]`` of the sequences with
        ``needs_logits``, in ``step.sequences`` order (None when nothing is computed)."""
        self._run_block_moves(step)
        if not step.sequences:
            return None
        positions = torch.tensor([step.positions], device=self.device)
        step_cache = PackedStepCache(self.specs, self.groups, self.storage, step, positions[0])
        forward = {
            "input_ids": torch.tensor([step.input_ids], device=self.device),
            "position_ids": positions,
            self._cache_kwarg: step_cache,
            "use_cache": True,
        }
        keep_index = torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)
        if self._logits_to_keep:
            forward["logits_to_keep"] = keep_index
        with packed_forward(), paged_call(self.model):
            logits = self.model(**forward).logits[0]
        clear_active_cache()
        if not self._logits_to_keep:
            logits = logits.index_select(0, keep_index)
        step_cache.check_no_pending()
        return logits.float()

    def _run_block_moves(self, step: SchedulerOutput) -> None:
        """Per layer group: swaps out before swaps in before copy-on-write copies (the order the
        scheduler assumes)."""
        for group, blocks, swap_blocks in zip(self.groups, step.groups, self.swap_space_blocks):
            self.storage.grow(blocks.num_blocks, group.layers)
            if blocks.swap_out:
                self.storage.transfer(self.swap_storage, list(blocks.swap_out), swap_blocks, group.layers)
            if blocks.swap_in:
                self.swap_storage.transfer(self.storage, list(blocks.swap_in), blocks.num_blocks, group.layers)
            self.storage.copy_blocks(list(blocks.block_copies), group.layers)

