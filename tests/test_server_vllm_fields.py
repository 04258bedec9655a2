"""vLLM's request fields that its server takes and a differential probe found refused here:
``model`` left out, ``return_tokens_as_token_ids``, ``stream_options.continuous_usage_stats``,
``truncate_prompt_tokens`` (with ``truncation_side``); and what its answers carry that this
server's lacked: a chat stream's opening role chunk, ``prompt_token_ids`` with
``return_token_ids``. Driven over HTTP (the ``openai`` client, or ``httpx`` where the client
insists on a field), compared with an in-process engine on the same weights, streamed and not;
bad values are 400s naming the field. After every test nothing is in flight and every KV block
is free (the ``client`` fixture)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from hf_paged.serve.protocol import CompletionRequest, Limits
from tests.helpers.serving import MODEL, client, engine, served  # noqa: F401
from tests.test_server import TOKENIZER, chat_ids, truth

PROMPT_IDS = list(range(40, 80))  # 40 byte tokens
TEXT = "Grüße, 世界! Hello"  # multi-byte characters: tokens inside a character, offsets in characters
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
GREEDY = dict(max_tokens=5, temperature=0)
IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def post(served, path: str, body: dict) -> httpx.Response:
    server, _ = served
    return httpx.post(server.url + path, json=body, timeout=60)


def chunks_of(resp: httpx.Response) -> list[dict]:
    """A streamed answer's chunks (``[DONE]`` last, left out)."""
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert resp.status_code == 200 and events[-1] == "[DONE]", resp.text
    return [json.loads(e) for e in events[:-1]]


def top_ids(entry: dict[int, float], k: int) -> list[int]:
    """The engine's ``k`` likeliest tokens at one step, likeliest first."""
    return [t for t, _ in sorted(entry.items(), key=lambda item: -item[1])[:k]]


def placeholders(ids: list[int]) -> list[str]:
    return [f"token_id:{t}" for t in ids]


def assert_refused(served, path: str, body: dict, param: str, says: str = "") -> None:
    resp = post(served, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and re.search(says, error["message"]), error


# ---------------------------------------------------------------------------- model
@STREAMED
def test_a_request_without_model_is_for_the_served_one(client, served, engine, stream):
    ref = truth(engine, PROMPT_IDS, max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    chat_ref = truth(engine, chat_ids(MESSAGES), max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    for model in ({}, {"model": None}):  # left out, or null (the openai package's "not set")
        common = {**model, **GREEDY, **IGNORE_EOS, "stream": stream}
        resp = post(served, COMPLETIONS, {"prompt": PROMPT_IDS, **common})
        chat = post(served, CHAT, {"messages": MESSAGES, **common})
        if stream:
            parts, chat_parts = chunks_of(resp), chunks_of(chat)
            assert {c["model"] for c in parts + chat_parts} == {MODEL}
            ids = [t for c in parts for t in c["choices"][0]["token_ids"]]
            chat_ids_got = [t for c in chat_parts for t in c["choices"][0].get("token_ids") or []]
            chat_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chat_parts)
        else:
            assert resp.status_code == chat.status_code == 200 and resp.json()["model"] == chat.json()["model"] == MODEL
            ids, chat_ids_got = resp.json()["choices"][0]["token_ids"], chat.json()["choices"][0]["token_ids"]
            chat_text = chat.json()["choices"][0]["message"]["content"]
        assert ids == ref.token_ids and chat_ids_got == chat_ref.token_ids and chat_text == chat_ref.text
    for path, body in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})):
        wrong = post(served, path, {"model": "other", **body, **GREEDY})
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
        assert wrong.json()["error"]["code"] == "model_not_found"
    assert_refused(served, COMPLETIONS, {"model": 3, "prompt": "Hi"}, "model")


