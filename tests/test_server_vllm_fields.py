"""vLLM's request fields that its server takes and a differential probe found refused here:
``model`` left out, ``return_tokens_as_token_ids``, ``stream_options.continuous_usage_stats``,
``truncate_prompt_tokens`` (with ``truncation_side``). Driven by the ``openai`` client over HTTP,
compared with an in-process engine on the same weights; bad values are 400s naming the field.
After every test nothing is in flight and every KV block is free (the ``client`` fixture)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.helpers.serving import MODEL, client, engine, served  # noqa: F401
from tests.test_server import chat_ids, truth

PROMPT_IDS = list(range(40, 80))  # 40 byte tokens
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
GREEDY = dict(max_tokens=5, temperature=0)
IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}


def post(served, path: str, body: dict) -> httpx.Response:
    server, _ = served
    return httpx.post(server.url + path, json=body, timeout=60)


# ---------------------------------------------------------------------------- model
def test_a_request_without_model_is_for_the_served_one(client, served, engine):
    ref = truth(engine, PROMPT_IDS, max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    resp = post(served, "/v1/completions", {"prompt": PROMPT_IDS, **GREEDY, **IGNORE_EOS})
    assert resp.status_code == 200 and resp.json()["model"] == MODEL
    assert resp.json()["choices"][0]["token_ids"] == ref.token_ids
    chat = post(served, "/v1/chat/completions", {"messages": MESSAGES, **GREEDY})
    assert chat.status_code == 200 and chat.json()["model"] == MODEL
    wrong = post(served, "/v1/completions", {"model": "other", "prompt": "Hi", **GREEDY})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


# ---------------------------------------------------------------------------- return_tokens_as_token_ids
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprob_tokens_as_token_ids(client, stream):
    def ask(as_ids: bool):
        resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, logprobs=2, stream=stream, **GREEDY,
                                         extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": as_ids})
        choices = [c.choices[0] for c in resp] if stream else [resp.choices[0]]
        ids = [t for c in choices for t in c.model_extra["token_ids"] or []]
        lp = [c.logprobs for c in choices if c.logprobs]
        return ("".join(c.text for c in choices), ids, [t for p in lp for t in p.tokens],
                [o for p in lp for o in p.text_offset], [k for p in lp for top in p.top_logprobs for k in top])

    text, ids, tokens, offsets, top_keys = ask(True)
    plain_text, plain_ids, plain_tokens, plain_offsets, _ = ask(False)
    assert (text, ids, offsets) == (plain_text, plain_ids, plain_offsets)  # the text and its offsets stay
    assert tokens == [f"token_id:{t}" for t in ids] != plain_tokens
    assert all(k.startswith("token_id:") and int(k.split(":")[1]) >= 0 for k in top_keys) and top_keys


def test_chat_logprob_tokens_as_token_ids(client):
    def ask(as_ids: bool):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                              **GREEDY, extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": as_ids})
        return resp.choices[0]

    got, plain = ask(True), ask(False)
    assert got.message.content == plain.message.content
    ids = got.model_extra["token_ids"]
    assert [e.token for e in got.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert [e.bytes for e in got.logprobs.content] == [e.bytes for e in plain.logprobs.content]
    assert all(top.token.startswith("token_id:") for e in got.logprobs.content for top in e.top_logprobs)


# ---------------------------------------------------------------------------- continuous_usage_stats
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(client, kind):
    options = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=3, n=2, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=IGNORE_EOS)
    if kind == "completion":
        chunks = list(client.completions.create(prompt=PROMPT_IDS, **options))
        prompt_len = len(PROMPT_IDS)
    else:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **options))
        prompt_len = len(chat_ids(MESSAGES))
    generated = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        generated[c.index] += len(c.model_extra.get("token_ids") or [])
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == \
            (prompt_len, generated[c.index], prompt_len + generated[c.index])
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 12 and last.usage.prompt_tokens == prompt_len
    without = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in without)  # as vLLM: only together with include_usage


# ---------------------------------------------------------------------------- truncate_prompt_tokens
@pytest.mark.parametrize("side, kept", [(None, PROMPT_IDS[-7:]), ("left", PROMPT_IDS[-7:]), ("right", PROMPT_IDS[:7])])
def test_truncate_prompt_tokens_keeps_that_many(client, engine, side, kept):
    ref = truth(engine, kept, max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    fields = {**IGNORE_EOS, "truncate_prompt_tokens": 7, **({"truncation_side": side} if side else {})}
    resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, **GREEDY, extra_body=fields)
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids and resp.usage.prompt_tokens == 7
    assert choice.text == engine.tokenizer.decode(kept) + ref.text  # the echo is the prompt served


def test_truncate_prompt_tokens_in_chat_and_minus_one(client, engine, served):
    ids = chat_ids(MESSAGES)
    ref = truth(engine, ids[-4:], max_new_tokens=5, temperature=0, ignore_eos=True).outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY,
                                          extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 4})
    assert chat.choices[0].model_extra["token_ids"] == ref.token_ids and chat.usage.prompt_tokens == 4
    context = client.models.retrieve(MODEL).model_extra["max_model_len"]
    too_long = [72] * (context + 20)
    refused = post(served, "/v1/completions", {"model": MODEL, "prompt": too_long, **GREEDY})
    assert refused.status_code == 400  # without truncation it does not fit
    fits = client.completions.create(model=MODEL, prompt=too_long, **GREEDY,
                                     extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1})
    assert fits.usage.prompt_tokens == context - GREEDY["max_tokens"] and fits.usage.completion_tokens == 5


@pytest.mark.parametrize("value, says", [(0, "-1 .* or the number of prompt tokens to keep"),
                                         (100000, "more than the model's context"), (-2, "greater than or equal"),
                                         ("5", "valid integer")])
def test_bad_truncation_is_a_400_naming_the_field(served, value, says):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        resp = post(served, path, {"model": MODEL, **body, "max_tokens": 2, "truncate_prompt_tokens": value})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "truncate_prompt_tokens", resp.text
        assert re.search(says, error["message"]), error["message"]
    side = post(served, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "truncation_side": "up"})
    assert side.status_code == 400 and side.json()["error"]["param"] == "truncation_side"
