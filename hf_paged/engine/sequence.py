"""Sequences and requests (sequence groups): the engine's bookkeeping, no torch."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from hf_paged.engine.outputs import PromptLogprobs
from hf_paged.engine.params import SamplingParams

_seq_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One token stream with its own block table (keyed by ``seq_id`` in the block manager)."""

    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # output index within its request
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    text: str | None = None  # None: not decoded yet ("" is a decoded text, e.g. one cut at a stop string)
    generator: Any = None  # a seeded sample's own torch.Generator after the first token (output_processor)
    stop_floor: int = 0  # text written before min_new_tokens: a stop string must end past it
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that finished it
    ngrams: Any = None  # speculative decoding's index of its n-grams (hf_paged.engine.speculative)
    lora_int_id: int = 0  # the LoRA adapter its tokens run with (0: the base model)
    # where its prefix-cache keys chain from: an adapter's K/V differ from the base model's (and
    # from another load of the same id); None for the base model
    cache_root: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens that are already known (prompt, or recompute after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def fork(self, index: int) -> Sequence:
        return Sequence(
            token_ids=list(self.token_ids), num_prompt_tokens=self.num_prompt_tokens, index=index,
            num_computed_tokens=self.num_computed_tokens, cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs), text=self.text,
            stop_floor=self.stop_floor, lora_int_id=self.lora_int_id, cache_root=self.cache_root,
        )


@dataclass
class Request:
    """A sequence group: the prompt, its parameters, and the sequences sampled from it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # the "priority" scheduling policy's order: lower first (vLLM's)
    status: Status = Status.WAITING
    seqs: list[Sequence] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    generator: Any = None  # torch.Generator when seeded
    sample_generators: list | None = None  # seeded n > 1: sample i's generator (the first is ``generator``)
    beam: Any = None  # BeamSearchState for beam search
    forked: bool = False  # n > 1 / beams: the single prefill sequence has been split
    beam_rows: dict[int, Any] = field(default_factory=dict)  # log-probs of beams waiting for siblings
    first_token_time: float | None = None
    error: str | None = None
    error_kind: str | None = None  # "rejected" or "fault" (see RequestOutput.error_kind)
    structured: Any = None  # a constrained request's StructuredRequest (hf_paged.engine.structured)
    # params.prompt_logprobs: the prompt's log-probs, filled as its prefill chunks run (request level:
    # n samples share them; scored once, a recompute after preemption does not score them again)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # vLLM's: prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int = 0  # vLLM's: times preempted (swapped out or dropped for recompute)
    text_context: Any = None  # the PromptContext its texts are decoded after (found on first use)
    # after a recompute of several live sequences: the tokens they have in common (their last token
    # left out). The first computes them alone, then the others fork from it, sharing those blocks
    # again as they did before the preemption (computed apart they could need more blocks than exist)
    rejoin_at: int | None = None
    lora_request: Any = None  # its LoRA adapter (hf_paged.lora.LoRARequest), None: the base model

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_token_ids), len(self.prompt_token_ids),
                                  lora_int_id=self.lora_int_id)]
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(len(self.prompt_token_ids), self.params.prompt_logprobs)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's: a request that asked for prompt log-probs computes every prompt token (they need
        each position's logits), so it takes no prefix-cache hits (its blocks still fill the cache)."""
        return self.params.prompt_logprobs is not None

    def fail(self, reason: str, kind: str) -> None:
        """Mark the request failed (its blocks are freed by whoever finishes it)."""
        self.error, self.error_kind = reason, kind
        for seq in self.live_seqs:
            seq.finish_reason = "error"

    def sequence(self, seq_id: int) -> Sequence:
        """The running sequence with this id."""
        for seq in self.seqs:
            if seq.seq_id == seq_id:
                return seq
        raise KeyError(f"request {self.request_id} has no running sequence {seq_id}")

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
