"""LoRA adapters over HTTP (``hf-paged serve --enable-lora --lora-modules``), driven by the real
``openai`` client on a loopback port: a request's ``model`` names the base model or an adapter, and
gets exactly the tokens an in-process ``LLMEngine`` gives with that adapter (streamed or not, alone
or alongside requests of the other adapter and of the base model); ``/v1/models`` lists the
adapters; vLLM's runtime load/unload routes, behind its switch; an engine process. After every test
nothing is in flight and every KV block is free."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.lora import LoRARequest
from hf_paged.serve import ServerSettings, build_app
from hf_paged.serve.serving_models import RUNTIME_LORA_SWITCH, LoRAModulePath
from tests.helpers.lora_adapters import save_adapter
from tests.helpers.serving import (MODEL, NUM_BLOCKS, assert_all_free, client, mend_forwards,  # noqa: F401
                                   serving, single_threaded_torch, slow_forwards, tiny_model)

TOKENIZER = byte_tokenizer()
LORA = {"enable_lora": True, "max_loras": 2, "num_blocks": NUM_BLOCKS}  # both adapters in one step
PROMPTS = ["Hello", "Once upon a time", "The quick brown fox"]
GREEDY = dict(temperature=0, max_tokens=10, extra_body={"return_token_ids": True})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Two adapters of the tiny model (random, large enough to change tokens): attention, and MLP
    with rank 8; a third one, ``extra``, for runtime loading."""
    root, model = tmp_path_factory.mktemp("adapters"), tiny_model()
    return {"sql": save_adapter(model, str(root / "sql"), seed=1, scale=3.0),
            "chat": save_adapter(model, str(root / "chat"), seed=2, r=8, lora_alpha=16, scale=3.0,
                                 target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
            "extra": save_adapter(model, str(root / "extra"), seed=3, scale=3.0)}


def modules(adapters: dict[str, str]) -> tuple[LoRAModulePath, ...]:
    return tuple(LoRAModulePath(name, adapters[name]) for name in ("sql", "chat"))


@pytest.fixture(scope="module")
def served(adapters):
    """The server with ``sql`` and ``chat`` served from the start and runtime updates allowed."""
    with single_threaded_torch(), serving(LORA, lora_modules=modules(adapters),
                                          allow_runtime_lora_updating=True) as (server, loop):
        yield server, loop


@pytest.fixture(scope="module")
def truth(adapters):
    """``truth(prompt, model)``: the greedy tokens of an in-process engine on an identical model with
    that model's adapter (``MODEL``: none); ids of its own, as ids are the engine's business."""
    engine = LLMEngine(tiny_model(), byte_tokenizer(), **LORA)
    ids = {name: i + 1 for i, name in enumerate(adapters)}

    def tokens(prompt: str | list[int], model: str, max_tokens: int = 10) -> list[int]:
        lora = None if model == MODEL else LoRARequest(model, ids[model], adapters[model])
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False,
                              lora_request=lora)[0]
        assert out.error is None
        return list(out.outputs[0].token_ids)

    return tokens


def chat_ids(messages: list[dict]) -> list[int]:
    text = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return TOKENIZER(text, add_special_tokens=False).input_ids


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


# ---------------------------------------------------------------------------- outputs equal the engine's
def test_the_adapters_change_the_tokens(truth):
    """The negative control of every comparison below: each adapter gives other tokens than the base
    model for some prompt, so a server that dropped the adapter would fail them."""
    for name in ("sql", "chat"):
        assert any(truth(p, name) != truth(p, MODEL) for p in PROMPTS), name
    assert any(truth(p, "sql") != truth(p, "chat") for p in PROMPTS)


@pytest.mark.parametrize("model", [MODEL, "sql", "chat"])
def test_completions_name_the_adapter_and_equal_the_engine(client, truth, model):
    resp = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    assert resp.model == model  # vLLM echoes the adapter's name
    assert [c.model_extra["token_ids"] for c in resp.choices] == [truth(p, model) for p in PROMPTS]
    if model != MODEL:  # the control: the base model's tokens would not pass
        assert [c.model_extra["token_ids"] for c in resp.choices] != [truth(p, MODEL) for p in PROMPTS]


def test_chat_and_the_responses_api_run_the_adapter(client, truth):
    messages = [{"role": "user", "content": "Once upon"}]
    expected = truth(chat_ids(messages), "chat")
    assert expected != truth(chat_ids(messages), MODEL)
    resp = client.chat.completions.create(model="chat", messages=messages, **GREEDY)
    assert (resp.model, resp.choices[0].model_extra["token_ids"]) == ("chat", expected)
    answer = client.responses.create(model="chat", input="Once upon", max_output_tokens=10, temperature=0)
    assert answer.model == "chat" and answer.output_text == TOKENIZER.decode(expected)


