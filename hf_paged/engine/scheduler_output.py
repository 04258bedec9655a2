"""``SchedulerOutput``: one step's decision, typed and immutable (vLLM V1's ``SchedulerOutput``).

The scheduler writes it; the model runner executes it against storage and the model; nothing
else is needed to run a step. It holds plain Python data only, so a tensor-parallel rank 0 can
broadcast it and every rank execute the same step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: tokens ``start .. start + num_tokens - 1`` are computed.

    A ``draft`` (speculative decoding, :mod:`hf_paged.engine.speculative`) is the last of those
    tokens: proposed, not known; the sequence then needs logits at its last known token and at
    every draft token (``1 + len(draft)`` rows, in order)."""

    request_id: str
    seq_id: int
    start: int  # tokens already cached before this step
    num_tokens: int
    needs_logits: bool  # the step reaches the sequence's last known token: a next token is due
    draft: tuple[int, ...] = ()
    lora_int_id: int = 0  # the LoRA adapter its tokens run with (0: the base model)

    @property
    def num_logits(self) -> int:
        """Logits rows the sequence needs from the step."""
        return len(self.draft) + 1 if self.needs_logits else 0


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows of a prefill chunk whose logits a request with ``prompt_logprobs`` needs (vLLM's prompt
    log-probs): the sequence ``index`` (in ``SchedulerOutput.sequences``) at positions ``first ..
    first + len(targets) - 1``, position ``p`` scoring the prompt token ``p + 1`` (``targets``), with
    the ``num_logprobs`` most likely tokens. The runner keeps these rows' logits only as long as it
    takes to score them."""

    index: int
    first: int
    targets: tuple[int, ...]
    num_logprobs: int


@dataclass(frozen=True)
class GroupBlocks:
    """One layer group's share of a step (block ids mean something only in their group's pools).

    ``block_tables`` are unpadded, one per scheduled sequence (-1 where a sliding group gave a
    block back: never read). Storage first grows to ``num_blocks``, then runs ``swap_out``
    (device block → CPU block), ``swap_in`` (CPU block → device block) and ``block_copies``
    (copy-on-write, src → dst) in that order, before the forward writes the new tokens at
    ``slot_mapping``.
    """

    slot_mapping: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    num_blocks: int = 0
    block_copies: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StateMoves:
    """Recurrent-state slots of a step (models with recurrent layers, :mod:`hf_paged.state_slots`).

    ``slots`` holds each scheduled sequence's device slot (in ``sequences`` order). Before the
    forward, storage runs ``copies`` (forks settled by the last step: one simultaneous copy),
    then ``swap_out`` (device slot → CPU slot) and ``swap_in`` (CPU slot → device slot).
    """

    slots: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step runs, in forward order.

    ``sequences`` and the per-token fields follow the order of the packed forward: decoding
    sequences (one token each, longest context first), then those with a draft, then prefill
    chunks. ``groups`` holds each layer group's slots, tables and block moves (see
    :class:`GroupBlocks`), in the order of the KV cache manager's groups; the properties below read
    the first group's.
    """

    sequences: tuple[ScheduledSequence, ...] = ()
    input_ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    groups: tuple[GroupBlocks, ...] = (GroupBlocks(),)
    rejected: tuple[tuple[str, str], ...] = ()  # (request_id, why): requests that can never fit
    states: StateMoves = StateMoves()  # models with recurrent layers (empty otherwise)
    prompt_logprobs: tuple[PromptLogprobRows, ...] = ()  # rows scored for prompt log-probs (usually none)

    def part(self, lo: int, hi: int) -> SchedulerOutput:
        """The forward of sequences ``lo .. hi - 1`` alone (no block or state moves: those run once,
        before the step's first forward). A model with recurrent layers runs a step as several
        such forwards, each sequence in its own batch row (:mod:`hf_paged.engine.model_runner`)."""
        counts = [s.num_tokens for s in self.sequences]
        t0, t1 = sum(counts[:lo]), sum(counts[:hi])
        groups = tuple(GroupBlocks(slot_mapping=g.slot_mapping[t0:t1], block_tables=g.block_tables[lo:hi],
                                   num_blocks=g.num_blocks) for g in self.groups)
        states = StateMoves(slots=self.states.slots[lo:hi])
        rows = tuple(dataclasses.replace(r, index=r.index - lo) for r in self.prompt_logprobs if lo <= r.index < hi)
        return SchedulerOutput(sequences=self.sequences[lo:hi], input_ids=self.input_ids[t0:t1],
                               positions=self.positions[t0:t1], groups=groups, states=states, prompt_logprobs=rows)

    @property
    def slot_mapping(self) -> tuple[int, ...]:
        return self.groups[0].slot_mapping

    @property
    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        return self.groups[0].block_tables

    @property
    def num_blocks(self) -> int:
        return self.groups[0].num_blocks

    @property
    def block_copies(self) -> tuple[tuple[int, int], ...]:
        return self.groups[0].block_copies

    @property
    def swap_out(self) -> tuple[tuple[int, int], ...]:
        return self.groups[0].swap_out

    @property
    def swap_in(self) -> tuple[tuple[int, int], ...]:
        return self.groups[0].swap_in

    @functools.cached_property
    def num_decode(self) -> int:
        """Leading sequences that compute one token each (the decode kernel's share)."""
        return next((i for i, s in enumerate(self.sequences) if s.num_tokens != 1), len(self.sequences))

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.input_ids)

    @functools.cached_property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens each sequence has cached once this step's are written."""
        return tuple(s.start + s.num_tokens for s in self.sequences)

    @functools.cached_property
    def logits_indices(self) -> tuple[int, ...]:
        """Positions in the packed row whose logits are needed (one per ``needs_logits`` sequence,
        and one per draft token: :attr:`ScheduledSequence.num_logits` each, in order)."""
        indices, end = [], 0
        for s in self.sequences:
            end += s.num_tokens
            if s.needs_logits:
                if s.draft:
                    indices += range(end - 1 - len(s.draft), end - 1)
                indices.append(end - 1)
        return tuple(indices)

    @functools.cached_property
    def has_lora(self) -> bool:
        return any(s.lora_int_id for s in self.sequences)

    @functools.cached_property
    def has_drafts(self) -> bool:
        return any(s.draft for s in self.sequences)

    @functools.cached_property
    def num_drafted(self) -> int:
        """Sequences with a draft right after the decoding ones (the scheduler puts them there)."""
        rest = self.sequences[self.num_decode :]
        return next((i for i, s in enumerate(rest) if not s.draft), len(rest))
