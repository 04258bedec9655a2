"""Structured outputs, ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` in the engine:
grammars, masks and matchers per step.

A constrained request (``SamplingParams.constrained``: any of those four) carries a
:class:`StructuredRequest`. Its grammar is compiled off the engine thread
(:class:`~hf_paged.constraints.ConstraintCompiler`): :meth:`StructuredOutputManager.admit` parks a
request whose grammar is not compiled yet, and each step takes the ones that are ready
(:meth:`ready`), so the request waits while the others proceed; a constraint that fails to
compile, or takes longer than the compiler's ``timeout_s``, fails its request alone.

Every step, before sampling, :meth:`mask` fills the bitmasks of all the step's constrained rows
together (one ``BatchGrammarMatcher`` call), applies them to the logits in place
(:func:`~hf_paged.constraints.bitmask.apply_bitmask`), then the sampler-side masks in vLLM's
order: ``allowed_token_ids`` (every other token ``-inf``), ``bad_words`` (a word's last token
``-inf`` where the sequence's generated tokens end with the rest of it; stateless, so forks and
preemption need nothing), and each biased row's ``logit_bias``. A row those masks leave with no
token fails its request alone (:func:`masked_out`), as a refusal, not a model fault.
After tokens are appended, :meth:`advance` moves each sequence's matcher over its new tokens. Matchers are kept per sequence
and counted by the output tokens they have accepted, which makes every engine feature fall out:

* a sample or beam forked from a sequence starts from a fork of its parent's matcher (the step's
  ``ForkSequence`` pairs, taken before the parent advances), so ``n > 1`` samples each have their own;
* a sequence preempted by recompute or swap keeps its tokens, hence its matcher, which still
  matches them; a sequence without one (or with fewer tokens accepted than it has) is rebuilt
  by replaying its output tokens;
* the tokens after a stop string, or over ``max_tokens``, are never sampled, so nothing else changes.

An unconstrained batch pays nothing: with no constrained request in flight, :attr:`active` is
False and neither hook is called. Logprobs of a constrained row are those of the grammar-masked
distribution, before ``allowed_token_ids``, ``bad_words`` and ``logit_bias`` (vLLM applies the
grammar before its sampler and reports raw log-probs): :meth:`mask` keeps a copy of such a row
from before those only when its request asks for logprobs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_paged.constraints.bitmask import apply_bitmask
from hf_paged.constraints.compiler import ConstraintCompiler, ConstraintError, compiler_for, too_slow, xgrammar
from hf_paged.engine import sampler
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.sequence import Request, Sequence
from hf_paged.engine.step_result import ForkSequence

logger = logging.getLogger("hf_paged")
IDLE_WAIT_S = 0.02  # how long a step with nothing else to do waits for a grammar to compile
MAX_NUM_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS: token sequences a request's bad_words may make


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token sequences ``words`` ban, as vLLM's ``SamplingParams.update_from_tokenizer`` makes
    them: each word (left-stripped) alone, and after a space when that gives another first token
    in as many tokens (a word both starting the text and inside it); no special tokens. Raises
    ``ValueError`` naming ``bad_words`` for a word that tokenizes to nothing, a token id past the
    model's vocabulary, or more than ``MAX_NUM_BAD_WORDS`` sequences."""
    sequences: list[list[int]] = []
    for word in words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise ValueError(f"SamplingParams.bad_words entries must tokenize to at least one token, got {word!r}")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        kept = [alone, spaced] if spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else [alone]
        sequences += kept
        outside = [t for ids in kept for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"SamplingParams.bad_words {word!r} tokenizes to ids outside the model's vocabulary "
                             f"(size {vocab_size}): {outside}")
    if len(sequences) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"SamplingParams.bad_words make {len(sequences)} token sequences (each word alone and, "
                         f"where it differs, after a space); at most {MAX_NUM_BAD_WORDS}")
    return sequences


