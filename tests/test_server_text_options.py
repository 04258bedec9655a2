"""vLLM's text options over HTTP (``include_stop_str_in_output``, ``skip_special_tokens``,
``spaces_between_special_tokens``) in completions and chat, driven by the ``openai`` client:
each choice's text, streamed or not, equals the engine's for the same request; wrong types are
400s that name the field. ``allowed_token_ids`` and ``bad_words`` (vLLM's, implemented by the
engine) are checked and mapped onto ``SamplingParams`` here. After every HTTP test nothing is in
flight and every KV block is free."""

from __future__ import annotations

import httpx
import pytest

from hf_paged import LLMEngine
from hf_paged.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, Limits
from tests.helpers.serving import (ENGINE_PLACES, MODEL, NUM_BLOCKS, client, engine, serving,  # noqa: F401
                                   single_threaded_torch)
from tests.test_output_text_options import LIKELY
from tests.test_server import chat_ids, truth

PROMPT = "Hello"
MESSAGES = [{"role": "user", "content": "Hi"}]
# sampled with LIKELY's bias: "a", "b" and special tokens, ending at EOS (as the engine tests' runs)
SAMPLED = dict(max_tokens=32, temperature=1.0, seed=2)
# request fields (extra_body) -> the same as SamplingParams (the bias aside); each changes the text here
CASES = {
    "skip_special_tokens": dict(skip_special_tokens=False),
    "include_stop_str_in_output": dict(include_stop_str_in_output=True, stop=["bb"]),
    "all three": dict(skip_special_tokens=False, spaces_between_special_tokens=False,
                      include_stop_str_in_output=True, stop=["<s>"]),
}


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def served(request):
    """The engine on the engine loop's thread, and in an engine process of its own."""
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS},
                                          engine_process=request.param == "engine process") as (server, loop):
        yield server, loop


def ask(client, kind: str, stream: bool, **fields):
    """``(text, token ids or None, finish_reason, stop_reason)`` of the first choice; a stream's
    text is its deltas joined."""
    extra = {k: v for k, v in fields.items() if k != "stop"}
    common = dict(model=MODEL, logit_bias={str(t): b for t, b in LIKELY.items()}, stop=fields.get("stop"),
                  stream=stream, extra_body={**extra, "return_token_ids": True}, **SAMPLED)
    if kind == "completion":
        resp = client.completions.create(prompt=PROMPT, **common)
        text_of = (lambda c: c.text)
    else:
        resp = client.chat.completions.create(messages=MESSAGES, **common)
        text_of = (lambda c: c.delta.content or "") if stream else (lambda c: c.message.content)
    chunks = [c.choices[0] for c in resp if c.choices] if stream else [resp.choices[0]]
    ids = [t for c in chunks for t in c.model_extra.get("token_ids") or []]
    last = chunks[-1]
    return "".join(text_of(c) for c in chunks), ids, last.finish_reason, last.model_extra["stop_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("case", list(CASES))
def test_text_options_equal_the_engine(client, engine, case, kind, stream):
    prompt = PROMPT if kind == "completion" else chat_ids(MESSAGES)
    params = dict(max_new_tokens=SAMPLED["max_tokens"], temperature=1.0, seed=SAMPLED["seed"], logit_bias=LIKELY)
    ref = truth(engine, prompt, **params, **CASES[case]).outputs[0]
    got = ask(client, kind, stream, **CASES[case])
    assert got == (ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)
    plain = truth(engine, prompt, **params, stop=CASES[case].get("stop", [])).outputs[0]
    assert plain.text != ref.text, "the options change nothing here: the test would not see them ignored"


BAD = {  # field: (a value it takes, wrong values)
    "include_stop_str_in_output": (True, ["yes", 1]),
    "skip_special_tokens": (False, ["false", 0]),
    "spaces_between_special_tokens": (False, [1.5, "true"]),
    "allowed_token_ids": (list(range(3, 259)), [[259], [-1], ["5"], [], 5]),  # the demo vocabulary: 259 ids
    "bad_words": (["zz"], ["word", [" "], [5]]),
}


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("field, value", [(f, v) for f, (_, values) in BAD.items() for v in values])
def test_wrong_values_are_400s_naming_the_field(client, served, kind, field, value):
    """... and a value the field takes is served (the field is known: it is the value that is refused)."""
    server, _ = served
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"

    def post(field_value):
        body = {"model": MODEL, "max_tokens": 2, field: field_value}
        body.update({"prompt": PROMPT} if kind == "completion" else {"messages": MESSAGES})
        return httpx.post(server.url + path, json=body, timeout=60)

    resp = post(value)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"] or "").startswith(field), resp.json()
    assert post(BAD[field][0]).status_code == 200


# ---------------------------------------------------------------------------- the mapping onto SamplingParams
LIMITS = Limits(vocab_size=259)


def sampling_params(kind: str, **fields):
    body = {"model": MODEL, **({"prompt": PROMPT} if kind == "completion" else {"messages": MESSAGES}), **fields}
    request = (CompletionRequest if kind == "completion" else ChatCompletionRequest).model_validate(body)
    request.check(LIMITS)
    return request.sampling_params(8)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_fields_reach_sampling_params(kind):
    default = sampling_params(kind)
    assert (default.include_stop_str_in_output, default.skip_special_tokens, default.spaces_between_special_tokens,
            default.allowed_token_ids, default.bad_words) == (False, True, True, None, None)
    text = dict(include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    params = sampling_params(kind, allowed_token_ids=[5, 258], bad_words=["ab", "c d"], **text)
    assert (params.allowed_token_ids, params.bad_words) == ([5, 258], ["ab", "c d"])
    assert all(getattr(params, name) is value for name, value in text.items())
    beams = sampling_params(kind, use_beam_search=True, best_of=2, **text)  # vLLM's beam search reads them too
    assert beams.num_beams == 2 and all(getattr(beams, name) is value for name, value in text.items())
    unset = sampling_params(kind, bad_words=[], skip_special_tokens=None)  # null is "not set", [] no words
    assert (unset.bad_words, unset.skip_special_tokens) == (None, True)


@pytest.mark.parametrize("field, value", [("allowed_token_ids", [5]), ("bad_words", ["ab"])])
def test_beam_search_refuses_allowed_token_ids_and_bad_words(field, value):
    with pytest.raises(APIError) as refused:
        sampling_params("completion", use_beam_search=True, best_of=2, **{field: value})
    assert refused.value.status == 400 and refused.value.param == field
