"""vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, ``/version``) and chat-template fields
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``, a request's own
``chat_template`` on a server that trusts them, the server's ``--chat-template``), over real HTTP.
A prompt ``/tokenize`` reports is the one a chat completion runs: its greedy tokens equal the
engine's on those ids. Every test ends with every KV block free."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import hf_paged
from hf_paged.__main__ import CliError, _chat_template
from hf_paged.demo import byte_tokenizer
from tests.helpers.serving import MODEL, NUM_BLOCKS, assert_all_free, serving, single_threaded_torch, tiny_model
from tests.helpers.serving import post_then_all_free as _post

TOKENIZER = byte_tokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
PREFILLED = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
# a template of our own: each message's content between brackets, then "shout" if the variable is set
TEMPLATE = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if shout %}!!{% endif %}"
            "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def trusted():
    """A server that takes requests' chat templates, and has a template of its own (--chat-template)."""
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}, trust_request_chat_template=True,
                                          chat_template=TEMPLATE) as (server, loop):
        yield server, loop


@pytest.fixture(scope="module")
def engine():
    """The truth: an in-process engine on an identical model (same seed)."""
    return hf_paged.LLMEngine(tiny_model(), TOKENIZER, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def plain():
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}) as (server, loop):
        yield server, loop


def _chat(served, **body) -> openai.types.chat.ChatCompletion:
    server, loop = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        extra = {k: body.pop(k) for k in list(body) if k not in ("messages", "max_tokens", "temperature")}
        resp = client.chat.completions.create(model=MODEL, extra_body={"return_token_ids": True, **extra}, **body)
    assert_all_free(loop)
    return resp


def _greedy(engine, ids: list[int], n: int) -> list[int]:
    out = engine.generate([ids], hf_paged.SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)[0]
    return out.outputs[0].token_ids