# ---------------------------------------------------------------------------- return_tokens_as_token_ids
@STREAMED
def test_completion_logprob_tokens_as_token_ids(client, engine, stream):
    """Every token (the echoed prompt's too) and every top-logprob key reads ``token_id:<id>``;
    the text, the token ids and ``text_offset`` (in the text's characters) are as without it."""
    prompt_ids = TOKENIZER(TEXT)["input_ids"]
    ref = truth(engine, prompt_ids, max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=2).outputs[0]

    def ask(as_ids: bool):
        resp = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, stream=stream, **GREEDY,
                                         extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": as_ids})
        choices = [c.choices[0] for c in resp] if stream else [resp.choices[0]]
        ids = [t for c in choices for t in c.model_extra["token_ids"] or []]
        lp = [c.logprobs for c in choices if c.logprobs]
        return ("".join(c.text for c in choices), ids, [t for p in lp for t in p.tokens],
                [o for p in lp for o in p.text_offset], [top for p in lp for top in p.top_logprobs])

    text, ids, tokens, offsets, tops = ask(True)
    plain_text, plain_ids, plain_tokens, plain_offsets, _ = ask(False)
    assert ids == ref.token_ids and text == TEXT + ref.text
    assert (text, ids, offsets) == (plain_text, plain_ids, plain_offsets)  # the text and its offsets stay
    assert tokens == placeholders(prompt_ids + ids) != plain_tokens
    assert offsets == sorted(offsets) and offsets[-1] < len(text)  # offsets index the text
    generated_tops = tops[len(prompt_ids):]
    assert [list(top) for top in generated_tops] == [placeholders(top_ids(e, 2)) for e in ref.logprobs]
    assert [list(top.values()) for top in generated_tops] == \
        [pytest.approx(sorted(e.values(), reverse=True)[:2], abs=1e-5) for e in ref.logprobs]
    assert tops[0] is None and all(k.startswith("token_id:") for top in tops[1:] for k in top)


@STREAMED
def test_chat_logprob_tokens_as_token_ids(client, engine, stream):
    """Each token and top alternative reads ``token_id:<id>``; as vLLM, a chosen token's ``bytes``
    stay its text's (joined they give the content) and an alternative's are its ``token_id:<id>``'s."""
    ref = truth(engine, chat_ids(MESSAGES), max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=2).outputs[0]

    def ask(as_ids: bool):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                              stream=stream, **GREEDY,
                                              extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": as_ids})
        choices = [c.choices[0] for c in resp if c.choices] if stream else [resp.choices[0]]
        content = "".join((c.delta if stream else c.message).content or "" for c in choices)
        entries = [e for c in choices if c.logprobs for e in c.logprobs.content]
        return content, [t for c in choices for t in c.model_extra.get("token_ids") or []], entries

    content, ids, entries = ask(True)
    plain_content, plain_ids, plain_entries = ask(False)
    assert (content, ids) == (plain_content, plain_ids) and ids == ref.token_ids and content == ref.text
    assert [e.token for e in entries] == placeholders(ids) != [e.token for e in plain_entries]
    assert [e.bytes for e in entries] == [e.bytes for e in plain_entries]
    assert bytes(b for e in entries for b in e.bytes).decode(errors="replace") == content
    assert [e.logprob for e in entries] == pytest.approx([e[t] for e, t in zip(ref.logprobs, ids)], abs=1e-5)
    assert [[top.token for top in e.top_logprobs] for e in entries] == \
        [placeholders(top_ids(e, 2)) for e in ref.logprobs]
    assert all(top.bytes == list(top.token.encode()) for e in entries for top in e.top_logprobs)


def test_return_tokens_as_token_ids_must_be_a_boolean(client, served):
    for path, body in ((COMPLETIONS, {"prompt": "Hi", "logprobs": 1}), (CHAT, {"messages": MESSAGES})):
        assert_refused(served, path, {"model": MODEL, **body, "max_tokens": 2, "return_tokens_as_token_ids": "yes"},
                       "return_tokens_as_token_ids", "valid boolean")


