"""No request can break the engine: SamplingParams extremes are refused or served, a failed step
fails only what it must (the rest of the batch gives a clean run's tokens exactly), nothing leaks,
and health follows consecutive failures."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer, demo_model
from hf_paged.engine import sampler
from hf_paged.engine.intake import prompt_tokens
from hf_paged.engine.outputs import FAULT, REJECTED

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 8, 61, 12, 9], [44, 3, 71, 29], list(range(10, 40)), [88, 7, 19, 23, 54, 66, 2, 90, 31],
           [120, 121, 122], [200, 14, 9, 250, 3, 66]]


@pytest.fixture(scope="module")
def model():
    return demo_model(seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3,
                      max_position_embeddings=512)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def check_no_leak(engine: LLMEngine) -> None:
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv.num_used_blocks() == 0, "blocks leaked"


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], max_steps: int = 2000) -> dict:
    """Add the requests, step until done (a bounded number of steps: a wedge fails the test);
    returns each request's final output by request id."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine did not finish: wedged?"
    return {rid: finished[rid] for rid in ids}


def clean_tokens(model, requests, **engine_kwargs) -> list:
    engine = LLMEngine(model, **{"num_blocks": 256, **engine_kwargs})
    outs = engine.generate([p for p, _ in requests], [params for _, params in requests], use_tqdm=False)
    assert all(o.error is None for o in outs)
    check_no_leak(engine)
    return tokens(outs)


class Fault(RuntimeError):
    """The injected fault."""


def failing_forward(engine: LLMEngine, when, exc: BaseException | type = Fault("injected forward fault")):
    """Make ``engine.runner.execute`` raise ``exc`` on the steps for which ``when(step)`` is true;
    returns the list of steps it failed."""
    execute, failed = engine.runner.execute, []

    def wrapped(step):
        if when(step):
            failed.append(step)
            raise exc
        return execute(step)

    engine.runner.execute = wrapped
    return failed


def poison_rows(engine: LLMEngine, request_id: str, value: float, at_call: int, rows: int = 1) -> None:
    """From the ``at_call``-th step with logits for ``request_id`` on, set the first ``rows`` of its
    logits rows to ``value`` (value -inf: the whole row, so nothing is finite)."""
    execute, calls = engine.runner.execute, [0]

    def wrapped(step):
        logits = execute(step)
        mine = [i for i, s in enumerate(s for s in step.sequences if s.needs_logits) if s.request_id == request_id]
        if mine:
            calls[0] += 1
            if calls[0] >= at_call:
                for row in mine[:rows]:
                    if value == -math.inf:
                        logits[row, :] = value
                    else:
                        logits[row, 3] = value
        return logits

    engine.runner.execute = wrapped


# ---------------------------------------------------------------------------- parameter extremes
@pytest.mark.parametrize("fields, where", [
    (dict(temperature=1.0, repetition_penalty=1e-300), "repetition_penalty"),
    (dict(num_beams=2, length_penalty=2000), "length_penalty"),
    (dict(num_beams=2, length_penalty=math.nan), "length_penalty"),
    (dict(num_beams=2, length_penalty=-math.inf), "length_penalty"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=1e300), "temperature"), (dict(temperature=True), "temperature"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"), (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"), (dict(top_p=math.nan), "top_p"), (dict(min_p=-0.0001), "min_p"),
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop=5), "stop"),
    (dict(early_stopping=1, num_beams=2), "early_stopping"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(logprobs=True), "logprobs"),
    (dict(num_beams=2, stop=["x"]), "stop"),  # beam search does not read them: refused, not ignored
    (dict(num_beams=2, presence_penalty=0.5), "presence_penalty"),
    (dict(num_beams=2, frequency_penalty=0.5), "frequency_penalty"), (dict(num_beams=2, top_p=0.5), "top_p"),
    (dict(num_beams=2, top_k=5), "top_k"), (dict(num_beams=2, min_p=0.1), "min_p"),
])
def test_extremes_are_refused_naming_the_field(fields, where):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{where} .*, got "):
        SamplingParams(**{"max_new_tokens": 4, **fields})


