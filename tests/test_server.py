"""The OpenAI-compatible server, driven by the real ``openai`` client on a loopback port: outputs
equal to ``LLMEngine.generate``, streaming, options, errors, disconnects, the command line. After
every test nothing is in flight and every KV block is free."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from hf_paged import LLMEngine, SamplingParams
from hf_paged.__main__ import main
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.detokenize import IncrementalDetokenizer, TextStream
from hf_paged.engine.outputs import CompletionOutput
from hf_paged.serve import ServerSettings
from hf_paged.serve.responses import TokenText
from hf_paged.serve.server import exposure_warning
from tests.helpers.serving import (ENGINE_PLACES, MODEL, NUM_BLOCKS, assert_all_free, client, engine,  # noqa: F401
                                   fail_next_step, free_port, mend_forwards, serving, single_threaded_torch,
                                   slow_forwards, tiny_model, wait_idle, wait_until_healthy)

TOKENIZER = byte_tokenizer()


def truth(engine: LLMEngine, prompt, **params) -> CompletionOutput:
    out = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert out.error is None
    return out


def chat_ids(messages: list[dict]) -> list[int]:
    text = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return TOKENIZER(text, add_special_tokens=False).input_ids


def has_multibyte(text: str) -> bool:
    """A character the byte tokenizer split over tokens (not U+FFFD, which invalid bytes give)."""
    return any(ord(ch) > 127 and ch != "\ufffd" for ch in text)


def aborted(server) -> int:
    metrics = httpx.get(server.url + "/metrics").text
    found = re.search(r'^hf_paged_requests_finished_total\{finish_reason="abort"\} (\d+)', metrics, re.M)
    return int(found.group(1)) if found else 0


GREEDY = dict(temperature=0, extra_body={"return_token_ids": True})


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def served(request):
    """Every test of this module runs against both: the engine on the engine loop's thread, and in
    an engine process of its own (what ``hf-paged serve`` runs)."""
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS},
                                          engine_process=request.param == "engine process") as (server, loop):
        yield server, loop


# ---------------------------------------------------------------------------- outputs equal the engine's
def test_completions_equal_the_engine(client, engine):
    prompts = ["Hello", "Once upon a time", "日本語"]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.model == MODEL and resp.object == "text_completion"
    refs = [truth(engine, p, max_new_tokens=12, temperature=0).outputs[0] for p in prompts]
    for choice, ref in zip(resp.choices, refs):
        assert (choice.text, choice.model_extra["token_ids"], choice.finish_reason) == \
               (ref.text, ref.token_ids, ref.finish_reason)
    assert resp.usage.prompt_tokens == sum(len(TOKENIZER(p).input_ids) for p in prompts)
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    ids = client.completions.create(model=MODEL, prompt=[72, 105, 33], max_tokens=6, **GREEDY).choices[0]
    ref = truth(engine, [72, 105, 33], max_new_tokens=6, temperature=0).outputs[0]
    assert ids.model_extra["token_ids"] == ref.token_ids


def test_chat_equals_the_engine(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    ref = truth(engine, chat_ids(messages), max_new_tokens=10, temperature=0).outputs[0]
    message = resp.choices[0].message
    assert (message.role, message.content, resp.choices[0].model_extra["token_ids"]) == ("assistant", ref.text,
                                                                                        ref.token_ids)
    assert resp.object == "chat.completion" and resp.usage.prompt_tokens == len(chat_ids(messages))
    assert resp.usage.completion_tokens == len(ref.token_ids)
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                       {"type": "text", "text": "there"}]}]  # one per line (vLLM)
    joined = truth(engine, chat_ids([messages[0], {"role": "user", "content": "Hi\nthere"}]), max_new_tokens=10,
                   temperature=0).outputs[0]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, **GREEDY) \
        .choices[0].model_extra["token_ids"] == joined.token_ids


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=6)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_chunks_concatenate_to_the_non_streamed_text(client, kind, sampling):
    """Multi-byte characters split over byte tokens arrive whole: a chunk sent with a broken
    character (U+FFFD for its first bytes) would make the concatenation differ."""
    if kind == "completion":
        create, args = client.completions.create, dict(prompt="Once upon a time")
        text_of, delta_of = (lambda r: r.choices[0].text), (lambda c: c.text)
    else:
        create, args = client.chat.completions.create, dict(messages=[{"role": "user", "content": "Once upon"}])
        text_of, delta_of = (lambda r: r.choices[0].message.content), (lambda c: c.delta.content or "")
    finish_of = lambda r: r.choices[0].finish_reason  # noqa: E731
    full = text_of(create(model=MODEL, max_tokens=48, **args, **sampling))
    chunks = [c for c in create(model=MODEL, max_tokens=48, stream=True, **args, **sampling) if c.choices]
    assert has_multibyte(full), "no split character in the output: the test would not see one broken"
    assert "".join(delta_of(c.choices[0]) for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == finish_of(create(model=MODEL, max_tokens=48, **args, **sampling))
    assert len(chunks) > 2
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"


CASES = {  # request options -> the same request as SamplingParams
    "n=2 seeded": (dict(temperature=1.0, seed=7, n=2), dict(temperature=1.0, seed=7, n=2)),
    "top_p top_k": (dict(temperature=1.0, top_p=0.9, seed=3, extra_body={"top_k": 8}),
                    dict(temperature=1.0, top_p=0.9, top_k=8, seed=3)),
    "min_p": (dict(temperature=1.0, seed=5, extra_body={"min_p": 0.5}), dict(temperature=1.0, min_p=0.5, seed=5)),
    "presence frequency": (dict(temperature=0, presence_penalty=1.5, frequency_penalty=1.0),  # greedy repeats here
                           dict(temperature=0, presence_penalty=1.5, frequency_penalty=1.0)),
    "repetition": (dict(temperature=1.0, seed=2, extra_body={"repetition_penalty": 1.8}),
                   dict(temperature=1.0, seed=2, repetition_penalty=1.8)),
    "min_tokens": (dict(temperature=1.0, seed=66, extra_body={"min_tokens": 20}),  # seed 66 alone stops at 7
                   dict(temperature=1.0, seed=66, min_new_tokens=20)),
    "ignore_eos": (dict(temperature=1.0, seed=66, extra_body={"ignore_eos": True}),
                   dict(temperature=1.0, seed=66, ignore_eos=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_options_equal_the_engine(client, engine, case):
    """Each option reaches the engine: the output equals the engine's with it, and differs from
    the engine's without it (where it changes anything)."""
    options, params = CASES[case]
    options = {**options, "extra_body": {**options.get("extra_body", {}), "return_token_ids": True}}
    prompt = "aaaa" if case == "presence frequency" else "The quick brown fox"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **options)
    ref = truth(engine, prompt, max_new_tokens=24, **params)
    assert [c.model_extra["token_ids"] for c in resp.choices] == [c.token_ids for c in ref.outputs]
    assert [c.text for c in resp.choices] == [c.text for c in ref.outputs]
    base = {k: v for k, v in params.items() if k in ("temperature", "seed", "n")}
    if base != params:
        assert [c.token_ids for c in truth(engine, prompt, max_new_tokens=24, **base).outputs] != \
               [c.token_ids for c in ref.outputs], f"{case} changes nothing here: the test would not see it ignored"