# ---------------------------------------------------------------------------- continuous_usage_stats
@pytest.mark.parametrize("kind", ["completion", "completion echo", "chat"])
def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(client, engine, kind):
    """As vLLM: with ``include_usage``, every choice's chunk carries the prompt's tokens and that
    choice's tokens so far (n=2: each counts its own); the last chunk is the usage of them all."""
    options = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=3, n=2, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=IGNORE_EOS)
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **options))
        prompt_len = len(chat_ids(MESSAGES))
    else:
        chunks = list(client.completions.create(prompt=PROMPT_IDS, echo=kind == "completion echo", **options))
        prompt_len = len(PROMPT_IDS)
    generated = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        generated[c.index] += c.model_extra.get("token_ids") or []
        so_far = len(generated[c.index])
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == \
            (prompt_len, so_far, prompt_len + so_far)
    assert [len(ids) for ids in generated.values()] == [6, 6]
    last = chunks[-1]
    assert not last.choices and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len, 12)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_count_what_the_engine_generated(client, engine, kind):
    """Greedy, one choice: the usage so far follows the engine's tokens one by one."""
    prompt = PROMPT_IDS if kind == "completion" else chat_ids(MESSAGES)
    ref = truth(engine, prompt, max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    options = dict(model=MODEL, stream=True, **GREEDY, extra_body=IGNORE_EOS,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    create = client.completions.create if kind == "completion" else client.chat.completions.create
    chunks = list(create(prompt=PROMPT_IDS, **options) if kind == "completion"
                  else create(messages=MESSAGES, **options))
    ids = [t for chunk in chunks if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids") or []]
    assert ids == ref.token_ids
    counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == len(prompt) for c in chunks)


def test_continuous_usage_stats_only_with_include_usage_and_stream(client, served):
    """As vLLM: without ``include_usage`` no chunk has usage; without ``stream`` stream_options is
    a 400; a value that is not a boolean is a 400 naming it."""
    without = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    assert without and all(c.usage is None for c in without)
    for path, body in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})):
        body = {"model": MODEL, **body, "max_tokens": 2}
        options = {"include_usage": True, "continuous_usage_stats": True}
        assert_refused(served, path, {**body, "stream_options": options}, "stream_options",
                       "only allowed when stream is true")
        assert_refused(served, path, {**body, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
                       "stream_options.continuous_usage_stats", "valid boolean")


# ---------------------------------------------------------------------------- truncate_prompt_tokens
@STREAMED
@pytest.mark.parametrize("side, kept", [(None, PROMPT_IDS[-7:]), ("left", PROMPT_IDS[-7:]), ("right", PROMPT_IDS[:7])])
def test_truncate_prompt_tokens_keeps_that_many(client, engine, side, kept, stream):
    ref = truth(engine, kept, max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    fields = {**IGNORE_EOS, "truncate_prompt_tokens": 7, **({"truncation_side": side} if side else {})}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, stream=stream, **GREEDY,
                                     extra_body=fields, **usage)
    parts = list(resp) if stream else [resp]
    choices = [p.choices[0] for p in parts if p.choices]
    assert [t for c in choices for t in c.model_extra["token_ids"]] == ref.token_ids
    assert parts[-1].usage.prompt_tokens == 7 and parts[-1].usage.completion_tokens == 5
    assert "".join(c.text for c in choices) == engine.tokenizer.decode(kept) + ref.text  # the echo: the prompt served


def test_a_cut_text_prompt_answers_as_its_kept_tokens_sent(client):
    """A text prompt cut to its last tokens answers (echo, log-probs, offsets) as those tokens sent
    as the prompt; a prompt not cut echoes as sent."""
    ids = TOKENIZER(TEXT)["input_ids"]
    common = dict(model=MODEL, echo=True, logprobs=2, **GREEDY)
    cut = client.completions.create(prompt=TEXT, **common, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 9})
    sent = client.completions.create(prompt=ids[-9:], **common, extra_body=IGNORE_EOS)
    assert cut.choices[0].model_dump() == sent.choices[0].model_dump() and cut.usage.prompt_tokens == 9
    assert len(cut.choices[0].logprobs.tokens) == 9 + 5 and cut.choices[0].logprobs.token_logprobs[0] is None
    whole = client.completions.create(prompt=TEXT, **common, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 500})
    assert whole.choices[0].text.startswith(TEXT) and whole.usage.prompt_tokens == len(ids)