def test_the_length_penalty_bound_names_its_range_for_max_new_tokens():
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-7\.5, 7\.5\] for max_new_tokens=10000"):
        SamplingParams(max_new_tokens=10_000, num_beams=2, length_penalty=-7.6)
    SamplingParams(max_new_tokens=10_000, num_beams=2, length_penalty=7.4)
    SamplingParams(max_new_tokens=10**40, length_penalty=50)  # no beams: length_penalty is not used
    SamplingParams(max_new_tokens=1, num_beams=2, length_penalty=1e300)  # 1 ** anything == 1


@pytest.mark.parametrize("fields, where", [
    (dict(logprobs=260), "logprobs"), (dict(n=2000), "n"), (dict(num_beams=2000), "num_beams"),
    (dict(n=9, temperature=0.5), "n"),
])
def test_engine_limits_are_refused_at_add_request(model, fields, where):
    engine = LLMEngine(model, num_blocks=64, max_num_seqs=8)
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{where} must be at most"):
        engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4, **fields))
    out = engine.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, SamplingParams(max_new_tokens=4, **fields)],
                          use_tqdm=False)
    assert out[1].error_kind == REJECTED and out[1].error.startswith(f"SamplingParams.{where}")
    assert tokens(out[:1]) == clean_tokens(model, [(PROMPTS[1], GREEDY)])
    check_no_leak(engine)


def test_a_tiny_temperature_is_raised_to_the_minimum_with_a_warning(model, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        tiny = SamplingParams(max_new_tokens=6, temperature=1e-300, seed=3, ignore_eos=True)
    assert tiny.temperature == 0.01 and "raised to 0.01" in caplog.text
    floor = SamplingParams(max_new_tokens=6, temperature=0.01, seed=3, ignore_eos=True)
    assert clean_tokens(model, [(PROMPTS[0], tiny)]) == clean_tokens(model, [(PROMPTS[0], floor)])


@pytest.mark.parametrize("fields", [
    dict(logprobs=259), dict(seed=-(2**63)), dict(seed=2**64 - 1), dict(top_k=10**9), dict(temperature=1e6),
    dict(temperature=0.01, repetition_penalty=0.01, min_new_tokens=4), dict(repetition_penalty=100, temperature=0),
    dict(num_beams=4, n=4, length_penalty=-20, max_new_tokens=8), dict(stop_token_ids=[10**30]),
    dict(presence_penalty=-2, frequency_penalty=2, top_p=1e-300, min_p=1.0),
])
def test_extremes_in_range_are_served(model, fields):
    engine = LLMEngine(model, num_blocks=64, max_num_seqs=8)
    params = SamplingParams(**{"max_new_tokens": 6, **fields})
    out = run(engine, [(PROMPTS[0], params), (PROMPTS[1], GREEDY)])
    first, normal = out.values()
    assert first.error is None and all(c.token_ids for c in first.outputs)
    assert tokens([normal]) == clean_tokens(model, [(PROMPTS[1], GREEDY)])
    check_no_leak(engine)


# ---------------------------------------------------------------------------- unattributed faults
def test_a_forward_that_raises_fails_its_step_and_the_engine_goes_on(model, caplog):
    engine = LLMEngine(model, num_blocks=64)
    failed = failing_forward(engine, lambda step: not failed)  # the first step only
    a = engine.add_request(PROMPTS[0], GREEDY)
    b = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=4, n=2, seed=1))
    with caplog.at_level(logging.ERROR, logger="hf_paged"):
        outs = engine.step()  # raises inside: the step's requests fail, step() does not
    assert {o.request_id for o in outs} == {a, b}
    assert all(o.finished and o.error_kind == FAULT and "injected forward fault" in o.error for o in outs)
    assert "Traceback" in caplog.text and "injected forward fault" in caplog.text
    assert engine.stats()["failed_steps"] == 1 and engine.healthy
    check_no_leak(engine)
    later = [(PROMPTS[2], GREEDY), (PROMPTS[3], SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, n=2))]
    assert tokens(run(engine, later).values()) == clean_tokens(model, later)
    assert engine.stats()["consecutive_failed_steps"] == 0
    check_no_leak(engine)


