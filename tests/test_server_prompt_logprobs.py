"""Prompt log-probs over the server: ``echo`` with ``logprobs`` on completions (OpenAI's legacy
scoring, what lm-evaluation-harness sends: ``echo=True, max_tokens=1, logprobs=1``), vLLM's
``prompt_logprobs`` field on completions and chat, and ``usage.prompt_tokens_details.cached_tokens``.
Numbers equal the in-process engine's and the model's own ``log_softmax``; the engine runs on the
loop's thread and in an engine process. Every test ends with every KV block free."""

from __future__ import annotations

import httpx
import pytest
import torch

import hf_paged
from hf_paged.demo import byte_tokenizer
from tests.helpers.serving import (ENGINE_PLACES, MODEL, NUM_BLOCKS, assert_all_free, serving, single_threaded_torch,
                                   tiny_model)

TOKENIZER = byte_tokenizer()
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def served(request):
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS, "block_size": 4},
                                          engine_process=request.param == "engine process") as (server, loop):
        yield server, loop


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _post(served, body: dict, path: str = "/v1/completions") -> httpx.Response:
    server, loop = served
    try:
        return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    finally:
        assert_all_free(loop)


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log P(token i | tokens < i) for i >= 1, from one stock forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served, model):
    resp = _post(served, {"prompt": PROMPT, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0})
    choice = resp.json()["choices"][0]
    ids = TOKENIZER(PROMPT).input_ids
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["tokens"][:len(ids)] == [TOKENIZER.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = torch.tensor(logprobs["token_logprobs"][1:len(ids)])
    assert torch.allclose(scored, _model_logprobs(model, ids), atol=1e-4)
    for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]):  # the top one, and the chosen
        assert token in top and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in logprobs["top_logprobs"][1:len(ids)])  # a prompt token not the likeliest
    assert logprobs["text_offset"][:3] == [0, 1, 2] and logprobs["text_offset"][len(ids)] == len(PROMPT)
    plain = _post(served, {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "temperature": 0}).json()
    assert len(plain["choices"][0]["logprobs"]["tokens"]) == 1  # negative control: no echo, no prompt
    # the same token, its log-prob to the last bits: the echoing request read no prefix cache, this one did
    assert plain["choices"][0]["logprobs"]["tokens"] == logprobs["tokens"][len(ids):]
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"][len(ids):],
                                                                              abs=1e-5)


def test_a_streamed_echo_carries_the_same_numbers(served):
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 3, "logprobs": 2, "temperature": 0}
    whole = _post(served, body).json()["choices"][0]
    server, loop = served
    tokens, values, text = [], [], ""
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, **body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()["choices"][0]
                text += chunk["text"]
                if chunk["logprobs"]:
                    tokens += chunk["logprobs"]["tokens"]
                    values += chunk["logprobs"]["token_logprobs"]
    assert_all_free(loop)
    assert (text, tokens, values) == (whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["token_logprobs"])


def test_vllms_prompt_logprobs_field_on_completions_and_chat(served, model):
    ids = TOKENIZER(PROMPT).input_ids
    choice = _post(served, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    want = _model_logprobs(model, ids)
    for i, entry in enumerate(entries[1:]):
        mine = entry[str(ids[i + 1])]
        assert abs(mine["logprob"] - want[i].item()) < 1e-4 and mine["decoded_token"] == TOKENIZER.decode([ids[i + 1]])
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2] and mine["rank"] >= 1
        assert mine["rank"] in (1, 2) or len(entry) == 3  # the prompt token, and the top 2
    assert choice["logprobs"] is None  # prompt log-probs alone, no output ones
    assert "prompt_logprobs" not in _post(served, {"prompt": PROMPT, "max_tokens": 2}).json()["choices"][0]
    messages = [{"role": "user", "content": "Hello"}]
    chat = _post(served, {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}, "/v1/chat/completions").json()
    chat_ids = TOKENIZER(TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    assert all(list(entry) == [str(t)] for entry, t in zip(chat["prompt_logprobs"][1:], chat_ids[1:]))


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
])
def test_bad_prompt_logprobs_are_400s_naming_them(served, body, param):
    resp = _post(served, {"prompt": PROMPT, "max_tokens": 2, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(served):
    prompt = "A long shared system prompt that fills several blocks. " * 2
    first = _post(served, {"prompt": prompt, "max_tokens": 2}).json()["usage"]
    again = _post(served, {"prompt": prompt, "max_tokens": 2}).json()["usage"]
    length = len(TOKENIZER(prompt).input_ids)
    assert first["prompt_tokens_details"]["cached_tokens"] in (0, again["prompt_tokens_details"]["cached_tokens"])
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < length and cached % 4 == 0  # whole blocks of 4, never the last token
    scored = _post(served, {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0}).json()["usage"]
    assert scored["prompt_tokens_details"]["cached_tokens"] == 0  # prompt log-probs read no cache (as vLLM)


def test_the_engine_agrees(model):
    """The server's numbers are the engine's: one in-process engine, same model and prompt."""
    engine = hf_paged.LLMEngine(model, TOKENIZER, num_blocks=NUM_BLOCKS, block_size=4)
    out = engine.generate([PROMPT], hf_paged.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
                          use_tqdm=False)[0]
    ids = TOKENIZER(PROMPT).input_ids
    values = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i])
    assert torch.allclose(values, _model_logprobs(model, ids), atol=1e-4)
    assert engine.kv.stats()["blocks_used"] == 0


