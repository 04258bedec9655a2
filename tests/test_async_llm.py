"""``hf_paged.AsyncLLM`` (vLLM's ``AsyncLLM``): requests from asyncio code, batched by one engine on
a background thread. Outputs equal the offline engine's; deltas join up for a consumer slower than
the engine; leaving early or ``abort`` frees every block; bad input and shutdown raise."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc

import pytest

from hf_paged import AsyncLLM, AsyncLLMEngine, LLMEngine, RequestOutputKind, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.serve import EngineProcess
from tests.helpers.serving import tiny_engine, tiny_model
from tests.helpers.tiny_models import assert_engine_idle

PROMPTS = ["Once upon a time", "The function returns", [40, 41, 42, 43], {"prompt": "Hello"}]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def reference():
    """The same model in an offline engine: what every request must come to."""
    return LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=128)


@pytest.fixture
def llm():
    llm = AsyncLLM(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=128)
    yield llm
    assert llm.get_num_unfinished_requests() == 0
    llm.shutdown()
    assert not llm.is_running
    assert_engine_idle(llm.engine)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None, lag: float = 0.0):
    seen = []
    async for out in llm.generate(prompt, params, request_id):
        seen.append(out)
        await asyncio.sleep(lag)  # a consumer slower than the engine
    return seen


class NearLogprobs:
    """Log-prob entries that compare equal to others with the same token ids and values within
    1e-4: batched with other requests differently, a row's log-probs round differently in the last
    bits (the offline engine batches all four prompts at once; ~1e-6 apart here)."""

    def __init__(self, entries: list[dict]):
        self.entries = [{t: float(v) for t, v in entry.items()} for entry in entries]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NearLogprobs) and len(self.entries) == len(other.entries) and all(
            a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-4 for t in a)
            for a, b in zip(self.entries, other.entries))

    def __repr__(self) -> str:
        return repr(self.entries)


def completions(out) -> list[tuple]:
    """What an output says: tokens, text, how it ended, its log-probs (see NearLogprobs)."""
    return [(c.index, c.token_ids, c.text, c.finish_reason, NearLogprobs(c.logprobs)) for c in out.outputs]


def joined(outputs: list) -> list[tuple]:
    """The deltas of each completion added up."""
    indices = sorted({c.index for out in outputs for c in out.outputs})
    parts = {i: [c for out in outputs for c in out.outputs if c.index == i] for i in indices}
    return [(i, [t for c in cs for t in c.token_ids], "".join(c.text for c in cs), cs[-1].finish_reason,
             NearLogprobs([e for c in cs for e in c.logprobs])) for i, cs in parts.items()]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_concurrent_requests_equal_the_offline_engine(llm, reference, params):
    async def main():
        return await asyncio.gather(*(collect(llm, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))

    results = run(main())
    expected = reference.generate(PROMPTS, params, use_tqdm=False)
    for i, (seen, want) in enumerate(zip(results, expected)):
        assert [out.request_id for out in seen] == [f"r{i}"] * len(seen)
        assert [out.finished for out in seen] == [False] * (len(seen) - 1) + [True]
        assert len(seen) > 1 and completions(seen[-1]) == completions(want)  # cumulative: the last is all of it
        assert seen[-1].prompt_token_ids == want.prompt_token_ids and seen[-1].prompt == want.prompt


def texts_by_length(reference: LLMEngine, prompt, params: SamplingParams) -> dict[int, str]:
    """The offline engine's text of the request at each of its lengths (decoded on its own thread)."""
    request_id, texts = reference.add_request(prompt, params), {}
    while reference.has_unfinished_requests():
        texts.update((len(c.token_ids), c.text) for out in reference.step() if out.request_id == request_id
                     for c in out.outputs)
    return texts


