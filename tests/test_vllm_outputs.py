"""Outputs as vLLM's offline API gives them, on the shipped demo weights: a stop token's text left
out, ``stop_reason``, log-probs reported before ``logit_bias``, ``Logprob`` entries (rank, decoded
token) that are still floats. The expected values are vLLM 0.32's on the same weights (an audit
ran both); nothing here needs vLLM."""

import json
import math
import pickle

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.constraints import StructuredOutputsParams
from hf_paged.demo import byte_tokenizer, demo_model
from hf_paged.engine.detokenize import TextStream
from hf_paged.engine.outputs import CompletionOutput, Logprob

PROMPT = "Return the"
SPACE, NEWLINE, EOS = 223, 201, 2  # the byte tokenizer's ids of " ", "\n", "</s>"
TOKENIZER = byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    return demo_model()


@pytest.fixture
def engine(model):
    return LLMEngine(model, TOKENIZER, block_size=16)


def run(engine, prompt=PROMPT, **options):
    return engine.generate([prompt], SamplingParams(**options), use_tqdm=False)[0].outputs


def test_a_stop_token_is_left_out_of_the_text_and_of_the_stream(engine):
    first, = run(engine, temperature=0, max_tokens=20, stop_token_ids=[SPACE])
    assert (first.text, first.token_ids, first.finish_reason, first.stop_reason) == ("", [SPACE], "stop", SPACE)
    later, = run(engine, temperature=0, max_tokens=20, stop_token_ids=[SPACE], min_tokens=3)
    assert (later.text, later.token_ids) == ("\ncommand", [NEWLINE, 69, 81, 79, 79, 67, 80, 70, SPACE])  # vLLM's
    stopped, = run(engine, temperature=0, max_tokens=20, stop_token_ids=[SPACE], min_tokens=3, stop=["xyz"])
    assert stopped.text == later.text  # the stop-string path decodes it the same way
    deltas = list(engine.stream(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[SPACE],
                                                       min_tokens=3)))
    assert "".join(d["text"] for d in deltas) == later.text and deltas[-1]["token_ids"] == [SPACE]
    # the server's stream, fed step by step: its detokenizer ends on the final text too
    request_id, stream = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=3,
                                                                   stop_token_ids=[SPACE])), TextStream(TOKENIZER)
    sent = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sent += stream.update(out.outputs[0])[0]
    assert sent == stream._detokenizer.text == later.text
    # an output decoded where it lands (the server's process) leaves the stop token out as well
    landed = pickle.loads(pickle.dumps(CompletionOutput(0, later.token_ids, None, "stop", stop_reason=SPACE)))
    landed.set_decoder(lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True))
    assert (landed.text, landed.stop_reason) == (later.text, SPACE)


def test_stop_reason_names_what_ended_the_output(engine):
    reason = lambda **options: (lambda c: (c.finish_reason, c.stop_reason))(run(engine, temperature=0, **options)[0])
    assert reason(max_tokens=40, stop=[" the"]) == ("stop", " the")
    assert reason(max_tokens=40, stop=["string", "of"]) == ("stop", "of")
    assert reason(max_tokens=20, min_tokens=3, logit_bias={EOS: 100.0}) == ("stop", None)  # EOS
    assert reason(max_tokens=20, min_tokens=3, logit_bias={EOS: 100.0}, stop_token_ids=[EOS]) == ("stop", None)
    assert reason(max_tokens=6, ignore_eos=True, logit_bias={EOS: 100.0}, stop_token_ids=[EOS]) == ("stop", EOS)
    assert reason(max_tokens=4) == ("length", None)
    out = run(engine, temperature=0, max_tokens=40, stop=[" the"])[0]
    assert pickle.loads(pickle.dumps(out)).stop_reason == " the" and "stop_reason=' the'" in repr(out)
    beams = [(stop, c) for stop in (SPACE, NEWLINE)  # all three beams end on " "; none reaches a "\n"
             for c in run(engine, temperature=0, max_tokens=8, num_beams=3, n=3, stop_token_ids=[stop])]
    assert [c.finish_reason for _, c in beams] == ["stop"] * 3 + ["length"] * 3
    for stop, c in beams:
        ended = c.finish_reason == "stop"
        assert c.stop_reason == (stop if ended else None)
        assert c.text == TOKENIZER.decode(c.token_ids[:-1] if ended else c.token_ids, skip_special_tokens=True)


