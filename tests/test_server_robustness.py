"""The server under hostile input, over real HTTP on a loopback port: extreme sampling values,
invalid Unicode, deep JSON, nulls, unknown roles, huge prompts, clients that never read, a
property-based fuzz of every route from the published ``/openapi.json`` (schemathesis), and a
real ``hf-paged serve`` process shut down by SIGTERM with requests in flight. Whatever a request
does, the others are served exactly, nothing is left in flight and every KV block is free."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, Limits, resolve_max_tokens
from tests.helpers.serving import (ENGINE_PLACES, MODEL, assert_all_free, break_forwards, free_port, mend_forwards,
                                   serving, single_threaded_torch, tiny_model, wait_idle, wait_until_healthy)

ENGINE = {"num_blocks": 256}
LIMITS = dict(max_n=4, max_tokens=4096)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def robust(request):
    with single_threaded_torch(), serving(ENGINE, engine_process=request.param == "engine process",
                                          **LIMITS) as (server, loop):
        yield server, loop


@pytest.fixture
def server(robust):
    yield robust[0]
    assert_all_free(robust[1])


@pytest.fixture(scope="module")
def truth():
    """An in-process engine on an identical model: what a served request must give."""
    return LLMEngine(tiny_model(), byte_tokenizer(), **ENGINE)


def post(server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    """POST JSON as a client would send it: non-ASCII escaped (so a lone surrogate goes as ``\\ud800``)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "return_token_ids": True, **fields}


def chat(content: str = "Hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, **fields}


def greedy_tokens(server, path: str = COMPLETIONS, **fields) -> list[int]:
    resp = post(server, path, completion(**fields) if path == COMPLETIONS else chat(**fields))
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


class Stream(threading.Thread):
    """A greedy stream read in the background: its tokens, finish reason, events and their arrival times."""

    def __init__(self, server, max_tokens: int = 48, prompt: str = "Once upon a time"):
        super().__init__(daemon=True)
        self.url, self.body = server.url + COMPLETIONS, completion(prompt=prompt, max_tokens=max_tokens,
                                                                   ignore_eos=True, stream=True)
        self.tokens, self.events, self.times, self.finish = [], [], [], None
        self.started, self.leave = threading.Event(), threading.Event()  # leave: its client hangs up

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as resp:
            for line in resp.iter_lines():
                if self.leave.is_set():
                    break
                if not line:
                    continue
                self.times.append(time.monotonic())
                self.events.append(line)
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        self.tokens += c.get("token_ids") or []
                        self.finish = c["finish_reason"] or self.finish
                if self.tokens:
                    self.started.set()
        self.started.set()


class EndlessStream(Stream):
    """Greedy streams one after another until the client leaves, so its events never stop for want of
    tokens however fast the server generates (one stream of 3,000 tokens once ended on a fast machine
    before a 4 MiB prompt was tokenized)."""

    def run(self) -> None:
        while not self.leave.is_set():
            self.finish = None
            super().run()
            if self.finish != "length":  # left by its client, or cut
                break


# ---------------------------------------------------------------------------- the reproductions of issue 19
RAW_SURROGATE = b'{"model": "tiny", "prompt": "Hi \xed\xa0\x80", "max_tokens": 4}'  # UTF-8-encoded U+D800
EXTREME = {  # name -> (path, body, statuses allowed, the param a 400 names)
    "temperature 1e-300": (COMPLETIONS, completion(temperature=1e-300, seed=3), {200}, None),
    "temperature 1e300": (COMPLETIONS, completion(temperature=1e300, seed=3), {400}, "temperature"),
    "repetition_penalty 1e-300": (COMPLETIONS, completion(temperature=1.0, repetition_penalty=1e-300), {400},
                                  "repetition_penalty"),
    "repetition_penalty 1e300": (COMPLETIONS, completion(temperature=1.0, repetition_penalty=1e300), {400},
                                 "repetition_penalty"),
    "length_penalty 2000": (COMPLETIONS, completion(use_beam_search=True, best_of=2, length_penalty=2000), {400},
                            "length_penalty"),
    "length_penalty -2000": (COMPLETIONS, completion(use_beam_search=True, best_of=2, length_penalty=-2000), {400},
                             "length_penalty"),
    "best_of 2000": (COMPLETIONS, completion(use_beam_search=True, best_of=2000), {400}, "best_of"),
    "n 2000": (COMPLETIONS, completion(n=2000), {400}, "n"),
    "seed 2**64 - 1": (COMPLETIONS, completion(temperature=1.0, seed=2**64 - 1), {200}, None),
    "seed 2**64": (COMPLETIONS, completion(temperature=1.0, seed=2**64), {400}, "seed"),
    "top_k 10**12": (COMPLETIONS, completion(temperature=1.0, seed=1, top_k=10**12), {200}, None),
    "logprobs 10**9": (COMPLETIONS, completion(logprobs=10**9), {400}, "logprobs"),
    "a lone surrogate in the prompt": (COMPLETIONS, completion(prompt="Hi \ud800"), {400}, "prompt"),
    "a lone surrogate as raw bytes": (COMPLETIONS, RAW_SURROGATE, {400}, "prompt"),
    "a lone surrogate in a message": (CHAT, chat("Hi \udfff"), {400}, "messages[0].content"),
    "a lone surrogate in the model name": (COMPLETIONS, completion(model="tiny\ud800"), {400}, "model"),
    "a lone surrogate in a key": (COMPLETIONS, {**completion(), "\ud800": 1}, {400}, None),
    "JSON nested 10,000 deep": (COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                                {400}, None),
    "JSON nested 100 deep": (COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}", {400},
                             "prompt"),
}


