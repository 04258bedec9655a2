"""An output's text continues its prompt's, as vLLM's detokenizer shows it.

With a SentencePiece (Metaspace) tokenizer, as Llama 2's, Mistral's and Gemma's, a token decoded
alone loses its word-start space: decoding a completion's ids alone would read "w7 w9" where,
after the prompt, it reads " w7 w9" (the completion of "The capital of France is" would read
"Paris", and an echo "...isParis"). The engine's texts, its streams, the log-probs' tokens, and the
server's completions, echoes, text offsets and chat contents all read as the continuation. Every
test ends with every KV block free.
"""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.detokenize import PromptContext, TokenTexts, decode_text, prompt_context
from hf_paged.serve import ServerSettings, ServerThread, build_app
from tests.helpers.tiny_models import VOCAB, build, single_threaded_torch

PROMPT_IDS = [5, 9, 13]
PROMPT = "w5 w9 w13"
MESSAGES = [{"role": "user", "content": "w20 w21"}]
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """One word a token ("\u2581w7"), Metaspace pre-tokenizer and decoder (SentencePiece's): a
    token decoded alone or first has no space; <pad> </s> <s> are ids 0-2 (the tiny models')."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"\u2581w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


TOKENIZER = sentencepiece_tokenizer()


def continued(prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text ``token_ids`` add to the prompt's: the whole decode less the prompt's."""
    head, whole = TOKENIZER.decode(prompt_ids), TOKENIZER.decode(prompt_ids + token_ids)
    assert whole.startswith(head)
    return whole[len(head):]


@pytest.fixture(scope="module")
def engine():
    with single_threaded_torch():
        yield LLMEngine(build("llama"), TOKENIZER, num_blocks=64)


def run(engine: LLMEngine, prompt, **params):
    out = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert out.error is None, out.error
    return out


def test_the_tokenizer_drops_a_first_tokens_space():
    """The premise: decoded alone, these ids read otherwise than after the prompt."""
    assert TOKENIZER.decode([9, 13]) == "w9 w13" and TOKENIZER.decode(PROMPT_IDS + [9, 13]) == PROMPT + " w9 w13"
    assert TOKENIZER(PROMPT, add_special_tokens=False).input_ids == PROMPT_IDS


@pytest.mark.parametrize("prompt", [PROMPT_IDS, PROMPT], ids=["token ids", "text"])
def test_the_engines_text_continues_the_prompt(engine, prompt):
    out = run(engine, prompt, **GREEDY, logprobs=0)
    ids, text = out.outputs[0].token_ids, out.outputs[0].text
    assert text == continued(PROMPT_IDS, ids) and text.startswith(" ") and text != TOKENIZER.decode(ids)
    assert TOKENIZER.decode(PROMPT_IDS) + text == TOKENIZER.decode(PROMPT_IDS + ids)
    assert "".join(entry[t].decoded_token for t, entry in zip(ids, out.outputs[0].logprobs)) == text
    streamed = "".join(delta["text"] for delta in engine.stream(prompt, SamplingParams(**GREEDY)))
    assert streamed == text
    assert engine.kv.num_used_blocks() == 0 and not engine.has_unfinished_requests()


def test_stop_strings_match_the_continued_text(engine):
    """A stop string that starts with the space the continuation shows ends the output there."""
    ids = run(engine, PROMPT_IDS, **GREEDY).outputs[0].token_ids
    stop = f" w{ids[2]}"
    out = run(engine, PROMPT_IDS, **GREEDY, stop=[stop]).outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == continued(PROMPT_IDS, ids[:ids.index(ids[2])])
    assert engine.kv.num_used_blocks() == 0


def test_the_prompt_context_is_its_tail_of_whole_characters():
    tail = prompt_context(TOKENIZER, list(range(3, 20)))  # the last CONTEXT_TOKENS, and their text
    assert tail == PromptContext(tuple(range(14, 20)), TOKENIZER.decode(list(range(14, 20))))
    assert prompt_context(TOKENIZER, []) == prompt_context(TOKENIZER, None) == PromptContext()
    nbytes = byte_tokenizer()
    e_acute = nbytes("\u00e9", add_special_tokens=False).input_ids  # two byte tokens
    assert len(e_acute) == 2
    a = nbytes("a", add_special_tokens=False).input_ids
    assert prompt_context(nbytes, a + e_acute[:1]) == PromptContext()  # ends inside a character: the output ends it
    assert decode_text(nbytes, e_acute[1:], context=prompt_context(nbytes, a + e_acute[:1])) == "\ufffd"
    assert prompt_context(nbytes, e_acute[1:] + a).token_ids == tuple(a)  # a tail starting inside a character is cut


def test_token_texts_keep_the_word_start_space():
    texts = TokenTexts(TOKENIZER)
    assert (texts(9), texts.alone(9)) == (" w9", "w9")
    nbytes = TokenTexts(byte_tokenizer())  # a byte-level tokenizer's tokens read the same either way
    space_a = byte_tokenizer()(" a", add_special_tokens=False).input_ids
    assert [nbytes(t) for t in space_a] == [nbytes.alone(t) for t in space_a] == [" ", "a"]


# ---------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def client(engine):
    """A server over its own engine (same weights as ``engine``, the truth)."""
    served = LLMEngine(build("llama"), TOKENIZER, num_blocks=64)
    app = build_app(served, ServerSettings(model_name="tiny"))
    with ServerThread(app) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
        assert served.kv.num_used_blocks() == 0 and not served.has_unfinished_requests()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_and_echoes_continue_the_prompt(client, engine, stream):
    ref = run(engine, PROMPT, **GREEDY).outputs[0]
    common = dict(model="tiny", prompt=PROMPT, max_tokens=GREEDY["max_tokens"], temperature=0.0, stream=stream,
                  extra_body={"ignore_eos": True})

    def text(**fields):
        resp = client.completions.create(**common, **fields)
        return "".join(c.choices[0].text for c in resp) if stream else resp.choices[0].text

    assert text() == ref.text and ref.text.startswith(" ")
    assert text(echo=True) == PROMPT + ref.text


def test_logprob_tokens_join_to_the_text_and_offsets_index_it(client, engine):
    ref = run(engine, PROMPT, **GREEDY).outputs[0]
    for echo in (False, True):
        choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=GREEDY["max_tokens"],
                                           temperature=0.0, logprobs=1, echo=echo,
                                           extra_body={"ignore_eos": True}).choices[0]
        tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
        assert choice.text == (PROMPT if echo else "") + ref.text
        assert "".join(tokens) == choice.text
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
        assert all(choice.text[at:].startswith(token) for at, token in zip(offsets, tokens))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_content_continues_the_templated_prompt(client, engine, stream):
    prompt_ids = TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = run(engine, prompt_ids, **GREEDY).outputs[0]
    assert ref.text == continued(prompt_ids, ref.token_ids) and ref.text.startswith(" ")
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=GREEDY["max_tokens"],
                                          temperature=0.0, stream=stream, extra_body={"ignore_eos": True})
    content = "".join(c.choices[0].delta.content or "" for c in resp if c.choices) if stream \
        else resp.choices[0].message.content
    assert content == ref.text