def test_logprobs_are_reported_before_logit_bias(engine):
    forced, = run(engine, temperature=0, max_tokens=20, min_tokens=2, logit_bias={EOS: 100.0}, logprobs=1)
    assert forced.token_ids == [SPACE, 69, EOS]  # vLLM's, with its log-probs of the unbiased model
    assert forced.cumulative_logprob == pytest.approx(-23.739, abs=1e-3)
    assert list(forced.logprobs[0]) == [SPACE] and forced.logprobs[0][SPACE] == pytest.approx(-0.0528, abs=1e-4)
    assert [len(entry) for entry in forced.logprobs] == [1, 1, 2]
    plain, = run(engine, temperature=0, max_tokens=12, logprobs=3)
    unused = next(t for t in range(3, 259) if t not in plain.token_ids)
    biased, = run(engine, temperature=0, max_tokens=12, logprobs=3, logit_bias={unused: -5.0})
    assert biased.token_ids == plain.token_ids and biased.logprobs == plain.logprobs
    # under a constraint: its mask stays in (masked tokens read -inf), the bias stays out
    choice = dict(temperature=0, max_tokens=8, logprobs=5,
                  structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]))
    constrained, = run(engine, "Answer:", **choice)
    starts = {TOKENIZER.convert_tokens_to_ids(c) for c in "ynm"}
    assert sum(math.isfinite(v) for v in constrained.logprobs[0].values()) == 3
    other = next(t for t in starts if t not in constrained.token_ids)
    biased, = run(engine, "Answer:", **choice, logit_bias={other: -3.0})
    assert biased.token_ids == constrained.token_ids and biased.logprobs == constrained.logprobs


def test_logprob_entries_are_vllm_logprobs_and_still_floats(engine, model):
    out, = run(engine, temperature=0, max_tokens=3, logprobs=2)
    first = out.logprobs[0]
    assert list(first) == [SPACE, NEWLINE]  # vLLM's: (-0.0528, rank 1, " "), (-3.4838, rank 2, "\n")
    # to 1e-4: vLLM's float32 sums run in other orders than ours (and ours in C at a few rows)
    assert [v.logprob for v in first.values()] == pytest.approx([-0.0528, -3.4838], abs=1e-4)
    assert [(v.rank, v.decoded_token) for v in first.values()] == [(1, " "), (2, "\n")]
    value = first[SPACE]
    assert isinstance(value, float) and value == float(value) == value.logprob and type(value.logprob) is float
    assert str(value) == repr(float(value)) and hash(value) == hash(float(value))
    assert json.dumps({"v": value}) == json.dumps({"v": float(value)})
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(out.logprobs, out.token_ids)))
    landed = pickle.loads(pickle.dumps(out))
    assert landed == out and [[(v.rank, type(v)) for v in e.values()] for e in landed.logprobs] == \
        [[(v.rank, Logprob) for v in e.values()] for e in out.logprobs]
    kept = pickle.loads(pickle.dumps(Logprob(-1.5, 3, "x")))
    assert (kept, kept.rank, kept.decoded_token) == (-1.5, 3, "x")
    # a sampled token's rank is its true rank in the whole distribution (all 259 tokens reported)
    sampled = dict(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True)
    ranked, = run(engine, **sampled, logprobs=0)
    whole, = run(engine, **sampled, logprobs=259)
    assert ranked.token_ids == whole.token_ids
    ranks = [e[t].rank for e, t in zip(ranked.logprobs, ranked.token_ids)]
    assert ranks == [sum(v >= e[t] for v in e.values()) for e, t in zip(whole.logprobs, whole.token_ids)]
    by_rank = [sorted(e.values(), key=lambda v: v.rank) for e in whole.logprobs]  # the top 259: ranks 1..259
    assert max(ranks) > 1 and all([v.rank for v in e] == list(range(1, 260)) and e == sorted(e, reverse=True)
                                  for e in by_rank)
    bare, = run(LLMEngine(model, block_size=16), [5, 6, 7], temperature=0, max_tokens=2, logprobs=1)
    assert all(v.decoded_token is None and v.rank >= 1 for e in bare.logprobs for v in e.values())
    assert torch.tensor([float(v) for e in bare.logprobs for v in e.values()]).isfinite().all()
