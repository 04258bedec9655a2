"""Speculative decoding by n-gram lookup (vLLM's ``speculative_config={"method": "ngram", ...}``).

A decoding sequence whose last tokens occurred earlier in its prompt or output proposes the
tokens that followed them there (its *draft*), and the step computes its last token and the draft
together, as a short chunk, with logits at every position. The output processor then takes the
sequence's tokens one position at a time exactly as it takes a plain decode step's (the same
sampler, penalties, masks, stop checks and seeded draws): while the token it chooses equals the
draft's, the next position's logits were computed from the right context and it goes on; at the
first difference it keeps the token it chose and stops. So every token is the one decoding
without a draft would choose (a seeded request draws the same numbers in the same order), and a
step yields up to ``num_speculative_tokens + 1`` tokens per sequence for the price of one forward
over a few more positions. The scheduler then rolls the sequence's blocks back to the K/V of the
tokens that stood (:meth:`hf_paged.engine.kv_cache_manager.KVCacheManager.truncate`).

This pays where outputs repeat their context (quoting, editing, extraction, code, and models
that loop), on a CPU or a GPU alike; a draft that never matches costs its extra positions.
Models with recurrent layers are refused: their state cannot be rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_paged.engine.params import SamplingParams
from hf_paged.engine.sequence import Request, Sequence

METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for the n-gram method: propose up to ``num_speculative_tokens``
    tokens after the longest suffix of ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens that
    occurred before (vLLM's defaults: both 5 when neither is given, else the one given).
    ``disable_by_batch_size`` (vLLM V0's): no drafts in a step while more sequences than this run
    (a large batch on a CPU is bound by arithmetic, and each draft token costs a token's)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    disable_by_batch_size: int | None = None

    @classmethod
    def of(cls, config: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A checked config from vLLM's dict form (or None for none); a bad one is a ValueError
        naming the key."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (vLLM's form) or None, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unsupported keys {unknown} (supported: {list(_KEYS)}; "
                             "draft models and EAGLE are not supported here, only method='ngram')")
        method = config.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported here (supported: 'ngram')")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lookup_max, lookup_min = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = 5
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        checked = [("num_speculative_tokens", config["num_speculative_tokens"]), ("prompt_lookup_max", lookup_max),
                   ("prompt_lookup_min", lookup_min)]
        if config.get("disable_by_batch_size") is not None:
            checked.append(("disable_by_batch_size", config["disable_by_batch_size"]))
        for name, value in checked:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={lookup_min} must be <= "
                             f"prompt_lookup_max={lookup_max}")
        return cls(config["num_speculative_tokens"], lookup_max, lookup_min, method,
                   config.get("disable_by_batch_size"))


class _NgramIndex:
    """Where each n-gram of a sequence's tokens last started, for the n-grams followed by at least
    one token (``ends``: those ending before it are indexed). Kept on the sequence, extended as it
    grows; rebuilt if its tokens were cut back (a failed step's undo)."""

    __slots__ = ("by_size", "ends")

    def __init__(self, sizes: range):
        self.by_size: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.ends = 0

    def extend(self, tokens: list[int]) -> None:
        for end in range(self.ends + 1, len(tokens)):
            for n, starts in self.by_size.items():
                if end >= n:
                    starts[tuple(tokens[end - n : end])] = end - n
        self.ends = max(self.ends, len(tokens) - 1)


class NgramProposer:
    """Drafts for decoding sequences (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_positions: int | None):
        self.config, self.max_positions = config, max_positions
        self._sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)

    def drafts_now(self, num_running_seqs: int) -> bool:
        """Whether a step of this many running sequences computes drafts."""
        cap = self.config.disable_by_batch_size
        return cap is None or num_running_seqs <= cap

    def limit(self, request: Request, seq: Sequence) -> int:
        """The most draft tokens worth computing: the tokens the sequence may still take (its
        ``max_tokens``, the model's positions), one of them the step's own."""
        params: SamplingParams = request.params
        room = params.max_new_tokens - seq.num_output_tokens - 1
        if self.max_positions:
            room = min(room, self.max_positions - seq.num_tokens - 1)
        return min(self.config.num_speculative_tokens, room)

    def propose(self, request: Request, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The draft after ``seq``'s tokens (empty: none), at most ``budget`` tokens."""
        limit = min(budget, self.limit(request, seq))
        if limit < 1:
            return ()
        tokens = seq.token_ids
        index = seq.ngrams
        if index is None or index.ends >= len(tokens):
            index = seq.ngrams = _NgramIndex(self._sizes)
        index.extend(tokens)
        for n in reversed(self._sizes):
            if n < len(tokens):
                start = index.by_size[n].get(tuple(tokens[-n:]))
                if start is not None:  # the text goes on as it did ``distance`` tokens before
                    distance = len(tokens) - n - start
                    draft = tokens[start + n : start + n + limit]
                    while len(draft) < limit:  # a repeat shorter than the draft: it repeats again
                        draft.append(draft[len(draft) - distance])
                    return tuple(draft)
        return ()