def test_seed_reproducibility_and_n(client):
    def run(seed):
        resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=seed, n=2)
        return [c.text for c in resp.choices]

    first = run(11)
    assert first == run(11) and first != run(12) and first[0] != first[1]


def test_stop_token_ids_and_stop_strings(client, engine):
    free = truth(engine, "Hello", max_new_tokens=24, temperature=0).outputs[0]
    stop_id = free.token_ids[4]
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "return_token_ids": True}).choices[0]
    assert cut.model_extra["token_ids"] == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop_id  # vLLM's extension
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stream=True,
                                            extra_body={"stop_token_ids": [stop_id]}))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop_id]
    j = next(j for j in range(3, len(free.text) - 2) if free.text.find(free.text[j: j + 2]) == j)
    stop = free.text[j: j + 2]
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=[stop])
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (free.text[:j], "stop")
    assert resp.choices[0].model_extra["stop_reason"] == stop
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0]
    assert (plain.finish_reason, plain.model_extra["stop_reason"]) == ("length", None)
    assert resp.choices[0].text == truth(engine, "Hello", max_new_tokens=24, temperature=0, stop=[stop]).outputs[0].text
    streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free.text[:j]


def test_logprobs(client, engine):
    """Log-probabilities equal the engine's to 1e-5: an engine in another process agreed to ~4e-6
    once in a full run (float32 log-softmax over the same tokens), never more; a wrong token or
    position differs by far more."""
    ref = truth(engine, "Hello", max_new_tokens=8, temperature=0, logprobs=3).outputs[0]
    lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=3) \
        .choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[t] for e, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5)
    assert lp.tokens == [TOKENIZER.decode([t]) for t in ref.token_ids]
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the chosen token is the top one
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.text_offset) == 8
    streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=3,
                                         stream=True)
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    messages = [{"role": "user", "content": "Hi"}]
    ref = truth(engine, chat_ids(messages), max_new_tokens=6, temperature=0, logprobs=2).outputs[0]
    content = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([e[t] for e, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in content)
    # a byte per token (a random model's are often parts of characters), none for special ones
    assert [len(e.bytes) for e in content] == [0 if t in TOKENIZER.all_special_ids else 1 for t in ref.token_ids]
    assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == \
        TOKENIZER.decode(ref.token_ids, skip_special_tokens=True)


def test_echo(client):
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + plain
    streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "Hello" + plain


def test_beam_search_extension(client, engine):
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, n=2,
                                     extra_body={"use_beam_search": True, "best_of": 3, "return_token_ids": True})
    ref = truth(engine, "Hello", max_new_tokens=8, temperature=0, num_beams=3, n=2)
    assert [c.model_extra["token_ids"] for c in resp.choices] == [c.token_ids for c in ref.outputs]
    assert len(resp.choices) == 2 and resp.choices[0].text != resp.choices[1].text
    ends = {"stop_token_ids": [resp.choices[0].model_extra["token_ids"][2]], "repetition_penalty": 1.5}
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, n=2, extra_body={
        "use_beam_search": True, "best_of": 3, "return_token_ids": True, **ends})  # beams read them
    ref = truth(engine, "Hello", max_new_tokens=8, temperature=0, num_beams=3, n=2, **ends)
    assert [c.model_extra["token_ids"] for c in resp.choices] == [c.token_ids for c in ref.outputs]


