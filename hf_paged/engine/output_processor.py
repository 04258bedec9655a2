"""Logits in, tokens out: sampling, beam steps, stop checks, and the outputs requests see.

For each step the processor reads the ``SchedulerOutput`` (which sequences ran, which need a
next token) and the runner's logits, appends tokens to the sequences, forks samples and beams,
retires finished sequences, and returns a :class:`StepResult` of what that means for the KV
blocks. It never touches KV memory itself: the scheduler applies the result.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from hf_paged.engine import sampler
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.sequence import Request, Sequence
from hf_paged.engine.step_result import BlockUpdate, FinishRequest, ForkSequence, FreeSequence, StepResult


@dataclass
class _Outcome:
    """A ``StepResult`` while it is being decided."""

    updates: list[BlockUpdate] = field(default_factory=list)
    changed: dict[str, Request] = field(default_factory=dict)
    generated: int = 0

    def result(self) -> StepResult:
        return StepResult(tuple(self.updates), tuple(self.changed.values()), self.generated)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_positions: int | None):
        self.tokenizer, self.eos_token_ids, self.max_positions = tokenizer, eos_token_ids, max_positions

    def process(self, step: SchedulerOutput, logits: torch.Tensor | None,
                requests: Mapping[str, Request]) -> StepResult:
        """Decide the step's tokens from ``logits`` (rows: the ``needs_logits`` sequences in order)."""
        outcome = _Outcome()
        for request_id, reason in step.rejected:
            self._fail(requests[request_id], reason, outcome)
        row = 0
        ready: dict[str, list[tuple[Sequence, torch.Tensor]]] = {}
        plain: list[tuple[Request, Sequence, int]] = []  # greedy rows that need nothing but the argmax
        for scheduled in step.sequences:
            request = requests[scheduled.request_id]
            if scheduled.needs_logits:
                seq = request.sequence(scheduled.seq_id)
                if self._is_plain_greedy(request, seq):
                    plain.append((request, seq, row))
                else:
                    ready.setdefault(request.request_id, []).append((seq, logits[row]))
                row += 1
            outcome.changed[request.request_id] = request
        self._advance_plain_greedy(plain, logits, outcome)
        for request_id, got in ready.items():
            self._advance(requests[request_id], got, outcome)
        return outcome.result()

    # ------------------------------------------------------------------ choosing tokens
    @staticmethod
    def _is_plain_greedy(request: Request, seq: Sequence) -> bool:
        params = request.params
        return (request.beam is None and request.forked and params.greedy and not params.penalized
                and params.logprobs is None and len(seq.output_token_ids) >= params.min_new_tokens)

    def _advance_plain_greedy(self, plain: list[tuple[Request, Sequence, int]], logits: torch.Tensor,
                              outcome: _Outcome) -> None:
        """All plain greedy rows of a step at once: one argmax and one log-softmax for the batch."""
        if not plain:
            return
        rows = logits[torch.tensor([r for _, _, r in plain], device=logits.device)]
        tokens = rows.argmax(-1)
        chosen = torch.log_softmax(rows, -1).gather(1, tokens[:, None])[:, 0]
        for (request, seq, _), token, logprob in zip(plain, tokens.tolist(), chosen.tolist()):
            self._append(request, seq, token, logprob, outcome)
            if not request.live_seqs:
                outcome.updates.append(FinishRequest(request))

    def _advance(self, request: Request, got: list[tuple[Sequence, torch.Tensor]], outcome: _Outcome) -> None:
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if request.beam is not None:
            self._advance_beams(request, got, outcome)
        else:
            for seq, logits in got:
                self._sample(request, seq, logits, outcome)
        if not request.live_seqs:
            outcome.updates.append(FinishRequest(request))

    def _sample(self, request: Request, seq: Sequence, logits: torch.Tensor, outcome: _Outcome) -> None:
        params = request.params
        processed = sampler.process(logits, params, seq.token_ids, len(seq.output_token_ids), self.eos_token_ids)
        width = params.n if not request.forked else 1
        tokens = sampler.choose(processed, params, request.generator, width)
        raw = torch.log_softmax(logits, -1)
        if not request.forked:  # the prompt's one sequence becomes n samples sharing its blocks
            request.forked = True
            children = [seq] + [seq.fork(i) for i in range(1, width)]
            outcome.updates += [ForkSequence(seq, child) for child in children[1:]]
            request.seqs = children
        else:
            children = [seq]
        for child, token in zip(children, tokens):
            self._append(request, child, token, float(raw[token]), outcome, raw)

    def _append(self, request: Request, seq: Sequence, token: int, logprob: float, outcome: _Outcome,
                raw_logprobs: torch.Tensor | None = None) -> None:
        params = request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + [sampler.top_logprobs(raw_logprobs, token, params.logprobs)]
        outcome.generated += 1
        generated = len(seq.output_token_ids)
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif generated >= params.max_new_tokens or (self.max_positions and seq.num_tokens >= self.max_positions):
            seq.finish_reason = "length"
        if params.stop and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            hits = [seq.text.find(s) for s in params.stop if s in seq.text]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
        if seq.is_finished:  # a finished sequence gives its blocks back at once
            request.seqs.remove(seq)
            request.finished_seqs.append(seq)
            outcome.updates.append(FreeSequence(seq))

    def _advance_beams(self, request: Request, got: list[tuple[Sequence, torch.Tensor]], outcome: _Outcome) -> None:
        state = request.beam
        pending = request.beam_rows
        for seq, logits in got:
            pending[seq.seq_id] = torch.log_softmax(logits.float(), -1)
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
            outcome.updates.append(ForkSequence(parent, child))
            child.token_ids.append(token)
            outcome.generated += 1
            new_seqs.append(child)
        outcome.updates += [FreeSequence(seq) for seq in beams]
        request.forked = True
        request.seqs = new_seqs
        if state.done:
            outcome.updates += [FreeSequence(seq) for seq in new_seqs]
            request.seqs = []
            request.finished_seqs = []
            for index, (tokens, score) in enumerate(state.finalize()):
                seq = Sequence(request.prompt_token_ids + tokens, len(request.prompt_token_ids), index=index)
                seq.cumulative_logprob = score  # the length-penalised beam score (generate's sequences_scores)
                seq.finish_reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
                request.finished_seqs.append(seq)

    def _fail(self, request: Request, reason: str, outcome: _Outcome) -> None:
        request.error = reason
        for seq in request.live_seqs:
            seq.finish_reason = "error"
        outcome.updates.append(FinishRequest(request))
        outcome.changed[request.request_id] = request

    # ------------------------------------------------------------------ outputs
    def _text(self, seq: Sequence) -> str:
        if seq.text or self.tokenizer is None:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def request_output(self, request: Request) -> RequestOutput:
        """What ``request`` has produced so far (all of it, not a delta)."""
        seqs = sorted(request.seqs + request.finished_seqs, key=lambda s: s.index)
        outputs = [
            CompletionOutput(
                index=s.index, token_ids=s.output_token_ids, text=self._text(s), finish_reason=s.finish_reason,
                cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
            )
            for s in seqs
        ]
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, finished=request.is_finished,
            prompt=request.prompt, error=request.error,
        )