@pytest.fixture(scope="module")
def clean_stream(robust):
    stream = Stream(robust[0])
    stream.run()
    assert stream.finish == "length" and len(stream.tokens) == 48
    return stream.tokens


@pytest.mark.parametrize("name", list(EXTREME))
def test_an_extreme_request_is_refused_or_served_while_a_concurrent_stream_is_untouched(server, clean_stream, name):
    path, body, statuses, param = EXTREME[name]
    stream = Stream(server)
    stream.start()
    assert stream.started.wait(60)
    resp = post(server, path, body)
    stream.join(120)
    assert resp.status_code in statuses, resp.text
    if resp.status_code == 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param and param.split(".")[0] in error["message"], error
    assert (stream.finish, stream.tokens) == ("length", clean_stream)
    assert stream.events[-1] == "data: [DONE]" and not any('"error"' in e for e in stream.events)
    assert greedy_tokens(server) == greedy_tokens(server)  # served afterwards, and the same again


def test_a_tiny_temperature_is_raised_to_the_documented_floor(server, truth):
    """0 < T < 0.01 samples as T = 0.01 (vLLM's rule), exactly as the engine does with 0.01."""
    got = post(server, COMPLETIONS, completion(temperature=1e-300, seed=5, max_tokens=16)).json()
    ref = truth.generate(["Hello"], SamplingParams(max_new_tokens=16, temperature=0.01, seed=5), use_tqdm=False)[0]
    assert got["choices"][0]["token_ids"] == ref.outputs[0].token_ids


# ---------------------------------------------------------------------------- smaller findings
def _openai_nullable(params_module) -> set[str]:
    """The request fields the ``openai`` package types as optional (``None`` allowed)."""
    names = set()
    for typed in (params_module.CompletionCreateParamsNonStreaming, params_module.CompletionCreateParamsStreaming):
        for name, hint in typing.get_type_hints(typed).items():
            if type(None) in typing.get_args(hint):
                names.add(name)
    return names


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_null_means_not_set_for_every_field_the_openai_package_types_as_optional(server, path):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    nullable = _openai_nullable(completion_create_params if path == COMPLETIONS else chat_params)
    assert {"n", "stream", "logprobs", "max_tokens", "stop", "seed"} <= nullable  # the introspection works
    base = completion(seed=11) if path == COMPLETIONS else chat(seed=11)  # seeded: unset temperature samples
    for name in sorted(nullable - {"prompt", "messages"}):
        resp = post(server, path, {**base, name: None})
        assert resp.status_code == 200, (name, resp.text)
        unset = post(server, path, {k: v for k, v in base.items() if k != name})
        assert resp.json()["choices"][0]["token_ids"] == unset.json()["choices"][0]["token_ids"], name
    if path == COMPLETIONS:  # no prompt: the model continues from the start of a document (<s>)
        no_prompt = post(server, path, {**base, "prompt": None}).json()["choices"][0]["token_ids"]
        assert no_prompt == post(server, path, {**base, "prompt": [1]}).json()["choices"][0]["token_ids"]


