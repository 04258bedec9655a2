"""OpenAI response bodies (and stream chunks) from engine outputs: choices, logprobs, usage."""

from __future__ import annotations

import codecs
import json
import re
import time
from typing import Any

from hf_paged.engine.detokenize import TokenTexts
from hf_paged.engine.outputs import CompletionOutput, RequestOutput

OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
MIN_LOGPROB = -9999.0  # what a token a constraint masked (log-prob -inf) reads as: vLLM's value


class TokenText(TokenTexts):
    """Each token's own text and bytes, as logprobs show them (found once per id).

    A token's text is its id decoded alone (:class:`~hf_paged.engine.detokenize.TokenTexts`, as
    the engine's ``Logprob.decoded_token``): a byte of a multi-byte character then reads U+FFFD, so
    its ``bytes`` are the token's own (what chat's ``bytes`` field is for: joined, they give the
    text back). They are read from the vocabulary where it says them: a byte-level BPE's
    (GPT-2's alphabet: Llama 3, Qwen, the demo's), SentencePiece's ``<0xNN>`` byte fallback and
    its ``▁`` word starts (a space); otherwise the text's UTF-8. Special tokens have no bytes: the
    text skips them.
    """

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._bytes: dict[int, bytes] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def alternative_bytes(self, token_id: int) -> bytes:
        """A top alternative's ``bytes`` in chat's logprobs: the token's own."""
        return self.bytes_of(token_id)

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._find_bytes(token_id)
        return found

    def _find_bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if "\u2581" in piece:  # SentencePiece's word start: a space (decoding alone may strip it)
                return piece.replace("\u2581", " ").encode("utf-8")
        return self(token_id).encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves,
    the others (control characters, space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_UNICODE_TO_BYTE = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextOffsets:
    """Completions' ``text_offset``: where each token starts in the text, in characters. A token
    inside a multi-byte character starts where that character does; a special token is as wide as
    its text where the text shows it (``skip_special_tokens: false``; an echoed token-id prompt,
    decoded whole) and adds nothing where it does not (a text prompt's added ``<s>``). Kept across a
    stream's chunks: its first ``echoed`` tokens are the echoed prompt's."""

    def __init__(self, shows_special: bool = False, echoed: int = 0, echo_shows_special: bool = False):
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._shows_special, self._echoed, self._echo_shows_special = shows_special, echoed, echo_shows_special

    def token(self, text_of: TokenText, token_id: int) -> tuple[str, int]:
        """This token's text as the choice's text shows it, and its offset (then counts its
        characters). The first word-start token of an echoed prompt reads without its space: the
        prompt's text, decoded whole (or sent), starts without it."""
        offset, echoing = self.chars, self._echoed > 0
        shown = self._echo_shows_special if echoing else self._shows_special
        self._echoed = max(self._echoed - 1, 0)
        text = text_of(token_id)
        if shown and text_of.is_special(token_id):
            self.chars += len(self._decoder.decode(b"", final=True)) + len(text_of.alone(token_id))
            return text, offset
        data = text_of.bytes_of(token_id)
        if echoing and not offset and data[:1] == b" " and not text_of.alone(token_id).startswith(" "):
            data, text = data[1:], text[1:] if text.startswith(" ") else text
        self.chars += len(self._decoder.decode(data))
        return text, offset


class TokenIdText:
    """:class:`TokenText` for ``return_tokens_as_token_ids`` (vLLM's): a token reads
    ``"token_id:<id>"`` (tokens whose text is no valid UTF-8 are still told apart). Its width in
    ``text_offset`` and whether it is special stay those of its text, so offsets still index the
    choice's text (vLLM's count the ``token_id:<id>`` strings', which index nothing). Chat's
    ``bytes`` are as vLLM's: a chosen token's are its text's, a top alternative's those of its
    ``token_id:<id>``."""

    def __init__(self, text_of: TokenText):
        self._text_of = text_of

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def alternative_bytes(self, token_id: int) -> bytes:
        return self(token_id).encode("utf-8")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._text_of, name)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _finite(logprobs: list[dict[int, float] | None]) -> list[dict[int, float] | None]:
    """The log-probs with -inf raised to ``MIN_LOGPROB``: JSON has no infinity (a 500, or a stream
    chunk no client parses, where a constraint masked a token in the top-k). ``None`` (an echoed
    prompt's first token, which has none) stays."""
    return [None if entry is None else {t: max(v, MIN_LOGPROB) for t, v in entry.items()} for entry in logprobs]