def test_usage_in_the_stream(client):
    sampled = dict(max_tokens=9, temperature=1.0, seed=5, n=2, extra_body={"ignore_eos": True})  # greedy takes n=1
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **sampled)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 stream=True, stream_options={"include_usage": True}, **sampled))
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1]) and plain.usage.completion_tokens == 18
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {0: plain.choices[0].message.content, 1: plain.choices[1].message.content}
    assert all("usage" in c.model_fields_set for c in chunks)  # "usage": null before the last, as OpenAI's


def test_models_health_and_metrics(client, served):
    server, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_running", "requests_waiting", "requests_swapped", "kv_blocks_used", "kv_blocks_free",
                 "kv_blocks_cached", "prefix_cache_hit_rate", "preemptions_total", "generation_tokens_per_second"):
        assert re.search(rf"^hf_paged_{name}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.M), name
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = int(re.search(rf"^hf_paged_{hist}_count (\d+)$", text, re.M).group(1))
        assert count >= 1 and f'hf_paged_{hist}_bucket{{le="+Inf"}} {count}' in text


def test_vllms_metric_names_ping_and_load(client, served):
    """What reads a vLLM server reads this one: its main series under vLLM's names (a Prometheus
    parser reads the whole exposition), ``/ping`` as ``/health``, ``/load`` counting the generation
    requests being answered."""
    server, loop = served
    loop.call(slow_forwards).result(10)  # the streamed request stays in the engine while it is looked at
    try:
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=64, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        assert httpx.get(server.url + "/load").json() == {"server_load": 1}
        busy = _samples(httpx.get(server.url + "/metrics").text)
        stream.close()
    finally:
        loop.call(mend_forwards).result(10)
    assert busy[("vllm:num_requests_running", (("model_name", MODEL),))] == 1
    assert 0 < busy[("vllm:kv_cache_usage_perc", (("model_name", MODEL),))] <= 1
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    samples = _samples(httpx.get(server.url + "/metrics").text)
    label = (("model_name", MODEL),)
    assert samples[("vllm:generation_tokens_total", label)] == samples[("hf_paged_generation_tokens_total", ())]
    for name in ("num_requests_waiting", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total"):
        assert ("vllm:" + name, label) in samples, name
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *label))] >= 1
    assert samples[("vllm:time_to_first_token_seconds_count", label)] == \
        samples[("hf_paged_time_to_first_token_seconds_count", ())] >= 2
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping").json() == {"status": "ok"}


