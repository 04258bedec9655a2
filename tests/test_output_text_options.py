"""vLLM's text options of ``SamplingParams`` in ``LLMEngine``: ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``.

Token ids never change with them; an output's text is the tokenizer's decode of its ids with the
options (without the EOS or stop token that ended it unless ``include_stop_str_in_output``, cut
before, or with that option after, the stop string that ended it); stop strings match the text as
it is shown; ``stream()`` deltas add up to that text; a request without the options next to one
with them is served as before. Every test ends with every KV block free.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.detokenize import TextStream, text_decoder
from tests.helpers.serving import tiny_model
from tests.helpers.tiny_models import VOCAB, build, single_threaded_torch

BYTES = byte_tokenizer()
PAD, BOS, EOS = 0, 1, 2  # the byte tokenizer's special tokens: <pad>, <s>, </s>
PROMPT = "Hello"
# Sampled with this bias (seed 2) the tiny model writes "a" and "b" between special tokens, <s>
# three times, and ends at EOS after 20 tokens (each test asserts what it relies on).
LIKELY = {BYTES.convert_tokens_to_ids("a"): 6.0, BYTES.convert_tokens_to_ids("b"): 6.0, PAD: 4.5, BOS: 4.5, EOS: 3.0}
SAMPLED = dict(max_tokens=32, temperature=1.0, seed=2, logit_bias=LIKELY)
OPTIONS = ["skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"]


@pytest.fixture(scope="module")
def engine():
    with single_threaded_torch():
        yield LLMEngine(tiny_model(), BYTES, num_blocks=64)


def run(engine: LLMEngine, prompt=PROMPT, **params):
    out = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs


def streamed(engine: LLMEngine, prompt=PROMPT, **params) -> dict[int, tuple[str, list[int]]]:
    """``stream()``'s deltas joined: ``{index: (text, token ids)}``."""
    joined: dict[int, tuple[str, list[int]]] = {}
    for delta in engine.stream(prompt, SamplingParams(**params)):
        text, ids = joined.get(delta["index"], ("", []))
        joined[delta["index"]] = (text + delta["text"], ids + delta["token_ids"])
    return joined


def decoded(token_ids: list[int], skip_special_tokens: bool = True, tokenizer=BYTES) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------------------- skip_special_tokens
def test_skip_special_tokens_false_shows_them_but_not_the_eos_that_ended_the_output(llm):
    """vLLM does not detokenize the token that ended a sequence (unless
    include_stop_str_in_output): the EOS id is in token_ids, its text is not."""
    hidden, shown = run(llm, **SAMPLED)[0], run(llm, **SAMPLED, skip_special_tokens=False)[0]
    ids = shown.token_ids
    assert ids == hidden.token_ids and ids[-1] == EOS and BOS in ids[:-1], "the run this test relies on changed"
    assert (shown.finish_reason, shown.stop_reason) == (hidden.finish_reason, hidden.stop_reason) == ("stop", None)
    assert shown.text == decoded(ids[:-1], skip_special_tokens=False) and "<s>" in shown.text
    assert not shown.text.endswith("</s>")
    assert hidden.text == decoded(ids[:-1]) != shown.text  # the option changes the text: ignoring it would show


def test_include_stop_str_in_output_keeps_the_text_of_the_token_that_ended_it(llm):
    kept = run(llm, **SAMPLED, skip_special_tokens=False, include_stop_str_in_output=True)[0]
    dropped = run(llm, **SAMPLED, skip_special_tokens=False)[0]
    assert kept.token_ids == dropped.token_ids and kept.token_ids[-1] == EOS
    assert (kept.finish_reason, kept.stop_reason) == ("stop", None)
    assert kept.text == decoded(kept.token_ids, skip_special_tokens=False) == dropped.text + "</s>"
    skipped = run(llm, **SAMPLED, include_stop_str_in_output=True)[0]  # an EOS decoded with skipping: nothing
    assert skipped.text == decoded(kept.token_ids) == run(llm, **SAMPLED)[0].text

    free = run(llm, max_tokens=16, temperature=0)[0]
    stop_id = free.token_ids[4]  # a stop token that is not special: its text shows with the option
    kept, dropped = (run(llm, max_tokens=16, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=flag)[0]
                     for flag in (True, False))
    ids = free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert kept.token_ids == dropped.token_ids == ids and kept.stop_reason == dropped.stop_reason == stop_id
    assert (kept.text, dropped.text) == (decoded(ids), decoded(ids[:-1])) and kept.text != dropped.text


# ---------------------------------------------------------------------------- stop strings
def a_stop_string(text: str) -> tuple[int, str]:
    """Two characters of ``text`` found first where they are, past its start, neither U+FFFD
    (a split character's bytes show it until the character is whole)."""
    j = next(j for j in range(3, len(text) - 2)
             if "\ufffd" not in text[j:j + 2] and text.find(text[j:j + 2]) == j)
    return j, text[j:j + 2]