def completion_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float] | None], k: int,
                        offsets: TextOffsets) -> dict:
    """Completions' format: parallel lists of tokens, their log-probs, top-``k`` and text offsets
    (``None`` entries, an echoed prompt's first token, have neither log-prob nor top ones)."""
    logprobs = _finite(logprobs)
    tokens = [offsets.token(text_of, t) for t in token_ids]
    return {"tokens": [text for text, _ in tokens],
            "token_logprobs": [None if lp is None else lp[t] for lp, t in zip(logprobs, token_ids)],
            "top_logprobs": [None if lp is None else _by_text(text_of, _with_chosen(_top(lp, k), t, lp[t]))
                             for lp, t in zip(logprobs, token_ids)],
            "text_offset": [offset for _, offset in tokens]}


def _with_chosen(top: list[tuple[int, float]], token_id: int, value: float) -> list[tuple[int, float]]:
    """Completions' top log-probs hold the chosen token too (OpenAI's legacy API, vLLM): up to
    ``k + 1`` entries, the chosen one alone with ``logprobs=0``."""
    return top if any(t == token_id for t, _ in top) else [*top, (token_id, value)]


def prompt_logprobs(text_of: TokenText, entries: list[dict[int, Any] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` in a response: per prompt token (the first ``None``), its entries
    keyed by token id, each ``{"logprob", "rank", "decoded_token"}``."""
    return [None if entry is None else
            {str(t): {"logprob": max(float(v), MIN_LOGPROB), "rank": getattr(v, "rank", None),
                      "decoded_token": text_of(t)} for t, v in entry.items()}
            for entry in entries]


def _by_text(text_of: TokenText, top: list[tuple[int, float]]) -> dict[str, float]:
    """Top alternatives keyed by text; tokens of the same text (bytes of a split character all read
    U+FFFD) keep the likeliest."""
    out: dict[str, float] = {}
    for token_id, value in top:
        out.setdefault(text_of(token_id), value)
    return out


def chat_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """Chat's format: one entry per token, with its bytes and its top-``k`` alternatives."""
    def entry(token_id: int, value: float, data: bytes) -> dict:
        return {"token": text_of(token_id), "logprob": value, "bytes": list(data)}

    logprobs = _finite(logprobs)
    return {"content": [{**entry(t, lp[t], text_of.bytes_of(t)),
                         "top_logprobs": [entry(i, v, text_of.alternative_bytes(i)) for i, v in _top(lp, k)]}
                        for lp, t in zip(logprobs, token_ids)]}


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_usage(output: RequestOutput, completion: CompletionOutput) -> dict:
    """vLLM's ``continuous_usage_stats``: one choice's usage so far (its prompt, its tokens)."""
    prompt, generated = len(output.prompt_token_ids), len(completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def choice(kind: str, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
           token_ids: list[int] | None = None, *, delta: bool = False, first: bool = False,
           tool_calls: list[dict] | None = None, stop_reason: str | int | None = None,
           role: str = "assistant") -> dict:
    """A completions or chat choice; ``delta``: a stream chunk's (chat: ``delta`` not ``message``);
    ``first``: a chat stream's opening chunk, the one whose delta carries the role.
    ``tool_calls``: a chat message's calls (or a chunk's call deltas); its content may then be None.
    ``stop_reason`` (vLLM's extension): the stop string or stop token id that ended it, else null.
    ``role``: a chat reply's (the last message's when no generation prompt started a new one)."""
    if kind == "completion":
        body = {"index": index, "text": text}
    elif delta:
        body = {"index": index, "delta": {"role": role, "content": text} if first else {"content": text}}
    else:
        body = {"index": index, "message": {"role": role, "content": text}}
    if tool_calls:
        body["delta" if delta else "message"]["tool_calls"] = tool_calls
    body.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def envelope(kind: str, response_id: str, model: str, choices: list[dict], usage_: dict | None = None, *,
             chunk: bool = False, created: int | None = None, null_usage: bool = False) -> dict:
    """A response or stream chunk; ``null_usage``: a chunk of a stream that ends with a usage chunk
    says ``"usage": null`` (as OpenAI's do)."""
    body = {"id": response_id, "object": (CHUNK_OBJECT if chunk else OBJECT)[kind],
            "created": int(time.time()) if created is None else created, "model": model, "choices": choices}
    if usage_ is not None or not chunk or null_usage:
        body["usage"] = usage_
    return body


# Line breaks to Python's str.splitlines() (and so to httpx's iter_lines()), not to JSON or SSE:
# left raw in a chunk's text they split its line, and the reader gets broken JSON.
_LINE_BREAKS_ESCAPED = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    """One server-sent event (a text's U+0085, U+2028 and U+2029 as JSON escapes)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:  # (rare: three scans cost less than a translate)
        text = text.translate(_LINE_BREAKS_ESCAPED)
    return f"data: {text}\n\n"
