"""OpenAI response bodies (and stream chunks) from engine outputs: choices, logprobs, usage."""

from __future__ import annotations

import json
import time
from typing import Any

from hf_paged.engine.outputs import RequestOutput

OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}


class TokenText:
    """Each token's own text, as logprobs show it (decoded once per id)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                        offset: int = 0) -> dict:
    """Completions' format: parallel lists of tokens, their log-probs, top-``k`` and text offsets."""
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp[t] for lp, t in zip(logprobs, token_ids)],
            "top_logprobs": [_by_text(text_of, _top(lp, k)) for lp in logprobs], "text_offset": offsets}


def _by_text(text_of: TokenText, top: list[tuple[int, float]]) -> dict[str, float]:
    """Top alternatives keyed by text; tokens of the same text (bytes of a split character all read
    U+FFFD) keep the likeliest."""
    out: dict[str, float] = {}
    for token_id, value in top:
        out.setdefault(text_of(token_id), value)
    return out


def chat_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """Chat's format: one entry per token, with its UTF-8 bytes and its top-``k`` alternatives."""
    def entry(token_id: int, value: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(i, v) for i, v in _top(lp, k)]}
                        for lp, t in zip(logprobs, token_ids)]}


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(kind: str, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
           token_ids: list[int] | None = None, *, delta: bool = False, first: bool = False,
           tool_calls: list[dict] | None = None) -> dict:
    """A completions or chat choice; ``delta``: a stream chunk's (chat: ``delta`` not ``message``).
    ``tool_calls``: a chat message's calls (or a chunk's call deltas); its content may then be None."""
    if kind == "completion":
        body = {"index": index, "text": text}
    elif delta:
        body = {"index": index, "delta": {"role": "assistant", "content": text} if first else {"content": text}}
    else:
        body = {"index": index, "message": {"role": "assistant", "content": text}}
    if tool_calls:
        body["delta" if delta else "message"]["tool_calls"] = tool_calls
    body.update(logprobs=logprobs, finish_reason=finish_reason)
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def envelope(kind: str, response_id: str, model: str, choices: list[dict], usage_: dict | None = None, *,
             chunk: bool = False, created: int | None = None) -> dict:
    body = {"id": response_id, "object": (CHUNK_OBJECT if chunk else OBJECT)[kind],
            "created": int(time.time()) if created is None else created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
