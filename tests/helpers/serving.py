"""Shared by the server tests: a tiny model, a served engine, the engine-side truth, idle checks."""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import time

import httpx
import openai
import pytest

import torch
from transformers import GenerationConfig

from hf_paged import LLMEngine
from hf_paged.demo import byte_tokenizer, demo_model
from hf_paged.serve import ServerSettings, ServerThread, build_app
from hf_paged.serve.engine_process import EngineProcess
from tests.helpers.tiny_models import single_threaded_torch  # noqa: F401 - the servers' tests take it from here

MODEL = "tiny"


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, port: int, timeout: float, poll: float = 0.2) -> None:
    """Wait for a server process on ``port`` to answer ``/health``; fail if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(poll)


def tiny_model(generation: dict | None = None, **overrides):
    """The demo architecture, tiny and random (seed 0): varied bytes, multi-byte characters among
    them. ``generation``: the fields of its generation config (as a generation_config.json sets them)."""
    options = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3)
    model = demo_model(seed=0, **{**options, **overrides})
    if generation is not None:
        model.generation_config = GenerationConfig(**generation)
    return model


def tiny_engine(engine_kwargs: dict, model_overrides: dict, threads: int | None = None) -> LLMEngine:
    """The engine ``serving`` serves, built where it runs (an engine process gets ``threads``)."""
    if threads is not None:
        torch.set_num_threads(threads)
    return LLMEngine(tiny_model(**model_overrides), byte_tokenizer(), **engine_kwargs)


ENGINE_PLACES = ["thread", "engine process"]  # where a served engine runs: fixtures parametrized by it


@contextlib.contextmanager
def serving(engine_kwargs: dict | None = None, model_overrides: dict | None = None,
            send_buffer_bytes: int | None = None, engine_process: bool = False, **settings):
    """A server on a free loopback port over a fresh engine (on the engine loop's thread, or in an
    engine process of its own); yields ``(server, engine loop)``. Engine processes fork from one fork
    server, which imports torch, transformers and this module once for the whole run (spawned, each
    would import them again: seconds apiece); ``hf-paged serve``'s spawned one is the CLI tests'."""
    build = functools.partial(tiny_engine, engine_kwargs or {}, model_overrides or {})
    engine = EngineProcess(functools.partial(build, threads=1), byte_tokenizer(), start_method="forkserver") \
        if engine_process else build()
    try:
        app = build_app(engine, ServerSettings(model_name=MODEL, **settings))
        with ServerThread(app, send_buffer_bytes=send_buffer_bytes) as server:
            yield server, app.state.engine_loop
    finally:
        if engine_process:
            engine.close()


# Engine-side changes for the fault tests, run by ``loop.call`` (module-level: they reach an engine
# process by reference).
def fail_next_step(engine: LLMEngine) -> None:
    """The engine's next step raises ``RuntimeError("injected")``; the one after runs normally."""
    real = engine.step

    def failing():
        engine.step = real
        raise RuntimeError("injected")

    engine.step = failing


def break_forwards(engine: LLMEngine) -> None:
    """Every forward with sequences raises, until :func:`mend_forwards`."""
    real = engine.runner.execute

    def failing(step):
        if step.sequences:
            raise RuntimeError("injected forward fault")
        return real(step)

    engine.runner.execute, engine.runner.real_execute = failing, real


def slow_forwards(engine: LLMEngine, seconds: float = 0.05) -> None:
    """Every forward takes at least ``seconds`` (requests stay in flight), until :func:`mend_forwards`."""
    real = engine.runner.execute

    def slow(step):
        time.sleep(seconds)
        return real(step)

    engine.runner.execute, engine.runner.real_execute = slow, real


def mend_forwards(engine: LLMEngine) -> None:
    engine.runner.execute = engine.runner.real_execute


def wait_idle(loop, timeout: float = 15.0) -> dict:
    """The engine's stats once nothing is in flight (aborts land between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = loop.call(LLMEngine.stats).result(timeout)
        in_flight = loop.in_flight
        idle = in_flight == 0 and stats["running"] == stats["waiting"] == stats["swapped"] == 0
        if idle or time.monotonic() > deadline:
            return {**stats, "in_flight": in_flight}
        time.sleep(0.02)


def post_then_all_free(served, path: str, body: dict) -> httpx.Response:
    """POST ``body`` to ``path`` on ``served`` (a ``(server, loop)`` fixture); then nothing is in flight
    and every KV block is free, whatever the answer."""
    server, loop = served
    try:
        return httpx.post(server.url + path, json=body, timeout=60)
    finally:
        assert_all_free(loop)


def assert_all_free(loop) -> None:
    stats = wait_idle(loop)
    assert stats["in_flight"] == 0 and stats["running"] == stats["waiting"] == stats["swapped"] == 0, stats
    assert stats["blocks_used"] == 0 and stats["swap_blocks_used"] == 0, f"KV blocks leaked: {stats}"


def same_or_near_tie(got: list[int], ref: list[int], ref_logprobs: list[dict[int, float]], gap: float = 1e-4) -> bool:
    """Greedy tokens equal, or first differing where the reference's top two were within ``gap``
    (a batch of another shape may round the logits differently)."""
    if got == ref:
        return True
    step = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if step is None:
        return False  # one is a prefix of the other: a length difference is never a tie
    entry = ref_logprobs[step]
    return got[step] in entry and abs(entry[got[step]] - entry[ref[step]]) < gap


# Fixtures of the server test modules (imported by them): the demo server with ``NUM_BLOCKS``
# blocks, an ``openai`` client that checks every block is free after each test, and the truth, an
# in-process engine on an identical model (same seed) and budget.
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def served():
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}) as (server, loop):
        yield server, loop


@pytest.fixture
def client(served):
    server, loop = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    assert_all_free(loop)


@pytest.fixture(scope="module")
def engine(served):
    return LLMEngine(tiny_model(), byte_tokenizer(), num_blocks=NUM_BLOCKS)