def _samples(exposition: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` as ``prometheus_client``'s parser reads the text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(exposition) for s in family.samples}


def test_an_unsent_max_tokens_is_at_most_what_fits(client):
    """As vLLM: a completion's default max_tokens (16) and a chat's (as many as fit) are at most the
    room each prompt leaves in the model's context (once a 400 about a max_tokens=16 never sent); a
    prompt that leaves none, or a max_tokens the client sent that does not fit, is a 400 saying so."""
    context = client.models.retrieve(MODEL).model_extra["max_model_len"]
    long = [72] * (context - 10)
    resp = client.completions.create(model=MODEL, prompt=[long, [72, 105]], temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [(len(c.model_extra["token_ids"]), c.finish_reason) for c in resp.choices] == [(10, "length"),
                                                                                          (16, "length")]
    messages = [{"role": "user", "content": "a" * (context - 5 - len(chat_ids([{"role": "user", "content": ""}])))}]
    assert len(chat_ids(messages)) == context - 5
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    refusals = {  # what is sent -> (param, message)
        "no room": (dict(prompt=[72] * context), "prompt",
                    f"the prompt ({context} tokens) leaves no room in the model's context ({context} tokens)"),
        "sent, too many": (dict(prompt=long, max_tokens=11), "max_tokens",
                           f"{context - 10} prompt tokens plus max_tokens=11 exceed the model's context "
                           f"({context} tokens)")}
    for args, param, message in refusals.values():
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, **args)
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": "context_length_exceeded"}


def test_reset_prefix_cache_forgets_cached_prompts_and_waits_for_requests_in_flight(client, served):
    server, loop = served
    prompt = "A prompt long enough to fill a few blocks of sixteen tokens each. " * 2  # 134 bytes: 8 full blocks

    def hits_of_one_request() -> int:
        before = loop.call(LLMEngine.stats).result(timeout=30)["prefix_cache_hit_tokens"]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return loop.call(LLMEngine.stats).result(timeout=30)["prefix_cache_hit_tokens"] - before

    hits_of_one_request()
    assert hits_of_one_request() >= 7 * 16  # the prompt's blocks are cached
    reset = httpx.post(server.url + "/reset_prefix_cache")
    assert (reset.status_code, reset.json()) == (200, {"reset": True})
    assert hits_of_one_request() == 0  # forgotten (and cached again by this request)

    loop.call(slow_forwards).result(10)  # the streamed request below stays in flight
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()  # held: a dropped iterator closes the response (an abort)
            assert next(lines).startswith("data: ")
            refused = httpx.post(server.url + "/reset_prefix_cache")
    finally:
        loop.call(mend_forwards).result(10)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "requests_in_flight"
    assert wait_idle(loop, timeout=10)["running"] == 0
    assert hits_of_one_request() >= 7 * 16  # the refused reset changed nothing


@pytest.mark.parametrize("stream", [False, True])
def test_the_serving_benchmark_loops_agree(client, served, engine, stream):
    import asyncio

    from hf_paged.bench import serving as bench, workloads

    server, _ = served
    requests = workloads.dataset("sharegpt", 12, scale=0.05, seed=3).requests
    local = bench.engine_closed_loop(engine, requests, concurrency=4)
    remote = asyncio.run(bench.http_closed_loop(server.url, requests, 4, stream=stream, model=MODEL))
    assert remote.tokens == local.tokens and [len(t) for t in local.tokens] == [r.max_new_tokens for r in requests]
    assert remote.summary()["tokens_per_s"] > 0 and ("ttft_s_p50" in remote.summary()) == stream


# ---------------------------------------------------------------------------- disconnects abort
def test_a_client_leaving_mid_stream_aborts_its_request(client, served):
    server, loop = served
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_idle(loop, timeout=10)["running"] == 0
    assert aborted(server) == before + 1


def test_a_client_leaving_a_non_streamed_request_aborts_it(client, served):
    server, loop = served
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert wait_idle(loop, timeout=10)["running"] == 0
    assert aborted(server) == before + 1


def test_an_engine_failure_ends_the_requests_in_flight_and_serving_goes_on(client, served):
    server, loop = served
    loop.call(fail_next_step).result(10)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert err.value.status_code == 503 and "injected" in err.value.message
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0) \
        .usage.completion_tokens == 4


# ---------------------------------------------------------------------------- bad input
KEY = "sekrit-test-key-42"
STRICT = dict(api_key=KEY, max_body_bytes=64 * 1024, max_n=4, max_tokens=64, max_waiting=2)
STRICT_ENGINE = {"num_blocks": 12, "block_size": 16, "max_num_seqs": 1}  # 192 tokens of KV
STRICT_MODEL = {"max_position_embeddings": 256}


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def strict(request):
    with single_threaded_torch(), serving(STRICT_ENGINE, STRICT_MODEL, engine_process=request.param == "engine process",
                                          **STRICT) as (server, loop):
        yield server, loop


@pytest.fixture(scope="module")
def strict_truth(strict):
    return truth(LLMEngine(tiny_model(**STRICT_MODEL), byte_tokenizer(), **STRICT_ENGINE), "Hello", max_new_tokens=8,
                 temperature=0).outputs[0].text


def answers_normally(server, expected: str) -> bool:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as good:
        return good.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0).choices[0].text == \
            expected


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 8, **fields}


CHAT = "/v1/chat/completions"
BAD = {  # name -> (path, body or raw bytes, headers, status, param)
    "no key": ("/v1/completions", completion(), {"Authorization": ""}, 401, None),
    "wrong key": ("/v1/completions", completion(), {"Authorization": "Bearer sekrit-test-key-43"}, 401, None),
    "reset_prefix_cache without the key": ("/reset_prefix_cache", {}, {"Authorization": ""}, 401, None),
    "unknown model": ("/v1/completions", completion(model="gpt-4"), {}, 404, "model"),
    "models of another name": ("/v1/models/gpt-4", None, {}, 404, "model"),
    "malformed JSON": ("/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, None),
    "body over the limit": ("/v1/completions", completion(prompt="x" * 70_000), {}, 413, None),
    "top_p 0": ("/v1/completions", completion(top_p=0), {}, 400, "top_p"),
    "negative temperature": ("/v1/completions", completion(temperature=-1), {}, 400, "temperature"),
    "max_tokens not a number": ("/v1/completions", completion(max_tokens="many"), {}, 400, "max_tokens"),
    "unknown parameter": ("/v1/completions", completion(frobnicate=1), {}, 400, "frobnicate"),
    "logit_bias out of range": ("/v1/completions", completion(logit_bias={"5": 101.0}), {}, 400, "logit_bias"),
    "not an object": ("/v1/completions", b"[1, 2]", {}, 400, None),
    "n over the limit": ("/v1/completions", completion(n=5), {}, 400, "n"),
    "max_tokens over the limit": ("/v1/completions", completion(max_tokens=65), {}, 400, "max_tokens"),
    "prompt too long for the model": ("/v1/completions", completion(prompt="a" * 300), {}, 400, "prompt"),
    "prompt too long for the KV budget": ("/v1/completions", completion(prompt="a" * 200), {}, 400, "prompt"),
    "prompt and max_tokens over the KV budget": ("/v1/completions", completion(prompt="a" * 150, max_tokens=60), {},
                                                 400, "max_tokens"),
    "empty prompt": ("/v1/completions", completion(prompt=""), {}, 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", completion(prompt=[1000]), {}, 400, "prompt"),
    "beam search streamed": ("/v1/completions", completion(use_beam_search=True, stream=True), {}, 400, "stream"),
    "more beams than the engine steps": ("/v1/completions", completion(use_beam_search=True, best_of=2), {}, 400,
                                         "best_of"),  # max_num_seqs=1 here
    "beam search sampled": ("/v1/completions", completion(use_beam_search=True, temperature=0.7), {}, 400,
                            "temperature"),
    "best_of without beams": ("/v1/completions", completion(best_of=3), {}, 400, "best_of"),
    "stream_options without stream": ("/v1/completions", completion(stream_options={"include_usage": True}), {},
                                      400, "stream_options"),
    "min_tokens over max_tokens": ("/v1/completions", completion(min_tokens=9), {}, 400, "min_tokens"),
    "chat without messages": (CHAT, {"model": MODEL}, {}, 400, "messages"),
    "chat image part": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400, "messages[0].content"),
    "top_logprobs without logprobs": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                             "top_logprobs": 2}, {}, 400, "top_logprobs"),
    "chat tools": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                          "tools": [{"type": "function"}]}, {}, 400, "tools[0]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(strict, strict_truth, name, caplog):
    caplog.set_level(logging.DEBUG)
    server, loop = strict
    path, body, headers, status, param = BAD[name]
    headers = {"Authorization": f"Bearer {KEY}", **headers}
    if body is None:
        resp = httpx.get(server.url + path, headers=headers)
    elif isinstance(body, bytes):
        resp = httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        resp = httpx.post(server.url + path, json=body, headers=headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert answers_normally(server, strict_truth)
    assert_all_free(loop)
    assert KEY not in caplog.text and KEY not in httpx.get(server.url + "/metrics").text


def test_a_chunked_body_over_the_limit_gets_413(strict):
    server, loop = strict

    def chunks():  # no Content-Length: the limit is enforced while the body is read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 8192
        yield b'"}'

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert_all_free(loop)


def test_head_is_guarded_by_the_key_as_get_is(strict):
    server, _ = strict
    for path in ("/v1/models", "/v1/models/" + MODEL):
        assert httpx.head(server.url + path).status_code == 401
        assert httpx.head(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200  # probes stay open


def test_the_openai_client_sees_typed_errors(strict):
    server, loop = strict
    url = server.url + "/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0) as good:
        with pytest.raises(openai.NotFoundError):
            good.completions.create(model="gpt-4", prompt="Hi")
        with pytest.raises(openai.BadRequestError, match="top_p"):
            good.completions.create(model=MODEL, prompt="Hi", top_p=0)
    assert_all_free(loop)


def test_a_full_waiting_queue_gets_503_and_the_rest_is_served(strict, strict_truth):
    """One sequence runs at a time (max_num_seqs=1) and two may wait: of eight at once, some get 503."""
    server, loop = strict
    results: list = [None] * 8

    def one(i: int) -> None:
        body = completion(max_tokens=40, stream=True, ignore_eos=True, temperature=0)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            results[i] = (resp.status_code, [line for line in resp.iter_lines() if line])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = [r[0] for r in results]
    assert 503 in statuses and 200 in statuses, statuses
    for status, lines in results:
        if status == 200:
            assert lines[-1] == "data: [DONE]"
        else:
            assert '"server_overloaded"' in lines[0]
    assert answers_normally(server, strict_truth)
    assert_all_free(loop)


# ---------------------------------------------------------------------------- streamed text, command line
def test_the_detokenizer_releases_whole_characters_only():
    text = "héllo 日本 🎉!"
    ids = TOKENIZER(text).input_ids
    assert "".join(TOKENIZER.decode([i]) for i in ids) != text  # characters really are split over tokens
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    deltas = [detokenizer.push([i]) for i in ids]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[ids.index(TOKENIZER("é").input_ids[0])] == ""  # held until the character's second byte


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_the_detokenizer_agrees_with_decoding_the_whole_on_invalid_bytes(chunk):
    """Random bytes (what a random model emits): invalid sequences, truncated characters and whole
    ones completed by later tokens, pushed a few tokens at a time (as a stream's coalesced outputs
    arrive). The released text always adds up to decoding everything at once: a character the
    next tokens complete is never released as U+FFFD first (the old rule, releasing whatever 8
    held tokens decoded to, broke tens of these 3,000 at every chunk size)."""
    import random

    rng = random.Random(chunk)
    for _ in range(3000):
        ids = [rng.randrange(3, 259) for _ in range(16)]
        detokenizer = IncrementalDetokenizer(TOKENIZER)
        text = "".join(detokenizer.push(ids[i:i + chunk], final=i + chunk >= len(ids)) for i in range(0, 16, chunk))
        assert text == TOKENIZER.decode(ids, skip_special_tokens=True), ids


def test_token_bytes_come_from_the_vocabulary():
    """Chat logprobs' ``bytes``: byte-level BPE (the demo's), SentencePiece byte fallback and word
    starts; a special token has none."""
    from tokenizers import Tokenizer, decoders, models

    text_of = TokenText(TOKENIZER)
    ids = TOKENIZER("é x", add_special_tokens=False).input_ids
    assert [text_of.bytes_of(t) for t in ids] == [b"\xc3", b"\xa9", b" ", b"x"] and text_of(ids[0]) == "\ufffd"
    assert text_of.bytes_of(TOKENIZER.eos_token_id) == b""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "\u2581hi": 258, "x": 259}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    sentencepiece = TokenText(PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>"))
    assert [sentencepiece.bytes_of(t) for t in (2 + 0xC3, 2 + 0xA9, 258, 259, 1)] == [b"\xc3", b"\xa9", b" hi", b"x", b""]


def test_a_text_stream_never_sends_what_a_stop_string_cuts():
    ids = TOKENIZER("abcXYdef").input_ids
    stream = TextStream(TOKENIZER, stop=["XY"])
    sent = "".join(stream.update(CompletionOutput(0, ids[:k], TOKENIZER.decode(ids[:k])))[0] for k in range(1, 5))
    assert sent == "abc"  # "X" might start the stop string: held back
    final = CompletionOutput(0, ids[:5], "abc", finish_reason="stop")
    assert sent + stream.update(final)[0] == "abc"


def test_a_text_stream_shorter_than_its_stop_string_sends_nothing_of_it():
    """While the text is shorter than what is held back, nothing goes out (a negative slice end once
    sent "a" of a stop string "aWXY" here, and the stream then no longer prefixed the final text)."""
    ids = TOKENIZER("aWXYb").input_ids
    stream = TextStream(TOKENIZER, stop=["aWXY"])
    sent = "".join(stream.update(CompletionOutput(0, ids[:k], TOKENIZER.decode(ids[:k])))[0] for k in range(1, 4))
    assert sent == ""
    assert stream.update(CompletionOutput(0, ids[:4], "", finish_reason="stop"))[0] == ""


def test_exposure_warning():
    assert exposure_warning("0.0.0.0", None) and exposure_warning("example.org", None)
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None and exposure_warning("0.0.0.0", "key") is None


def test_serve_refuses_a_tensor_parallel_size_below_one(capsys):
    assert main(["serve", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be positive" in capsys.readouterr().err
    assert main(["serve", "--max-logprobs", "-2"]) == 2
    assert "--max-logprobs must be >= 0, or -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ServerSettings.max_logprobs"):
        ServerSettings(max_logprobs=-3)


def test_hf_paged_serve_answers_and_shuts_down_cleanly():
    port = free_port()
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--api-key", KEY, "--num-blocks", "64",
           "--served-model-name", "demo", "--device", "cpu", "--block-size", "32", "--max-model-len", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until_healthy(proc, port, timeout=120)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
            resp = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0)
            assert client.models.retrieve("demo").model_extra["max_model_len"] == 300  # --max-model-len
        assert resp.usage.completion_tokens == 4
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "API key required" in output and "Application shutdown complete" in output and KEY not in output


RECOMMENDED = {"do_sample": True, "top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 5}  # a generation_config.json


@pytest.mark.parametrize("where", ENGINE_PLACES)
@pytest.mark.parametrize("generation_config", ["auto", "vllm"])
def test_the_models_generation_config_gives_the_defaults_of_requests_that_set_none(where, generation_config):
    """As vLLM's ``--generation-config auto`` (its default): a model's recommended sampling values
    (here top_k 1, so sampling is deterministic, and a repetition penalty) and max_new_tokens are
    what a request that sets none gets; what a request sets wins; ``vllm`` ignores them."""
    model = {"generation": RECOMMENDED}
    reference = LLMEngine(tiny_model(**model), byte_tokenizer(), num_blocks=NUM_BLOCKS)
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}, model, engine_process=where != "thread",
                                          generation_config=generation_config) as (server, loop):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
            bare = api.completions.create(model=MODEL, prompt="Hello", seed=0, extra_body={"return_token_ids": True})
            chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={"return_token_ids": True, "repetition_penalty": 1.0})
        if generation_config == "auto":  # a completion keeps OpenAI's 16 tokens (as vLLM); a chat takes the 5
            expected = truth(reference, "Hello", max_new_tokens=16, temperature=1.0, top_k=1, repetition_penalty=1.3,
                             seed=0)
            chat_expected = truth(reference, chat_ids([{"role": "user", "content": "Hi"}]), max_new_tokens=5,
                                  temperature=1.0, top_k=1, repetition_penalty=1.0)  # the request's own value wins
            assert chat.choices[0].model_extra["token_ids"] == chat_expected.outputs[0].token_ids
            assert len(chat_expected.outputs[0].token_ids) == 5
        else:  # OpenAI's defaults: temperature 1, no top_k, no penalty
            expected = truth(reference, "Hello", max_new_tokens=16, temperature=1.0, seed=0)
            assert chat.usage.completion_tokens != 5 or chat.choices[0].finish_reason == "stop"
        assert bare.choices[0].model_extra["token_ids"] == expected.outputs[0].token_ids
        assert len(expected.outputs[0].token_ids) == 16
        assert_all_free(loop)


def test_a_generation_config_value_requests_cannot_take_is_refused_at_start():
    with pytest.raises(ValueError, match="generation config holds a value requests cannot take.*temperature"):
        with serving({"num_blocks": NUM_BLOCKS}, {"generation": {"do_sample": True, "temperature": 5e6}}):
            pass


@pytest.mark.parametrize("value", ["Auto", "none"])
def test_an_unknown_generation_config_is_refused_before_serving(value):
    """``--generation-config`` takes auto or vllm; so do the settings behind it (a typo once served
    quietly as vllm, without the model's defaults)."""
    with pytest.raises(ValueError, match=f"ServerSettings.generation_config must be one of 'auto', 'vllm', "
                                         f"got '{value}'"):
        with serving({"num_blocks": NUM_BLOCKS}, generation_config=value):
            pass