def test_tokenize_a_prompt_as_a_completion_sees_it(plain):
    got = _post(plain, "/tokenize", {"model": MODEL, "prompt": "Hello, 世界"}).json()
    want = TOKENIZER("Hello, 世界").input_ids
    assert got["tokens"] == want and got["count"] == len(want) and got["token_strs"] is None
    assert got["max_model_len"] == tiny_model().config.max_position_embeddings
    bare = _post(plain, "/tokenize", {"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == TOKENIZER("Hello", add_special_tokens=False).input_ids
    assert bare["token_strs"] == TOKENIZER.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_messages_is_the_prompt_a_chat_completion_runs(plain, engine):
    got = _post(plain, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    text = TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert got["tokens"] == TOKENIZER(text, add_special_tokens=False).input_ids
    resp = _chat(plain, messages=MESSAGES, max_tokens=8, temperature=0)
    assert resp.usage.prompt_tokens == got["count"]
    assert resp.choices[0].model_extra["token_ids"] == _greedy(engine, got["tokens"], 8)
    no_prompt = _post(plain, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] != got["tokens"] and got["tokens"][:no_prompt["count"]] == no_prompt["tokens"]


def test_continue_final_message_goes_on_with_the_assistants_text(plain, engine):
    ids = _post(plain, "/tokenize", {"messages": PREFILLED, "continue_final_message": True,
                                     "add_generation_prompt": False}).json()["tokens"]
    text = TOKENIZER.decode(ids)
    assert text.endswith("Well, the") and TOKENIZER.apply_chat_template(
        PREFILLED, continue_final_message=True, tokenize=False) == text
    resp = _chat(plain, messages=PREFILLED, max_tokens=8, temperature=0, continue_final_message=True,
                 add_generation_prompt=False)
    assert resp.choices[0].model_extra["token_ids"] == _greedy(engine, ids, 8)
    closed = _chat(plain, messages=PREFILLED, max_tokens=8, temperature=0)  # negative control: a new turn
    assert closed.usage.prompt_tokens != len(ids)
    both = _post(plain, "/v1/chat/completions", {"model": MODEL, "messages": PREFILLED, "max_tokens": 4,
                                                "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_a_request_template_needs_a_trusting_server(plain, trusted, engine):
    body = {"messages": MESSAGES, "chat_template": TEMPLATE, "chat_template_kwargs": {"shout": True}}
    refused = _post(plain, "/tokenize", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    refused = _post(plain, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, **body})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    own = _post(trusted, "/tokenize", {**body, "chat_template": "{{ messages[-1]['content'] }}"}).json()
    assert TOKENIZER.decode(own["tokens"]) == "Hi there"
    resp = _chat(trusted, messages=MESSAGES, max_tokens=6, temperature=0, chat_template="{{ messages[-1]['content'] }}")
    assert resp.choices[0].model_extra["token_ids"] == _greedy(engine, own["tokens"], 6)


def test_the_servers_template_and_its_variables(trusted, engine):
    shout = _post(trusted, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"shout": True}}).json()
    assert TOKENIZER.decode(shout["tokens"]) == "[Be brief.][Hi there]!!>"  # --chat-template, not the tokenizer's
    quiet = _post(trusted, "/tokenize", {"messages": MESSAGES}).json()
    assert TOKENIZER.decode(quiet["tokens"]) == "[Be brief.][Hi there]>"
    resp = _chat(trusted, messages=MESSAGES, max_tokens=6, temperature=0, chat_template_kwargs={"shout": True})
    assert resp.usage.prompt_tokens == shout["count"]
    assert resp.choices[0].model_extra["token_ids"] == _greedy(engine, shout["tokens"], 6)
    reserved = _post(trusted, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    bad = _post(trusted, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": ["shout"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_detokenize_and_version(plain):
    ids = TOKENIZER("Hello, 世界").input_ids
    assert _post(plain, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": TOKENIZER.decode(ids)}
    outside = _post(plain, "/detokenize", {"tokens": [65, 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens[1]"
    other = _post(plain, "/detokenize", {"model": "other", "tokens": ids})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    typed = _post(plain, "/tokenize", {"prompt": 42})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "prompt"
    unknown = _post(plain, "/tokenize", {"prompt": "x", "truncate": 3})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "truncate"
    assert httpx.get(plain[0].url + "/version").json() == {"version": hf_paged.__version__}
    paths = httpx.get(plain[0].url + "/openapi.json").json()["paths"]
    schema = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in schema["anyOf"]] == ["TokenizeCompletionRequest",
                                                                         "TokenizeChatRequest"]


def test_a_request_whose_masks_leave_nothing_is_a_400_about_them_not_max_tokens(plain):
    eos = TOKENIZER.eos_token_id
    resp = _post(plain, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                            "allowed_token_ids": [eos], "min_tokens": 2})
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] is None and "every token is masked" in error["message"]


def test_the_chat_template_option_reads_a_file_or_takes_a_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert _chat_template(str(path)) == TEMPLATE and _chat_template(TEMPLATE) == TEMPLATE
    assert _chat_template(None) is None
    with pytest.raises(CliError, match="not a readable file"):
        _chat_template(str(tmp_path / "missing.jinja"))


def test_chat_prompts_as_vllm_renders_them(plain):
    """Text parts one per line; tools in the template under tool_choice "none" too; a reply without
    a generation prompt keeps the last message's role."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    ids = _post(plain, "/tokenize", {"messages": parts}).json()["tokens"]
    assert ids == _post(plain, "/tokenize", {"messages": [{"role": "user", "content": "Hi\nthere"}]}).json()["tokens"]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": MESSAGES, "tools": [tool]}
    with_tools = _post(plain, "/tokenize", body).json()["count"]
    assert with_tools > _post(plain, "/tokenize", {"messages": MESSAGES}).json()["count"]
    none = _post(plain, "/v1/chat/completions", {"model": MODEL, **body, "tool_choice": "none", "max_tokens": 2})
    assert none.json()["usage"]["prompt_tokens"] == with_tools
    reply = _post(plain, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                 "add_generation_prompt": False}).json()
    assert reply["choices"][0]["message"]["role"] == "user"
    normal = _post(plain, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    assert normal["choices"][0]["message"]["role"] == "assistant"


def test_a_tool_reaches_the_template_with_vllms_keys(trusted):
    """A tool declared without ``description`` or ``parameters`` reaches the template with both null
    (vLLM's; a template that prints tools as JSON writes them); other declared keys stay."""
    tool = {"type": "function", "function": {"name": "get_time", "strict": True}}
    body = {"messages": MESSAGES, "tools": [tool], "chat_template": "{{ tools | tojson }}"}
    shown = TOKENIZER.decode(_post(trusted, "/tokenize", body).json()["tokens"])
    assert json.loads(shown) == [{"type": "function", "function": {"name": "get_time", "description": None,
                                                                    "parameters": None, "strict": True}}]


def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(plain):
    """vLLM's chat ``echo``: a reply of the last message's role starts with that message's text
    (a continued message comes back whole), streamed alike; a new assistant turn echoes nothing."""
    def chat(messages, stream=False, **body):
        payload = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "echo": True,
                   "stream": stream, **body}
        if not stream:
            return _post(plain, "/v1/chat/completions", payload).json()["choices"][0]["message"]["content"]
        server, loop = plain
        content = ""
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    content += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert_all_free(plain[1])
        return content

    plain_reply = _post(plain, "/v1/chat/completions", {"model": MODEL, "messages": PREFILLED, "max_tokens": 5,
                                                        "temperature": 0, "continue_final_message": True,
                                                        "add_generation_prompt": False}).json()
    generated = plain_reply["choices"][0]["message"]["content"]
    for stream in (False, True):
        assert chat(PREFILLED, stream, continue_final_message=True, add_generation_prompt=False) == \
            "Well, the" + generated
        assert chat(MESSAGES, stream, add_generation_prompt=False).startswith("Hi there")
        assert not chat(MESSAGES, stream).startswith("Hi there")  # a new assistant turn: nothing to echo