def test_echo_with_max_tokens_0_is_the_prompt_alone_scored(served):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "temperature": 0}
    alone = _post(served, {**body, "max_tokens": 0}).json()
    more = _post(served, {**body, "max_tokens": 1}).json()
    ids = TOKENIZER(PROMPT).input_ids
    choice, lp = alone["choices"][0], alone["choices"][0]["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"] == more["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    assert alone["usage"]["completion_tokens"] == 0 and alone["usage"]["total_tokens"] == len(ids)
    assert [list(top.values()) for top in lp["top_logprobs"][1:]] == [[v] for v in lp["token_logprobs"][1:]]
    for refused in ({"prompt": PROMPT, "max_tokens": 0}, {**body, "max_tokens": 0, "stream": True}):
        resp = _post(served, refused)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    chat = _post(served, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "/v1/chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_offsets_count_the_special_tokens_the_text_shows(served, skip_special_tokens):
    """A token's ``text_offset`` is the length of the text before it: an echoed token-id prompt shows
    its special tokens (decoded whole), the output shows them with ``skip_special_tokens: false``
    (before, special tokens were zero wide everywhere, so later offsets fell short); streamed too."""
    eos = TOKENIZER.eos_token_id
    prompt = [TOKENIZER.bos_token_id, *TOKENIZER("Hi, ").input_ids, eos, *TOKENIZER("there").input_ids]
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos): 100}, "skip_special_tokens": skip_special_tokens}
    choice = _post(served, body).json()["choices"][0]
    ids = [TOKENIZER.convert_tokens_to_ids(t) if t in TOKENIZER.all_special_tokens else None
           for t in choice["logprobs"]["tokens"]]
    generated = [eos] * 4
    assert ids[len(prompt):] == generated  # the bias made every output token the special one
    shown = TOKENIZER.decode(prompt) + TOKENIZER.decode(generated, skip_special_tokens=skip_special_tokens)
    assert choice["text"] == shown
    every = [*prompt, *generated]
    expected = [len(TOKENIZER.decode(every[:i])) for i in range(len(prompt))]
    shown_before = [TOKENIZER.decode(generated[:i], skip_special_tokens=skip_special_tokens) for i in range(4)]
    expected += [len(TOKENIZER.decode(prompt)) + len(text) for text in shown_before]
    assert choice["logprobs"]["text_offset"] == expected
    server, loop = served
    offsets = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, **body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()["choices"][0]
                offsets += chunk["logprobs"]["text_offset"] if chunk["logprobs"] else []
    assert_all_free(loop)
    assert offsets == expected


def test_the_whole_vocabulary_on_a_server_that_allows_it(served):
    """``-1`` asks for every token's log-prob (vLLM's), on a server started with
    ``--max-logprobs -1``; elsewhere it is a 400 naming the field and the option."""
    body = {"max_tokens": 2, "temperature": 0}
    refused = _post(served, {**body, "prompt": PROMPT, "logprobs": -1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert "--max-logprobs" in refused.json()["error"]["message"]
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}, max_logprobs=-1) as whole:
        vocab = whole[1].engine.model.config.vocab_size
        chat = _post(whole, {**body, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                             "top_logprobs": -1, "prompt_logprobs": -1}, "/v1/chat/completions").json()
        for entry in chat["choices"][0]["logprobs"]["content"]:
            values = torch.tensor([top["logprob"] for top in entry["top_logprobs"]])
            assert len(values) == vocab and abs(float(values.exp().sum()) - 1) < 1e-4
        assert all(len(entry) == vocab for entry in chat["prompt_logprobs"][1:])
        completion = _post(whole, {**body, "prompt": PROMPT, "logprobs": -1}).json()["choices"][0]["logprobs"]
        assert len(completion["top_logprobs"][0]) > 20  # keyed by text: tokens of one text count once
        too_many = _post(whole, {**body, "prompt": PROMPT, "logprobs": vocab + 1})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
