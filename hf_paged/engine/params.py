"""``SamplingParams``: what to generate for one request (vLLM's names and meanings), validated once.

Every range below keeps a step numerically safe on float32 logits of realistic size (the model
runner hands the sampler float32; realistic logits are far below 1e30 in magnitude): a request
that passes these checks cannot make the sampler or the beam arithmetic overflow into inf or
NaN. The checks the engine's own limits add (``n``/``num_beams`` against ``max_num_seqs``,
``logprobs`` against the vocabulary) are in :mod:`hf_paged.engine.intake`.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import InitVar, dataclass, field, fields
from enum import Enum
from collections.abc import Callable
from typing import Any, ClassVar

from hf_paged.constraints.params import StructuredOutputsParams

logger = logging.getLogger("hf_paged")

# temperature: 0 is greedy; a positive value below TEMPERATURE_MIN is raised to it (as vLLM does),
# so that logits / temperature stays finite (|logit| < 3.4e36) and the softmax keeps some mass.
TEMPERATURE_MIN = 0.01
# Above this every realistic distribution is uniform already; the bound keeps temperature a
# finite float32 (a float32 inf would turn the -inf of masked tokens into NaN).
TEMPERATURE_MAX = 1e6
# repetition_penalty multiplies or divides logits: within this range they change by at most 100x.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's range)
# length_penalty: len ** length_penalty (len <= max_new_tokens) must stay in [1e-30, 1e30], so
# that beam scores divided by it stay finite in float32: |length_penalty| * ln(max_new_tokens)
# <= ln(LENGTH_SCALE_MAX).
LENGTH_SCALE_MAX = 1e30
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [-(2**63), 2**64)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: the server's bound (and from_optional's clamp), as vLLM's
# SamplingParams' own bound on a bias: any value a script uses (vLLM's offline API takes any, e.g. -1e4 to ban
# a token) and still finite in float32 once penalties and temperature scale the logits by up to 1e4
LOGIT_BIAS_MAX = 1e30
# max_tokens' default: not passed (16 new tokens), unlike an explicit None (as many as fit, vLLM's meaning)
_UNSET = object()


class RequestOutputKind(Enum):
    """vLLM's ``SamplingParams.output_kind``: what ``LLMEngine.step()`` hands out of a request.
    ``CUMULATIVE``: every step it changed, all of it so far; ``DELTA``: only what is new (token ids,
    text, log-probs; prompt log-probs once); ``FINAL_ONLY``: the finished output alone. As vLLM's
    ``LLM.generate``, ``generate()`` returns final outputs whatever it says; ``stream()`` gives
    deltas."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (not a bool, NaN or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def max_length_penalty(max_new_tokens: int) -> float:
    """The largest ``|length_penalty|`` for which ``max_new_tokens ** length_penalty`` stays within
    ``[1 / LENGTH_SCALE_MAX, LENGTH_SCALE_MAX]`` (``inf`` for a single token)."""
    log_len = math.log(max_new_tokens)
    return math.log(LENGTH_SCALE_MAX) / log_len if log_len else math.inf


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request generation parameters.

    ``temperature=0`` means greedy decoding (as in vLLM). ``n`` samples are drawn from one shared
    prefill; with ``num_beams > 1`` the request runs beam search and returns its ``n`` best beams.
    ``seed`` makes a request's sampling reproducible whatever else is in the batch. Keyword
    arguments only: vLLM's first positional parameter is ``n``, this class's was ``max_new_tokens``.

    Invalid values raise ``ValueError("SamplingParams.<field> <rule>, got <value>")``. The rules:

    * ``max_new_tokens``: int >= 1, or None (vLLM's ``max_tokens=None``): as many as fit in the
      model's positions after the prompt; ``min_new_tokens``: int in ``[0, max_new_tokens]``;
    * ``temperature``: 0 (greedy) or a number in ``(0, 1e6]``; a value in ``(0, 0.01)`` is raised
      to 0.01 with a logged warning (vLLM does the same): dividing logits by less would overflow
      them or leave a one-hot distribution that float32 cannot represent;
    * ``top_p``: in ``(0, 1]``; ``top_k``: int >= 0, or -1 (0 and -1: no top-k; a value above the
      vocabulary keeps every token); ``min_p``: in ``[0, 1]``;
    * ``repetition_penalty``: in ``[0.01, 100]``; ``presence_penalty``, ``frequency_penalty``: in
      ``[-2, 2]``;
    * ``n``, ``num_beams``: ints >= 1, ``n <= num_beams`` in beam search (the engine also bounds
      both by its ``max_num_seqs``); ``n`` is 1 with greedy decoding (``temperature=0``, no beams),
      whose ``n`` outputs would all be the same (vLLM and transformers refuse it too);
    * ``length_penalty`` (beam search): a finite number; with ``num_beams > 1`` also
      ``|length_penalty| * ln(max_new_tokens) <= ln(1e30)`` (scores are divided by
      ``length ** length_penalty``, which must stay finite in float32);
    * ``early_stopping``: True, False or ``"never"``; ``ignore_eos``: a bool;
    * ``seed``: None or an int in ``[-(2**63), 2**64)`` (what ``torch.Generator`` takes); -1 is
      None (unseeded), as in vLLM;
    * ``stop_token_ids``: a list of ints >= 0 (they end beams as EOS does); ``stop``: a string or a
      list of non-empty strings;
    * beam search (``num_beams > 1``) reads no ``top_p``, ``top_k``, ``min_p``,
      ``presence_penalty``, ``frequency_penalty`` or ``stop``: setting one is refused;
    * ``logprobs``: None or an int >= 0 (the engine also bounds it by the vocabulary size); -1 is
      the whole vocabulary (vLLM's), as is -1 for ``prompt_logprobs``;
    * ``structured_outputs``: None or a :class:`~hf_paged.constraints.StructuredOutputsParams`
      (one constraint; it checks itself). Not with beam search, ``min_new_tokens`` or
      ``ignore_eos``: the constraint decides where the output may end (EOS is allowed exactly
      when the constraint can end), which those would override. Stop strings still cut the text
      (the result is then a prefix of a valid output, like a ``"length"`` one);
    * ``logit_bias``: None or ``{token id: bias}`` with ids >= 0 and finite biases in ``[-1e30, 1e30]``
      (any a script uses, as vLLM's offline API: ``-1e4`` bans a token; the server keeps OpenAI's
      ``[-100, 100]``), added to the logits before penalties and sampling; the engine bounds ids by
      the vocabulary. Not with beam search;
    * ``allowed_token_ids``: None or a non-empty list of token ids >= 0 (every other token is
      masked; the engine bounds ids by the vocabulary); ``bad_words``: None or a list of non-empty
      strings, tokenized by the engine's tokenizer (alone and after a space, as vLLM does); a
      word's last token is masked wherever the tokens before it were just generated. Neither with
      beam search (like ``logit_bias``); log-probs are reported before either;
    * ``prompt_logprobs``: None or an int >= 0: each prompt token's log-prob (the first token's
      is None) with that many most likely tokens, in ``RequestOutput.prompt_logprobs``. A request
      that asks for them does not read the prefix cache (as in vLLM): every prompt token's logits
      are computed;
    * ``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``:
      bools (the text of outputs; token ids are the same either way);
    * ``output_kind``: a :class:`RequestOutputKind` (what ``step()`` hands out: every step's whole
      output, deltas, or the final one); ``DELTA`` not with beam search (beams change until the
      search ends); ``stream_interval``: None or an int >= 1: ``step()`` outputs (and ``stream()``
      deltas) come once that many new tokens are in, besides the first and the last (vLLM's);
    * vLLM's fields for what this engine does its own way (``skip_clone``, ``flat_logprobs``,
      ...): only the values :data:`VLLM_DEFAULT_ONLY` lists;
    * ``detokenize``: a bool (vLLM's). False: nothing is decoded for the request: every output's
      ``text`` is ``""`` (streamed deltas too) and every ``Logprob.decoded_token`` None, prompt
      log-probs' included; token ids and log-prob values are the same. Not with ``stop``: stop
      strings are matched on the text (vLLM refuses them too).

    Every float must be a finite number (bools, NaN and inf are refused). A message names the
    length fields as the caller wrote them: ``max_tokens`` / ``min_tokens`` (vLLM's names) or
    ``max_new_tokens`` / ``min_new_tokens``. Writing ``max_tokens`` or ``min_tokens`` on an object
    checks the new value as the constructor would (a refused one leaves the object as it was).
    """

    max_new_tokens: int | None = 16  # None: up to the model's positions (resolved per request by the engine)
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
    min_new_tokens: int = 0  # vLLM's min_tokens: until then no EOS, stop token or stop string ends it
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be generated (vLLM's)
    bad_words: list[str] | None = None  # never completed: a word's last token is masked when the rest precedes it
    prompt_logprobs: int | None = None  # log-probs of each prompt token (and this many top ones) under the model
    include_stop_str_in_output: bool = False  # text keeps the stop string that ended it
    skip_special_tokens: bool = True  # text leaves special tokens out
    spaces_between_special_tokens: bool = True  # ... and, when they are in, spaces them from the rest
    detokenize: bool = True  # False: no text at all (outputs' text "", Logprob.decoded_token None)
    output_kind: RequestOutputKind = field(default=RequestOutputKind.CUMULATIVE, repr=False)  # step()'s outputs
    stream_interval: int | None = field(default=None, repr=False)  # new tokens per step() output / stream() delta
    # vLLM's fields for what this engine does its own way: taken at the values that ask for what it does
    # anyway (VLLM_DEFAULT_ONLY: which values, and what to do for another); skip_clone is honoured by clone()
    skip_clone: bool = field(default=False, repr=False)
    skip_reading_prefix_cache: bool | None = field(default=None, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    logprob_token_ids: list[int] | None = field(default=None, repr=False)
    prompt_logprob_token_ids: Any = field(default=None, repr=False)
    prompt_logprob_start: int | None = field(default=None, repr=False)
    extra_args: dict[str, Any] | None = field(default=None, repr=False)
    thinking_token_budget: int | None = field(default=None, repr=False)
    repetition_detection: Any = field(default=None, repr=False)
    watermarking: bool | None = field(default=None, repr=False)
    routed_experts_prompt_start: int = field(default=0, repr=False)
    trace_decode_token_ids: list[int] | None = field(default=None, repr=False)
    output_text_buffer_length: int = field(default=0, repr=False)
    # vLLM's spellings, accepted as they are what its users write (not kept: max_new_tokens / min_new_tokens)
    max_tokens: InitVar[int | None] = _UNSET  # None here is vLLM's "as many as fit", not "unset"
    min_tokens: InitVar[int | None] = None
    # dataclasses.replace passes every init field as the object has it, both names of a length field
    # included; this one (read: the object's (max_new_tokens, min_new_tokens)) tells which name changed
    _replaced_lengths: InitVar[tuple[int | None, int] | None] = None
    # the length fields' names as the caller wrote them, where it did (set by __init__ and the setters)
    _spelling: ClassVar[dict[str, str]] = {}

    def __post_init__(self, max_tokens: int | None = _UNSET, min_tokens: int | None = None,
                      _replaced_lengths: tuple[int | None, int] | None = None) -> None:
        old = _replaced_lengths or (_UNSET, _UNSET)  # a replace()'s source values: the name still at its
        for alias, name, value, unset, before in (  # old value is the one the caller did not change
                ("max_tokens", "max_new_tokens", max_tokens, _UNSET, old[0]),
                ("min_tokens", "min_new_tokens", min_tokens, None, old[1])):
            if value is unset or value == before:
                continue
            if getattr(self, name) not in (value, before if _replaced_lengths else _DEFAULTS[name]):
                raise ValueError(f"SamplingParams: {alias} (vLLM's name) and {name} say different things "
                                 f"({value!r}, {getattr(self, name)!r}): pass one")
            setattr(self, name, value)
        self._check_lengths()
        self._check_sampling()
        self._check_penalties()
        self._check_width()
        self._check_stops()
        self._check_beam_search()
        self._check_constraints()
        self._check_outputs()
        self._check_vllm_defaults()

    def _shown(self, name: str) -> str:
        """``name`` as messages write it: a length field as the caller spelled it; one it did not
        write follows the other (``min_tokens`` alone: ``max_tokens`` too), else hf_paged's name."""
        if name not in VLLM_NAMES:
            return name
        spelled = self._spelling
        if name in spelled:
            return spelled[name]
        other = next(n for n in VLLM_NAMES if n != name)
        return VLLM_NAMES[name] if spelled.get(other) == VLLM_NAMES[other] else name

    def _bad(self, name: str, rule: str) -> ValueError:
        return ValueError(f"SamplingParams.{self._shown(name)} {rule}, got {getattr(self, name)!r}")

    def _check_real(self, name: str, low: float, high: float, rule: str) -> None:
        value = getattr(self, name)
        if not _is_real(value) or not low <= value <= high:
            raise self._bad(name, rule)

    def _check_lengths(self) -> None:
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise self._bad("max_new_tokens", "must be an int >= 1 or None (as many as fit)")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= (self.max_new_tokens or math.inf):
            raise self._bad("min_new_tokens", f"must be an int between 0 and {self._shown('max_new_tokens')}")

    def _check_sampling(self) -> None:
        t = self.temperature
        if not _is_real(t) or not (t == 0 or 0 < t <= TEMPERATURE_MAX):
            raise self._bad("temperature", f"must be 0 (greedy) or a number in (0, {TEMPERATURE_MAX:g}]")
        if 0 < t < TEMPERATURE_MIN:
            logger.warning("SamplingParams.temperature %r is below %g: raised to %g (use 0 for greedy decoding)",
                           t, TEMPERATURE_MIN, TEMPERATURE_MIN)
            self.temperature = TEMPERATURE_MIN
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise self._bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise self._bad("top_k", "must be an int >= 0 (or -1 for no limit)")
        self._check_real("min_p", 0, 1, "must be a number in [0, 1]")
        if _is_int(self.seed) and self.seed == -1:  # vLLM's "unseeded"
            self.seed = None
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise self._bad("seed", "must be None or an int in [-(2**63), 2**64)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise self._bad(name, "must be None, an int >= 0, or -1 (the whole vocabulary)")

    def _check_penalties(self) -> None:
        low, high = REPETITION_PENALTY_RANGE
        self._check_real("repetition_penalty", low, high, f"must be a number in [{low:g}, {high:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            self._check_real(name, *PENALTY_RANGE, f"must be a number in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}]")

    def _check_width(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise self._bad("n", "must be an int >= 1")
        if not _is_int(self.num_beams) or self.num_beams < 1:
            raise self._bad("num_beams", "must be an int >= 1")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise self._bad("n", f"must not exceed num_beams={self.num_beams} in beam search")
        if self.greedy and self.n > 1 and not self.beam_search:
            raise self._bad("n", "must be 1 with greedy decoding (temperature=0): its n outputs would be the same; "
                                 "sample (temperature > 0) or run beam search (num_beams >= n)")
        if not _is_real(self.length_penalty):
            raise self._bad("length_penalty", "must be a finite number")
        # max_new_tokens=None: checked once the engine resolves it for a prompt
        bound = max_length_penalty(self.max_new_tokens) if self.max_new_tokens else math.inf
        if self.num_beams > 1 and abs(self.length_penalty) > bound:
            max_name = self._shown("max_new_tokens")
            raise self._bad("length_penalty", f"must be in [-{bound:.4g}, {bound:.4g}] for {max_name}="
                                              f"{self.max_new_tokens} ({max_name} ** length_penalty must stay "
                                              f"within [1e-30, 1e30])")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise self._bad("early_stopping", "must be True, False or 'never'")

    def _check_stops(self) -> None:
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise self._bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise self._bad("stop", "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "must be a bool")
        if self.stop and not self.detokenize:  # vLLM's rule: stop strings are matched on the text
            raise self._bad("stop", "is only supported when detokenize is True (set detokenize=True to use stop "
                                    "strings)")

    def _check_beam_search(self) -> None:
        """What would change a beam search that reads it is refused, not ignored: the search is
        deterministic (no draws, so no truncation of the distribution), scores beams by
        log-probability (no OpenAI penalties) and ends beams at tokens (no stop strings).
        ``temperature`` (default 1.0) and ``seed`` are left alone: they change nothing here."""
        if not self.beam_search:
            return
        unread = {"top_p": self.top_p != 1, "top_k": self.top_k not in (0, -1), "min_p": self.min_p != 0,
                  "presence_penalty": self.presence_penalty != 0,
                  "frequency_penalty": self.frequency_penalty != 0, "stop": bool(self.stop)}
        for name, is_set in unread.items():
            if is_set:
                instead = {"stop": "; stop_token_ids end beams", "presence_penalty": "; repetition_penalty applies",
                           "frequency_penalty": "; repetition_penalty applies"}.get(name, "")
                raise self._bad(name, f"does not apply to beam search (num_beams > 1){instead}")

    def _check_outputs(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            raise self._bad("output_kind", "must be a hf_paged.RequestOutputKind: CUMULATIVE, DELTA or FINAL_ONLY")
        if self.output_kind is RequestOutputKind.DELTA and self.beam_search:
            raise self._bad("output_kind", "cannot be DELTA in beam search (num_beams > 1): beams change until the "
                                           "search ends; use CUMULATIVE or FINAL_ONLY")
        if self.stream_interval is not None and (not _is_int(self.stream_interval) or self.stream_interval < 1):
            raise self._bad("stream_interval", "must be None or an int >= 1")

    def _check_vllm_defaults(self) -> None:
        for name, (accepts, shown, hint) in VLLM_DEFAULT_ONLY.items():
            if not accepts(getattr(self, name), self):
                raise self._bad(name, f"can only be {shown} here: {hint}")

    def _check_constraints(self) -> None:
        """One constraint and a bias, and nothing that would override where the constraint ends."""
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise self._bad("structured_outputs", "must be None or a StructuredOutputsParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_real(b) and abs(b) <= LOGIT_BIAS_MAX
                    for t, b in self.logit_bias.items()):
                raise self._bad("logit_bias", f"must map token ids (ints >= 0) to finite numbers in "
                                              f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or not all(
                    _is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise self._bad("allowed_token_ids", "must be None or a non-empty list of token ids (ints >= 0)")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise self._bad("bad_words", "must be None or a list of strings with more than whitespace")
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if self.constrained and self.beam_search:
            name = next(name for name in ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words")
                        if getattr(self, name))
            raise ValueError(f"SamplingParams.{name} cannot be combined with beam search (num_beams > 1): the engine "
                             "gives beams no grammar state of their own; use sampling or greedy decoding, or "
                             "generate() with an hf_paged.constraints processor (which supports beams)")
        if self.structured_outputs is not None:
            if self.min_new_tokens:
                raise self._bad("min_new_tokens", "must be 0 with structured_outputs (the constraint decides "
                                                  "where the output may end)")
            if self.ignore_eos:
                raise self._bad("ignore_eos", "must be False with structured_outputs (the constraint decides "
                                              "where the output may end)")

    @property
    def constrained(self) -> bool:
        """Whether its logits change before sampling (a constraint's mask, ``logit_bias``,
        ``allowed_token_ids``, ``bad_words``): such a
        request never takes the plain-greedy fast path."""
        return (self.structured_outputs is not None or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

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

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone()``): its lists and dicts (``stop``, ``logit_bias``, ...) and
        its ``structured_outputs`` (plain data: strings, lists, dicts) are its own, so a script can
        change one request's copy and leave the others alone. With ``skip_clone=True`` the object
        itself (vLLM's: its owner promised not to share it)."""
        return self if self.skip_clone else copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's ``SamplingParams.from_optional``: params from fields that may be None (an API
        request's). A keyword whose value is None takes the default, except ``max_tokens`` /
        ``max_new_tokens``, where None means as many as fit (vLLM passes it on too). As vLLM's does,
        ``logit_bias`` keys may be strings of token ids and biases are clamped to [-100, 100]."""
        known = _parameter_names()  # an unknown name is refused by the constructor, None or not
        given = {name: value for name, value in kwargs.items()
                 if value is not None or name in ("max_tokens", "max_new_tokens") or name not in known}
        if given.get("logit_bias") is not None:
            given["logit_bias"] = _clamped_logit_bias(given["logit_bias"])
        return cls(**given)


_DEFAULTS = {"max_new_tokens": SamplingParams.max_new_tokens, "min_new_tokens": SamplingParams.min_new_tokens}
VLLM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}  # the length fields' vLLM names


# generation_config.json fields that are a model's recommended request defaults (vLLM's
# ``--generation-config auto``), and the SamplingParams keyword each one sets
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config) -> dict[str, float | int]:
    """The request defaults a model's generation config sets (``{}`` for none), by SamplingParams keyword."""
    values = generation_config.to_diff_dict() if generation_config is not None else {}
    return {field: values[name] for name, field in GENERATION_DEFAULTS.items() if values.get(name) is not None}


def _clamped_logit_bias(bias: Any) -> Any:
    """``from_optional``'s ``logit_bias`` (vLLM's rule): string keys read as token ids, numeric biases
    clamped to ``LOGIT_BIAS_RANGE``; anything else is left for the constructor to refuse."""
    if not isinstance(bias, dict):
        return bias
    low, high = LOGIT_BIAS_RANGE
    clamped, bad = {}, []
    for token, value in bias.items():
        if isinstance(token, str):
            try:
                token = int(token)
            except ValueError:
                bad.append(token)
                continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        clamped[token] = min(high, max(low, value)) if numeric else value
    if bad:
        raise ValueError(f"SamplingParams.logit_bias contains key(s) that cannot be converted to integer token ids: "
                         f"{bad!r}")
    return clamped


def _length_alias(name: str) -> property:
    """vLLM's name of the length field ``name``, read and written: a write is checked as the
    constructor checks it, and a refused value leaves the object unchanged."""
    alias = VLLM_NAMES[name]

    def write(self: SamplingParams, value: int | None) -> None:
        trial = copy.copy(self)
        setattr(trial, name, value)
        trial._spelling = {**self._spelling, name: alias}
        trial._check_lengths()
        trial._check_width()  # length_penalty's bound depends on max_new_tokens
        trial._check_constraints()  # min_new_tokens must be 0 with structured_outputs
        setattr(self, name, value)
        self._spelling = trial._spelling

    return property(lambda self: getattr(self, name), write, doc=f"vLLM's name of {name}")


# ... and read and written under them too (the init-only aliases above would otherwise read None)
SamplingParams.max_tokens = _length_alias("max_new_tokens")
SamplingParams.min_tokens = _length_alias("min_new_tokens")
SamplingParams._replaced_lengths = property(lambda self: (self.max_new_tokens, self.min_new_tokens))

# vLLM SamplingParams fields this engine does not take, and what to write instead
VLLM_ONLY = {
    "best_of": "sampled best_of is not built; num_beams runs beam search",
    "use_beam_search": "pass num_beams > 1",
    "guided_decoding": "pass structured_outputs=StructuredOutputsParams(...)",
    "truncate_prompt_tokens": "truncate the prompt before adding it",
}


def _only(*values: Any) -> Callable[[Any, SamplingParams], bool]:
    """Accepts exactly ``values`` (None, bools and enum members by identity: 0 is not False)."""
    def accepts(value: Any, params: SamplingParams) -> bool:
        return any(value is v if v is None or isinstance(v, (bool, Enum)) else _is_int(value) and value == v
                   for v in values)
    return accepts


def _reads_cache_as_vllm(value: Any, params: SamplingParams) -> bool:
    """vLLM's None: a request skips reading the prefix cache exactly when it asks for prompt log-probs."""
    return value is None or value is (params.prompt_logprobs is not None)


# vLLM SamplingParams fields taken only at the values that ask for what this engine does anyway:
# name -> (accepts(value, params), those values as a message shows them, what it does here / instead)
VLLM_DEFAULT_ONLY: dict[str, tuple[Callable[[Any, SamplingParams], bool], str, str]] = {
    "skip_clone": (_only(False, True), "a bool", "True makes clone() return the object itself"),
    "skip_reading_prefix_cache": (_reads_cache_as_vllm, "None (or prompt_logprobs is not None)",
                                  "a request reads the prefix cache unless it asks for prompt_logprobs"),
    "flat_logprobs": (_only(False), "False", "logprobs are lists of {token id: Logprob} (FlatLogprobs is not "
                                             "built)"),
    "logprob_token_ids": (_only(None), "None", "not supported; ask for the top logprobs=k (-1: every token)"),
    "prompt_logprob_token_ids": (_only(None), "None", "not supported; ask for prompt_logprobs=k (-1: every token)"),
    "prompt_logprob_start": (_only(None, 0), "None or 0", "prompt_logprobs score every prompt token"),
    "extra_args": (_only(None), "None", "there are no custom sampling plugins to read them"),
    "thinking_token_budget": (_only(None), "None", "not supported (no budget for reasoning tokens); bound "
                                                   "max_tokens instead"),
    "repetition_detection": (_only(None), "None", "not supported (no n-gram repetition stop); bound max_tokens "
                                                  "or use repetition_penalty"),
    "watermarking": (_only(None, False), "None or False", "no watermark is applied"),
    "routed_experts_prompt_start": (_only(0), "0", "routed experts are not returned"),
    "trace_decode_token_ids": (_only(None), "None", "forced decoding is not supported; allowed_token_ids or "
                                                    "structured_outputs constrain the output"),
    "output_text_buffer_length": (_only(0), "0", "vLLM sets it itself; it is not an input"),
}


def _parameter_names() -> set[str]:
    """Every keyword ``SamplingParams(...)`` takes (``dataclasses.replace``'s ``_replaced_lengths`` aside)."""
    return {f.name for f in fields(SamplingParams)} | set(VLLM_NAMES.values())


def _spelling_of(kwargs: dict[str, Any]) -> dict[str, str]:
    """The names the caller wrote for the length fields: ``max_tokens`` / ``min_tokens`` where it
    passed vLLM's name (also when it passed both, as ``dataclasses.replace`` does), else the field's."""
    return {name: alias if alias in kwargs else name
            for name, alias in VLLM_NAMES.items() if alias in kwargs or name in kwargs}


def _naming_unknown_parameters(init):
    """``SamplingParams(...)`` with a name it does not take: a TypeError that says what to pass
    instead (vLLM users write vLLM's names), not the dataclass's bare one. Also notes how the
    caller spelled the length fields, for the messages."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if args:  # vLLM's SamplingParams(2) is n=2: a positional value is refused, never guessed at
            raise TypeError(f"SamplingParams takes keyword arguments only (e.g. SamplingParams(max_tokens=32, "
                            f"n=2)), got positional {args!r}")
        known = _parameter_names()
        for name in kwargs:
            if name not in known and name != "_replaced_lengths":
                hint = f": {VLLM_ONLY[name]}" if name in VLLM_ONLY else ""
                raise TypeError(f"SamplingParams has no parameter {name!r}{hint} (it takes: "
                                f"{', '.join(sorted(known))})")
        spelling = _spelling_of(kwargs)
        if spelling:
            self._spelling = spelling
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _naming_unknown_parameters(SamplingParams.__init__)