def test_include_stop_str_in_output_cuts_after_the_stop_string(llm):
    free = run(llm, max_tokens=24, temperature=0)[0]
    j, stop = a_stop_string(free.text)
    kept = run(llm, max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True)[0]
    cut = run(llm, max_tokens=24, temperature=0, stop=[stop])[0]
    assert (kept.text, cut.text) == (free.text[:j + len(stop)], free.text[:j])
    assert kept.token_ids == cut.token_ids and free.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert (kept.finish_reason, kept.stop_reason) == (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_stop_strings_match_the_text_as_it_is_shown(llm):
    """A special token's text is a stop string's match only where the text shows it."""
    shown = run(llm, **SAMPLED, skip_special_tokens=False)[0]
    first = shown.token_ids.index(BOS)
    assert first > 0, "the run this test relies on changed"
    cut = run(llm, **SAMPLED, skip_special_tokens=False, stop=["<s>"])[0]
    kept = run(llm, **SAMPLED, skip_special_tokens=False, stop=["<s>"], include_stop_str_in_output=True)[0]
    assert cut.token_ids == kept.token_ids == shown.token_ids[:first + 1]
    assert (cut.finish_reason, cut.stop_reason, kept.stop_reason) == ("stop", "<s>", "<s>")
    assert (cut.text, kept.text) == (decoded(shown.token_ids[:first], False), decoded(shown.token_ids[:first + 1], False))
    unseen = run(llm, **SAMPLED, stop=["<s>"])[0]  # skipped, <s> is in no text: the output goes on to its EOS
    assert unseen.token_ids == shown.token_ids and unseen.stop_reason is None


# ---------------------------------------------------------------------------- spaces_between_special_tokens
def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id ("w7"), decoded with spaces between tokens (WordPiece's decoder), special
    <pad> <s> </s> (ids 0-2) and one added token that is not special, <x> (the last id)."""
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB - 1)]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_tokens(["<x>"])
    assert len(tokenizer) == VOCAB
    return tokenizer


def continued(tokenizer, prompt: list[int], token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` as it continues ``prompt``'s (vLLM's): the whole decode less the
    prompt's. This tokenizer's decoder puts a space before every token but the first."""
    head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    whole = tokenizer.decode(prompt + token_ids, skip_special_tokens=skip_special_tokens)
    assert whole.startswith(head) and whole[len(head)] == " "
    return whole[len(head):]


def unspaced(tokenizer, token_ids: list[int]) -> str:
    """The text vLLM shows with special tokens and spaces_between_special_tokens=False, after a
    prompt: the words spaced, an added token right after another added token of the output
    without its space."""
    added, text, after_added = set(tokenizer.added_tokens_decoder), "", False
    for token in token_ids:
        piece = tokenizer.convert_ids_to_tokens(token)
        text += piece if token in added and after_added else " " + piece
        after_added = token in added
    return text


@pytest.fixture(scope="module")
def words_engine():
    with single_threaded_torch():
        yield LLMEngine(build("llama"), word_tokenizer(), num_blocks=64)


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(words_engine):
    tokenizer = words_engine.tokenizer
    added = {PAD, BOS, EOS, VOCAB - 1}
    params = dict(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True, logit_bias=dict.fromkeys(added, 3.0))
    spaced = run(words_engine, [5, 9, 13], **params, skip_special_tokens=False)[0]
    joined = run(words_engine, [5, 9, 13], **params, skip_special_tokens=False, spaces_between_special_tokens=False)[0]
    ids = joined.token_ids
    assert ids == spaced.token_ids and any(a in added and b in added for a, b in zip(ids, ids[1:])), \
        "no two added tokens in a row: the test would not see the option"
    assert spaced.text == continued(tokenizer, [5, 9, 13], ids, False)
    assert joined.text == unspaced(tokenizer, ids) != spaced.text
    skipped = run(words_engine, [5, 9, 13], **params, spaces_between_special_tokens=False)[0]
    assert skipped.text == continued(tokenizer, [5, 9, 13], ids)  # as in vLLM: special tokens skipped, nothing to join
    stream = streamed(words_engine, [5, 9, 13], **params, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert stream == {0: (joined.text, ids)}
    assert words_engine.kv.num_used_blocks() == 0 and not words_engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- streams, n, neighbours
STOPS = {"no stop": [], "stop strings": ["bb"], "a special stop string": ["<s>&", "ba"]}


def expected_text(out, skip_special_tokens: bool, include_stop_str_in_output: bool, stop: list[str],
                  spaces_between_special_tokens: bool) -> str:
    """vLLM's text of an output of the byte tokenizer (which puts no spaces between tokens: so
    spaces_between_special_tokens changes nothing), from its token ids: without the token that ended it unless included, cut before (or after)
    the first of its stop strings to end in the text."""
    by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
    text = decoded(out.token_ids[:-1] if by_token and not include_stop_str_in_output else out.token_ids,
                   skip_special_tokens)
    ends = [(at + len(s), s) for s in stop if (at := text.find(s)) >= 0]
    if not ends:
        return text
    end, first = min(ends, key=lambda e: e[0])
    assert out.stop_reason == first and out.token_ids[-1] != EOS, "a stop string in the text did not end it"
    return text[:end] if include_stop_str_in_output else text[:end - len(first)]


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=3)),
                         ids=lambda flags: "-".join(f"{name}={flag}" for name, flag in zip(OPTIONS, flags)))
