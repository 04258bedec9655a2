"""Load on loopback: 200 requests from 32 concurrent openai clients, mixed lengths, some streamed,
10% cancelled mid-stream. Every request not cancelled gets the engine's output, every cancelled
one is aborted, and all KV blocks are free at the end. Bounded in count and time; no timing
assertions (latency percentiles are ``hf_paged.bench.serving``'s business)."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass

import httpx
import openai

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from tests.helpers.serving import MODEL, assert_all_free, same_or_near_tie, serving, single_threaded_torch, tiny_model

NUM_REQUESTS, CLIENTS, CANCEL_EVERY = 200, 32, 10
ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?ABCDEFGHIJ0123456789éüß日本語→"


@dataclass
class Spec:
    prompt: str
    max_tokens: int
    stream: bool
    cancel: bool


def workload() -> list[Spec]:
    rng = random.Random(0)
    specs = []
    for i in range(NUM_REQUESTS):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 80)))
        cancel = i % CANCEL_EVERY == CANCEL_EVERY // 2
        specs.append(Spec(prompt, 400 if cancel else rng.randint(1, 40), cancel or rng.random() < 0.4, cancel))
    return specs


async def _one(client: openai.AsyncOpenAI, spec: Spec) -> tuple[list[int], str] | None:
    args = dict(model=MODEL, prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": spec.cancel})
    if not spec.stream:
        choice = (await client.completions.create(**args)).choices[0]
        return choice.model_extra["token_ids"], choice.text
    stream = await client.completions.create(stream=True, **args)
    tokens, text, chunks = [], "", 0
    async for chunk in stream:
        tokens += chunk.choices[0].model_extra.get("token_ids") or []
        text += chunk.choices[0].text
        chunks += 1
        if spec.cancel and chunks == 2:
            await stream.close()  # the client goes away mid-stream
            return None
    return tokens, text


async def _drive(url: str, specs: list[Spec]) -> list:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    todo: asyncio.Queue = asyncio.Queue()
    for i in range(len(specs)):
        todo.put_nowait(i)
    results: list = [None] * len(specs)

    async def worker() -> None:
        while not todo.empty():
            i = todo.get_nowait()
            results[i] = await _one(client, specs[i])

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    await client.close()
    return results


def test_200_requests_from_32_clients_with_cancellations():
    specs = workload()
    engine = LLMEngine(tiny_model(), byte_tokenizer(), num_blocks=512)
    kept = [s for s in specs if not s.cancel]
    with single_threaded_torch():
        refs = engine.generate([s.prompt for s in kept],
                               [SamplingParams(max_new_tokens=s.max_tokens, temperature=0, logprobs=2) for s in kept],
                               use_tqdm=False)
        with serving({"num_blocks": 512, "max_num_batched_tokens": 512}) as (server, loop):
            results = asyncio.run(asyncio.wait_for(_drive(server.url, specs), timeout=300))
            assert_all_free(loop)
            metrics = httpx.get(server.url + "/metrics").text
    ref_of = dict(zip((id(s) for s in kept), refs))
    exact = 0
    for spec, result in zip(specs, results):
        if spec.cancel:
            assert result is None
            continue
        ref = ref_of[id(spec)].outputs[0]
        tokens, text = result
        assert same_or_near_tie(tokens, ref.token_ids, ref.logprobs), (spec, tokens, ref.token_ids)
        if tokens == ref.token_ids:
            exact += 1
            assert text == ref.text, spec
    assert exact >= 0.9 * len(kept)  # near ties are rare: most requests must match to the token
    cancelled = sum(s.cancel for s in specs)
    assert re.search(rf'^hf_paged_requests_finished_total\{{finish_reason="abort"\}} {cancelled}$', metrics, re.M)