def test_streams_run_the_adapter(client, truth):
    chunks = list(client.completions.create(model="sql", prompt=PROMPTS[1], stream=True, **GREEDY))
    assert {c.model for c in chunks} == {"sql"}
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == truth(PROMPTS[1], "sql")
    messages = [{"role": "user", "content": "Hello"}]
    chunks = list(client.chat.completions.create(model="chat", messages=messages, stream=True, **GREEDY))
    assert {c.model for c in chunks} == {"chat"}
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == \
        truth(chat_ids(messages), "chat")


def test_concurrent_requests_of_both_adapters_and_the_base_model(served, truth):
    """All at once, streamed and not: requests of two adapters and of the base model share steps,
    each getting its own tokens."""
    server, loop = served

    async def one(api: openai.AsyncOpenAI, prompt: str, model: str, stream: bool) -> list[int]:
        if not stream:
            resp = await api.completions.create(model=model, prompt=prompt, **GREEDY)
            return resp.choices[0].model_extra["token_ids"]
        chunks = await api.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
        return [t async for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]

    async def run_all() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
            return await asyncio.gather(*(one(api, p, m, s) for p, m, s in jobs))

    jobs = [(p, m, s) for p in PROMPTS for m in (MODEL, "sql", "chat") for s in (False, True)]
    assert asyncio.run(run_all()) == [truth(p, m) for p, m, _ in jobs]
    assert_all_free(loop)


# ---------------------------------------------------------------------------- models and errors
def test_models_lists_the_adapters_after_the_base_model(client, adapters):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL, "sql", "chat"]
    assert [(c.model_extra["root"], c.model_extra["parent"]) for c in cards[1:]] == \
        [(adapters["sql"], MODEL), (adapters["chat"], MODEL)]
    assert client.models.retrieve("chat").model_extra["root"] == adapters["chat"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("sql2")


def test_an_unknown_model_is_404_naming_the_served_ones(client, served):
    for create, args in ((client.completions.create, dict(prompt="Hi", max_tokens=2)),
                         (client.chat.completions.create, dict(messages=[{"role": "user", "content": "Hi"}])),
                         (client.responses.create, dict(input="Hi", max_output_tokens=2))):
        with pytest.raises(openai.NotFoundError) as err:
            create(model="sql2", **args)
        assert "'sql2' does not exist" in err.value.message and "'sql'" in err.value.message
        assert err.value.body["code"] == "model_not_found"
    server, _ = served
    assert post(server, "/tokenize", {"model": "sql", "prompt": "Hi"}).json()["tokens"] == TOKENIZER("Hi").input_ids
    assert post(server, "/detokenize", {"model": "sql2", "tokens": [72]}).status_code == 404


def test_settings_and_app_refuse_adapters_they_could_not_serve(adapters):
    with pytest.raises(ValueError, match="name is another adapter's name too"):
        ServerSettings(lora_modules=(LoRAModulePath("a", "/x"), LoRAModulePath("a", "/y")))
    with pytest.raises(ValueError, match="the served model's name"):
        ServerSettings(model_name="m", lora_modules=(LoRAModulePath("m", "/x"),))
    with pytest.raises(ValueError, match="base_model_name 'other' is not the served model 'm'"):
        ServerSettings(model_name="m", lora_modules=(LoRAModulePath("a", "/x", "other"),))
    engine = LLMEngine(tiny_model(), byte_tokenizer(), num_blocks=16)  # LoRA off
    with pytest.raises(ValueError, match="enable_lora=True"):
        build_app(engine, ServerSettings(lora_modules=modules(adapters)))


# ---------------------------------------------------------------------------- runtime loading
def test_runtime_loading_is_off_unless_switched_on(adapters, monkeypatch):
    """vLLM's routes exist only with its switch (here also a setting): else a 404 as any unknown route."""
    body = {"lora_name": "extra", "lora_path": adapters["extra"]}
    monkeypatch.delenv(RUNTIME_LORA_SWITCH, raising=False)
    with single_threaded_torch(), serving(LORA) as (server, loop):
        assert post(server, "/v1/load_lora_adapter", body).status_code == 404
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    monkeypatch.setenv(RUNTIME_LORA_SWITCH, "true")
    with single_threaded_torch(), serving(LORA) as (server, loop):
        assert post(server, "/v1/load_lora_adapter", body).text == "Success: LoRA adapter 'extra' added successfully."
        assert post(server, "/v1/unload_lora_adapter", {"lora_int_id": 1}).status_code == 200  # the first id
        assert httpx.get(server.url + "/v1/models").json()["data"][1:] == []
        assert_all_free(loop)


def test_load_use_and_unload_an_adapter_at_runtime(client, served, truth, adapters):
    server, loop = served
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'extra' added successfully.")
    try:
        assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat", "extra"]
        resp = client.completions.create(model="extra", prompt=PROMPTS, **GREEDY)
        assert [c.model_extra["token_ids"] for c in resp.choices] == [truth(p, "extra") for p in PROMPTS]
        again = post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["sql"]})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    finally:
        unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'extra' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="Hi", max_tokens=2)
    assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat"]
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_a_reload_in_place_serves_the_new_weights(client, served, truth, adapters):
    """vLLM's ``load_inplace``: the name stays, the weights are the new folder's (a fresh id: no
    prefix block cached with the old weights is reused)."""
    server, _ = served
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["sql"]}).is_success
    try:
        first = client.completions.create(model="extra", prompt=PROMPTS[1], **GREEDY).choices[0]
        assert first.model_extra["token_ids"] == truth(PROMPTS[1], "sql")
        reload = {"lora_name": "extra", "lora_path": adapters["extra"], "load_inplace": True}
        assert post(server, "/v1/load_lora_adapter", reload).is_success
        second = client.completions.create(model="extra", prompt=PROMPTS[1], **GREEDY).choices[0]
        assert second.model_extra["token_ids"] == truth(PROMPTS[1], "extra") != truth(PROMPTS[1], "sql")
    finally:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"}).is_success


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "bad", "lora_path": "/no/such/adapter"}, 400, "'/no/such/adapter' is not a folder"),
    ({"lora_name": MODEL, "lora_path": "/x"}, 400, "the served model's name"),
    ({"lora_name": "sql", "lora_path": "/x"}, 400, "already been loaded"),
    ({"lora_name": "bad"}, 400, "lora_path"),
    ({"lora_name": "bad", "lora_path": "/x", "extra_field": 1}, 400, "unknown parameter"),
])
def test_a_bad_load_is_a_400_naming_the_problem(client, served, body, status, message):
    server, _ = served
    answer = post(server, "/v1/load_lora_adapter", body)
    assert answer.status_code == status and message in answer.json()["error"]["message"], answer.text
    assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat"]