@STREAMED
def test_truncate_prompt_tokens_in_chat_cuts_the_templated_prompt(client, engine, stream):
    ids = chat_ids(MESSAGES)
    ref = truth(engine, ids[-4:], max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **GREEDY,
                                          extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 4},
                                          **({"stream_options": {"include_usage": True}} if stream else {}))
    parts = list(resp) if stream else [resp]
    choices = [p.choices[0] for p in parts if p.choices]
    assert [t for c in choices for t in c.model_extra.get("token_ids") or []] == ref.token_ids
    assert "".join((c.delta if stream else c.message).content or "" for c in choices) == ref.text
    assert parts[-1].usage.prompt_tokens == 4


def test_truncate_prompt_tokens_minus_one_keeps_what_fits(client, engine, served):
    """-1: the prompt's last tokens that fit in the context beside the ``max_tokens`` the request
    gets (its own, or completions' default 16)."""
    context = client.models.retrieve(MODEL).model_extra["max_model_len"]
    too_long = [72 + i % 50 for i in range(context + 20)]
    assert post(served, COMPLETIONS, {"model": MODEL, "prompt": too_long, **GREEDY}).status_code == 400
    ref = truth(engine, too_long[-(context - 5):], max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    fits = client.completions.create(model=MODEL, prompt=too_long, **GREEDY,
                                     extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1})
    assert (fits.usage.prompt_tokens, fits.usage.completion_tokens) == (context - 5, 5)
    assert fits.choices[0].model_extra["token_ids"] == ref.token_ids
    default = client.completions.create(model=MODEL, prompt=too_long, temperature=0,
                                        extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1})
    assert (default.usage.prompt_tokens, default.usage.completion_tokens) == (context - 16, 16)
    short = client.completions.create(model=MODEL, prompt=PROMPT_IDS, **GREEDY,
                                      extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1})
    assert short.usage.prompt_tokens == len(PROMPT_IDS)  # a prompt that fits is not cut


@pytest.mark.parametrize("value, says", [(0, "-1 .* or the number of prompt tokens to keep"),
                                         (100000, "more than the model's context"), (-2, "greater than or equal"),
                                         ("5", "valid integer"), (True, "valid integer"), (2.0, "valid integer")])
def test_bad_truncation_is_a_400_naming_the_field(client, served, value, says):
    for path, body in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})):
        assert_refused(served, path, {"model": MODEL, **body, "max_tokens": 2, "truncate_prompt_tokens": value},
                       "truncate_prompt_tokens", says)
        assert_refused(served, path, {"model": MODEL, **body, "max_tokens": 2, "truncate_prompt_tokens": 3,
                                      "truncation_side": "up"}, "truncation_side")


def test_minus_one_keeps_what_the_context_and_the_kv_budget_hold():
    """Unit: -1 against a server's limits (the served model's KV cache holds its whole context)."""
    ids = list(range(200))
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 10, "truncate_prompt_tokens": -1})
    assert req.truncated(ids, Limits(context=100)) == ids[-90:]
    assert req.truncated(ids, Limits(context=100, kv_tokens=50)) == ids[-40:]  # a fixed KV budget below the context
    assert req.truncated(ids, Limits()) == ids  # no known context: nothing to cut to
    unset = CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": -1})
    assert unset.truncated(ids, Limits(context=100), 16) == ids[-84:] and unset.truncated(ids, Limits(context=100)) \
        == ids[-99:]  # room for the default max_tokens, else for one token


