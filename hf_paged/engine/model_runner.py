"""Executes a ``SchedulerOutput``: storage first (grow, swaps, copies), then one packed forward.

``input_ids`` and ``position_ids`` are ``[1, total_tokens]``; a per-step cache carries the
per-sequence metadata (slot of each new token, block tables, context lengths, where the decode
tokens end) to the ``hf_paged`` attention function, which writes the new K/V into their slots and
attends per sequence. No padding, no dense mask. Logits are computed only at the last token of
each sequence that needs a next token, and at the rows a request with ``prompt_logprobs`` scores
(``SchedulerOutput.prompt_logprobs``): those are turned into log-probs, ranks and top tokens at
once (:func:`score_prompt_rows`, kept in :attr:`ModelRunner.prompt_logprobs` for the engine) and
dropped. The runner holds the K/V storage and decides nothing.
Where :mod:`hf_paged.engine.compiled_body` compiled the model's decoder body (CPU, plain attention
layers), the packed forward runs it, with the same attention behind a custom op.

Models with recurrent layers (:mod:`hf_paged.kinds.recurrent`) need each sequence in a batch row
of its own, as transformers' mixers treat a row as one sequence: a step then runs the decoding
sequences as one ``[num_decode, 1]`` batch (their states gathered from their slots in the
:class:`~hf_paged.state_pool.StatePool`) and each prefill chunk as a ``[1, chunk]`` forward; the
attention layers read the same blocks as in the packed layout. ``per_sequence`` turns this
layout on for any model (to measure what it costs).
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_paged.attention import (ATTN_IMPLEMENTATION, COMPILED_ATTN_IMPLEMENTATION, DecodePlanner, packed_attention,
                                paged_call)
from hf_paged.channel import clear_active_cache, packed_forward
from hf_paged.engine import compiled_body, cpu_linear, step_threads
from hf_paged.engine.cuda_graphs import DecodeGraphs
from hf_paged.engine.cpu_linear import onednn_linears, prepacked_lm_head, switchable_lm_head
from hf_paged.engine.scheduler_output import PromptLogprobRows, SchedulerOutput
from hf_paged.engine.step_cache import PackedStepCache, host_tensor
from hf_paged.engine.step_threads import SerialSmallSteps
from hf_paged.kernels import cpu_decode
from hf_paged.kinds import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, attention_heads
from hf_paged.layer_groups import LayerGroup, layer_groups
from hf_paged.lora import LoRAManager, StepLoRA
from hf_paged.model_info import cache_kwarg, layer_configs, layer_kinds, takes_logits_to_keep
from hf_paged.state_pool import StatePool
from hf_paged.storage import PagedKVStorage


class ModelRunner:
    """Runs steps of ``model`` on the device pools in ``storage`` (and the CPU ``swap_storage``)."""

    def __init__(self, model: PreTrainedModel, storage: PagedKVStorage, swap_storage: PagedKVStorage,
                 swap_space_blocks: int | list[int] = 0, *, groups: list[LayerGroup] | None = None,
                 states: StatePool | None = None, swap_states: StatePool | None = None,
                 prepack_lm_head: bool | None = None, compile: bool | None = None,
                 serial_small_steps: bool | None = None, lora: LoRAManager | None = None,
                 onednn_layers: bool | None = None, prepack_layers: bool | None = None):
        self.model, self.storage, self.swap_storage = model, storage, swap_storage
        self.states, self.swap_states = states, swap_states
        self.per_sequence = states is not None
        _, self.specs = layer_kinds(model.config.get_text_config(decoder=True))  # derived once: configs are slow
        self.groups = groups if groups is not None else layer_groups(self.specs)  # the KV cache manager's, in order
        # MLA layers return each sequence's whole latent context from update: rows of unequal
        # contexts cannot share a batch, so such models run every sequence alone in this layout
        self._batch_rows = not any(isinstance(spec, MLAAttentionSpec) for spec in self.specs)
        self.swap_space_blocks = (list(swap_space_blocks) if isinstance(swap_space_blocks, (list, tuple))
                                  else [swap_space_blocks] * len(self.groups))  # per group
        self.device = model.device
        self.cache_kwarg = cache_kwarg(model)
        self.takes_logits_to_keep = takes_logits_to_keep(model)
        # the float32 CPU LM head runs through oneDNN (hf_paged.engine.cpu_linear)
        self._onednn_linears = tuple(m for m in (switchable_lm_head(model),) if m is not None)
        self._prepacked = tuple(p for p in (prepacked_lm_head(model, prepack_lm_head),) if p is not None)
        # and the layers' linears, where oneDNN is much faster than sgemm on this CPU (measured)
        onednn, self.onednn_layers_note = cpu_linear.layer_linears(model, onednn_layers)
        # on prepacked copies of their weights where those fit (a second copy: prepack_layers)
        self.layer_packs, self.layer_packs_note = cpu_linear.layer_packs(onednn, prepack_layers)
        # the layer linears the engine's forwards route through cpu_linear: on oneDNN, or else
        # their few-row products in C (the decode steps of a few sequences)
        self.onednn_layers = bool(onednn)
        self.layer_linears = onednn or cpu_linear.few_row_layers(model)
        # small steps on the stepping thread alone (hf_paged.engine.step_threads); None: every step splits
        self.serial_steps = SerialSmallSteps.of(model, serial_small_steps)
        # the CPU reads of float32 steps: "c" (the C reads, hf_paged.kernels.cpu_decode / cpu_prefill,
        # where they build), "gather" (gather + SDPA) / "sdpa" (SDPA per sequence), or "auto" (the C
        # reads on x86 CPUs with AVX2 or AVX-512, where they were measured; else torch's); see PackedStep
        self.decode_read = self.prefill_read = "auto"
        # packed steps through a torch.compile'd decoder body (hf_paged.engine.compiled_body), whose
        # steps of decode rows only read in C from a plan of every layer (attention.DecodePlanner)
        text_config = model.config.get_text_config(decoder=True)
        heads = [attention_heads(layer)[0] if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)) else 0
                 for spec, layer in zip(self.specs, layer_configs(text_config))]
        self.decode_planner = DecodePlanner(self.specs, heads, bool(getattr(text_config, "attn_logit_softcapping", 0)))
        self.compiled, self.compiled_note = compiled_body.compiled_body(
            model, self.specs, packed_attention, compile, recurrent=self.per_sequence,
            also_one_thread=self.serial_steps is not None,
            around=lambda: self._layer_products(traced=True), planner=self.decode_planner)
        # LoRA (hf_paged.lora): steps with adapters run a body of their own, compiled with the
        # linear layers calling the adapters' op (steps without adapters keep the plain one)
        self.lora, self.compiled_lora, self.compiled_lora_note = lora, None, None
        if lora is not None and self.compiled is not None:
            self.compiled_lora, self.compiled_lora_note = compiled_body.compiled_body(
                model, self.specs, packed_attention, compile, also_one_thread=self.serial_steps is not None,
                around=lambda: _entered(self._layer_products(traced=True), lora.layers.active(None, traced=True)),
                planner=self.decode_planner)
        self._build_cpu_reads()
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs (LLMEngine(cuda_graphs=True))
        # the last step's scored prompt rows, one (ids, values, ranks) per SchedulerOutput.prompt_logprobs entry
        self.prompt_logprobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def _build_cpu_reads(self) -> None:
        """Build (or load from the disk cache) the C reads for the attention layers' layouts now,
        where steps will use it (CPU, float32), so the first step does not wait for the compiler.
        A layout the configs do not tell builds on first use."""
        if self.device.type != "cpu" or self.model.dtype != torch.float32:
            return
        layouts = set()
        for spec, layer in zip(self.specs, layer_configs(self.model.config.get_text_config(decoder=True))):
            if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                heads, kv_heads, head_dim = attention_heads(layer)
                layouts.add((kv_heads, heads // kv_heads, head_dim, self.storage.block_size))
        for layout in layouts:
            cpu_decode.ready(*layout)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        """Run the step. Returns float32 logits ``[n, vocab]`` of the sequences with
        ``needs_logits``, in ``step.sequences`` order (None when nothing is computed). The scored
        prompt rows of ``step.prompt_logprobs`` go to :attr:`prompt_logprobs`."""
        self._run_block_moves(step)
        self._run_state_moves(step)
        if not step.sequences:
            return None
        if step.prompt_logprobs:
            self.prompt_logprobs = []
        if self.graphs is not None and not step.prompt_logprobs and self.graphs.applies(step):
            return self.graphs.run(step)
        if not self.per_sequence:
            return self._forward(step, rows=False)
        return torch.cat([self._forward(part, rows) for part, rows in _row_parts(step, self._batch_rows)])

    def _forward(self, step: SchedulerOutput, rows: bool) -> torch.Tensor:
        """One forward: the packed row ``[1, tokens]``, or (``rows``) one decode token per batch row."""
        shape = (-1, 1) if rows else (1, -1)
        positions = host_tensor(step.positions).to(self.device).view(shape)
        step_cache = PackedStepCache(self.specs, self.groups, self.storage, step, positions.view(-1),
                                     decode_read=self.decode_read, prefill_read=self.prefill_read)
        forward = {
            "input_ids": host_tensor(step.input_ids).to(self.device).view(shape),
            "position_ids": positions,
            self.cache_kwarg: step_cache,
            "use_cache": True,
        }
        keep_index = host_tensor(step.logits_indices).to(self.device)
        if rows:  # every row is one decode token that needs its logits
            keep_index = torch.zeros(1, dtype=torch.long, device=self.device)
        elif step.prompt_logprobs:  # and the rows scored for prompt log-probs, after them
            keep_index = torch.cat([keep_index, _prompt_row_indices(step).to(self.device)])
        if self.takes_logits_to_keep:
            forward["logits_to_keep"] = keep_index
        state_layers, slots = None, None
        if self.states is not None:
            slots = torch.tensor(step.states.slots, dtype=torch.long, device=self.device)
            state_layers = self.states.layers_for(slots, has_previous=step.sequences[0].start > 0)
            for layer, held in state_layers.items():
                step_cache.layers[layer] = held
        lora_step = self.lora.step(step, self.device) if self.lora is not None else None
        scored = step.prompt_logprobs and not rows  # the head's sampled rows apart from the scored ones
        with cpu_linear.sampled_head_rows(len(step.logits_indices)) if scored else contextlib.nullcontext():
            logits = self.run_model(forward, step_cache, compiled=self.compiled is not None and not rows,
                                    num_tokens=step.num_scheduled_tokens, lora_step=lora_step)
        if state_layers is not None:
            self.states.store(state_layers, slots)
        if step.prompt_logprobs:
            return self._score_prompt_rows(logits, step, rows, keep_index).float()
        return self._kept(logits, step, rows, keep_index).float()

    def run_model(self, forward: dict, step_cache: PackedStepCache, compiled: bool, num_tokens: int,
                  lora_step: StepLoRA | None = None) -> torch.Tensor:
        """``model(**forward).logits`` with the paged attention reading and writing ``step_cache``'s
        blocks (through the compiled body when ``compiled``), and ``lora_step``'s adapters applied."""
        body = self.compiled if lora_step is None else self.compiled_lora
        compiled = compiled and body is not None
        implementation = COMPILED_ATTN_IMPLEMENTATION if compiled else ATTN_IMPLEMENTATION
        serial = self.serial_steps is not None and self.serial_steps.applies(num_tokens)
        with (packed_forward(), paged_call(self.model, implementation),
              body.active(step_cache) if compiled else contextlib.nullcontext(),
              onednn_linears(self._onednn_linears, self._prepacked, self.serial_steps.head_threads if serial else None),
              # eager steps only (a compiled body holds the op); before LoRA's forwards, which wrap these
              self._layer_products() if self.layer_linears and not compiled else contextlib.nullcontext(),
              cpu_linear.packed_layers(self.layer_packs) if self.layer_packs else contextlib.nullcontext(),
              self.lora.layers.active(lora_step, traced=compiled) if lora_step else contextlib.nullcontext(),
              step_threads.one_thread() if serial else contextlib.nullcontext()):
            logits = self.model(**forward).logits
        clear_active_cache()
        step_cache.check_no_pending()
        return logits

    def _layer_products(self, traced: bool = False) -> contextlib.AbstractContextManager:
        """The layer linears routed through :mod:`cpu_linear` inside (``traced``: as its ops, for a compiled body)."""
        return cpu_linear.layer_products(self.layer_linears, traced, self.onednn_layers)

    def packed_logits(self, logits: torch.Tensor, keep_index: torch.Tensor) -> torch.Tensor:
        """The rows ``keep_index`` of a packed forward's logits (already kept where the model took
        ``logits_to_keep``)."""
        return logits[0] if self.takes_logits_to_keep else logits[0].index_select(0, keep_index)

    def _score_prompt_rows(self, logits: torch.Tensor, step: SchedulerOutput, rows: bool,
                           keep_index: torch.Tensor) -> torch.Tensor:
        """Score the step's prompt rows (into :attr:`prompt_logprobs`) and return what ``_kept``
        would: the sampled rows alone (a copy, so the prompt rows' logits are freed with the
        forward's). ``keep_index`` holds the sampled rows first, then the prompt rows."""
        if rows:  # one token per batch row: each row's last column is its token's
            index = torch.tensor([r.index for r in step.prompt_logprobs], device=logits.device)
            self.prompt_logprobs += score_prompt_rows(logits[:, -1].index_select(0, index), step.prompt_logprobs)
            return self._kept(logits, step, rows, keep_index)
        num_sampled = len(step.logits_indices)
        kept = self.packed_logits(logits, keep_index)
        self.prompt_logprobs += score_prompt_rows(kept[num_sampled:], step.prompt_logprobs)
        return kept[:num_sampled].clone()

    def _kept(self, logits: torch.Tensor, step: SchedulerOutput, rows: bool, keep_index: torch.Tensor) -> torch.Tensor:
        """The logits of the sequences with ``needs_logits``, one row each."""
        if not rows:
            return self.packed_logits(logits, keep_index)
        logits = logits[:, -1]
        if len(step.logits_indices) < len(step.sequences):  # a 1-token chunk of a recompute needs none
            keep = [i for i, s in enumerate(step.sequences) if s.needs_logits]
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))
        return logits

    def _run_state_moves(self, step: SchedulerOutput) -> None:
        """Fork copies (one simultaneous copy), then swaps out, then swaps in."""
        moves = step.states
        if self.states is None:
            return
        self.states.copy_slots(moves.copies)
        if moves.swap_out:
            self.states.transfer(self.swap_states, moves.swap_out)
        if moves.swap_in:
            self.swap_states.transfer(self.states, moves.swap_in)

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


