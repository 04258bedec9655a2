"""Constraints in ``model.generate()``: a transformers ``LogitsProcessor`` over xgrammar.

``generate()`` gives a processor the rows' token ids and scores and nothing else: beam search
reorders its rows every step without saying how. So the processor keys each row's grammar state
by the row's generated tokens: at every step a row's state is its prefix's state (kept from the
step before) forked and advanced by the row's last token. Rows that share a prefix share one
state, whatever row they sit in, so greedy, sampling, ``num_return_sequences`` and beam search
all work, with or without ``cache_implementation="hf_paged"`` (the flag changes nothing the
processor sees). A row whose grammar has ended (its EOS accepted; generate pads it afterwards)
or whose token the grammar refused (a beam search candidate of score ``-inf``, kept only to fill
the beam) is left unmasked: its scores no longer matter, and an all ``-inf`` row would turn into
NaN under sampling.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from hf_paged.constraints.bitmask import apply_bitmask
from hf_paged.constraints.compiler import compiler_for, xgrammar
from hf_paged.constraints.params import StructuredOutputsParams

_FREE = None  # a row the processor leaves unmasked


class StructuredLogitsProcessor(LogitsProcessor):
    """Masks every row's scores to the tokens its constraint allows next; EOS only once the
    constraint can end. Build it with :func:`hf_paged.constraints.json_schema` and friends; an
    invalid constraint raises ``ValueError`` (``ConstraintError``) here, not in ``generate()``."""

    def __init__(self, tokenizer: Any, params: StructuredOutputsParams, *, vocab_size: int | None = None,
                 eos_token_id: int | list[int] | None = None):
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        self.tokenizer, self.params = tokenizer, params
        self.stop_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self._grammars: dict[int, Any] = {}
        self._grammar(vocab_size or len(tokenizer))  # compile now: errors belong to the caller's line
        self.reset()

    def reset(self) -> None:
        """Forget the rows (a new ``generate()`` call; detected on its own when lengths restart)."""
        self._states: dict[bytes, Any] = {}
        self._prompt_len: int | None = None
        self._last_len: int | None = None

    def _batch(self, xgr):
        if getattr(self, "_filler", None) is None:
            self._filler = xgr.BatchGrammarMatcher(1)
        return self._filler

    def _grammar(self, vocab_size: int):
        if vocab_size not in self._grammars:
            compiler = compiler_for(self.tokenizer, vocab_size, self.stop_token_ids)
            self._grammars[vocab_size] = compiler.compile(self.params)
        return self._grammars[vocab_size]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        xgr = xgrammar()
        grammar = self._grammar(scores.shape[-1])
        length = input_ids.shape[1]
        if self._last_len is None or length != self._last_len + 1:
            self.reset()
            self._prompt_len = length
        self._last_len = length
        generated = input_ids[:, self._prompt_len:].cpu().numpy()
        states, self._states = self._states, {}
        rows, matchers, last = [], [], []
        for row, tokens in enumerate(generated):
            key = tokens.tobytes()
            if key not in self._states:
                self._states[key] = _advance(states, key, tokens, grammar, xgr)
            matcher = self._states[key]
            if matcher is not _FREE:
                rows.append(row)
                matchers.append(matcher)
                last.append(int(tokens[-1]) if len(tokens) else None)
        if matchers:
            bitmask = xgr.allocate_token_bitmask(len(scores), scores.shape[-1])
            self._batch(xgr).batch_fill_next_token_bitmask(matchers, bitmask, rows)
            compiler_for(self.tokenizer, scores.shape[-1], self.stop_token_ids).guard.apply(bitmask, rows, last)
            apply_bitmask(scores, bitmask, rows)
        return scores


def _advance(states: dict[bytes, Any], key: bytes, tokens, grammar, xgr):
    """The grammar state after ``tokens``: the prefix's state, forked and advanced by the last token."""
    if not len(tokens):
        return xgr.GrammarMatcher(grammar)
    parent = states.get(key[: -tokens.itemsize], _FREE)
    if parent is _FREE or parent.is_terminated():
        return _FREE
    matcher = parent.fork()
    return matcher if matcher.accept_token(int(tokens[-1])) and not matcher.is_terminated() else _FREE
