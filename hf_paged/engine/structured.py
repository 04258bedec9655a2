"""Structured outputs and ``logit_bias`` in the engine: grammars, masks and matchers per step.

A constrained request (``SamplingParams.structured_outputs`` and/or ``logit_bias``) carries a
:class:`StructuredRequest`. Its grammar is compiled off the engine thread
(:class:`~hf_paged.constraints.ConstraintCompiler`): :meth:`StructuredOutputManager.admit` parks a
request whose grammar is not compiled yet, and each step takes the ones that are ready
(:meth:`ready`), so the request waits while the others proceed; a constraint that fails to
compile, or takes longer than the compiler's ``timeout_s``, fails its request alone.

Every step, before sampling, :meth:`mask` fills the bitmasks of all the step's constrained rows
together (one ``BatchGrammarMatcher`` call), applies them to the logits in place
(:func:`~hf_paged.constraints.bitmask.apply_bitmask`), then adds each biased row's ``logit_bias``.
After tokens are appended, :meth:`advance` moves each sequence's matcher over its new tokens. Matchers are kept per sequence
and counted by the output tokens they have accepted, which makes every engine feature fall out:

* a sample or beam forked from a sequence starts from a fork of its parent's matcher (the step's
  ``ForkSequence`` pairs, taken before the parent advances), so ``n > 1`` samples each have their own;
* a sequence preempted by recompute or swap keeps its tokens, hence its matcher, which still
  matches them; a sequence without one (or with fewer tokens accepted than it has) is rebuilt
  by replaying its output tokens;
* the tokens after a stop string, or over ``max_tokens``, are never sampled, so nothing else changes.

An unconstrained batch pays nothing: with no constrained request in flight, :attr:`active` is
False and neither hook is called. Logprobs of a constrained row are those of the masked
distribution, before ``logit_bias`` (as vLLM reports them): :meth:`mask` keeps a copy of a biased
row from before its bias only when its request asks for logprobs.
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
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.sequence import Request, Sequence
from hf_paged.engine.step_result import ForkSequence

logger = logging.getLogger("hf_paged")
IDLE_WAIT_S = 0.02  # how long a step with nothing else to do waits for a grammar to compile


@dataclass
class _Matcher:
    """A sequence's grammar state: the matcher and how many output tokens it has accepted."""

    matcher: Any
    accepted: int = 0


@dataclass
class StructuredRequest:
    """What a constrained request adds: its compiled grammar (None: ``logit_bias`` only), its bias
    as (token ids, values) tensors, and a matcher per live sequence."""

    grammar: Any = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    matchers: dict[int, _Matcher] = field(default_factory=dict)

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
        if params.structured_outputs is None and not params.logit_bias:
            return True
        request.structured = StructuredRequest(bias=self._bias(params.logit_bias))
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
        grammar masks, then biases (``-inf + bias`` stays ``-inf``: the order changes no value).
        Returns, by row, the masked rows before their bias, for the biased requests that ask for
        logprobs (reported before ``logit_bias``)."""
        if logits is None:
            return {}
        rows, matchers, last, biased, row = [], [], [], [], -1
        for scheduled in step.sequences:
            if not scheduled.needs_logits:
                continue
            row += 1
            request = requests.get(scheduled.request_id)
            state = request.structured if request is not None else None
            if state is None:
                continue
            if state.bias is not None:
                biased.append((row, state.bias, request.params.logprobs is not None))
            if state.grammar is not None:
                seq = request.sequence(scheduled.seq_id)
                rows.append(row)
                matchers.append(state.matcher(seq))
                last.append(seq.token_ids[-1] if seq.num_tokens > seq.num_prompt_tokens else None)
        if matchers:
            self._apply(logits, rows, matchers, last)
        unbiased = {}
        for row, (ids, values), reported in biased:
            if reported:
                unbiased[row] = logits[row].clone()
            logits[row].index_add_(0, ids, values)
        return unbiased

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