def test_a_fault_mid_run_fails_the_step_and_requests_arriving_later_are_served(model):
    """Requests that were waiting (not in the failed step) are not touched by the fault."""
    engine = LLMEngine(model, num_blocks=64, max_num_seqs=2)
    calls = []
    failing_forward(engine, lambda step: calls.append(1) or len(calls) == 3)
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY), (PROMPTS[3], GREEDY), (PROMPTS[4], GREEDY)]
    out = list(run(engine, requests).values())
    assert [o.error_kind for o in out] == [FAULT, FAULT, None, None]  # two in the failed step, two waited
    assert tokens(out[2:]) == clean_tokens(model, requests[2:])
    check_no_leak(engine)


def test_a_keyboard_interrupt_rolls_the_step_back_then_propagates(model):
    engine = LLMEngine(model, num_blocks=64)
    failing_forward(engine, lambda step: len(step.sequences) == 2, KeyboardInterrupt())
    engine.add_request(PROMPTS[0], GREEDY)
    engine.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.has_unfinished_requests()  # the failed outputs are still to be delivered
    outs = engine.step()
    assert len(outs) == 2 and all(o.error_kind == FAULT for o in outs)
    check_no_leak(engine)
    later = [(PROMPTS[2], GREEDY)]
    assert tokens(run(engine, later).values()) == clean_tokens(model, later)
    check_no_leak(engine)


@pytest.mark.parametrize("move", ["swap_out", "swap_in", "block_copies"])
def test_a_fault_in_a_step_that_moves_blocks_leaks_nothing(model, move):
    """Swaps (the requests swapped out or in fail with the step: their copies may not have run)
    and copy-on-write copies (targets are the writing sequence's own blocks)."""
    engine = LLMEngine(model, block_size=4, num_blocks=14, max_num_seqs=4, preemption_mode="swap",
                       max_num_batched_tokens=64)
    failed = failing_forward(engine, lambda step: not failed and any(getattr(g, move) for g in step.groups))
    params = SamplingParams(max_new_tokens=12, n=2, seed=7, temperature=0.9, ignore_eos=True)
    requests = [(p, params) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[4])]
    out = list(run(engine, requests).values())
    assert failed, f"no step had {move}"
    assert any(o.error_kind == FAULT for o in out)
    clean = clean_tokens(model, requests, block_size=4, num_blocks=14, max_num_seqs=4, preemption_mode="swap",
                         max_num_batched_tokens=64)
    survivors = [i for i, o in enumerate(out) if o.error is None]
    assert survivors and [tokens(out)[i] for i in survivors] == [clean[i] for i in survivors]  # no stale K/V read
    if move != "block_copies":
        assert engine.stats()["preemptions_swap"] > 0
    check_no_leak(engine)
    assert engine.stats()["swap_blocks_used"] == 0
    assert tokens(run(engine, [(PROMPTS[2], GREEDY)]).values()) == clean_tokens(model, [(PROMPTS[2], GREEDY)])
    check_no_leak(engine)


def test_consecutive_failures_make_the_engine_unhealthy_until_a_clean_step(model):
    for limit in (3, 1):
        engine = LLMEngine(model, num_blocks=64, max_consecutive_failures=limit)
        broken = [True]
        failing_forward(engine, lambda step: broken[0])
        for i in range(limit):
            assert engine.healthy
            engine.add_request(PROMPTS[i], GREEDY)
            assert [o.error_kind for o in engine.step()] == [FAULT]
        stats = engine.stats()
        assert not engine.healthy and stats["healthy"] is False
        assert stats["failed_steps"] == stats["consecutive_failed_steps"] == limit
        broken[0] = False  # the engine keeps serving while unhealthy; a clean step heals it
        assert tokens(run(engine, [(PROMPTS[4], GREEDY)]).values()) == clean_tokens(model, [(PROMPTS[4], GREEDY)])
        assert engine.healthy and engine.stats()["consecutive_failed_steps"] == 0
        assert engine.stats()["failed_steps"] == limit
        check_no_leak(engine)
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        LLMEngine(model, num_blocks=8, max_consecutive_failures=0)


