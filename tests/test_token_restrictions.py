"""``SamplingParams.allowed_token_ids`` and ``bad_words`` in LLMEngine, with vLLM's semantics:
greedy outputs token-exact against stock ``generate()`` with the same masks (an allow-list
``LogitsProcessor`` written here, transformers' ``bad_words_ids``), each with a negative control;
seeded samples; ``n > 1`` samples with their own histories; batches beside plain requests (theirs
unchanged); ``logit_bias``, structured outputs, penalties and ``min_tokens`` together with them;
preemption; the engine process; log-probs reported from before the masks; refusals, and a request
its masks leave nothing to generate failing alone. Every test ends with every KV block free."""

from __future__ import annotations

import functools
import string

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged import LLMEngine, SamplingParams
from hf_paged.constraints import StructuredOutputsParams
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.outputs import REJECTED
from hf_paged.engine.structured import MAX_NUM_BAD_WORDS, bad_words_token_ids
from tests.helpers.serving import serving, single_threaded_torch, tiny_model
from tests.helpers.tiny_models import assert_engine_idle

TOKENIZER = byte_tokenizer()
EOS = 2
ALLOWED = [EOS, *sorted(set(TOKENIZER.encode(string.ascii_letters + string.digits + " .,", add_special_tokens=False)))]
X, TILDE = TOKENIZER.convert_tokens_to_ids("x"), TOKENIZER.convert_tokens_to_ids("~")  # allowed, not allowed


@pytest.fixture(scope="module")
def model():
    with single_threaded_torch():
        yield tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(model, TOKENIZER, num_blocks=256, max_num_seqs=16)


@pytest.fixture(autouse=True)
def all_blocks_free(request):
    yield
    if "engine" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("engine"))


class AllowOnly(LogitsProcessor):
    """Every token outside ``ids`` to -inf (transformers has no allow-list processor)."""

    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.ids] = scores[:, self.ids]
        return masked


def ids_of(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=True)["input_ids"]


def reference(model, prompt: str, max_new_tokens: int, **kwargs) -> list[int]:
    """Stock greedy ``generate()``: the new tokens (it stops at EOS, as the engine does)."""
    ids = torch.tensor([ids_of(prompt)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list:
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    return outputs


def one_request(engine: LLMEngine, prompt: str, **params):
    return run(engine, [prompt], SamplingParams(**params))[0]


def one(engine: LLMEngine, prompt: str, **params):
    return one_request(engine, prompt, **params).outputs[0]


def word_of(token_ids: list[int]) -> str | None:
    """The text whose tokens (alone) are ``token_ids``, when there is one a user could write."""
    text = TOKENIZER.decode(token_ids)
    ok = text.isprintable() and text.strip() == text and TOKENIZER.encode(text, add_special_tokens=False) == token_ids
    return text if ok else None


def first_word(tokens: list[int], length: int, start: int = 1, avoid: tuple[list[int], ...] = ()) -> tuple[int, str]:
    """The first ``length``-token word inside ``tokens`` from ``start`` (position, text) that
    occurs in none of the token sequences ``avoid``."""
    for i in range(start, len(tokens) - length + 1):
        window = tokens[i:i + length]
        if word_of(window) and not any(_contains(other, window) for other in avoid):
            return i, word_of(window)
    raise AssertionError(f"no printable {length}-token word in {tokens}")


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


# ---------------------------------------------------------------------------- allowed_token_ids
def test_allowed_token_ids_greedy_equals_generate_with_an_allow_list(engine, model):
    prompts = ["Hi", "Hello there", "Once upon a time"]
    plain = run(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0))
    outputs = run(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0, allowed_token_ids=ALLOWED))
    for prompt, out, before in zip(prompts, outputs, plain):
        got = out.outputs[0].token_ids
        assert got == reference(model, prompt, 24, logits_processor=LogitsProcessorList([AllowOnly(ALLOWED)]))
        assert set(got) <= set(ALLOWED)
        assert not set(before.outputs[0].token_ids) <= set(ALLOWED)  # negative control: the list changes it


