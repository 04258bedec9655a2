"""Streamed text: token ids in, whole characters out.

A byte-level tokenizer (the demo's, GPT-2's) splits a multi-byte UTF-8 character over several
tokens, and decoding only the first of them gives U+FFFD. Sending that and the rest later would
put a broken character on the wire and make the chunks add up to something else than the
non-streamed text. :class:`IncrementalDetokenizer` holds such tokens back until the character is
whole; :class:`TextStream` also holds back what could be the start of a stop string, and ends on
the engine's final text, so a stream's deltas always concatenate to the non-streamed response.

What an output's text shows is vLLM's (``SamplingParams``' text options): :func:`decode_text`
keeps special tokens when ``skip_special_tokens=False`` (and, with
``spaces_between_special_tokens=False``, joins consecutive added tokens without the spaces a
decoder puts between tokens); :func:`shown_token_ids` leaves out the token that ended an output
(EOS, a stop token) unless ``include_stop_str_in_output`` asks for it.

An output's text continues its prompt's: it is decoded after the prompt's last tokens
(:func:`prompt_context`), as vLLM's detokenizer does. Decoded alone, a SentencePiece tokenizer's
first token loses its word-start space and a WordPiece decoder puts no space before it, so the
completion of "The capital of France is" would read "Paris" and an echo "The capital of France
isParis"; after the prompt it reads " Paris".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_paged.engine.outputs import CompletionOutput, ended_by_token

if TYPE_CHECKING:
    from hf_paged.engine.params import SamplingParams

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens an output is decoded after (see prompt_context)
WORD_START = "\u2581"  # SentencePiece's mark of a token that starts a word (with a space)
MAX_HELD_TOKENS = 8  # a UTF-8 character has at most 4 bytes: more than this is really invalid text
PENDING_TOKENS = 3  # still held when invalid text is released: the start of a character they may complete


@dataclass(frozen=True)
class PromptContext:
    """The prompt tokens an output's text is decoded after, and their own text (left out of it)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""


NO_CONTEXT = PromptContext()


def prompt_context(tokenizer: Any, prompt_token_ids: Sequence[int] | None,
                   skip_special_tokens: bool = True) -> PromptContext:
    """The longest tail of the prompt, of at most ``CONTEXT_TOKENS``, that decodes to whole
    characters (none where the prompt ends inside a multi-byte character: the output then
    completes it, and its text is decoded alone), with its text."""
    tail = list(prompt_token_ids or ())[-CONTEXT_TOKENS:]
    while tail:
        text = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
        if REPLACEMENT not in text:
            return PromptContext(tuple(tail), text)
        tail = tail[1:]
    return NO_CONTEXT


def decode_text(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True, context: PromptContext = NO_CONTEXT) -> str:
    """The text of ``token_ids`` as an output shows it: the tokenizer's own decode (special tokens
    skipped or kept), after the ``context`` tokens (:func:`prompt_context`; their own text left
    out). With special tokens kept and ``spaces_between_special_tokens=False``, an added token
    that follows another added token of the output is its bare content, without the space a
    decoder (WordPiece's, say) would put before it: what vLLM's detokenizer shows. Where the
    context's text is not a prefix of the whole (a decoder that rewrites across tokens), the ids
    are decoded alone."""
    if context.token_ids:
        whole = _decode(tokenizer, [*context.token_ids, *token_ids], skip_special_tokens,
                        spaces_between_special_tokens, len(context.token_ids))
        if whole.startswith(context.text):
            return whole[len(context.text):]
    return _decode(tokenizer, list(token_ids), skip_special_tokens, spaces_between_special_tokens, 0)