# ---------------------------------------------------------------------------- attributed faults
BATCH = [
    (PROMPTS[0], GREEDY),
    (PROMPTS[1], SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=11, n=2, ignore_eos=True)),
    (PROMPTS[2], SamplingParams(max_new_tokens=8, num_beams=3, n=2, ignore_eos=True)),
    (PROMPTS[3], SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, logprobs=2, ignore_eos=True)),
    (PROMPTS[4], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),
]
VICTIMS = {  # (prompt, params, logits call at which it is poisoned, rows poisoned)
    "plain greedy": (PROMPTS[5], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True), 3, 1),
    "first token": (PROMPTS[5], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True), 1, 1),
    "one of two samples": (PROMPTS[5], SamplingParams(max_new_tokens=8, temperature=0.8, seed=2, n=2,
                                                      ignore_eos=True), 3, 1),
    "beam": (PROMPTS[5], SamplingParams(max_new_tokens=8, num_beams=2, ignore_eos=True), 2, 1),
}


@pytest.fixture(scope="module")
def clean_batch(model):
    return {name: clean_tokens(model, [*BATCH, victim[:2]]) for name, victim in VICTIMS.items()}


@pytest.mark.parametrize("victim", list(VICTIMS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_row_fails_only_its_request(model, clean_batch, victim, value):
    prompt, params, at_call, rows = VICTIMS[victim]
    engine = LLMEngine(model, num_blocks=256)
    ids = [engine.add_request(p, q) for p, q in BATCH]
    bad = engine.add_request(prompt, params)
    poison_rows(engine, bad, value, at_call, rows)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    others = tokens([finished[i] for i in ids])
    assert others == clean_batch[victim][:-1]  # exactly a clean run's tokens, greedy, seeded, n=2, beams
    failed = finished[bad]
    assert failed.error_kind == FAULT and "non-finite logits" in failed.error
    # negative control: the same comparison catches the poisoned request (it cannot pass vacuously)
    assert tokens([finished[i] for i in ids] + [failed]) != clean_batch[victim]
    assert all(len(c.token_ids) < 8 for c in failed.outputs)
    assert engine.stats()["consecutive_failed_steps"] == 0  # the others progressed: not a failed step
    check_no_leak(engine)


def test_a_nonfinite_request_leaves_nothing_in_the_prefix_cache(model):
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    bad = engine.add_request(PROMPTS[2], GREEDY)  # 30 tokens: 7 full blocks computed by the failing step
    poison_rows(engine, bad, math.nan, 1)
    outs = engine.step()
    assert outs[0].error_kind == FAULT and engine.stats()["blocks_cached"] == 0
    assert engine.stats()["failed_steps"] == 1  # its only row was non-finite: the step counts as failed
    check_no_leak(engine)


def test_an_exception_while_sampling_one_request_fails_it_alone(model, monkeypatch, clean_batch):
    victim = SamplingParams(max_new_tokens=8, temperature=0.8, seed=2, n=2, ignore_eos=True)
    sample, calls = sampler.sample, []

    def flaky(logits, rows, *args):
        calls.append(len(rows))
        if any(row.params is victim and row.num_generated == 2 for row in rows):  # its third step
            raise Fault("injected sampler fault")
        return sample(logits, rows, *args)

    monkeypatch.setattr(sampler, "sample", flaky)
    engine = LLMEngine(model, num_blocks=256)
    out = list(run(engine, [*BATCH, (PROMPTS[5], victim)]).values())
    assert tokens(out[:-1]) == clean_batch["one of two samples"][:-1]
    assert out[-1].error_kind == FAULT and "injected sampler fault" in out[-1].error
    assert [len(c.token_ids) for c in out[-1].outputs] == [2, 2]  # the failed step's tokens are not reported
    # the third step's five sampled rows drew together and raised; then each request drew alone
    assert calls[:3] == [5, 5, 5] and sorted(calls[3:6]) == [1, 2, 2] and set(calls[6:]) == {3}
    check_no_leak(engine)


def test_a_fault_after_the_fork_into_samples_undoes_the_forks(model, monkeypatch, clean_batch):
    """The victim's first token: its prompt sequence has forked into 2 samples when the second
    sample's log-probs raise; the forks are taken out of the step again (else they would leak)."""
    victim = SamplingParams(max_new_tokens=8, temperature=0.8, seed=2, n=2, logprobs=3, ignore_eos=True)
    top, calls = sampler.top_logprobs, [0]

    def flaky(raw, token, k):
        if k == 3:
            calls[0] += 1
            if calls[0] == 2:
                raise Fault("injected logprobs fault")
        return top(raw, token, k)

    monkeypatch.setattr(sampler, "top_logprobs", flaky)
    engine = LLMEngine(model, num_blocks=256)
    out = list(run(engine, [*BATCH, (PROMPTS[5], victim)]).values())
    assert tokens(out[:-1]) == clean_batch["one of two samples"][:-1]
    assert out[-1].error_kind == FAULT and "injected logprobs fault" in out[-1].error
    assert [c.token_ids for c in out[-1].outputs] == [[]]  # back to the unforked prompt sequence
    check_no_leak(engine)


def test_a_stop_string_decode_that_raises_fails_its_request_alone(model, tokenizer):
    stop = SamplingParams(max_new_tokens=8, temperature=0, stop=["\x00never"], ignore_eos=True)
    requests = [("Hello there", GREEDY), ("Paged attention", stop), ("Once upon", GREEDY)]
    clean = LLMEngine(model, tokenizer, num_blocks=64).generate([p for p, _ in requests], [q for _, q in requests],
                                                                use_tqdm=False)
    target = clean[1].outputs[0].token_ids[:3]

    class Flaky:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kwargs):
            if list(ids)[-len(target):] == target:  # the output so far (decoded after the prompt's last tokens)
                raise Fault("injected decode fault")
            return self.inner.decode(ids, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine = LLMEngine(model, tokenizer, num_blocks=64)
    engine.output_processor.tokenizer = Flaky(tokenizer)
    out = list(run(engine, [(prompt_tokens(engine.tokenizer, p)[1], q) for p, q in requests]).values())
    assert out[1].error_kind == FAULT and "injected decode fault" in out[1].error
    assert out[1].outputs[0].token_ids == target[:2]
    assert tokens([out[0], out[2]]) == tokens([clean[0], clean[2]])
    assert [o.outputs[0].text for o in (out[0], out[2])] == [o.outputs[0].text for o in (clean[0], clean[2])]
    check_no_leak(engine)


@pytest.mark.parametrize("n", [2, 5])
def test_samples_that_all_finish_at_their_first_token_finish_the_request(model, n):
    """Found by the property test: the fork into n samples iterated the list that finished samples
    were removed from, so every other sample never got its first token (the engine spun forever)."""
    engine = LLMEngine(model, num_blocks=64)
    out = run(engine, [(PROMPTS[1], SamplingParams(n=n, max_new_tokens=1, seed=4)), (PROMPTS[0], GREEDY)], 50)
    assert [len(c.token_ids) for c in list(out.values())[0].outputs] == [1] * n
    check_no_leak(engine)


def test_a_request_that_can_never_fit_is_rejected_not_faulted(model):
    engine = LLMEngine(model, block_size=8, num_blocks=4)
    out = engine.generate([[5] * 20, []], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert [o.error_kind for o in out] == [REJECTED, REJECTED] and "KV blocks" in out[0].error
    check_no_leak(engine)


# ---------------------------------------------------------------------------- property: any parameters
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 0.005, 0.01, 0.5, 1.0, 2.0, 100.0, 1e6, 1e30, 1e300,
                                    -1.0, -2.0, -1e300, math.nan, math.inf, -math.inf]),
                   st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans())