def test_allowed_token_ids_with_penalties_and_min_tokens_equal_generate(engine, model):
    """``repetition_penalty`` and ``min_tokens`` on top of the mask, as generate() composes them;
    the list holds EOS, which ``min_tokens`` holds back past where the output ends without it."""
    allowed = [EOS, *TOKENIZER.encode("abcdefghij", add_special_tokens=False)]
    common = dict(max_new_tokens=40, temperature=0, allowed_token_ids=allowed, repetition_penalty=1.5)
    eager = one(engine, "Hi", **common).token_ids
    assert eager[-1] == EOS and len(eager) < 20
    held = len(eager) + 4
    got = one(engine, "Hi", **common, min_tokens=held).token_ids
    processors = LogitsProcessorList([AllowOnly(allowed)])
    assert got == reference(model, "Hi", 40, logits_processor=processors, repetition_penalty=1.5,
                            min_new_tokens=held)
    assert EOS not in got[:held] and got[:len(eager) - 1] == eager[:-1]  # negative control: EOS held back


def test_allowed_token_ids_when_sampling(engine):
    params = dict(max_new_tokens=32, temperature=1.0, seed=3, n=2)
    restricted = run(engine, ["Hi", "The cat"], SamplingParams(**params, allowed_token_ids=ALLOWED))
    free = run(engine, ["Hi", "The cat"], SamplingParams(**params))
    assert all(set(c.token_ids) <= set(ALLOWED) for out in restricted for c in out.outputs)
    assert all(not set(c.token_ids) <= set(ALLOWED) for out in free for c in out.outputs)  # negative control
    again = run(engine, ["Hi", "The cat"], SamplingParams(**params, allowed_token_ids=ALLOWED))
    assert [c.token_ids for o in again for c in o.outputs] == [c.token_ids for o in restricted for c in o.outputs]


def test_log_probs_are_reported_from_before_the_masks(engine, model):
    """vLLM reports raw log-probs: a token's is the model's, not the restricted distribution's,
    and the top entries may be tokens the masks ban."""
    ids = torch.tensor([ids_of("Hi")])
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         logits_processor=LogitsProcessorList([AllowOnly(ALLOWED)]), output_logits=True,
                         return_dict_in_generate=True)
    raw = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]  # the logits before any processor
    got = one(engine, "Hi", max_new_tokens=12, temperature=0, allowed_token_ids=ALLOWED, bad_words=["Z"], logprobs=2)
    assert got.token_ids == ref.sequences[0, ids.shape[1]:].tolist()
    for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        assert entry[token] == pytest.approx(float(raw[step][token]), abs=1e-4)
        top = int(raw[step].argmax())
        assert top in entry and entry[top].rank == 1
    assert any(t not in ALLOWED for entry in got.logprobs for t in entry)  # banned tokens reported on top


# ---------------------------------------------------------------------------- bad_words
def test_bad_words_greedy_equals_generate_bad_words_ids(engine, model):
    """A two-token word taken from the unrestricted output (so the ban bites) and a one-token
    word; transformers bans the same sequences (it also reads the prompt: the words are chosen so
    that no match runs into it, the case where vLLM and it differ)."""
    prompt = "Hi"
    plain = one(engine, prompt, max_new_tokens=24, temperature=0).token_ids
    at, pair = first_word(plain, 2)
    _, single = first_word(plain, 1, start=at + 2, avoid=(plain[:at + 2],))
    words = [pair, single]
    sequences = [TOKENIZER.encode(w, add_special_tokens=False) for w in words]
    assert len(TOKENIZER.encode(" " + pair, add_special_tokens=False)) == 3  # vLLM's rule keeps no spaced form
    assert bad_words_token_ids(TOKENIZER, words, 259) == sequences
    assert ids_of(prompt)[-1] != sequences[0][0]
    got = one(engine, prompt, max_new_tokens=24, temperature=0, bad_words=words).token_ids
    assert got == reference(model, prompt, 24, bad_words_ids=sequences)
    assert got[:at + 1] == plain[:at + 1] and got != plain  # negative control: the ban changed the output there
    assert not _contains(got, sequences[0]) and sequences[1][0] not in got


def test_bad_words_read_the_generated_tokens_only(engine, model):
    """vLLM matches a word against the output's tokens, never the prompt's: a word whose first
    token ends the prompt does not ban the first output token (transformers' processor does)."""
    prompt = "Hello there"
    plain = one(engine, prompt, max_new_tokens=16, temperature=0).token_ids
    across = word_of([ids_of(prompt)[-1], plain[0]])
    at, inside = first_word(plain, 2)
    assert across is not None and across != inside
    got = one(engine, prompt, max_new_tokens=16, temperature=0, bad_words=[across, inside]).token_ids
    assert got[:at + 1] == plain[:at + 1] and got[at + 1] != plain[at + 1]  # only the word inside the output bites
    hf = reference(model, prompt, 16, bad_words_ids=[TOKENIZER.encode(across, add_special_tokens=False)])
    assert hf[0] != plain[0]  # the other semantics would have changed the first token


