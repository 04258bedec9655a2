"""vLLM's ``output_kind`` and ``stream_interval`` in ``LLMEngine.step()`` (and ``stream()``): whole
outputs every step, deltas, or the final one alone, every ``k`` new tokens. Whatever the kind, the
outputs add up to what ``generate()`` returns for the same seeded request."""

from __future__ import annotations

import dataclasses

import pytest

from hf_paged import LLMEngine, RequestOutputKind, SamplingParams
from hf_paged.demo import byte_tokenizer
from tests.helpers.serving import tiny_model
from tests.helpers.tiny_models import assert_engine_idle

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = "Once upon a time"
# two seeded samples of 10 tokens each, with log-probs and prompt log-probs: every part of a delta
SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=2, ignore_eos=True, logprobs=2, prompt_logprobs=1)


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=64)
    yield engine
    assert_engine_idle(engine)


def stepped(engine: LLMEngine, request_id: str) -> list:
    """Every ``step()`` output of ``request_id``, to its end."""
    seen = []
    while engine.has_unfinished_requests():
        seen += [out for out in engine.step() if out.request_id == request_id]
    return seen


def final(engine: LLMEngine, params: SamplingParams):
    """``generate()``'s output of the same request (it returns final outputs whatever the kind)."""
    return engine.generate([PROMPT], params, use_tqdm=False)[0]


def joined(outputs: list, index: int) -> tuple[list[int], str, list]:
    """Completion ``index``'s deltas added up: token ids, text, log-probs."""
    parts = [c for out in outputs for c in out.outputs if c.index == index]
    return ([t for c in parts for t in c.token_ids], "".join(c.text for c in parts),
            [entry for c in parts for entry in c.logprobs or ()])


@pytest.mark.parametrize("interval, sizes", [(None, [1] * 10), (1, [1] * 10), (3, [1, 3, 3, 3])])
def test_delta_outputs_add_up_to_the_final_output(engine, interval, sizes):
    params = dataclasses.replace(SAMPLED, output_kind=DELTA, stream_interval=interval)
    outputs = stepped(engine, engine.add_request(PROMPT, params))
    whole = final(engine, params)
    assert [out.finished for out in outputs] == [False] * (len(sizes) - 1) + [True]
    for c in whole.outputs:
        assert [len(d.token_ids) for out in outputs for d in out.outputs if d.index == c.index] == sizes
        assert joined(outputs, c.index) == (c.token_ids, c.text, c.logprobs)
        last = [d for d in outputs[-1].outputs if d.index == c.index][0]
        assert last.finish_reason == c.finish_reason == "length" and last.cumulative_logprob == c.cumulative_logprob
    assert outputs[0].prompt_logprobs == whole.prompt_logprobs is not None  # once, with the first tokens
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    assert len({tuple(c.token_ids) for c in whole.outputs}) == 2  # two different samples were joined