# ---------------------------------------------------------------------------- stream openings, prompt_token_ids
@pytest.mark.parametrize("echo", [False, True], ids=["reply", "echo"])
def test_a_chat_stream_opens_each_choice_with_its_role_alone(client, served, echo):
    """As OpenAI and vLLM: a choice's first chunk is ``{"role": ..., "content": ""}`` (no tokens,
    log-probs or finish reason); no later chunk repeats the role; the contents still join to the
    reply (with ``echo``, the last message's text first, in a chunk of its own as vLLM's)."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Well"}] if echo else MESSAGES
    template = dict(add_generation_prompt=False, continue_final_message=True) if echo else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 1.0, "seed": 4, "n": 2,
            "logprobs": True, "echo": echo, **IGNORE_EOS, **template}
    whole = post(served, CHAT, body).json()
    parts = chunks_of(post(served, CHAT, {**body, "stream": True}))
    for index in (0, 1):
        mine = [c["choices"][0] for c in parts if c["choices"][0]["index"] == index]
        assert mine[0] == {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None, "stop_reason": None}
        assert all("role" not in c["delta"] for c in mine[1:]) and mine[-1]["finish_reason"] == "length"
        if echo:
            assert mine[1] == {"index": index, "delta": {"content": "Well"}, "logprobs": None,
                               "finish_reason": None, "stop_reason": None}
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == whole["choices"][index]["message"]["content"]
        assert [t for c in mine for t in c.get("token_ids") or []] == whole["choices"][index]["token_ids"]
    assert whole["choices"][0]["message"]["content"].startswith("Well") == echo


@STREAMED
def test_return_token_ids_gives_each_completion_its_prompt_token_ids(client, served, stream):
    """As vLLM: with ``return_token_ids`` every completion choice carries its prompt's token ids
    (streamed: in its first chunk only); without it none does."""
    prompts = [PROMPT_IDS, PROMPT_IDS[:9]]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 4,
            "stream": stream, **IGNORE_EOS}
    resp = post(served, COMPLETIONS, body)
    choices = [c["choices"][0] for c in chunks_of(resp)] if stream else resp.json()["choices"]
    for index in range(4):
        mine = [c for c in choices if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompts[index // 2]
        assert all("prompt_token_ids" not in c for c in mine[1:])
    plain = post(served, COMPLETIONS, {**body, "return_token_ids": False})
    without = [c["choices"][0] for c in chunks_of(plain)] if stream else plain.json()["choices"]
    assert len(without) >= 4 and all("prompt_token_ids" not in c for c in without)


@STREAMED
def test_return_token_ids_gives_a_chat_answer_its_prompt_token_ids(client, served, stream):
    """As vLLM: a chat answer carries the templated prompt's token ids once, at its top level
    (streamed: in each choice's opening chunk); without ``return_token_ids`` it does not."""
    body = {"model": MODEL, "messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 4,
            "stream": stream, **IGNORE_EOS}
    resp = post(served, CHAT, body)
    if stream:
        parts = chunks_of(resp)
        carrying = [c for c in parts if "prompt_token_ids" in c]
        assert [c["choices"][0]["delta"] for c in carrying] == [{"role": "assistant", "content": ""}] * 2
        assert all(c["prompt_token_ids"] == chat_ids(MESSAGES) for c in carrying)
    else:
        assert resp.json()["prompt_token_ids"] == chat_ids(MESSAGES)
    plain = post(served, CHAT, {**body, "return_token_ids": False})
    bodies = chunks_of(plain) if stream else [plain.json()]
    assert all("prompt_token_ids" not in b for b in bodies)


# ---------------------------------------------------------------------------- line breaks inside texts
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unicode_line_breaks_in_a_streamed_text_keep_each_event_on_one_line(client, served, path):
    """U+2028, U+0085 and U+2029 in a streamed text (echoed here) go out as JSON escapes: raw, they
    are line breaks to ``str.splitlines()``, so a reader such as httpx's ``iter_lines()`` cut the
    event and got broken JSON (a soak found it: a sampled text held U+2028)."""
    breaks = "a\u2028b\x85c\u2029d"
    if path == CHAT:
        body = {"messages": [*MESSAGES, {"role": "assistant", "content": breaks}], "add_generation_prompt": False,
                "continue_final_message": True}
    else:
        body = {"prompt": breaks}
    server, _ = served
    with httpx.stream("POST", server.url + path, json={"model": MODEL, "max_tokens": 2, "temperature": 0,
                                                       "echo": True, "stream": True, **body}, timeout=60) as resp:
        lines = list(resp.iter_lines())
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and "[DONE]" not in line]
    assert all(not line or line.startswith("data: ") for line in lines), lines
    text = "".join(c["choices"][0]["delta"].get("content") or "" if path == CHAT else c["choices"][0]["text"]
                   for c in events)
    assert text.startswith(breaks) and lines[-2] == "data: [DONE]"