def test_bad_words_n2_samples_each_have_their_own_history(engine):
    """A word from sample 1's unrestricted output: sample 1 is cut there (the same draws up to
    it), sample 0, which never reaches it, is unchanged token for token."""
    params = dict(max_new_tokens=32, temperature=1.0, seed=11, n=2)
    free = [c.token_ids for c in one_request(engine, "Hi", **params).outputs]
    at, word = first_word(free[1], 2, avoid=(free[0],))
    banned = [c.token_ids for c in one_request(engine, "Hi", **params, bad_words=[word]).outputs]
    assert banned[0] == free[0]
    assert banned[1][:at + 1] == free[1][:at + 1] and banned[1] != free[1]
    assert not any(_contains(tokens, TOKENIZER.encode(word, add_special_tokens=False)) for tokens in banned)


def test_bad_words_beside_plain_requests(engine):
    """Plain greedy and seeded requests in a batch with a bad_words one: token-exact as alone."""
    plain = [SamplingParams(max_new_tokens=20, temperature=0),
             SamplingParams(max_new_tokens=20, temperature=1.0, seed=4)]
    prompts = ["The cat", "Hello there"]
    alone = [run(engine, [p], params)[0].outputs[0].token_ids for p, params in zip(prompts, plain)]
    restricted = SamplingParams(max_new_tokens=20, temperature=0, bad_words=["YV", "'?"])
    solo = run(engine, ["Hi"], restricted)[0].outputs[0].token_ids
    mixed = run(engine, ["Hi", *prompts], [restricted, *plain])
    assert [out.outputs[0].token_ids for out in mixed] == [solo, *alone]
    assert solo != one(engine, "Hi", max_new_tokens=20, temperature=0).token_ids  # the words do bite here


# ---------------------------------------------------------------------------- with the other constraints
def test_bad_words_and_allowed_token_ids_inside_a_structured_output(engine):
    """The masks meet the grammar's: a banned first letter leaves the other options (no letter in
    common), an allow-list the one option it spells."""
    options = ("yes", "nah", "ok")
    choice = dict(max_new_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=list(options)))
    free = one(engine, "Answer:", **choice).text
    other = one(engine, "Answer:", **choice, bad_words=[free[0]]).text
    assert free in options and other in options and other != free
    for option in options:
        allowed = [EOS, *TOKENIZER.encode(option, add_special_tokens=False)]
        assert one(engine, "Answer:", **choice, allowed_token_ids=allowed).text == option


def test_logit_bias_cannot_lift_a_mask(engine):
    """``-inf + bias`` stays ``-inf``: a biased banned token is never drawn; a biased allowed one is."""
    assert one(engine, "Hi", max_new_tokens=8, temperature=0, logit_bias={TILDE: 100.0}).token_ids == [TILDE] * 8
    outside = one(engine, "Hi", max_new_tokens=16, temperature=0, allowed_token_ids=ALLOWED,
                  logit_bias={TILDE: 100.0, X: 100.0}, bad_words=["x"]).token_ids
    assert TILDE not in outside and X not in outside
    assert one(engine, "Hi", max_new_tokens=8, temperature=0, allowed_token_ids=ALLOWED,
               logit_bias={TILDE: 100.0, X: 100.0}).token_ids == [X] * 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_equal(model, mode):
    prompts = [f"Request {i}: " + "context " * (2 + i) for i in range(6)]
    params = [SamplingParams(max_new_tokens=40, temperature=0, allowed_token_ids=ALLOWED, bad_words=["AB", "7"]),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=2, bad_words=["ab", "é", "Q"])] * 3
    ample = LLMEngine(model, TOKENIZER, num_blocks=256, block_size=8)
    tight = LLMEngine(model, TOKENIZER, num_blocks=24, block_size=8, preemption_mode=mode, max_num_batched_tokens=64)
    reference_outputs = run(ample, prompts, params)
    outputs = run(tight, prompts, params)
    assert tight.stats()[f"preemptions_{mode}"] >= 2, tight.stats()
    assert all(set(c.token_ids) <= set(ALLOWED) for out in outputs[::2] for c in out.outputs)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs]
                                                                   for o in reference_outputs]
    assert_engine_idle(ample)
    assert_engine_idle(tight)