def test_a_sample_that_ends_first_is_not_sent_again(engine):
    """Seed 7's second sample meets the stop string at its 6th token, the first runs to 12; the
    text is random bytes (characters split over tokens, held back until whole)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2, stop=["e"], output_kind=DELTA)
    outputs = stepped(engine, engine.add_request(PROMPT, params))
    whole = final(engine, params)
    assert [(len(c.token_ids), c.finish_reason) for c in whole.outputs] == [(12, "length"), (6, "stop")]
    sent = [[(d.index, d.finish_reason) for d in out.outputs] for out in outputs]
    assert sent[5] == [(0, None), (1, "stop")] and all(index == 0 for out in sent[6:] for index, _ in out)
    for c in whole.outputs:
        assert joined(outputs, c.index)[:2] == (c.token_ids, c.text)


@pytest.mark.parametrize("interval, lengths", [(None, list(range(1, 11))), (3, [1, 4, 7, 10])])
def test_cumulative_outputs_come_every_step_or_every_interval(engine, interval, lengths):
    params = dataclasses.replace(SAMPLED, output_kind=CUMULATIVE, stream_interval=interval)
    outputs = stepped(engine, engine.add_request(PROMPT, params))
    whole = final(engine, params)
    assert [[len(c.token_ids) for c in out.outputs] for out in outputs] == [[n, n] for n in lengths]
    assert outputs[-1].outputs == whole.outputs and outputs[-1].finished


@pytest.mark.parametrize("interval", [None, 3])
def test_final_only_gives_the_finished_output_alone(engine, interval):
    params = dataclasses.replace(SAMPLED, output_kind=FINAL_ONLY, stream_interval=interval)
    outputs = stepped(engine, engine.add_request(PROMPT, params))
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs == final(engine, params).outputs


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
@pytest.mark.parametrize("tokens, other_tokens", [(12, 5), (3, 10)], ids=["outlives", "finishes-inside"])
def test_outputs_of_a_request_a_generate_call_stepped_past_lose_nothing(engine, kind, tokens, other_tokens):
    """``generate()`` of another prompt steps the engine: the request's outputs of those steps wait
    for the next ``step()`` (deltas joined), and a ``has_unfinished_requests()`` loop collects them
    even when the request finished inside that call."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, output_kind=kind, stop=["zz"])
    request_id = engine.add_request(PROMPT, params)
    engine.generate(["A longer prompt"], SamplingParams(max_tokens=other_tokens, temperature=0), use_tqdm=False)
    outputs = stepped(engine, request_id)
    whole = final(engine, params).outputs[0]
    assert outputs and outputs[-1].finished
    assert len(outputs[0].outputs[0].token_ids) > 1  # several steps' tokens in one output
    if kind is DELTA:
        assert joined(outputs, 0)[:2] == (whole.token_ids, whole.text)
    else:
        assert (outputs[-1].outputs[0].token_ids, outputs[-1].outputs[0].text) == (whole.token_ids, whole.text)


def test_an_aborted_delta_request_leaves_nothing_behind(engine):
    request_id = engine.add_request(PROMPT, dataclasses.replace(SAMPLED, output_kind=DELTA))
    engine.step()
    engine.abort(request_id)
    assert not engine.step()  # assert_engine_idle checks the request's delta books are gone too
    finished_inside = engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    engine.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)
    assert engine.has_unfinished_requests()  # its output waits for step()
    engine.abort(finished_inside)  # ... or goes with an abort
    assert not engine.has_unfinished_requests() and not engine.step()


def test_stream_sends_every_interval_of_tokens(engine):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stream_interval=4)
    deltas = list(engine.stream(PROMPT, params))
    whole = final(engine, params).outputs[0]
    assert [len(d["token_ids"]) for d in deltas] == [1, 4, 4, 1]  # the first, every 4, the last
    assert [t for d in deltas for t in d["token_ids"]] == whole.token_ids
    assert "".join(d["text"] for d in deltas) == whole.text


def test_a_streamed_beam_search_sends_its_best_beams_whole_at_the_end(engine):
    """Beams change until the search ends (a beam's tokens may be another's next step): a stream
    of one waits, then sends each of the ``n`` best beams whole, as ``generate()`` returns them."""
    params = SamplingParams(max_tokens=10, temperature=0, num_beams=3, n=2, ignore_eos=True)
    deltas = list(engine.stream(PROMPT, params))
    whole = final(engine, params)
    assert [(d["index"], d["token_ids"], d["text"], d["finished"]) for d in deltas] == [
        (c.index, c.token_ids, c.text, True) for c in whole.outputs]
    cumulative = stepped(engine, engine.add_request(PROMPT, dataclasses.replace(params, stream_interval=5)))
    assert cumulative[-1].outputs == whole.outputs and len(cumulative) < 10


def test_output_kind_and_stream_interval_are_checked():
    with pytest.raises(ValueError, match=r"^SamplingParams\.output_kind cannot be DELTA in beam search"):
        SamplingParams(num_beams=2, temperature=0, output_kind=DELTA)
    with pytest.raises(ValueError, match=r"^SamplingParams\.output_kind must be a hf_paged\.RequestOutputKind: "):
        SamplingParams(output_kind=1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.stream_interval must be None or an int >= 1, got "):
            SamplingParams(stream_interval=bad)
    assert SamplingParams(num_beams=2, temperature=0, output_kind=FINAL_ONLY, stream_interval=2).stream_interval == 2