def _decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool,
            first: int) -> str:
    """``decode_text`` of ``token_ids`` whose output starts at ``first`` (the rest is context)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens or spaces_between_special_tokens:
        return text
    return _unspaced_added_runs(tokenizer, token_ids, text, first)


def text_decoder(tokenizer: Any, params: SamplingParams | None = None,
                 prompt_token_ids: Sequence[int] | None = None) -> Callable[[Sequence[int]], str]:
    """``decode(token_ids)`` of an output of ``prompt_token_ids``, with the text options of
    ``params`` (the defaults without them). The prompt's context is found on the first call: the
    server attaches a decoder to every unfinished output it passes on, and reads almost none."""
    skip = params is None or params.skip_special_tokens
    spaces = params is None or params.spaces_between_special_tokens
    context: PromptContext | None = None

    def decode(token_ids: Sequence[int]) -> str:
        nonlocal context
        if context is None:
            context = prompt_context(tokenizer, prompt_token_ids, skip)
        return decode_text(tokenizer, token_ids, skip, spaces, context)

    return decode


def _unspaced_added_runs(tokenizer: Any, token_ids: list[int], text: str, first: int = 0) -> str:
    """``text`` (the decode of ``token_ids``) with each run of consecutive added tokens from
    ``first`` on after its first written as their bare contents. Runs are replaced from the last
    one back, so the offsets (lengths of prefix decodes) of the earlier ones stay valid; a run
    whose prefix decodes are not prefixes of the text (a decoder that rewrites across tokens) is
    left as is."""
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    runs, start = [], None
    for i, token in enumerate([*token_ids, None]):
        if token is not None and token in added and i >= first:
            start = i if start is None else start
            continue
        if start is not None and i - start > 1:
            runs.append((start, i))
        start = None
    for start, end in reversed(runs):
        head = tokenizer.decode(token_ids[:start + 1], skip_special_tokens=False)
        spaced = tokenizer.decode(token_ids[:end], skip_special_tokens=False)
        if spaced.startswith(head) and text.startswith(spaced):
            text = head + "".join(added[t] for t in token_ids[start + 1:end]) + text[len(spaced):]
    return text


def shown_token_ids(token_ids: list[int], finish_reason: str | None, stop_reason: str | int | None,
                    include_stop_str_in_output: bool = False) -> list[int]:
    """The ids an output's text is decoded from: vLLM leaves out the token that ended it (EOS or a
    stop token; its id stays in ``token_ids``), unless ``include_stop_str_in_output``, where that
    token is decoded too (an EOS then shows as its text when special tokens are kept)."""
    if not include_stop_str_in_output and ended_by_token(finish_reason, stop_reason):
        return token_ids[:-1]
    return token_ids


class TokenTexts:
    """Each token's text (``Logprob.decoded_token``, logprobs' tokens), found once per id: its id
    decoded alone, with the word-start spaces that decoding alone strips from a SentencePiece
    token (``"\u2581Paris"`` reads " Paris", as vLLM shows it), so that the tokens of an output
    join to its text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._find(token_id)
        return text

    def alone(self, token_id: int) -> str:
        """The id decoded alone: how the token reads at the start of a text."""
        return self.tokenizer.decode([token_id])

    def _find(self, token_id: int) -> str:
        text = self.alone(token_id)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece.startswith(WORD_START):
            marks = len(piece) - len(piece.lstrip(WORD_START))
            missing = marks - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        return text