def _generate(prompts: list[str], params: SamplingParams, engine: LLMEngine) -> list[list[int]]:
    return [c.token_ids for out in engine.generate(prompts, params, use_tqdm=False) for c in out.outputs]


def test_in_the_engine_process(engine):
    """The parameters cross the pipe pickled; the process's engine applies them as this one does."""
    params = SamplingParams(max_new_tokens=16, temperature=0, allowed_token_ids=ALLOWED, bad_words=["YV", "Q"])
    here = _generate(["Hi"], params, engine)
    with serving({"num_blocks": 128}, engine_process=True) as (_, loop):
        there = loop.call(functools.partial(_generate, ["Hi"], params)).result(60)
    assert there == here and set(here[0]) <= set(ALLOWED)


# ---------------------------------------------------------------------------- refusals and failures
def test_token_ids_past_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids .*vocabulary size 259, got 259"):
        engine.add_request("Hi", SamplingParams(allowed_token_ids=[5, 259]))
    out, = engine.generate(["Hi"], SamplingParams(allowed_token_ids=[300]), use_tqdm=False)
    assert out.error_kind == REJECTED and "allowed_token_ids" in out.error


def test_bad_words_need_a_tokenizer(model):
    bare = LLMEngine(model, num_blocks=16)
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words needs a tokenizer"):
        bare.add_request([5, 6], SamplingParams(bad_words=["no"]))
    assert bare.generate([[5, 6]], SamplingParams(max_new_tokens=3, allowed_token_ids=[7]),
                         use_tqdm=False)[0].outputs[0].token_ids == [7, 7, 7]  # ids need none
    assert_engine_idle(bare)


class _Chars:
    """A tokenizer of one token per character (its code point) that drops "?", and gives a word
    after a space one token of its own (as word-level vocabularies do) when ``spaced`` has it."""

    def __init__(self, spaced: dict[str, int] | None = None):
        self.spaced = spaced or {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text in self.spaced:
            return [self.spaced[text]]
        return [ord(c) for c in text if c != "?"]


def test_bad_words_that_cannot_be_banned_are_refused(engine):
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words .*at least one token, got '\?\?'"):
        bad_words_token_ids(_Chars(), ["ok", "??"], 200)
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words 'é' .*vocabulary \(size 200\): \[233\]"):
        bad_words_token_ids(_Chars(), ["é"], 200)
    # vLLM's rule for the spaced form: kept only as another first token in as many tokens
    assert bad_words_token_ids(_Chars({" a": 150}), ["  a", "b"], 200) == [[97], [150], [98]]
    assert bad_words_token_ids(_Chars({" ab": 150}), ["ab"], 200) == [[97, 98]]
    many = [f"w{i}" for i in range(MAX_NUM_BAD_WORDS + 1)]
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words make 129 token sequences"):
        engine.add_request("Hi", SamplingParams(bad_words=many))
    assert not engine.structured.active


def test_a_request_its_masks_leave_nothing_fails_alone(engine):
    """Nothing left to generate (at the first token, or once min_tokens holds EOS back, or a
    grammar and an allow-list that share nothing): that request fails as refused, with why; its
    batch neighbour is token-exact as alone and the engine stays healthy."""
    neighbour = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)
    alone = run(engine, ["The cat"], neighbour)[0].outputs[0].token_ids
    failed_before = engine.stats()["failed_steps"]
    a = TOKENIZER.convert_tokens_to_ids("A")
    hopeless = [SamplingParams(max_new_tokens=8, temperature=0, allowed_token_ids=[a], bad_words=["A"]),
                SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, n=2, allowed_token_ids=[EOS], min_tokens=2),
                SamplingParams(max_new_tokens=8, temperature=0, allowed_token_ids=[a, EOS],
                               structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    for params in hopeless:
        out, beside = engine.generate(["Hi", "The cat"], [params, neighbour], use_tqdm=False)
        assert out.finished and out.error_kind == REJECTED, out
        assert out.error.startswith("nothing can be generated: every token is masked by the request's ")
        assert beside.error is None and beside.outputs[0].token_ids == alone
        alone_fail, = engine.generate(["Hi"], params, use_tqdm=False)  # alone in its step: still its own fault
        assert alone_fail.error_kind == REJECTED
    assert engine.stats()["failed_steps"] == failed_before and engine.healthy