@pytest.mark.parametrize("body, status", [({"lora_int_id": 99}, 404), ({"lora_name": "sql", "lora_int_id": 2}, 404),
                                          ({}, 400), ({"lora_name": ""}, 400)])
def test_an_unload_naming_no_served_adapter_changes_nothing(client, served, body, status):
    """By name, by id (sql is 1, chat 2), or both, which must agree."""
    server, _ = served
    assert post(server, "/v1/unload_lora_adapter", body).status_code == status
    assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat"]


def test_an_adapter_in_use_is_not_unloaded_and_shows_in_the_metrics(client, served, truth):
    """Unloading an adapter that requests in flight use is a 400 (it stays served); vLLM's
    ``vllm:lora_requests_info`` names the adapters of the running requests meanwhile."""
    server, loop = served
    info = re.compile(r'^vllm:lora_requests_info\{max_lora="2",running_lora_adapters="([^"]*)",'
                      r'waiting_lora_adapters="([^"]*)"\} \S+$', re.M)
    assert info.search(httpx.get(server.url + "/metrics").text).groups() == ("", "")
    loop.call(slow_forwards).result(10)
    try:
        stream = client.completions.create(model="sql", prompt=PROMPTS[0], stream=True, **GREEDY)
        first = next(iter(stream))  # in flight now
        busy = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        running = info.search(httpx.get(server.url + "/metrics").text).group(1)
        rest = list(stream)
    finally:
        loop.call(mend_forwards).result(10)
    assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"], busy.text
    assert running == "sql"
    tokens = [t for c in [first, *rest] for t in c.choices[0].model_extra.get("token_ids") or []]
    assert tokens == truth(PROMPTS[0], "sql")
    assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat"]  # still served


def test_an_engine_call_given_up_on_neither_runs_nor_stops_the_engine_loop(served, adapters):
    """A load whose wait timed out (or a /metrics scrape's) cancels its engine call: the call must not
    run later, and the engine's thread must not die on a result nobody can take."""
    _, loop = served
    ran = []
    blocker = loop.call(lambda engine: time.sleep(0.3))  # the engine is busy
    late = loop.call(lambda engine: ran.append(engine.add_lora(LoRARequest("late", 90, adapters["extra"]))))
    assert late.cancel()
    blocker.result(10)
    assert 90 not in loop.call(LLMEngine.list_loras).result(10) and not ran and loop.alive


# ---------------------------------------------------------------------------- an engine process
def test_an_engine_process_serves_adapters_and_loads_them_at_runtime(adapters, truth):
    """The adapter travels to the engine process with each request, and the load/unload calls too."""
    with single_threaded_torch(), serving(LORA, engine_process=True, lora_modules=modules(adapters),
                                          allow_runtime_lora_updating=True) as (server, loop):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
            resp = api.completions.create(model="sql", prompt=PROMPTS, **GREEDY)
            assert [c.model_extra["token_ids"] for c in resp.choices] == [truth(p, "sql") for p in PROMPTS]
            bad = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/adapter"})
            assert bad.status_code == 400 and "/no/such/adapter" in bad.json()["error"]["message"]
            assert post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]}) \
                .is_success
            chat = api.chat.completions.create(model="extra", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
            assert chat.choices[0].model_extra["token_ids"] == truth(chat_ids([{"role": "user", "content": "Hi"}]),
                                                                     "extra")
            assert post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"}).is_success
            assert 'vllm:lora_requests_info{max_lora="2"' in httpx.get(server.url + "/metrics").text
        assert_all_free(loop)