def test_unfinished_outputs_read_as_the_engines_own(llm, reference):
    """An unfinished output's text is decoded when read, here with the caller's tokenizer copy. A
    reader slower than the steps gets the newest output only (cumulative outputs), so the lengths
    it sees may skip some: each one it sees has the text the offline engine has at that length."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["zz"])
    seen = run(collect(llm, PROMPTS[1], params))
    texts = texts_by_length(reference, PROMPTS[1], params)
    read = {len(c.token_ids): c.text for out in seen for c in out.outputs}
    assert len(texts) == 12 and 12 in read and len(read) > 1
    assert read == {length: texts[length] for length in read}


@pytest.mark.parametrize("interval", [None, 3])
def test_deltas_to_a_slow_consumer_join_up_to_the_final_output(llm, reference, interval):
    params = dataclasses.replace(SAMPLED, output_kind=RequestOutputKind.DELTA, stream_interval=interval)
    seen = run(collect(llm, PROMPTS[0], params, lag=0.2))
    want = reference.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert joined(seen) == completions(want)
    assert any(len(c.token_ids) > (interval or 1) for out in seen for c in out.outputs)  # the lag joined steps


def test_final_only_yields_the_finished_output_alone(llm, reference):
    params = dataclasses.replace(SAMPLED, output_kind=RequestOutputKind.FINAL_ONLY)
    seen = run(collect(llm, PROMPTS[1], params))
    assert len(seen) == 1 and completions(seen[0]) == completions(reference.generate(PROMPTS[1:2], params,
                                                                                      use_tqdm=False)[0])


def test_a_consumer_that_leaves_early_aborts_its_request(llm):
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    def engine_state(engine: LLMEngine) -> tuple[bool, int]:
        return engine.has_unfinished_requests(), engine.stats()["generated_tokens"]

    async def main():
        async for out in llm.generate(PROMPTS[0], long, "leaver"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        while True:  # the generator is closed once collected; the engine thread then aborts the request
            await asyncio.sleep(0.01)
            unfinished, generated = await asyncio.wrap_future(llm._loop.call(engine_state))
            if not unfinished:
                return generated

    assert run(main()) < 100  # of the 400 it asked for


async def abort_after_three_outputs(llm: AsyncLLM) -> list:
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    seen = []
    async for out in llm.generate(PROMPTS[0], params, "stopped"):
        seen.append(out)
        if len(seen) == 3:
            await llm.abort("stopped")
    return seen


def test_abort_ends_the_generator_with_vllms_abort_output(llm):
    seen = run(abort_after_three_outputs(llm))
    assert [c.finish_reason for c in seen[-1].outputs] == ["abort"] and seen[-1].finished
    assert sum(len(c.token_ids) for out in seen for c in out.outputs) < 400


def test_abort_before_the_first_output_ends_with_an_empty_abort_output(llm):
    async def main():
        generator = llm.generate("Hello there", SamplingParams(max_tokens=400, n=2, seed=1), "early")
        first = asyncio.ensure_future(generator.__anext__())
        await asyncio.sleep(0)  # the request is submitted
        await llm.abort(["early", "unknown"])
        return [await first] + [out async for out in generator]

    seen = run(main())
    assert seen[-1].finished and [c.finish_reason for c in seen[-1].outputs] == ["abort", "abort"]


def test_bad_input_raises_before_anything_is_queued(llm):
    async def first(prompt, params=None, request_id=None):
        async for out in llm.generate(prompt, params, request_id):
            return out

    with pytest.raises(ValueError, match="empty prompt"):
        run(first([]))
    with pytest.raises(ValueError, match="SamplingParams.n must be at most the engine's max_num_seqs"):
        run(first("Hi", SamplingParams(n=1000, temperature=1.0)))
    with pytest.raises(ValueError, match=r"prompt dict key\(s\) \['multi_modal_data'\] are not supported"):
        run(first({"prompt": "Hi", "multi_modal_data": {"image": 1}}))

    async def twice():
        running = llm.generate("Hi", SamplingParams(max_tokens=50), "same")
        await running.__anext__()
        try:
            await first("Hi", None, "same")
        finally:
            await running.aclose()

    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        run(twice())


def test_a_request_the_engine_cannot_hold_raises_value_error():
    """Four beams of 24 tokens outgrow 8 blocks of 4 (found when they run: beams share blocks, so
    they are not refused up front as four whole sequences would be)."""
    llm = AsyncLLM(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=8)
    try:
        with pytest.raises(ValueError, match="^request async-0 failed: the request alone needs more KV blocks"):
            run(collect(llm, "Hi", SamplingParams(max_tokens=24, temperature=0, num_beams=4, n=4, ignore_eos=True)))
        with pytest.raises(ValueError, match="exceeds the whole KV cache"):  # this one up front
            run(collect(llm, "Once upon a time" * 3, SamplingParams(max_tokens=4)))
    finally:
        llm.shutdown()
    assert_engine_idle(llm.engine)


def test_shutdown_ends_requests_in_flight_and_health_says_so(llm):
    async def main():
        await llm.check_health()
        assert llm.is_running and not llm.errored and await llm.reset_prefix_cache()
        running = llm.generate("Hi", SamplingParams(max_tokens=400, ignore_eos=True), "cut")
        await running.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(RuntimeError, match="shutting down"):
            async for _ in running:
                pass
        with pytest.raises(RuntimeError, match="not running"):
            await llm.check_health()

    run(main())
    assert llm.errored and AsyncLLMEngine is AsyncLLM


def test_an_asyncllm_dropped_without_shutdown_ends_its_thread():
    llm = AsyncLLM(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=16)
    thread = llm._loop._thread
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_an_engine_in_a_process_of_its_own_serves_the_same(reference):
    """``hf-paged serve``'s engine process under AsyncLLM: outputs arrive pickled, texts decoded here."""
    build = functools.partial(tiny_engine, {"block_size": 4, "num_blocks": 128}, {}, threads=1)
    process = EngineProcess(build, byte_tokenizer(), start_method="forkserver")
    llm = AsyncLLM(process)
    delta = dataclasses.replace(SAMPLED, output_kind=RequestOutputKind.DELTA)

    async def main():
        whole, deltas = await asyncio.gather(collect(llm, PROMPTS[0], GREEDY), collect(llm, PROMPTS[1], delta))
        assert await llm.reset_prefix_cache()
        return whole, deltas

    try:
        whole, deltas = run(main())
        aborted = run(abort_after_three_outputs(llm))
    finally:
        llm.shutdown()
    assert process.process.exitcode == 0 and llm.engine is process and llm.errored
    # a reader slower than the steps gets the newest cumulative output only (lengths may skip; see above)
    read, texts = {len(c.token_ids): c.text for out in whole for c in out.outputs}, texts_by_length(
        reference, PROMPTS[0], GREEDY)
    assert max(texts) in read and read == {length: texts[length] for length in read}
    assert completions(whole[-1]) == completions(reference.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0])
    assert joined(deltas) == completions(reference.generate(PROMPTS[1:2], delta, use_tqdm=False)[0])
    assert [c.finish_reason for c in aborted[-1].outputs] == ["abort"] and len(aborted) < 100


def test_an_engine_is_served_as_it_is(reference):
    with pytest.raises(TypeError, match="takes the engine alone"):
        AsyncLLM(reference, block_size=8)
    engine = LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=64)
    llm = AsyncLLM(engine)
    try:
        seen = run(collect(llm, PROMPTS[0], GREEDY))
    finally:
        llm.shutdown()
    assert llm.engine is engine and completions(seen[-1]) == completions(
        reference.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0])
    assert_engine_idle(engine)