def test_stream_deltas_add_up_to_the_text(llm, flags, stop):
    options = dict(zip(OPTIONS, flags), stop=STOPS[stop])
    out = run(llm, **SAMPLED, **options)[0]
    assert out.text == expected_text(out, **options)
    assert streamed(llm, **SAMPLED, **options) == {0: (out.text, out.token_ids)}
    if stop != "no stop":
        assert out.finish_reason == "stop" and isinstance(out.stop_reason, str), "no stop string ended it"


def test_a_text_stream_decodes_with_the_requests_options(llm):
    """The negative control of the stream test: a stream decoding with the default options does
    not add up to a text that shows special tokens."""
    params = SamplingParams(**SAMPLED, skip_special_tokens=False, include_stop_str_in_output=True)
    out = run(llm, **SAMPLED, skip_special_tokens=False, include_stop_str_in_output=True)[0]
    right, default, sent = TextStream.of(BYTES, params), TextStream(BYTES), ["", ""]
    request_id = llm.add_request(PROMPT, params)
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.request_id == request_id:
                for i, stream in enumerate((right, default)):
                    sent[i] += stream.update(output.outputs[0])[0]
    assert sent[0] == out.text and sent[1] != out.text and "<s>" not in sent[1]


def test_unfinished_outputs_read_with_the_options_here_and_after_a_pipe(llm):
    """``step()``'s outputs decode their text when it is read; sent undecoded to the server's
    process (pickled), they get a decoder there (``text_decoder``, as the server's engine loop
    gives them)."""
    params = SamplingParams(**SAMPLED, skip_special_tokens=False)
    request_id, texts = llm.add_request(PROMPT, params), []
    while llm.has_unfinished_requests():
        for output in llm.step():
            completion = output.outputs[0] if output.request_id == request_id else None
            if completion is None or completion.finished():
                continue
            landed = pickle.loads(pickle.dumps(completion))
            assert landed.needs_decoder
            landed.set_decoder(text_decoder(BYTES, params))
            texts.append((completion.text, landed.text, decoded(completion.token_ids, skip_special_tokens=False)))
    assert texts and all(here == there == want for here, there, want in texts)
    assert any("<s>" in want for _, _, want in texts)  # not what the default options would show
    assert text_decoder(BYTES)(BYTES("<s>ab").input_ids) == "ab"


def test_n_samples_each_follow_the_options(llm):
    options = dict(skip_special_tokens=False, include_stop_str_in_output=True, stop=["<s>&"])
    plain = run(llm, **{**SAMPLED, "n": 2})
    shown = run(llm, **{**SAMPLED, "n": 2}, **options)
    assert [c.token_ids[:len(s.token_ids)] for c, s in zip(plain, shown)] == [s.token_ids for s in shown]
    for c in shown:
        if c.stop_reason == "<s>&":
            assert c.text.endswith("<s>&") and c.text.count("<s>&") == 1
        else:
            assert c.text == decoded(c.token_ids, skip_special_tokens=False)
    assert [c.text for c in shown] != [c.text for c in plain] and "<s>" in "".join(c.text for c in shown)
    assert streamed(llm, **{**SAMPLED, "n": 2}, **options) == {c.index: (c.text, c.token_ids) for c in shown}


def test_greedy_tokens_with_the_options_equal_generate(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, skip_special_tokens=False,
                            spaces_between_special_tokens=False, include_stop_str_in_output=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    prompt = torch.tensor([out.prompt_token_ids])
    stock = tiny_model().generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False, eos_token_id=None)[0, prompt.shape[1]:].tolist()
    assert out.outputs[0].token_ids == stock and out.outputs[0].text == decoded(stock, skip_special_tokens=False)


def test_a_request_without_the_options_is_served_as_before_next_to_one_with_them(llm):
    alone = run(llm, **SAMPLED)[0]
    options = SamplingParams(**SAMPLED, skip_special_tokens=False, include_stop_str_in_output=True)
    both = llm.generate([PROMPT, PROMPT], [options, SamplingParams(**SAMPLED)], use_tqdm=False)
    with_options, without = both[0].outputs[0], both[1].outputs[0]
    assert (without.text, without.token_ids, without.finish_reason) == (alone.text, alone.token_ids, "stop")
    assert with_options.token_ids == alone.token_ids
    assert with_options.text == decoded(alone.token_ids, skip_special_tokens=False) != alone.text
