"""``SamplingParams``: what to generate for one request (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request generation parameters.

    ``temperature=0`` means greedy decoding (as in vLLM). ``n`` samples are drawn from one shared
    prefill; with ``num_beams > 1`` the request runs beam search and returns its ``n`` best beams.
    ``seed`` makes a request's sampling reproducible whatever else is in the batch. Invalid values
    raise ``ValueError`` naming the field.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # ... and this times the number of times it was generated
    n: int = 1
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an int >= 1")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", "must be an int between 0 and max_new_tokens")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an int >= 0 (or -1 for no limit)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not isinstance(getattr(self, name), (int, float)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if not is_int(self.num_beams) or self.num_beams < 1:
            raise bad("num_beams", "must be an int >= 1")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise bad("n", f"must not exceed num_beams={self.num_beams} in beam search")
        if not isinstance(self.length_penalty, (int, float)):
            raise bad("length_penalty", "must be a number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", "must be True, False or 'never'")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an int or None")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an int >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (a plain argmax is not enough)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def beam_search(self) -> bool:
        return self.num_beams > 1