INTS = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64, -(2**63)]),
                 st.booleans())
WIDTH = st.one_of(st.integers(1, 4), st.integers(-2, 5000), st.booleans())
WIDE = {  # anything, mostly out of range
    "max_new_tokens": st.one_of(st.integers(1, 6), INTS), "min_new_tokens": st.one_of(st.integers(0, 3), INTS),
    "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "min_p": FLOATS, "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "n": WIDTH, "num_beams": WIDTH,
    "length_penalty": FLOATS, "early_stopping": st.sampled_from([True, False, "never", 1, None]),
    "seed": st.one_of(st.none(), INTS), "stop_token_ids": st.lists(INTS, max_size=3),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=2), st.text(max_size=2)),
    "ignore_eos": st.sampled_from([True, False, 0]), "logprobs": st.one_of(st.none(), st.integers(0, 300), INTS),
}


def _edges(low: float, high: float, *more: float):
    return st.one_of(st.sampled_from([low, high, *more]), st.floats(low, high))


IN_RANGE = {  # the extremes of what SamplingParams accepts (combinations may still be refused)
    "max_new_tokens": st.one_of(st.integers(1, 8), st.integers(1, 10**30)), "min_new_tokens": st.integers(0, 6),
    "temperature": st.one_of(st.just(0), _edges(5e-324, 1e6, 1e-300, 0.0099, 0.01)),
    "top_p": _edges(5e-324, 1.0, 1e-300), "top_k": st.one_of(st.integers(-1, 300), st.just(2**70)),
    "min_p": _edges(0.0, 1.0, 5e-324), "repetition_penalty": _edges(0.01, 100.0),
    "presence_penalty": _edges(-2.0, 2.0), "frequency_penalty": _edges(-2.0, 2.0),
    "n": st.integers(1, 16), "num_beams": st.integers(1, 16), "length_penalty": _edges(-70.0, 70.0, 0.0),
    "early_stopping": st.sampled_from([True, False, "never"]),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop_token_ids": st.lists(st.integers(0, 2**70), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2), "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 259)),
}
PARAMS = st.one_of(st.fixed_dictionaries({}, optional=IN_RANGE), st.fixed_dictionaries({}, optional=WIDE))