def masked_out(request: Request, row: torch.Tensor) -> str | None:
    """Why a non-finite logits row is its request's own doing (None: it is not): its masks left
    no token to generate (every logit ``-inf``; a model's NaN or +inf would not read so)."""
    if request.structured is None or not bool(torch.isneginf(row).all()):
        return None
    params = request.params
    names = [name for name in ("structured_outputs", "allowed_token_ids", "bad_words", "min_tokens")
             if getattr(params, name)]
    return f"nothing can be generated: every token is masked by the request's {', '.join(names)}"


@dataclass
class _Matcher:
    """A sequence's grammar state: the matcher and how many output tokens it has accepted."""

    matcher: Any
    accepted: int = 0


@dataclass
class StructuredRequest:
    """What a constrained request adds: its compiled grammar (None: no ``structured_outputs``),
    its bias as (token ids, values) tensors, its ``allowed_token_ids`` as a tensor, its
    ``bad_words`` as (prefix, last token) pairs, and a matcher per live sequence."""

    grammar: Any = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: torch.Tensor | None = None
    bad_words: list[tuple[list[int], int]] = field(default_factory=list)
    matchers: dict[int, _Matcher] = field(default_factory=dict)

    @property
    def restricted(self) -> bool:
        """Whether the sampler-side masks or bias apply (anything beyond a grammar)."""
        return self.bias is not None or self.allowed is not None or bool(self.bad_words)

    def banned(self, seq: Sequence, params: SamplingParams, eos_token_ids: list[int], vocab_size: int) -> list[int]:
        """The tokens ``seq`` may not take next: the last token of each bad word whose other tokens
        end its generated tokens (vLLM reads the output only, not the prompt), and, with
        ``allowed_token_ids`` or ``bad_words``, the stop tokens ``min_tokens`` holds back (the
        sampler masks those too; here they make a row left with nothing visible before it)."""
        tokens, generated = seq.token_ids, seq.num_output_tokens
        banned = [last for prefix, last in self.bad_words
                  if len(prefix) <= generated and (not prefix or tokens[-len(prefix):] == prefix)]
        stops = sampler.min_tokens_mask(sampler.RowSpec(params, tokens, generated), eos_token_ids)
        return banned + [t for t in stops if t < vocab_size]  # a stop id past the vocabulary is never drawn

    def matcher(self, seq: Sequence) -> Any:
        """``seq``'s matcher, advanced over all of its output tokens (built or caught up here: a
        new sequence, or one whose tokens came without :meth:`StructuredOutputManager.advance`)."""
        entry = self.matchers.get(seq.seq_id)
        if entry is None:
            entry = self.matchers[seq.seq_id] = _Matcher(xgrammar().GrammarMatcher(self.grammar))
        start = seq.num_prompt_tokens + entry.accepted
        if start == len(seq.token_ids):  # caught up (the common case: nothing to slice)
            return entry.matcher
        for token in seq.token_ids[start:]:
            if not entry.matcher.accept_token(token):
                raise RuntimeError(f"token {token} is not allowed by the request's constraint")
            entry.accepted += 1
        return entry.matcher


@dataclass
class _Parked:
    request: Request
    future: concurrent.futures.Future
    since: float


