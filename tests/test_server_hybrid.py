"""``hf-paged serve`` on a hybrid checkpoint (issue 21): a tiny Qwen3.5-like model saved with the byte
tokenizer, served by the real command line and driven by the ``openai`` client over loopback.
Completions equal the in-process engine's tokens; ``/metrics`` shows the state slots; a load of
100 requests from 16 clients, 10% cancelled mid-stream, leaves every state slot and block free."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from hf_paged import LLMEngine, SamplingParams, state_layers
from hf_paged.demo import byte_tokenizer
from hf_paged.serve import ServerSettings, ServerThread, build_app
from tests.helpers.hybrid_models import CONFIGS
from tests.helpers.serving import free_port, single_threaded_torch, wait_idle, wait_until_healthy

pytestmark = pytest.mark.skipif(not state_layers.STATE_API, reason="transformers lacks the state-layer cache API")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "hybrid models keep a state", "x", "ünïcødé and 日本語 too"]


def _hybrid_checkpoint(path: Path) -> Path:
    tokenizer = byte_tokenizer()
    config = CONFIGS["qwen3_5_text"]()
    config.vocab_size = len(tokenizer)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    config.initializer_range = 0.3
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"))


def _engine(checkpoint: Path, **options) -> LLMEngine:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return LLMEngine(model, tokenizer, **options)


def test_serve_a_hybrid_checkpoint_from_the_command_line(checkpoint):
    with single_threaded_torch():
        refs = _engine(checkpoint).generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--model", str(checkpoint), "--port", str(port),
                             "--num-state-slots", "8"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_until_healthy(proc, port, timeout=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, ref in zip(PROMPTS, refs):
            choice = client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True}).choices[0]
            assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids and choice.text == ref.outputs[0].text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert re.search(r"^hf_paged_state_slots_total 8$", metrics, re.M), metrics
        assert re.search(r"^hf_paged_state_slots_used 0$", metrics, re.M)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
    assert "recurrent state: 8 slots" in log and "prefix caching off" in log, log[-2000:]


# ------------------------------------------------------------------------------ load
NUM_REQUESTS, CLIENTS, CANCEL_EVERY = 100, 16, 10


async def _drive(url: str, specs: list[tuple[str, int, bool]]) -> list:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    todo = list(range(len(specs)))
    results: list = [None] * len(specs)

    async def one(i: int):
        prompt, max_tokens, cancel = specs[i]
        args = dict(model="hybrid", prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": cancel})
        if not cancel:
            return (await client.completions.create(**args)).choices[0].model_extra["token_ids"]
        stream = await client.completions.create(stream=True, **args)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                await stream.close()  # the client goes away mid-stream
                return None
        return "not cancelled"

    async def worker():
        while todo:
            i = todo.pop(0)
            results[i] = await one(i)

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    await client.close()
    return results


def test_100_requests_from_16_clients_with_cancellations_leave_every_slot_free(checkpoint):
    rng = random.Random(0)
    specs = [("".join(rng.choice("abcdefgh ,.") for _ in range(rng.randint(1, 40))),
              300 if i % CANCEL_EVERY == 3 else rng.randint(1, 16), i % CANCEL_EVERY == 3) for i in range(NUM_REQUESTS)]
    with single_threaded_torch():
        engine = _engine(checkpoint, num_blocks=256, max_num_batched_tokens=256, num_state_slots=12)
        kept = [s for s in specs if not s[2]]
        refs = engine.generate([p for p, _, _ in kept], [SamplingParams(max_new_tokens=n, temperature=0) for _, n, _ in kept],
                               use_tqdm=False)
        app = build_app(engine, ServerSettings(model_name="hybrid"))
        with ServerThread(app) as server:
            results = asyncio.run(asyncio.wait_for(_drive(server.url, specs), timeout=300))
            stats = wait_idle(app.state.engine_loop)
    assert stats["in_flight"] == 0 and stats["running"] == stats["waiting"] == 0, stats
    assert stats["blocks_used"] == 0 and stats["state_slots_used"] == 0, f"leaked: {stats}"
    ref_of = iter(refs)
    for (_, _, cancel), result in zip(specs, results):
        if cancel:
            assert result is None
        else:
            assert result == next(ref_of).outputs[0].token_ids