@pytest.fixture(scope="module")
def short_model():
    """Few positions: whatever max_new_tokens says, a request ends within 40 tokens."""
    return demo_model(seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64, initializer_range=0.3,
                      max_position_embeddings=40)


def test_property_no_sampling_params_break_the_engine(short_model, tokenizer, record_property):
    """Any fields, straight on the engine: refused with a ValueError naming the field, or served;
    never an exception from step(), a wedge, a fault or a leak; a normal greedy request in the
    same batch gives a clean run's tokens, and one after it is served."""
    reference = clean_tokens(short_model, [(PROMPTS[0], GREEDY)])
    counts = {"examples": 0, "accepted": 0, "refused": 0}

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.lists(PARAMS, min_size=1, max_size=3))
    def check(drawn):
        counts["examples"] += 1
        engine = LLMEngine(short_model, tokenizer, block_size=4, num_blocks=96, max_num_seqs=16)
        ids = [engine.add_request(PROMPTS[0], GREEDY)]
        for fields in drawn:
            try:
                ids.append(engine.add_request(PROMPTS[1], SamplingParams(**fields)))
                counts["accepted"] += 1
            except ValueError as err:  # refused by SamplingParams or by the engine's limits
                assert str(err).startswith("SamplingParams."), err
                counts["refused"] += 1
        outs = {}
        # a bounded run: a wedge fails here. Not tighter: beam searches as wide as max_num_seqs run one
        # after another (n=6 groups of 15 beams beside another 15-beam request took 500 steps)
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert not engine.has_unfinished_requests(), f"wedged: {drawn}"
        assert tokens([outs[ids[0]]]) == reference
        assert all(outs[i].error_kind != FAULT for i in ids), [outs[i].error for i in ids]
        check_no_leak(engine)
        assert tokens(run(engine, [(PROMPTS[0], GREEDY)]).values()) == reference  # still serving
        check_no_leak(engine)

    check()
    record_property("property_examples", counts["examples"])
    print(f"property test: {counts}")
    assert counts["examples"] >= 100 and counts["accepted"] > 50 and counts["refused"] > 50, counts