class StructuredOutputManager:
    """The engine's structured-output state (see the module docstring). ``compiler`` is built on
    first use and shared with the server, which compiles a request's constraint before queueing
    it (so it can answer 400 before a stream starts)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.device = tokenizer, vocab_size, eos_token_ids, device
        self._compiler: ConstraintCompiler | None = None
        self._parked: dict[str, _Parked] = {}
        self._active: dict[str, Request] = {}
        self._bitmask: torch.Tensor | None = None
        self._filler = None

    @property
    def compiler(self) -> ConstraintCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer (pass tokenizer= to LLMEngine)")
            self._compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    @property
    def active(self) -> bool:
        """Whether any constrained request is in flight (the per-step hooks run only then)."""
        return bool(self._active)

    # ------------------------------------------------------------------ admission
    def admit(self, request: Request) -> bool:
        """Attach the request's constraint. True: it can be scheduled now; False: its grammar is
        compiling and :meth:`ready` hands it over later. Raises ``ValueError`` for a constraint
        known to be bad (its error was cached)."""
        params = request.params
        if not params.constrained:
            return True
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else []
        request.structured = StructuredRequest(
            bias=self._bias(params.logit_bias), allowed=self._allowed(params.allowed_token_ids),
            bad_words=[(ids[:-1], ids[-1]) for ids in bad_words])
        self._active[request.request_id] = request
        if params.structured_outputs is None:
            return True
        try:
            grammar = self.compiler.cached(params.structured_outputs)
        except ConstraintError:
            del self._active[request.request_id]
            raise
        if grammar is not None:
            request.structured.grammar = grammar
            return True
        future = self.compiler.submit(params.structured_outputs)
        self._parked[request.request_id] = _Parked(request, future, time.monotonic())
        return False

    def _bias(self, logit_bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not logit_bias:
            return None
        ids = torch.tensor(list(logit_bias), dtype=torch.long, device=self.device)
        return ids, torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=self.device)

    def _allowed(self, allowed_token_ids: list[int] | None) -> torch.Tensor | None:
        if allowed_token_ids is None:
            return None
        return torch.tensor(sorted(set(allowed_token_ids)), dtype=torch.long, device=self.device)

    def has_waiting(self) -> bool:
        return bool(self._parked)

    def ready(self, idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Parked requests whose grammar is ready, and those whose constraint failed (with why).
        ``idle``: nothing else can run, so wait a little for a compile instead of spinning."""
        if not self._parked:
            return [], []
        if idle:
            concurrent.futures.wait([p.future for p in self._parked.values()], timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, now = [], [], time.monotonic()
        timeout_s = self.compiler.timeout_s
        for request_id, parked in list(self._parked.items()):
            params = parked.request.params.structured_outputs
            if parked.future.done():
                error = parked.future.exception()
                if error is None:
                    parked.request.structured.grammar = parked.future.result()
                    ready.append(parked.request)
                else:
                    failed.append((parked.request, str(error)))
            elif now - parked.since > timeout_s:
                failed.append((parked.request, str(too_slow(params, timeout_s))))
            else:
                continue
            del self._parked[request_id]
        for request, _ in failed:
            self.forget(request)
        return ready, failed

    def forget(self, request: Request) -> None:
        """The request is done (finished, failed or aborted): drop its state."""
        self._parked.pop(request.request_id, None)
        self._active.pop(request.request_id, None)
        if request.structured is not None:
            request.structured.matchers.clear()

    # ------------------------------------------------------------------ the step
    def mask(self, step: SchedulerOutput, logits: torch.Tensor | None,
             requests: Mapping[str, Request]) -> dict[int, torch.Tensor]:
        """Constrain the step's logits in place (rows: the ``needs_logits`` sequences in order):
        grammar masks, then :meth:`_restrict` (``allowed_token_ids``, ``bad_words``, biases).
        Returns, by row, the grammar-masked rows before the rest, for the restricted requests that
        ask for logprobs (reported before ``allowed_token_ids``, ``bad_words`` and ``logit_bias``)."""
        if logits is None:
            return {}
        rows, matchers, last, restricted, row = [], [], [], [], -1
        for scheduled in step.sequences:
            if not scheduled.needs_logits:
                continue
            row += 1
            request = requests.get(scheduled.request_id)
            state = request.structured if request is not None else None
            if state is None:
                continue
            if state.restricted:
                restricted.append((row, request, scheduled.seq_id))
            if state.grammar is not None:
                seq = request.sequence(scheduled.seq_id)
                rows.append(row)
                matchers.append(state.matcher(seq))
                last.append(seq.token_ids[-1] if seq.num_tokens > seq.num_prompt_tokens else None)
        if matchers:
            self._apply(logits, rows, matchers, last)
        return self._restrict(logits, restricted) if restricted else {}

    def _restrict(self, logits: torch.Tensor, restricted: list[tuple[int, Request, int]]) -> dict[int, torch.Tensor]:
        """vLLM's sampler-side masks, in its order, on rows ``(row, request, seq_id)``: every token
        outside ``allowed_token_ids`` and each sequence's :meth:`StructuredRequest.banned` tokens
        to ``-inf`` (one indexed write for the batch), then ``logit_bias`` (``-inf + bias`` stays
        ``-inf``, so the order changes no value). Returns the rows as they were, for the requests
        that report logprobs."""
        raw: dict[int, torch.Tensor] = {}
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for row, request, seq_id in restricted:
            state, params = request.structured, request.params
            if params.logprobs is not None:
                raw[row] = logits[row].clone()
            if state.allowed is not None:  # keep the allowed values, -inf elsewhere: exact, O(vocab) once
                kept = logits[row].index_select(0, state.allowed)
                logits[row].fill_(float("-inf")).index_copy_(0, state.allowed, kept)
            if state.allowed is not None or state.bad_words:
                banned = state.banned(request.sequence(seq_id), params, self.eos_token_ids, logits.shape[-1])
                banned_rows += [row] * len(banned)
                banned_tokens += banned
            if state.bias is not None:
                logits[row].index_add_(0, *state.bias)
        if banned_tokens:
            index = (torch.tensor(banned_rows, device=logits.device), torch.tensor(banned_tokens, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
        return raw

    def _apply(self, logits: torch.Tensor, rows: list[int], matchers: list, last: list[int | None]) -> None:
        """One batched bitmask fill for the rows (xgrammar), one in-place apply (:mod:`.bitmask`)."""
        xgr = xgrammar()
        if self._bitmask is None or len(self._bitmask) < len(logits):
            self._bitmask = xgr.allocate_token_bitmask(max(len(logits), 64), logits.shape[-1])
            self._filler = xgr.BatchGrammarMatcher(1)
        self._filler.batch_fill_next_token_bitmask(matchers, self._bitmask, rows)
        self.compiler.guard.apply(self._bitmask, rows, last)
        apply_bitmask(logits, self._bitmask, rows)

    def advance(self, changed: Iterable[Request], forks: Iterable[ForkSequence],
                fail: Callable[[Request, str], None]) -> None:
        """After the step's tokens are appended: fork matchers for new samples, advance every live
        constrained sequence over its new tokens, forget what finished. A token the grammar
        refuses (a bug, or a mask that was not applied) fails its request."""
        parent_of = {fork.child.seq_id: fork.parent for fork in forks}
        for request in changed:
            state = request.structured
            if state is None:
                continue
            live = request.live_seqs
            if state.grammar is not None:
                if parent_of:
                    self._fork_children(state, live, parent_of)
                try:
                    for seq in live:
                        state.matcher(seq)
                except RuntimeError as err:
                    fail(request, f"the engine broke the request's constraint: {err}")
                    live = []
                if len(state.matchers) != len(live):  # finished or replaced sequences
                    kept = {seq.seq_id for seq in live}
                    for seq_id in [s for s in state.matchers if s not in kept]:
                        del state.matchers[seq_id]
            if not live:
                self.forget(request)

    @staticmethod
    def _fork_children(state: StructuredRequest, live: list[Sequence], parent_of: dict[int, Sequence]) -> None:
        """New sequences start from their parent's matcher as it was before this step."""
        for seq in live:
            parent = parent_of.get(seq.seq_id)
            if seq.seq_id in state.matchers or parent is None or parent.seq_id not in state.matchers:
                continue
            entry = state.matchers[parent.seq_id]
            state.matchers[seq.seq_id] = _Matcher(entry.matcher.fork(), entry.accepted)
