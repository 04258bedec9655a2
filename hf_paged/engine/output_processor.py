"""Logits in, tokens out: sampling, beam steps, stop checks, and the outputs requests see.

For each step the processor reads the ``SchedulerOutput`` (which sequences ran, which need a
next token) and the runner's logits, appends tokens to the sequences, forks samples and beams,
retires finished sequences, and returns a :class:`StepResult` of what that means for the KV
blocks. It never touches KV memory itself: the scheduler applies the result.

Faults are kept to the request they belong to: a logits row that is not finite (NaN, +inf, or
no finite value at all), or an exception while one request is sampled, stepped or checked for
stop strings, fails that request alone. What the step had already done to it (tokens, forks,
frees) is undone in the step's outcome, so its blocks are freed exactly once and every other
request of the batch goes on as if the failed one had been aborted.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hf_paged.engine import sampler
from hf_paged.engine.detokenize import TokenTexts, decode_text, prompt_context, shown_token_ids
from hf_paged.engine.outputs import FAULT, REJECTED, CompletionOutput, Logprob, RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.sequence import Request, Sequence
from hf_paged.engine.step_result import BlockUpdate, FinishRequest, ForkSequence, FreeSequence, StepResult
from hf_paged.engine.structured import masked_out

logger = logging.getLogger("hf_paged")

NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class _Saved:
    """A request as it was before the step touched it: what to put back if it fails."""

    seqs: list[Sequence]
    finished_seqs: list[Sequence]
    states: list[tuple]  # per sequence in ``seqs``: (tokens, cumulative logprob, logprobs, text, finish reason)

    @classmethod
    def of(cls, request: Request) -> _Saved:
        states = [(len(s.token_ids), s.cumulative_logprob, s.logprobs, s.text, s.finish_reason) for s in request.seqs]
        return cls(list(request.seqs), list(request.finished_seqs), states)

    def restore(self, request: Request) -> None:
        request.seqs, request.finished_seqs = list(self.seqs), list(self.finished_seqs)
        for seq, (n, cumulative, logprobs, text, reason) in zip(self.seqs, self.states):
            del seq.token_ids[n:]
            seq.cumulative_logprob, seq.logprobs, seq.text, seq.finish_reason = cumulative, logprobs, text, reason


class _Appended:
    """A request whose one sequence got one token that did not finish it: undone by dropping it
    (the plain greedy lane's undo, much cheaper than a whole ``_Saved``)."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence):
        self.seq = seq

    def restore(self, request: Request) -> None:
        del self.seq.token_ids[-1]


@dataclass
class _Outcome:
    """A ``StepResult`` while it is being decided: each update is kept with its request, so that
    a request that fails can be taken out of the step again."""

    updates: list[tuple[str, BlockUpdate]] = field(default_factory=list)
    changed: dict[str, Request] = field(default_factory=dict)
    generated: Counter[str] = field(default_factory=Counter)
    saved: dict[str, _Saved | _Appended] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    all_logits_nonfinite: bool = False

    def touch(self, request: Request) -> None:
        """Before the step changes ``request``: remember how it was."""
        if request.request_id not in self.saved:
            self.saved[request.request_id] = _Saved.of(request)

    def add(self, request: Request, update: BlockUpdate) -> None:
        self.updates.append((request.request_id, update))

    def fail(self, request: Request, reason: str, kind: str) -> None:
        """Undo what this step did to ``request`` and finish it with an error."""
        rid = request.request_id
        saved = self.saved.pop(rid, None)
        if saved is not None:
            saved.restore(request)
        self.updates = [(r, u) for r, u in self.updates if r != rid]
        self.generated.pop(rid, None)
        request.fail(reason, kind)
        self.add(request, FinishRequest(request))
        self.changed[rid] = request
        if kind == FAULT:
            self.failed.add(rid)

    def restore_all(self) -> None:
        """Put every request the step touched back as it was (the whole step is being abandoned)."""
        for rid, saved in self.saved.items():
            saved.restore(self.changed[rid])
        self.saved.clear()

    def result(self) -> StepResult:
        return StepResult(tuple(u for _, u in self.updates), tuple(self.changed.values()),
                          sum(self.generated.values()), frozenset(self.failed), self.all_logits_nonfinite)


def _merged(results: list[StepResult], num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> StepResult:
    """One step's result from its rounds' (a step with drafts), in round order."""
    changed = {id(r): r for result in results for r in result.changed}
    return StepResult(tuple(u for result in results for u in result.updates), tuple(changed.values()),
                      sum(result.num_generated_tokens for result in results),
                      frozenset().union(*(result.failed for result in results)), results[0].all_logits_nonfinite,
                      num_drafts, num_draft_tokens, num_accepted_tokens)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_positions: int | None, structured=None):
        self.tokenizer, self.eos_token_ids, self.max_positions = tokenizer, eos_token_ids, max_positions
        self.structured = structured  # StructuredOutputManager (hf_paged.engine.structured): masks and matchers
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None  # Logprob.decoded_token

    def process(self, step: SchedulerOutput, logits: torch.Tensor | None,
                requests: Mapping[str, Request]) -> StepResult:
        """Decide the step's tokens from ``logits`` (rows: the ``needs_logits`` sequences in order,
        :attr:`~hf_paged.engine.scheduler_output.ScheduledSequence.num_logits` each).

        A fault that belongs to one request fails that request only (see the module docstring).
        Anything else raises, with every request the step touched put back as it was."""
        if step.has_drafts:
            return self._process_drafts(step, logits, requests)
        return self._process(step, logits, requests)

    def _process_drafts(self, step: SchedulerOutput, logits: torch.Tensor,
                        requests: Mapping[str, Request]) -> StepResult:
        """A step with drafts (:mod:`hf_paged.engine.speculative`), one position at a time: first
        every sequence's first row, as in a step without drafts; then, while a sequence's new
        token equals its draft's, its next row, with the others that go on. Each round is a
        step of one row per sequence, so every token is chosen as decoding would choose it."""
        first, row = [], 0
        for s in step.sequences:
            first.append(row)
            row += s.num_logits
        going = [(s.draft, first[i], requests[s.request_id].sequence(s.seq_id))
                 for i, s in enumerate(step.sequences) if s.draft]
        rows = [first[i] for i, s in enumerate(step.sequences) if s.needs_logits]
        results = [self._process(step, logits.index_select(0, torch.tensor(rows, device=logits.device)), requests)]
        scheduled = {s.seq_id: s for s in step.sequences}
        accepted, position = 0, 0
        while going:
            going = [(draft, row, seq) for draft, row, seq in going
                     if position < len(draft) and self._took(seq, draft[position])]
            accepted += len(going)
            position += 1
            if going:
                rows = torch.tensor([row + position for _, row, _ in going], device=logits.device)
                round_step = SchedulerOutput(sequences=tuple(scheduled[seq.seq_id] for _, _, seq in going))
                results.append(self._process(round_step, logits.index_select(0, rows), requests))
        drafts = [len(s.draft) for s in step.sequences if s.draft]
        return _merged(results, len(drafts), sum(drafts), accepted)

    @staticmethod
    def _took(seq: Sequence, draft_token: int) -> bool:
        """Whether ``seq`` goes on after a round: the token it was given is the draft's, and that
        did not finish it (a sequence that finished, or failed, has a reason)."""
        return seq.finish_reason is None and seq.token_ids[-1] == draft_token

    def _process(self, step: SchedulerOutput, logits: torch.Tensor | None,
                 requests: Mapping[str, Request]) -> StepResult:
        """:meth:`process` of a step whose sequences need one row each (or none)."""
        outcome = _Outcome()
        for request_id, reason in step.rejected:
            outcome.fail(requests[request_id], reason, REJECTED)
        constrained = self.structured is not None and self.structured.active  # structured outputs, logit_bias
        unbiased = None  # rows whose log-probs are reported from a copy taken before their logit_bias
        try:
            if constrained:  # their rows masked and biased in place, before anything reads the logits
                unbiased = self.structured.mask(step, logits, requests)
            scan = sampler.RowScan(logits)
            plain, ready = self._rows(step, logits, scan, requests, outcome)
            self._advance_plain_greedy(plain, scan, outcome)
            drawn = self._draw(ready, logits, requests, outcome)
            for request_id, got in ready.items():
                request, tokens = requests[request_id], drawn.get(request_id)
                if not (tokens is not None and len(got) == 1 and request.forked and request.params.logprobs is None
                        and self._append_quietly(request, got[0][0], tokens[0][0], outcome)):
                    self._guarded(request, outcome, self._advance, request, got, logits, tokens, outcome, unbiased)
            if constrained:  # their matchers follow the new tokens (forks start from their parents')
                forks = [u for _, u in outcome.updates if isinstance(u, ForkSequence)]
                self.structured.advance(list(outcome.changed.values()), forks,
                                        lambda request, why: outcome.fail(request, why, FAULT))
        except BaseException:
            outcome.restore_all()
            raise
        return outcome.result()

    def _rows(self, step: SchedulerOutput, logits: torch.Tensor | None, scan: sampler.RowScan,
              requests: Mapping[str, Request],
              outcome: _Outcome) -> tuple[list[tuple[Request, Sequence, int]], dict[str, list[tuple[Sequence, int]]]]:
        """Each logits row to its sequence: plain greedy rows (an argmax is all they need) and the
        others by request. Requests with a non-finite row fail here."""
        bad = set(scan.bad)
        row = 0
        ready: dict[str, list[tuple[Sequence, int]]] = {}
        plain: list[tuple[Request, Sequence, int]] = []
        poisoned: dict[str, Request] = {}
        masked: dict[str, str] = {}  # poisoned by their own masks (every token -inf), not by the model
        changed = outcome.changed
        for scheduled in step.sequences:
            request = requests[scheduled.request_id]
            changed[scheduled.request_id] = request
            if not scheduled.needs_logits:
                continue
            seq = request.sequence(scheduled.seq_id)
            if bad and row in bad:
                poisoned[request.request_id] = request
                if request.structured is not None and (why := masked_out(request, logits[row])):
                    masked[request.request_id] = why
            elif self._is_plain_greedy(request, seq):
                plain.append((request, seq, row))
            else:
                ready.setdefault(request.request_id, []).append((seq, row))
            row += 1
        for request in poisoned.values():
            if request.request_id in masked:  # its parameters' doing: refused, the model is fine
                outcome.fail(request, masked[request.request_id], REJECTED)
                continue
            logger.error("request %s: %s", request.request_id, NONFINITE_LOGITS)
            outcome.fail(request, NONFINITE_LOGITS, FAULT)
        outcome.all_logits_nonfinite = bool(row) and len(bad) == row and not masked
        if not poisoned:
            return plain, ready
        plain = [p for p in plain if p[0].request_id not in poisoned]
        return plain, {rid: got for rid, got in ready.items() if rid not in poisoned}

    @staticmethod
    def _guarded(request: Request, outcome: _Outcome, work: Callable[..., None], *args) -> None:
        """Run one request's share of the step, ``work(*args)``; an exception fails that request alone."""
        if request.request_id in outcome.failed:
            return
        outcome.touch(request)
        try:
            work(*args)
        except Exception as err:  # noqa: BLE001 - kept to this request: the batch goes on
            logger.exception("request %s failed while its step was processed", request.request_id)
            outcome.fail(request, f"the engine failed while processing this request ({type(err).__name__}: {err})",
                         FAULT)

    # ------------------------------------------------------------------ choosing tokens
    @staticmethod
    def _is_plain_greedy(request: Request, seq: Sequence) -> bool:
        params = request.params
        # a constrained request qualifies: its row was masked and biased in place before this
        return (request.forked and request.beam is None and params.greedy and params.logprobs is None
                and not params.penalized and len(seq.token_ids) - seq.num_prompt_tokens >= params.min_new_tokens)

    def _advance_plain_greedy(self, plain: list[tuple[Request, Sequence, int]], scan: sampler.RowScan,
                              outcome: _Outcome) -> None:
        """All plain greedy rows of a step at once: their argmax from the step's ``scan`` (no
        log-softmax: these requests asked for no log-probabilities).

        Tokens that :meth:`_append_quietly` can take go there; the others take the guarded path."""
        if not plain:
            return
        for (request, seq, _), token in zip(plain, scan.argmax([r for _, _, r in plain])):
            if not self._append_quietly(request, seq, token, outcome):
                self._guarded(request, outcome, self._append_plain, request, seq, token, outcome)

    def _append_quietly(self, request: Request, seq: Sequence, token: int, outcome: _Outcome) -> bool:
        """Append ``token`` to ``seq``, its request's only sequence, with a one-line undo, where
        nothing can raise: it does not finish the sequence and no stop strings are checked. False
        (nothing done): the caller takes the guarded path."""
        rid, params = request.request_id, request.params
        if (len(request.seqs) != 1 or rid in outcome.saved or (params.stop and self.tokenizer is not None)
                or self._finish_reason(params, token, seq.num_output_tokens + 1, len(seq.token_ids) + 1) is not None):
            return False
        outcome.saved[rid] = _Appended(seq)
        seq.token_ids.append(token)
        outcome.generated[rid] += 1
        return True

    def _append_plain(self, request: Request, seq: Sequence, token: int, outcome: _Outcome) -> None:
        self._append(request, seq, token, None, outcome)
        if not request.live_seqs:
            outcome.add(request, FinishRequest(request))

    def _draw(self, ready: dict[str, list[tuple[Sequence, int]]], logits: torch.Tensor,
              requests: Mapping[str, Request], outcome: _Outcome) -> dict[str, list[list[int]]]:
        """The tokens of every row of the requests without beams, per request and row: drawn for
        the whole step at once; when that raises, request by request, so that a fault (a row with
        nothing left to sample, say) fails its request alone."""
        sampled = {rid: got for rid, got in ready.items() if requests[rid].beam is None}
        if not sampled:
            return {}
        try:
            return self._draw_rows(sampled, logits, requests)
        except Exception:  # noqa: BLE001 - found again below, in the request it belongs to
            drawn: dict[str, list[list[int]]] = {}
            for rid, got in sampled.items():
                self._guarded(requests[rid], outcome,
                              lambda rid=rid, got=got: drawn.update(self._draw_rows({rid: got}, logits, requests)))
            return drawn

    def _draw_rows(self, sampled: dict[str, list[tuple[Sequence, int]]], logits: torch.Tensor,
                   requests: Mapping[str, Request]) -> dict[str, list[list[int]]]:
        rows, specs = [], []
        for rid, got in sampled.items():
            request = requests[rid]
            width = request.params.n if not request.forked else 1  # the prompt's row: one token per sample
            for seq, row in got:
                rows.append(row)
                generator = seq.generator if request.forked and seq.generator is not None else (
                    request.sample_generators if width > 1 else request.generator)
                specs.append(sampler.RowSpec(request.params, seq.token_ids, seq.num_output_tokens, width, generator))
        if rows != list(range(len(logits))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        tokens = iter(sampler.sample(logits, specs, self.eos_token_ids))
        return {rid: [next(tokens) for _ in got] for rid, got in sampled.items()}

    def _advance(self, request: Request, got: list[tuple[Sequence, int]], logits: torch.Tensor,
                 drawn: list[list[int]] | None, outcome: _Outcome,
                 unbiased: dict[int, torch.Tensor] | None = None) -> None:
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if request.beam is not None:
            self._advance_beams(request, [(seq, logits[row]) for seq, row in got], outcome)
        else:
            for (seq, row), tokens in zip(got, drawn, strict=True):
                self._sample(request, seq, unbiased[row] if unbiased and row in unbiased else logits[row], tokens,
                             outcome)
        if not request.live_seqs:
            outcome.add(request, FinishRequest(request))

    def _sample(self, request: Request, seq: Sequence, logits: torch.Tensor, tokens: list[int],
                outcome: _Outcome) -> None:
        """Append ``tokens`` (drawn from the row; ``logits``: its raw logits, which log-probs are
        reported from: a constraint's mask in, ``logit_bias`` out), forking the prompt's sequence
        into the request's samples at its first token."""
        params = request.params
        width = len(tokens)
        raw = torch.log_softmax(logits, -1) if params.logprobs is not None else None
        if not request.forked:  # the prompt's one sequence becomes n samples sharing its blocks
            request.forked = True
            children = [seq] + [seq.fork(i) for i in range(1, width)]
            for child in children[1:]:
                outcome.add(request, ForkSequence(seq, child))
            if request.sample_generators is not None:
                for child in children:
                    child.generator = request.sample_generators[child.index]
            request.seqs = list(children)  # a copy: _append removes finished children from request.seqs
        else:
            children = [seq]
        for child, token in zip(children, tokens):
            self._append(request, child, token, None if raw is None else float(raw[token]), outcome, raw)

    def _stop_token(self, params: SamplingParams, token: int) -> int | None:
        """vLLM's ``stop_reason`` for an output a token ended: a stop token's id, None for EOS."""
        stops = token in params.stop_token_ids and (params.ignore_eos or token not in self.eos_token_ids)
        return token if stops else None

    def _finish_reason(self, params: SamplingParams, token: int, num_output_tokens: int, num_tokens: int) -> str | None:
        """Why a sequence ends with ``token`` appended (its counts then given), stop strings aside;
        None: it goes on."""
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if num_output_tokens >= params.max_new_tokens or (self.max_positions and num_tokens >= self.max_positions):
            return "length"
        return None

    def _append(self, request: Request, seq: Sequence, token: int, logprob: float | None, outcome: _Outcome,
                raw_logprobs: torch.Tensor | None = None) -> None:
        """``logprob`` (and ``raw_logprobs``) only for requests that asked for log-probabilities.

        A sequence that finishes "stop" gets ``stop_reason`` (vLLM's): the stop string, the stop
        token, or None for EOS. A token that ends it is left out of the text, as in vLLM (unless
        ``include_stop_str_in_output``); stop strings are matched on the text as the request shows
        it (its ``skip_special_tokens``), and with ``include_stop_str_in_output`` the text is cut
        after the stop string, not before it."""
        params = request.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
            texts = self.token_texts if params.detokenize else None  # None: decoded_token None (vLLM's)
            seq.logprobs = (seq.logprobs or []) + [{t: Logprob(v, r, token=t, texts=texts) for t, v, r in
                                                    sampler.top_logprobs(raw_logprobs, token, params.logprobs)}]
        outcome.generated[request.request_id] += 1
        seq.finish_reason = self._finish_reason(params, token, seq.num_output_tokens, len(seq.token_ids))
        if seq.finish_reason == "stop":
            seq.stop_reason = self._stop_token(params, token)
        if params.stop and self.tokenizer is not None:
            shown = shown_token_ids(seq.output_token_ids, seq.finish_reason, seq.stop_reason,
                                    params.include_stop_str_in_output)
            seq.text = self._decode(request, shown)
            if seq.num_output_tokens < params.min_new_tokens:  # no stop string may end in this text
                seq.stop_floor = len(seq.text)
            else:
                hits = [(i, s) for s in params.stop
                        if (i := seq.text.find(s, max(0, seq.stop_floor - len(s) + 1))) >= 0]
                if hits:
                    cut, seq.stop_reason = min(hits, key=lambda hit: hit[0])
                    seq.text = seq.text[:cut + len(seq.stop_reason) if params.include_stop_str_in_output else cut]
                    seq.finish_reason = "stop"
        if seq.is_finished:  # a finished sequence gives its blocks back at once
            request.seqs.remove(seq)
            request.finished_seqs.append(seq)
            outcome.add(request, FreeSequence(seq))

    def _advance_beams(self, request: Request, got: list[tuple[Sequence, torch.Tensor]], outcome: _Outcome) -> None:
        state = request.beam
        pending = request.beam_rows
        for seq, logits in got:  # penalised after the log-softmax, as transformers' beam search does
            pending[seq.seq_id] = torch.log_softmax(logits.float(), -1)
            sampler.repetition_penalty(pending[seq.seq_id], seq.token_ids, request.params.repetition_penalty)
        beams = request.live_seqs
        if any(seq.seq_id not in pending for seq in beams):
            return  # some beams are still being recomputed after a preemption
        if not request.forked:  # the prompt: every beam starts from it
            rows = pending[beams[0].seq_id].expand(state.num_beams, -1)
            parents_src = [beams[0]] * state.num_beams
        else:
            rows = torch.stack([pending[seq.seq_id] for seq in beams])
            parents_src = beams
        pending.clear()
        choices = state.step(rows)
        new_seqs = []
        for i, (parent_row, token) in enumerate(choices):
            parent = parents_src[parent_row]
            child = parent.fork(i)
            outcome.add(request, ForkSequence(parent, child))
            child.token_ids.append(token)
            outcome.generated[request.request_id] += 1
            new_seqs.append(child)
        for seq in beams:
            outcome.add(request, FreeSequence(seq))
        request.forked = True
        request.seqs = new_seqs
        if state.done:
            for seq in new_seqs:
                outcome.add(request, FreeSequence(seq))
            request.seqs = []
            request.finished_seqs = []
            for index, (tokens, score) in enumerate(state.finalize()):
                seq = Sequence(request.prompt_token_ids + tokens, len(request.prompt_token_ids), index=index)
                seq.cumulative_logprob = score  # the length-penalised beam score (generate's sequences_scores)
                seq.finish_reason = "stop" if tokens and tokens[-1] in state.eos_token_ids else "length"
                if seq.finish_reason == "stop":
                    seq.stop_reason = self._stop_token(request.params, tokens[-1])
                request.finished_seqs.append(seq)

    # ------------------------------------------------------------------ outputs
    def _decode(self, request: Request, token_ids: list[int]) -> str:
        """The text of ``token_ids``, an output of ``request``: decoded after its prompt's."""
        params = request.params
        if request.text_context is None:
            request.text_context = prompt_context(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        return decode_text(self.tokenizer, token_ids, params.skip_special_tokens, params.spaces_between_special_tokens,
                           request.text_context)

    def request_output(self, request: Request, with_text: bool = True) -> RequestOutput:
        """What ``request`` has produced so far (all of it, not a delta). ``with_text=False``: no
        decoding (for a request whose decoding failed). A request with ``detokenize=False`` is never
        decoded: its texts are "" and its prompt log-probs' ``decoded_token`` None, as in vLLM."""
        seqs = request.seqs + request.finished_seqs
        if len(seqs) > 1:
            seqs.sort(key=lambda s: s.index)
        params = request.params
        if not params.detokenize:
            with_text = False
            if request.prompt_logprobs is not None:  # given the engine's decoder when the request was added
                request.prompt_logprobs.texts = None
        scored = params.logprobs is not None or params.beam_search  # else None, as in vLLM
        outputs = []
        for s in seqs:
            token_ids = s.output_token_ids
            text, decode = s.text, None
            stop_reason = s.stop_reason if s.finish_reason == "stop" else None
            if with_text and text is None and self.tokenizer is not None and token_ids:
                if s.is_finished:  # decoded here, once, so that a tokenizer fault fails this request
                    shown = shown_token_ids(token_ids, s.finish_reason, stop_reason, params.include_stop_str_in_output)
                    text = s.text = self._decode(request, shown)
                else:  # decoded by whoever reads it (the server never does), not on the engine thread
                    decode = functools.partial(self._decode, request, token_ids)
            outputs.append(CompletionOutput(
                index=s.index, token_ids=token_ids, text=text or "", finish_reason=s.finish_reason,
                cumulative_logprob=s.cumulative_logprob if scored else None, logprobs=s.logprobs,
                decode=decode, stop_reason=stop_reason,
            ))
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, finished=request.is_finished,
            prompt=request.prompt, error=request.error, error_kind=request.error_kind,
            prompt_logprobs=None if request.prompt_logprobs is None else request.prompt_logprobs.output(),
            num_cached_tokens=request.num_cached_tokens, lora_request=request.lora_request,
        )