class IncrementalDetokenizer:
    """Decodes a growing list of token ids, releasing text only once its characters are whole.

    Each push decodes just a window, from the tokens released last time to the end, so the cost
    per token is constant; starting the window at earlier tokens (not at the new ones) lets
    tokenizers that treat a leading space specially (SentencePiece) see their context. The first
    window starts at the ``context`` tokens (:func:`prompt_context`), whose text is not released.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 context: PromptContext = NO_CONTEXT):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = list(context.token_ids)
        self.text = ""
        self._first = len(self.token_ids)  # where the output starts
        self._start = 0  # window start
        self._read = self._first  # token_ids[_first:_read] are in self.text

    def _decode(self, start: int, end: int) -> str:
        return _decode(self.tokenizer, self.token_ids[start:end], self.skip_special_tokens,
                       self.spaces_between_special_tokens, max(self._first - start, 0))

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the text they complete ('' while a character is still partial).
        ``final``: release everything, broken or not (the sequence has ended)."""
        self.token_ids += token_ids
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self._start, self._read)
        end = len(self.token_ids)
        after = self._decode(self._start, end)
        if not final and after.endswith(REPLACEMENT):
            end, after = self._boundary(end, after)
            if end == self._read:
                return ""
        delta = after[len(before):]
        self._start, self._read = self._read, end
        self.text += delta
        return delta

    def _boundary(self, end: int, whole: str) -> tuple[int, str]:
        """Where to stop releasing when the text ends in a partial (or invalid) character: after
        the last token whose text ends in a whole character and is a prefix of the whole window's
        (later tokens cannot change it); after ``MAX_HELD_TOKENS`` held tokens of invalid bytes, all
        but the last ``PENDING_TOKENS`` (a character they begin may still come)."""
        for cut in range(end - 1, self._read, -1):
            text = self._decode(self._start, cut)
            if not text.endswith(REPLACEMENT) and whole.startswith(text):
                return cut, text
        if end - self._read < MAX_HELD_TOKENS:
            return self._read, ""
        cut = end - PENDING_TOKENS
        return cut, self._decode(self._start, cut)


class TextStream:
    """The text deltas of one completion (one choice) as its outputs arrive from the engine.

    The text options are the request's (:meth:`of` reads them from its ``SamplingParams``). With
    ``include_stop_str_in_output`` nothing is held back for stop strings (as in vLLM): the text
    is cut after the stop string, in the token that completes it, so what was sent before stays
    a prefix of the final text."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 context: PromptContext = NO_CONTEXT):
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, spaces_between_special_tokens,
                                                   context)
        self._include_stop = include_stop_str_in_output
        longest = 0 if include_stop_str_in_output else max((len(s) for s in stop or ()), default=0)
        self._hold = max(longest - 1, 0)  # a stop string may be starting
        self.sent = ""
        self.num_tokens = 0
        self.finished = False

    @classmethod
    def of(cls, tokenizer: Any, params: SamplingParams,
           prompt_token_ids: Sequence[int] | None = None) -> TextStream | TokenStream:
        """The stream of a request with ``params``: its stop strings and text options, its text
        decoded after its prompt's. Without a tokenizer, or with ``detokenize=False``, a
        :class:`TokenStream`: its text deltas are "" (vLLM decodes nothing)."""
        if tokenizer is None or not params.detokenize:
            return TokenStream()
        return cls(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   context=prompt_context(tokenizer, prompt_token_ids, params.skip_special_tokens))

    def update(self, completion: CompletionOutput) -> tuple[str, list[int]]:
        """``(text delta, new token ids)`` for the completion's latest state. The engine's final
        text (cut at a stop string) closes the stream: what was sent is always its prefix. A last
        token that ended it (EOS, a stop token) is left out of the text, as the engine's text does."""
        new_ids = completion.token_ids[self.num_tokens:]
        self.num_tokens = len(completion.token_ids)
        ended = new_ids and ended_by_token(completion.finish_reason, completion.stop_reason)
        shown = new_ids[:-1] if ended else new_ids
        self._detokenizer.push(shown, final=completion.finished())
        if completion.finished():
            self.finished = True
            final = completion.text
            delta = final[len(self.sent):] if final.startswith(self.sent) else self._detokenizer.text[len(self.sent):]
        else:
            text = self._detokenizer.text  # all but its last ``_hold`` characters (none while shorter)
            delta = text[len(self.sent): max(len(self.sent), len(text) - self._hold)]
        self.sent += delta
        return delta, new_ids


class TokenStream:
    """:class:`TextStream` for an engine without a tokenizer, or a request with ``detokenize=False``:
    the new token ids, no text."""

    def __init__(self):
        self.num_tokens = 0
        self.finished = False

    def update(self, completion: CompletionOutput) -> tuple[str, list[int]]:
        new_ids = completion.token_ids[self.num_tokens:]
        self.num_tokens, self.finished = len(completion.token_ids), completion.finished()
        return "", new_ids