def test_nonfinite_rows_finds_nan_inf_and_rows_without_a_finite_value():
    from hf_paged.engine.sampler import nonfinite_rows

    logits = torch.randn(64, 32000)
    assert nonfinite_rows(logits) == []
    logits[5, 7], logits[9, :] = math.nan, -math.inf
    logits[11, 0] = math.inf
    assert nonfinite_rows(logits) == [5, 9, 11]


@pytest.mark.parametrize("name, hint", [("best_of", "num_beams runs beam search"),
                                        ("guided_decoding", "structured_outputs"), ("temprature", "it takes: ")])
def test_a_parameter_it_does_not_take_is_named_with_what_to_pass_instead(name, hint):
    with pytest.raises(TypeError, match=rf"^SamplingParams has no parameter '{name}'.*{hint}"):
        SamplingParams(**{name: 1})
    assert dataclasses.replace(SamplingParams(max_tokens=5), n=2).max_new_tokens == 5  # replace() still works


def test_a_stream_raises_when_its_request_fails_and_aborts_when_left_early(model):
    """``stream()``: a failed request was a stream that just ended (its text cut short, no error);
    a consumer that stopped early left the request running, holding its blocks."""
    engine = LLMEngine(model, num_blocks=64)
    poison_rows(engine, "0", math.nan, at_call=3)  # stream()'s request gets the first automatic id
    deltas = []
    with pytest.raises(RuntimeError, match="request 0 failed: .*non-finite"):
        for delta in engine.stream(PROMPTS[0], GREEDY):
            deltas.append(delta)
    assert sum(len(d["token_ids"]) for d in deltas) == 2  # what came before the fault
    for delta in engine.stream(PROMPTS[1], SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)):
        break  # a consumer that stops after one token
    assert not engine.has_unfinished_requests()
    check_no_leak(engine)


def test_beams_with_min_tokens_and_a_stop_token_id_past_the_vocabulary(model):
    """Such an id can never be chosen: beams, like samples, have nothing to mask for it (beams once
    failed with an IndexError while min_tokens held; the property test above found it)."""
    engine = LLMEngine(model)
    far = 382485965600234
    beams = SamplingParams(max_new_tokens=6, num_beams=2, n=2, min_tokens=3, stop_token_ids=[far])
    plain = dataclasses.replace(beams, stop_token_ids=[])
    got, expected = engine.generate([[5, 6, 7], [5, 6, 7]], [beams, plain], use_tqdm=False)
    assert got.error is None
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    check_no_leak(engine)


def test_beams_with_a_stop_token_id_past_int64_are_served(model):
    """Found by the property test above: beams keep their stop ids in an int64 tensor, which 2**63
    overflowed (a ValueError from add_request that named no field). Such an id never matches."""
    engine = LLMEngine(model)
    beams = SamplingParams(max_new_tokens=6, num_beams=2, stop_token_ids=[2**63, 2**70])
    plain = dataclasses.replace(beams, stop_token_ids=[10**6, 10**7])  # as many ids, past the vocabulary
    got, expected = engine.generate([[5, 6, 7], [5, 6, 7]], [beams, plain], use_tqdm=False)
    assert got.error is None and got.outputs[0].token_ids == expected.outputs[0].token_ids
    check_no_leak(engine)