@contextlib.contextmanager
def _entered(*contexts: contextlib.AbstractContextManager):
    """The ``contexts`` entered in order (left in reverse)."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _prompt_row_indices(step: SchedulerOutput) -> torch.Tensor:
    """Where the step's prompt rows are in its packed row, in ``step.prompt_logprobs`` order."""
    starts = list(itertools.accumulate((s.num_tokens for s in step.sequences), initial=0))
    index = []
    for rows in step.prompt_logprobs:
        lo = starts[rows.index] + rows.first - step.sequences[rows.index].start
        index += range(lo, lo + len(rows.targets))
    return torch.tensor(index, dtype=torch.long)


def score_prompt_rows(logits: torch.Tensor, rows: tuple[PromptLogprobRows, ...]
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """vLLM's prompt log-probs from ``logits`` (one row per scored position, ``rows``' in order),
    on the raw model distribution (float32 log-softmax) as the sampled tokens' log-probs are.
    Per entry of ``rows``: int32 token ids and float32 log-probs, ``num_logprobs + 1`` per position
    (the prompt token, then the most likely tokens), and int32 ranks of the prompt tokens (1-based:
    the tokens at least as likely, as vLLM counts them), for :meth:`PromptLogprobs.add_rows`."""
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor([t for r in rows for t in r.targets], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= chosen).sum(-1, dtype=torch.int32)
    top = torch.topk(logprobs, max(r.num_logprobs for r in rows))
    ids = torch.cat([targets[:, None], top.indices], 1).to(torch.int32).cpu().numpy()
    values, ranks = torch.cat([chosen, top.values], 1).cpu().numpy(), ranks.cpu().numpy()
    scored, lo = [], 0
    for r in rows:
        hi, width = lo + len(r.targets), r.num_logprobs + 1
        scored.append((ids[lo:hi, :width].ravel(), values[lo:hi, :width].ravel(), ranks[lo:hi]))
        lo = hi
    return scored


def _row_parts(step: SchedulerOutput, batch_rows: bool = True) -> list[tuple[SchedulerOutput, bool]]:
    """A step as forwards that give each sequence a batch row of its own: the decoding sequences
    (one token each, after a first one) together as rows (unless not ``batch_rows``), then each
    other sequence alone."""
    continuing = next((i for i, s in enumerate(step.sequences) if s.num_tokens != 1 or s.start == 0 or not batch_rows),
                      len(step.sequences))
    parts = [(step.part(0, continuing), True)] if continuing else []
    return parts + [(step.part(i, i + 1), False) for i in range(continuing, len(step.sequences))]