def test_openai_fields_this_server_does_not_implement_are_named(server):
    resp = post(server, CHAT, chat(store=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "store"
    assert "not supported by this server (accepted: null, false)" in resp.json()["error"]["message"]
    assert post(server, CHAT, chat(store=None, metadata=None, service_tier=None)).status_code == 200
    plain = greedy_tokens(server, CHAT)
    no_ops = dict(store=False, service_tier="auto", modalities=["text"], metadata={"app": "test"})  # SDKs send these
    assert greedy_tokens(server, CHAT, **no_ops) == plain
    for name, value in [("store", 0), ("service_tier", "flex"), ("modalities", ["text", "audio"]),
                        ("metadata", {"n": 1})]:
        resp = post(server, CHAT, chat(**{name: value}))
        assert resp.status_code == 400 and resp.json()["error"]["param"].startswith(name), (name, resp.text)
    reply = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None}
    history = [{"role": "user", "content": "Hi"}, reply, {"role": "user", "content": "And?"}]
    assert post(server, CHAT, {**chat(), "messages": history}).status_code == 200  # a reply's model_dump() sent back
    resp = post(server, CHAT, {**chat(), "messages": [*history[:1], {**reply, "annotations": [{"type": "x"}]}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[1].annotations", resp.text


@pytest.mark.parametrize("path, name, value", [
    (CHAT, "max_tokens", "3"), (CHAT, "max_tokens", True), (CHAT, "max_tokens", 3.0), (CHAT, "stream", "yes"),
    (CHAT, "n", "2"), (CHAT, "temperature", True), (CHAT, "seed", "7"), (CHAT, "logprobs", 1),
    (COMPLETIONS, "prompt", [True, False]), (COMPLETIONS, "logprobs", True), (COMPLETIONS, "echo", "no"),
])
def test_a_value_of_the_wrong_json_type_is_a_400_not_converted(server, path, name, value):
    body = completion(**{name: value}) if path == COMPLETIONS else chat(**{name: value})
    resp = post(server, path, body)
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith(name), resp.text


def test_max_completion_tokens_wins_and_too_long_is_context_length_exceeded(server):
    both = post(server, CHAT, chat(max_tokens=7, max_completion_tokens=3)).json()
    assert both["usage"]["completion_tokens"] == 3
    assert greedy_tokens(server, CHAT, temperature=1, seed=3)  # an integer where a float goes is fine (as JSON)
    over = post(server, CHAT, chat(max_tokens=None, max_completion_tokens=10_000)).json()["error"]
    assert (over["param"], over["code"]) == ("max_completion_tokens", "invalid_value") and "10000" in over["message"]
    near = post(server, CHAT, chat(max_tokens=None, max_completion_tokens=4090)).json()["error"]
    assert (near["param"], near["code"]) == ("max_completion_tokens", "context_length_exceeded"), near
    long = post(server, COMPLETIONS, completion(prompt="x" * 5000)).json()["error"]
    assert (long["param"], long["code"]) == ("prompt", "context_length_exceeded"), long


def test_n_samples_that_together_outgrow_the_kv_cache_are_refused_before_they_run(server):
    """Samples share the prompt's blocks, not what each generates: n=4 samples of max_tokens=1100
    exceed a KV cache of 4,096 tokens (256 blocks of 16) though one sequence of 1,100 tokens fits.
    Refused up front, streamed or not, as context_length_exceeded naming max_tokens (they were
    taken, and the engine refused them once they outgrew the cache: a stream failed after its 200);
    what fits together is served; beams (which share what they generated) are not counted."""
    for path, body in [(COMPLETIONS, completion(n=4, max_tokens=1100, temperature=1.0)),
                       (CHAT, chat(n=4, max_tokens=1100, temperature=1.0, stream=True))]:
        resp = post(server, path, body)
        error = resp.json()["error"]
        assert resp.status_code == 400 and (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert "plus n=4 samples of max_tokens=1100 exceed the KV cache (4096 tokens; the samples share the prompt)" \
            in error["message"], error
    fits = post(server, COMPLETIONS, completion(n=4, max_tokens=4, temperature=1.0, seed=1))
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
    beams = post(server, COMPLETIONS, completion(n=1, best_of=2, use_beam_search=True, max_tokens=1100))
    assert beams.status_code == 200, beams.text


def test_the_kv_room_of_n_samples_bounds_the_default_max_tokens_and_prompt_truncation():
    """Units: chat's unset max_tokens is what each of n samples fits beside the shared prompt (its
    full blocks shared, the partial last one copied by each), and ``truncate_prompt_tokens=-1``
    keeps what leaves room for every sample's max_tokens."""
    limits = Limits(context=4096, kv_tokens=4096)
    assert resolve_max_tokens(None, None, 96, limits, "messages") == 4000
    assert resolve_max_tokens(None, None, 96, limits, "messages", samples=4) == 1000
    with pytest.raises(APIError, match=r"leaves no room in the KV cache \(4096 tokens\) for n=4 samples"):
        resolve_max_tokens(None, None, 4094, limits, "messages", samples=4)
    blocks = Limits(kv_tokens=96 * 8, kv_block_size=8)  # 635 prompt tokens: 79 full blocks and 3 tokens
    assert resolve_max_tokens(None, None, 635, blocks, "prompt") == 768 - 635  # one sequence: the tokens left
    assert resolve_max_tokens(None, None, 635, blocks, "prompt", samples=2) == 8 * 8 - 3  # (96 - 79) // 2 blocks
    with pytest.raises(APIError, match="n=2 samples of max_tokens=64 exceed"):  # (once served, then refused)
        resolve_max_tokens(64, None, 635, blocks, "prompt", samples=2)
    ids = list(range(200))
    request = CompletionRequest(model=MODEL, prompt=ids, truncate_prompt_tokens=-1, max_tokens=10, n=2)
    assert request.truncated(ids, Limits(context=100, kv_tokens=50)) == ids[-30:]
    assert request.truncated(ids, Limits(context=100, kv_tokens=48, kv_block_size=8)) == ids[-22:]


def test_a_client_that_leaves_mid_body_is_no_server_error(server):
    """Once logged as an unhandled error with two tracebacks (any client could fill the log)."""
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    loggers = [logging.getLogger(name) for name in ("hf_paged.serve", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\":")
            time.sleep(0.2)
        time.sleep(0.5)
        assert greedy_tokens(server)  # still serving
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert not errors, [record.getMessage() for record in errors]


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine process"])
def test_n_and_best_of_past_the_engines_max_num_seqs_name_themselves(engine_process):
    """An engine that steps two sequences at most: n=3 (or 3 beams) is a 400 naming n (best_of),
    not the prompt with the engine's internal field name."""
    with single_threaded_torch(), serving({"num_blocks": 64, "max_num_seqs": 2}, engine_process=engine_process,
                                          **LIMITS) as (server, loop):
        for path, body in [(COMPLETIONS, completion(n=3)), (CHAT, chat(n=3)),
                           (COMPLETIONS, completion(n=1, best_of=3, use_beam_search=True))]:
            error = post(server, path, body).json()["error"]
            name = "best_of" if "best_of" in body else "n"
            assert error["param"] == name and f"{name} must be at most 2 on this server" in error["message"], error
        sampled = dict(n=2, temperature=1.0, seed=1)  # greedy decoding takes n=1 only
        assert greedy_tokens(server, **sampled) and greedy_tokens(server, CHAT, **sampled)
        assert_all_free(loop)


def test_content_parts_that_are_not_plain_text_are_named(server):
    """Once both read "messages.0.content: Input should be a valid string"."""
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    cached = [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]
    for content, param, fragment in [(image, "messages[0].content", "part 1 is 'image_url'"),
                                     (cached, "messages[0].content[0].cache_control", "unknown parameter")]:
        resp = post(server, CHAT, {**chat(), "messages": [{"role": "user", "content": content}]})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == param and fragment in error["message"], error
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]  # one per line, as vLLM joins them
    assert greedy_tokens(server, CHAT, messages=[{"role": "user", "content": parts}]) == \
        greedy_tokens(server, CHAT, messages=[{"role": "user", "content": "H\ni"}])


def test_chat_roles_are_validated(server):
    roles = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42", "tool_call_id": "c1"},
             {"role": "user", "content": "And?"}]
    assert post(server, CHAT, {**chat(), "messages": roles}).status_code == 200
    system = post(server, CHAT, {**chat(), "messages": roles}).json()["choices"][0]["token_ids"]
    developer = [{"role": "developer", "content": "Be brief."}, *roles[1:]]
    assert post(server, CHAT, {**chat(), "messages": developer}).json()["choices"][0]["token_ids"] == system
    for role in ("function", "wizard", "", "System"):
        resp = post(server, CHAT, {**chat(), "messages": [{"role": role, "content": "Hi"}]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[0].role", (role, resp.text)


def test_a_wrong_method_gets_405_with_allow_naming_every_method_the_path_answers(server):
    """GET routes answer HEAD too (a route of its own, left out of the schema): Allow lists both (it
    once named GET alone), and each method it lists is answered."""
    for method, path, allow in (("GET", COMPLETIONS, "POST"), ("PUT", CHAT, "POST"),
                                ("GET", "/reset_prefix_cache", "POST"), ("POST", "/v1/models", "GET, HEAD"),
                                ("POST", "/v1/models/" + MODEL, "GET, HEAD"), ("DELETE", "/health", "GET, HEAD"),
                                ("PUT", "/metrics", "GET, HEAD")):
        resp = httpx.request(method, server.url + path)
        assert (resp.status_code, resp.headers.get("allow")) == (405, allow), (method, path)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        for listed in allow.split(", "):
            body = (chat() if path == CHAT else completion()) if listed == "POST" else None
            assert httpx.request(listed, server.url + path, json=body).status_code == 200, (listed, path)


def test_head_answers_where_get_does_without_a_body(server):
    """Load balancers and uptime checks probe with HEAD."""
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/" + MODEL):
        get, head = httpx.get(server.url + path), httpx.head(server.url + path)
        assert (get.status_code, head.status_code) == (200, 200), path
        assert head.headers["content-type"] == get.headers["content-type"], path
        if path != "/metrics":  # the same body's length (the metrics' numbers move between two calls)
            assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content)), path
    assert httpx.head(server.url + "/v1/models/no-such-model").status_code == 404


def test_openapi_publishes_the_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path, model in ((COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest)):
        body = schema["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        published = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["required"] and set(published["properties"]) == set(model.model_fields)
        assert published["additionalProperties"] is False and "model" not in published.get("required", [])  # vLLM's
    roles = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert sorted(roles) == sorted(["system", "developer", "user", "assistant", "tool"])


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt of almost 4 MiB takes seconds to tokenize (then it is too long for the model): the
    other streams go on meanwhile, they do not freeze until the 400."""
    stream = EndlessStream(server, max_tokens=3000)
    stream.start()
    assert stream.started.wait(60)
    prompt = "hello world " * ((4 * 2**20 - 1024) // 12)
    sent = time.monotonic()
    resp = post(server, COMPLETIONS, completion(prompt=prompt), timeout=120)
    answered = time.monotonic()
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    assert answered - sent > 2.0, "tokenizing was quick: the test cannot see the event loop blocked"
    during = [t for t in stream.times if sent <= t <= answered]
    gaps = [b - a for a, b in zip([sent, *during], [*during, answered])]
    assert len(during) > 10 and max(gaps) < 1.0, f"{len(during)} events, largest gap {max(gaps):.2f} s"
    deadline = time.monotonic() + 30
    while sum(t > answered for t in stream.times) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.leave.set()  # it goes on after the 400; its client need not wait for all 3,000 tokens
    stream.join(60)
    after = sum(t > answered for t in stream.times)
    assert stream.finish in (None, "length") and after >= 20, (stream.finish, after)
    assert not any('"error"' in event for event in stream.events)


def test_repeated_engine_faults_make_health_503_until_a_clean_step(server, robust):
    """Forwards that keep raising: each request gets a 503 ``engine_error`` (the engine stays
    consistent), after 3 failed steps in a row ``/health`` answers 503 ``engine_unhealthy``; once
    the fault is gone the next request is served and ``/health`` is 200 again."""
    _, loop = robust
    loop.call(break_forwards).result(10)
    try:
        for _ in range(3):
            assert httpx.get(server.url + "/health").status_code == 200
            resp = post(server, COMPLETIONS, completion())
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_error", resp.text
            assert "injected forward fault" in resp.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_unhealthy"
        assert _metric(server, "engine_healthy") == 0
    finally:
        loop.call(mend_forwards).result(10)
    assert greedy_tokens(server) == greedy_tokens(server)
    assert httpx.get(server.url + "/health").status_code == 200 and _metric(server, "engine_healthy") == 1


# ---------------------------------------------------------------------------- property-based HTTP fuzz
# Cases per POST route and mode (positive: valid by the schema; negative: violating it); a deeper local run:
# HF_PAGED_FUZZ_EXAMPLES=2000 python -m pytest tests/test_server_robustness.py -k fuzz
FUZZ_EXAMPLES = int(os.environ.get("HF_PAGED_FUZZ_EXAMPLES", 150))
FUZZ_EXAMPLES_NO_ENGINE = max(1, FUZZ_EXAMPLES // 4)  # ... for the tokenizer routes, which never reach the engine


def test_fuzz_every_route_from_the_published_schema():
    """schemathesis draws requests from ``/openapi.json`` (bounded: ``FUZZ_EXAMPLES`` per route with a body
    and generation mode, ``FUZZ_EXAMPLES_NO_ENGINE`` for the tokenizer routes, 25 per other route): no 500
    ever, a 503 only with a documented cause, and a normal request is served afterwards with nothing leaked.
    Prints the case counts."""
    import schemathesis
    from schemathesis import GenerationMode

    allowed_503 = {"server_overloaded", "server_shutting_down", "engine_unhealthy"}
    counts: collections.Counter = collections.Counter()
    with single_threaded_torch(), serving({"num_blocks": 64, "max_num_seqs": 8}, max_n=2, max_tokens=8) as (srv, loop):
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {(op.method.upper(), op.path) for op in operations} >= {("POST", COMPLETIONS), ("POST", CHAT)}
        for op in operations:
            has_body = bool(op.body)  # a route without parameters (GETs, /reset_prefix_cache) has no invalid form
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
                examples = (FUZZ_EXAMPLES_NO_ENGINE if op.path in ("/tokenize", "/detokenize") else FUZZ_EXAMPLES) \
                    if has_body else 25
                _fuzz(srv, op, mode, examples, counts, allowed_503)
        assert greedy_tokens(srv) == greedy_tokens(srv)
        assert_all_free(loop)
    report = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"\nschemathesis cases: {sum(counts.values())} ({report})")
    generated = {f"POST {COMPLETIONS}", f"POST {CHAT}"}
    assert sum(v for (route, mode, status), v in counts.items() if status == 200 and route in generated) > 50, counts


def _fuzz(srv, op, mode, examples: int, counts, allowed_503: set[str]) -> None:
    from schemathesis import GenerationMode

    route = f"{op.method.upper()} {op.path}" if op.method.upper() == "POST" else "GET"

    @given(case=op.as_strategy(generation_mode=mode))
    # derandomized: the same draws every run (random ones served 47-87 generations of the 300 cases, around
    # the floor below); HF_PAGED_FUZZ_EXAMPLES widens the search
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    def run(case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = MODEL  # past the model check: into sampling, tokenization and the engine
        resp = case.call(base_url=srv.url, timeout=60)
        counts[(route, mode.value, resp.status_code)] += 1
        assert resp.status_code < 500 or resp.status_code == 503, (resp.status_code, resp.text[:500], case.body)
        if resp.status_code == 503:
            assert resp.json()["error"]["code"] in allowed_503, resp.text
        content_type = resp.headers.get("content-type", "")  # schemathesis gives a header's values as a list
        if resp.status_code == 200 and "text/event-stream" in ",".join(
                content_type if isinstance(content_type, list) else [content_type]):
            counts[(route, "stream", 200)] += 1
            data = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
            if op.path == "/v1/responses":  # OpenAI's events: no [DONE], the last one says how it ended
                assert data[-1]["type"] in ("response.completed", "response.incomplete", "error"), data[-1]
            else:
                assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
            for event in data:
                if "error" in event and isinstance(event["error"], dict):
                    assert event["error"]["code"] in allowed_503, event

    run()


# ---------------------------------------------------------------------------- clients that never read
def _rss_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _metric(srv, name: str) -> float:
    found = re.search(rf"^hf_paged_{name} (\S+)$", httpx.get(srv.url + "/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_clients_that_never_read_are_aborted_and_memory_stays_bounded():
    """20 streams whose clients never read (4 KiB receive buffers, a 16 KiB server send buffer, so
    the sends really block within a few hundred tokens): after ``stream_timeout_s`` each is aborted
    and its blocks freed while the clients are still connected; another client is served
    meanwhile; the process's RSS grows by a bounded amount."""
    with single_threaded_torch(), serving({"num_blocks": 2048}, send_buffer_bytes=16384, max_tokens=4096,
                                          stream_timeout_s=2.0) as (srv, loop):
        before = greedy_tokens(srv, max_tokens=16)
        body = json.dumps(completion(max_tokens=4000, stream=True, ignore_eos=True, logprobs=5)).encode()
        request = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        rss_before, peak, sockets = _rss_mb(), 0.0, []
        try:
            for _ in range(20):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", srv.port))
                sock.sendall(request)
                sockets.append(sock)
            assert greedy_tokens(srv, max_tokens=16) == before  # served while the 20 hold their streams
            deadline = time.monotonic() + 60
            while _metric(srv, "stream_timeouts_total") < 20 and time.monotonic() < deadline:
                peak = max(peak, _rss_mb())
                time.sleep(0.2)
            assert _metric(srv, "stream_timeouts_total") == 20
            stats = wait_idle(loop)
            assert stats["running"] == stats["waiting"] == 0 and stats["blocks_used"] == 0, stats
            assert stats["generated_tokens"] < 20 * 4000 / 2, "the streams ran to the end: nothing blocked them"
            assert peak - rss_before < 100, f"RSS grew {peak - rss_before:.0f} MB"
            print(f"\nslow readers: RSS {rss_before:.0f} -> peak {peak:.0f} MB, "
                  f"{stats['generated_tokens']} tokens generated before the timeouts")
        finally:
            for sock in sockets:
                sock.close()
        assert greedy_tokens(srv, max_tokens=16) == before
        assert_all_free(loop)


# ---------------------------------------------------------------------------- graceful shutdown
def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_sigterm_drains_then_ends_what_is_left_and_exits_0():
    """A real ``hf-paged serve`` with requests in flight gets SIGTERM: a short request finishes, new
    ones get 503 ``server_shutting_down`` (``/health`` too), and after ``--shutdown-timeout`` the long
    streams end with an error event and ``data: [DONE]``, the waiting non-streaming clients get a
    JSON 503; the process exits 0 and leaves no process behind."""
    port, marker = free_port(), f"shutdown-test-{os.getpid()}"
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--num-blocks", "512",
           "--served-model-name", marker, "--shutdown-timeout", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1/completions"
    long_body = {"model": marker, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    results: dict[str, object] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", url, json={**long_body, "stream": True}, timeout=60) as resp:
            results[f"stream{i}"] = [line for line in resp.iter_lines() if line]

    def blocking(i: int) -> None:
        resp = httpx.post(url, json=long_body, timeout=60)
        results[f"blocking{i}"] = (resp.status_code, resp.json())

    try:
        wait_until_healthy(proc, port, timeout=120)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=blocking, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _running(port) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        short = threading.Thread(target=lambda: results.update(short=httpx.post(
            url, json={**long_body, "max_tokens": 20}, timeout=60).json()))
        short.start()
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = httpx.post(url, json={**long_body, "max_tokens": 4}, timeout=10)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        for t in [*threads, short]:
            t.join(60)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "server_shutting_down"
    assert results["short"]["choices"][0]["finish_reason"] == "length", results["short"]
    for i in range(3):
        lines = results[f"stream{i}"]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
        assert len(lines) > 3  # tokens came before the end
    for i in range(2):
        status, body = results[f"blocking{i}"]
        assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert _processes_with(marker) == [], "a process of the server is still running"


def _running(port: int) -> int:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return 0
    found = re.search(r"^hf_paged_requests_running (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0
