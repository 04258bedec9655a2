"""OpenAI's Responses API (``POST /v1/responses``) over HTTP with the real ``openai`` client: the
same prompt, tokens and text as the equivalent chat completion, the Response object and stream
events as the ``openai`` package types them (validated strictly), streamed equal to non-streamed,
a function tool round trip, ``text.format``, ``max_output_tokens`` giving ``incomplete``, vLLM's
sampling extensions, errors naming the Responses fields, disconnects and engine failures. After
every test nothing is in flight and every KV block is free."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.serve import responses_api
from tests.helpers.serving import (ENGINE_PLACES, MODEL, NUM_BLOCKS, client, engine,  # noqa: F401 - fixtures
                                   fail_next_step, serving, single_threaded_torch, wait_idle)

TOKENIZER = byte_tokenizer()
EVENTS = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "Be brief."
CONVERSATION = [  # every input form: a string, text parts, a reply sent back with its id and status
    {"role": "user", "content": "Hi there"},
    {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
     "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]},
    {"role": "developer", "content": [{"type": "input_text", "text": "Answer in "},
                                      {"type": "input_text", "text": "English."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Once upon"}]},
]
AS_CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hi there"},
           {"role": "assistant", "content": "Hello!"}, {"role": "developer", "content": "Answer in English."},
           {"role": "user", "content": "Once upon"}]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                       "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMETERS}
WEATHER_AS_CHAT = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                    "parameters": WEATHER_PARAMETERS}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def chat_ids(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = TOKENIZER.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return TOKENIZER(text, add_special_tokens=False).input_ids


def has_multibyte(text: str) -> bool:
    return any(ord(ch) > 127 and ch != "\ufffd" for ch in text)


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def served(request):
    """Every test runs against the engine on the loop's thread and in an engine process (what
    ``hf-paged serve`` runs)."""
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS},
                                          engine_process=request.param == "engine process") as (server, loop):
        yield server, loop


@pytest.fixture
def prompts(served, monkeypatch) -> list[list[int]]:
    """The prompt token ids the engine loop is given, request after request, during the test."""
    _, loop = served
    seen, submit = [], loop.submit

    def recording(prompt_ids, params, request_id, final_only=False, priority=0, **options):
        seen.extend(prompt_ids)
        return submit(prompt_ids, params, request_id, final_only, priority, **options)

    monkeypatch.setattr(loop, "submit", recording)
    return seen


def post(served, body: dict) -> httpx.Response:
    return httpx.post(served[0].url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)


def raw_events(served, body: dict) -> list[dict]:
    """The SSE events of a streamed request, each checked against the ``openai`` types (strictly) and
    its ``event:`` line; their sequence numbers count from 0."""
    with httpx.stream("POST", served[0].url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        blocks = resp.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---------------------------------------------------------------------------- the chat machinery's output
def test_text_equals_the_chat_completions_token_for_token(client, engine, prompts):
    resp = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=CONVERSATION, max_output_tokens=24,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=AS_CHAT, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True}).choices[0]
    as_template = [{**m, "role": "system"} if m["role"] == "developer" else m for m in AS_CHAT]  # chat's mapping
    assert prompts[0] == prompts[1] == chat_ids(as_template)  # the engine got the chat request's prompt
    ref = engine.generate([prompts[0]], SamplingParams(max_new_tokens=24, temperature=0), use_tqdm=False)[0]
    assert chat.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert resp.output_text == chat.message.content == ref.outputs[0].text
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(prompts[0]), len(ref.outputs[0].token_ids))
    # the control: the instructions reach the prompt, and change the text
    bare = client.responses.create(model=MODEL, input=CONVERSATION, max_output_tokens=24, temperature=0)
    assert prompts[2] == chat_ids(as_template[1:]) != prompts[0] and bare.output_text != resp.output_text


def test_a_string_input_is_one_user_message(client, prompts):
    text = client.responses.create(model=MODEL, input="Once upon", max_output_tokens=12, temperature=0).output_text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon"}],
                                          max_tokens=12, temperature=0).choices[0].message.content
    assert prompts[0] == prompts[1] == chat_ids([{"role": "user", "content": "Once upon"}]) and text == chat


def test_the_response_object_is_openais(served, client):
    body = dict(input="Hello", max_output_tokens=200, temperature=0, instructions="Hi.", store=True,
                metadata={"tag": "x"}, user="u1")
    raw = post(served, body).json()
    resp = Response.model_validate(raw)  # strictly: every field the type requires, of its type
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    (message,) = resp.output
    assert (message.type, message.role, message.status, message.content[0].type) == \
           ("message", "assistant", "completed", "output_text")
    assert resp.output_text == message.content[0].text and resp.output_text
    usage = resp.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens > 0
    assert usage.input_tokens == len(chat_ids([{"role": "system", "content": "Hi."},
                                               {"role": "user", "content": "Hello"}]))
    assert (resp.temperature, resp.top_p, resp.max_output_tokens, resp.parallel_tool_calls) == (0.0, 1.0, 200, True)
    assert (resp.tools, resp.tool_choice, resp.text.format.type) == ([], "none", "text")
    assert (resp.instructions, resp.metadata, resp.user) == ("Hi.", {"tag": "x"}, "u1")
    assert client.responses.create(model=MODEL, store=False, **{k: v for k, v in body.items() if k != "store"}) \
        .output_text == resp.output_text  # nothing is stored either way


def test_a_reply_goes_back_as_it_came(client, prompts):
    """``input += response.output``, as clients and agent loops do: the reply's message item (its
    id, status, annotations and logprobs) is the assistant message the template sees."""
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0)
    turn = [{"role": "user", "content": "Hi"}, *first.output, {"role": "user", "content": "More"}]
    second = client.responses.create(model=MODEL, input=turn, max_output_tokens=6, temperature=0)
    assert second.status == "incomplete" and prompts[1] == chat_ids(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": "More"}])


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, extra_body={"seed": 6})],
                         ids=["greedy", "seeded"])
def test_streamed_events_build_the_non_streamed_response(served, client, sampling):
    """The deltas concatenate to the non-streamed text, multi-byte characters split over byte
    tokens arriving whole (a delta with a broken character would make the concatenation differ)."""
    args = dict(input="Hi", max_output_tokens=48, **sampling)
    whole = client.responses.create(model=MODEL, **args)
    events = raw_events(served, {**{k: v for k, v in args.items() if k != "extra_body"}, **args.get("extra_body", {})})
    types = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert has_multibyte(whole.output_text) and len(deltas) > 2, "no split character: the test would not see one"
    assert "".join(deltas) == whole.output_text == events[-4]["text"] == events[-3]["part"]["text"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == whole.output_text and final.id == events[0]["response"]["id"]
    assert [final.usage.input_tokens, final.usage.output_tokens] == [whole.usage.input_tokens,
                                                                     whole.usage.output_tokens]
    parsed = list(client.responses.create(model=MODEL, stream=True, **args))  # the client parses every event
    assert [e.type for e in parsed if e.type != "response.output_text.delta"] == \
           [t for t in types if t != "response.output_text.delta"]
    assert parsed[-1].response.output_text == whole.output_text


def test_the_stream_helper_gives_the_final_response(client):
    args = dict(model=MODEL, input="Hello there", max_output_tokens=200, temperature=0)
    whole = client.responses.create(**args)
    assert whole.status == "completed"  # the helper's final response needs response.completed
    with client.responses.stream(**args) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text


def test_max_output_tokens_makes_it_incomplete(served, client):
    resp = client.responses.create(model=MODEL, input="Once upon", max_output_tokens=5, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.output[0].status == "incomplete" and resp.max_output_tokens == 5
    events = raw_events(served, dict(input="Once upon", max_output_tokens=5, temperature=0))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert Response.model_validate(events[-1]["response"]).output_text == resp.output_text
    longer = client.responses.create(model=MODEL, input="Once upon", max_output_tokens=300, temperature=0)
    assert longer.status == "completed" and longer.output_text.startswith(resp.output_text)  # the control


def test_sampling_extensions_reach_the_engine(client):
    extras = {"top_k": 8, "min_p": 0.1, "repetition_penalty": 1.5}
    args = dict(model=MODEL, max_output_tokens=24, temperature=1.0, top_p=0.9)
    text = client.responses.create(input="Hello", **args, extra_body={"seed": 3, **extras}).output_text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=24,
                                          temperature=1.0, top_p=0.9, seed=3, extra_body=extras)
    assert text == chat.choices[0].message.content
    assert text != client.responses.create(input="Hello", **args, extra_body={"seed": 3}).output_text  # the control


# ---------------------------------------------------------------------------- tools and text.format
@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"], ids=["named", "required"])
def test_a_function_tool_round_trip(client, prompts, choice):
    """The model is made to call; its call and the client's output go back as items, and the
    template sees them as it sees the equivalent chat messages."""
    user = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[user], tools=[WEATHER], tool_choice=choice,
                                    parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    (call,) = first.output
    assert (call.type, call.name, call.status, first.status) == ("function_call", "get_weather", "completed",
                                                                 "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    chat_choice = {"type": "function", "function": {"name": "get_weather"}} if isinstance(choice, dict) else choice
    chat = client.chat.completions.create(model=MODEL, messages=[user], tools=[WEATHER_AS_CHAT], max_tokens=120,
                                          tool_choice=chat_choice, parallel_tool_calls=False, temperature=0)
    assert prompts[0] == prompts[1] == chat_ids([user], [WEATHER_AS_CHAT])
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    assert (first.tool_choice if isinstance(choice, str) else first.tool_choice.model_dump()) == choice

    back = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"}
    second = client.responses.create(model=MODEL, input=[user, *first.output, back], tools=[WEATHER],
                                     max_output_tokens=8, temperature=0)
    messages = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees"}]
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_AS_CHAT], max_tokens=8,
                                           temperature=0)
    assert prompts[2] == prompts[3] and "22 degrees" in TOKENIZER.decode(prompts[2])
    assert TOKENIZER.decode(prompts[2]).count("<tool_call>") == 1
    assert second.output_text == again.choices[0].message.content and second.output[0].type == "message"
    client.responses.create(model=MODEL, input=[user, *first.output], tools=[WEATHER], max_output_tokens=8,
                            temperature=0)
    assert prompts[4] != prompts[2]  # the control: without the output item the prompt differs


def test_a_streamed_call_builds_the_non_streamed_one(served, client):
    args = dict(input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=120, temperature=0)
    (call,) = client.responses.create(model=MODEL, **args).output
    events = raw_events(served, args)
    assert [e["type"] for e in events[:3]] + [e["type"] for e in events[-4:]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[2]["item"], events[-2]["item"]
    assert (added["type"], added["name"], added["arguments"], added["status"]) == ("function_call", "get_weather", "",
                                                                                   "in_progress")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == events[-3]["arguments"] == done["arguments"] == call.arguments and len(deltas) > 1
    assert done["call_id"] == added["call_id"] == events[-1]["response"]["output"][0]["call_id"]
    with client.responses.stream(model=MODEL, **args) as stream:
        final = stream.get_final_response()
    assert final.output[0].arguments == call.arguments


def test_output_items_follow_the_text_in_order():
    """Text, a call, and text after it: streamed in any split or whole, the same items."""
    text = 'Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> done'
    whole = responses_api.OutputItems(tools=True, calls_only=False)
    whole.feed(text, final=True)
    whole.close("completed")
    pieces = responses_api.OutputItems(tools=True, calls_only=False)
    events = [e for i in range(0, len(text), 3) for e in pieces.feed(text[i: i + 3], final=i + 3 >= len(text))]
    events += pieces.close("completed")
    shape = [(item["type"], item.get("arguments"), item["content"][0]["text"] if "content" in item else None)
             for item in whole.items]
    assert shape == [("message", None, "Sure!"), ("function_call", '{"city": "Paris"}', None),
                     ("message", None, " done")]
    assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in pieces.items] == \
           [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole.items]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_text_format_json_schema_gives_valid_json(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    resp = client.responses.create(model=MODEL, input="Give me a record", max_output_tokens=80, temperature=0,
                                   text={"format": fmt})
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "person"
    plain = client.responses.create(model=MODEL, input="Give me a record", max_output_tokens=80, temperature=0)
    with pytest.raises(ValueError):  # the control: unconstrained, the model writes no JSON
        json.loads(plain.output_text)
    obj = client.responses.create(model=MODEL, input="Give me a record", max_output_tokens=120, temperature=1.0,
                                  text={"format": {"type": "json_object"}}, extra_body={"seed": 11})
    assert isinstance(json.loads(obj.output_text), dict)

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    parsed = client.responses.parse(model=MODEL, input="Give me a record", max_output_tokens=80, temperature=0,
                                    text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


# ---------------------------------------------------------------------------- errors and limits
BAD = [  # (body fields, the param the 400 names, what its message says)
    ({"foo": 1}, "foo", "unknown parameter"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "no responses are stored"),
    ({"conversation": "conv_1"}, "conversation", "no conversations are stored"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "'disabled'"),
    ({"background": True}, "background", "False"),
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"seed": True}, "seed", "valid integer"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens must be at most"),
    ({"input": 3}, "input", "valid"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "only input_text and output_text"),
    ({"input": [{"role": "user", "content": "x", "phase": "commentary"}]}, "input[0].phase", "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'user'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "only message, function_call"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "required"),
    ({"input": [{"role": "assistant", "content": "x", "status": "incomplete"}]}, "input[0].status",
     "continuing an unfinished assistant message"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x",
                                                  "annotations": [{"type": "url_citation"}]}]}, "Hi"]},
     "input[0].content[0].annotations", "at most 0 items"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "required"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "tools[0].name must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "two tools are named"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}], "tool_choice": "required"}, "tools[0].parameters", "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "auto"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs schema"),
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name", "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema",
     "text.format.schema"),
    ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name", "only read with type json_schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     "text.format cannot be added"),
    ({"metadata": {"a": 1}}, "metadata", "valid string"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "False"),
    ({"top_k": "3"}, "top_k", "valid integer"),
    ({"stop": [""]}, "stop", "non-empty"),
]


@pytest.mark.parametrize("fields,param,fragment", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(served, client, fields, param, fragment):
    resp = post(served, {"input": "Hi", "max_output_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert fragment in error["message"], error["message"]


def test_null_and_asking_for_what_is_done_anyway_are_accepted(served, client):
    unset = {name: None for name in responses_api.RESPONSES_UNSUPPORTED}
    resp = post(served, {"input": "Hi", "max_output_tokens": 4, "temperature": 0, **unset, "truncation": "disabled",
                         "background": False, "service_tier": "auto", "store": True, "tools": None,
                         "tool_choice": "auto", "instructions": None,
                         "text": {"format": {"type": "text"}, "verbosity": None}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["tool_choice"] == "none"  # auto with nothing to call (as vLLM)
    plain = post(served, {"input": "Hi", "max_output_tokens": 4, "temperature": 0})
    assert resp.json()["output"][0]["content"] == plain.json()["output"][0]["content"]


def test_limits_are_chats(served, client):
    model = post(served, {"model": "other", "input": "Hi"})
    assert model.status_code == 404 and model.json()["error"]["code"] == "model_not_found"
    no_model = httpx.post(served[0].url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
    assert no_model.status_code == 200 and no_model.json()["model"] == MODEL  # unset: the served model (as vLLM)
    long = post(served, {"input": "x" * 5000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert long.json()["error"]["param"] == "input"
    over = post(served, {"input": "Hi", "max_output_tokens": 4096})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert over.json()["error"]["param"] == "max_output_tokens" and "max_output_tokens=4096" in \
        over.json()["error"]["message"]


def test_key_and_body_size_guard_the_route():
    with single_threaded_torch(), serving({"num_blocks": 32}, api_key="k", max_body_bytes=1024) as (server, loop):
        url = server.url + "/v1/responses"
        assert httpx.post(url, json={"model": MODEL, "input": "Hi"}).status_code == 401
        big = httpx.post(url, json={"model": MODEL, "input": "x" * 2000}, headers={"Authorization": "Bearer k"})
        assert big.status_code == 413
        ok = httpx.post(url, json={"model": MODEL, "input": "Hi", "max_output_tokens": 2},
                        headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2
        assert wait_idle(loop)["blocks_used"] == 0


def test_the_route_is_published_with_its_request_model(served, client):
    schema = httpx.get(served[0].url + "/openapi.json").json()
    body = schema["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    fields = schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "top_k"} <= set(fields)
    chat_stream_options = schema["components"]["schemas"]["StreamOptions"]["properties"]
    assert set(chat_stream_options) == {"include_usage", "continuous_usage_stats"}  # the chat model's, not a namesake's


# ---------------------------------------------------------------------------- disconnects and failures
def test_a_client_leaving_mid_stream_aborts_its_request(served, client):
    server, loop = served
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(lines) == "event: response.created"
        stats = loop.call(LLMEngine.stats).result(10)
        assert stats["running"] + stats["waiting"] == 1
    stats = wait_idle(loop, timeout=10)
    assert stats["running"] == stats["waiting"] == 0 and stats["blocks_used"] == 0


def test_an_engine_failure_mid_stream_is_an_error_event(served, client):
    server, loop = served
    loop.call(fail_next_step).result(10)
    with pytest.raises(openai.APIError) as err:
        for _ in client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=True):
            pass
    assert "injected" in err.value.message and err.value.body["code"] == "engine_error"
    loop.call(fail_next_step).result(10)
    events = raw_events(served, dict(input="Hello", max_output_tokens=4))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "engine_error" and "injected" in events[-1]["message"]
    loop.call(fail_next_step).result(10)
    failed = post(served, {"input": "Hello", "max_output_tokens": 4})
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"
    assert post(served, {"input": "Hello", "max_output_tokens": 4}).json()["usage"]["output_tokens"] == 4
