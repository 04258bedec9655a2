"""The engine in a process of its own (``hf_paged/serve/engine_process.py``): what only it can get
wrong. The server's behaviour over it (outputs equal the engine's, options, errors, disconnects,
faults) is tested by ``test_server.py`` and ``test_server_robustness.py``, whose servers run both
ways. Here: outputs cross the pipe intact, the engine process dies or fails to start, nothing is
left behind when either process ends."""

from __future__ import annotations

import functools
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import openai
import pytest

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.engine import step_threads
from hf_paged.engine.outputs import CompletionOutput
from hf_paged.serve.engine_process import START_METHODS, EngineProcess
from tests.helpers.serving import (MODEL, assert_all_free, free_port, same_or_near_tie, serving, single_threaded_torch,
                                   tiny_engine, wait_until_healthy)

ENGINE = {"num_blocks": 128}
IN_FLIGHT_TOKENS = 200  # a request the server drains on SIGINT/SIGTERM


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_an_undecoded_output_pickles_without_its_decoder_and_decodes_where_it_lands():
    tokenizer = byte_tokenizer()
    ids = tokenizer("héllo", add_special_tokens=False).input_ids
    made = CompletionOutput(0, ids, decode=lambda: "decoded where it was made")
    landed = pickle.loads(pickle.dumps(made))
    assert landed.needs_decoder and landed.token_ids == ids
    with pytest.raises(RuntimeError, match="no decoder was set"):
        landed.text
    landed.set_decoder(tokenizer.decode)
    assert landed.text == "héllo" and not landed.needs_decoder
    decoded = pickle.loads(pickle.dumps(CompletionOutput(0, ids, "text", "stop")))
    assert (decoded.text, decoded.finish_reason, decoded.needs_decoder) == ("text", "stop", False)


def test_many_concurrent_streams_through_the_pipe_equal_the_engine():
    """Sixteen streams at once (outputs of many requests per step, prompts sent once, texts
    decoded in the server's process): each stream's tokens are an in-process engine's (or part
    from them only at a near-tie: the streams join the batch at times the engine does not see, and
    float32 sums depend on the batch's shape), its text those tokens' text. The same sixteen
    prompts in one request are batched as the engine batches them: exactly its outputs, each text
    after its echoed prompt."""
    prompts = [f"Prompt number {i}: " + "abc" * i for i in range(16)]
    with single_threaded_torch():
        truth = tiny_engine(ENGINE, {}).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, logprobs=2),
                                                 use_tqdm=False)
    results: dict[int, tuple] = {}
    with single_threaded_torch(), serving(ENGINE, engine_process=True) as (server, loop):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def one(i: int) -> None:
            chunks = list(client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0,
                                                    stream=True, extra_body={"return_token_ids": True}))
            ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
            results[i] = ids, "".join(c.choices[0].text for c in chunks)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        final = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0, echo=True,
                                          extra_body={"return_token_ids": True})
        assert_all_free(loop)
    for i, ref in enumerate(truth):
        ids, text = results[i]
        assert len(ids) == 24 and text == byte_tokenizer().decode(ids, skip_special_tokens=True), i
        assert same_or_near_tie(ids, ref.outputs[0].token_ids, ref.outputs[0].logprobs), i
        assert final.choices[i].model_extra["token_ids"] == ref.outputs[0].token_ids, i
        assert final.choices[i].text == prompts[i] + ref.outputs[0].text  # the prompt kept by the server
    assert sum(results[i][0] == ref.outputs[0].token_ids for i, ref in enumerate(truth)) >= 12
    assert final.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in truth)


def test_call_needs_a_picklable_function_and_says_so():
    with single_threaded_torch(), serving(ENGINE, engine_process=True) as (_, loop):
        assert loop.call(LLMEngine.stats).result(30)["blocks_used"] == 0
        with pytest.raises(ValueError, match="cannot be sent to the engine process"):
            loop.call(lambda engine: engine.stats()).result(30)
        with pytest.raises(RuntimeError, match="cannot be sent back"):
            loop.call(_unpicklable_result).result(30)
        assert loop.call(LLMEngine.stats).result(30)["healthy"]


def _unpicklable_result(engine: LLMEngine):
    return lambda: engine


def test_a_dead_engine_process_ends_the_requests_in_flight_and_health_says_503():
    with single_threaded_torch(), serving(ENGINE, engine_process=True) as (server, loop):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(loop.engine.process.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"engine_unhealthy"' in rest[-2], rest[-3:]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_unhealthy"
        late = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unhealthy", late.text
        assert loop.in_flight == 0
        metrics = httpx.get(server.url + "/metrics")  # the scrape that matters most (once a 500)
        assert metrics.status_code == 200 and "\nhf_paged_engine_healthy 0\n" in metrics.text, metrics.text[:300]


@pytest.mark.parametrize("start_method", START_METHODS)
def test_an_engine_that_fails_to_build_is_reported_with_its_cause(start_method):
    build = functools.partial(tiny_engine, {"block_size": 0}, {})
    with pytest.raises(RuntimeError, match="the engine process failed to start: ValueError: .*block_size"):
        EngineProcess(build, byte_tokenizer(), start_method=start_method)


def test_an_unknown_start_method_is_named():
    with pytest.raises(ValueError, match="start_method must be one of .*'spawn'.*got 'fork'"):
        EngineProcess(functools.partial(tiny_engine, {}, {}), byte_tokenizer(), start_method="fork")


def _omp_wait_policy(pid: int) -> str | None:
    """``OMP_WAIT_POLICY`` as process ``pid`` started with it."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    value = pairs.get(b"OMP_WAIT_POLICY")
    return value.decode() if value is not None else None


@pytest.mark.parametrize("how, user_policy", [("SIGINT", None), ("SIGTERM", "ACTIVE"), ("SIGKILL", None)])
def test_hf_paged_serve_starts_its_engine_process_and_leaves_none_behind(how, user_policy):
    """``hf-paged serve`` with engine threads on every core starts its engine process waiting
    passively, unless the user chose an OpenMP wait policy (read from the running engine process's
    environment); stopped by SIGINT or SIGTERM to its whole process group (a terminal's Ctrl-C, a
    service manager's stop: the engine process ignores them, the server drains a request in flight
    and then stops it) or killed outright (the engine process sees its pipe close and exits), it
    leaves no engine process behind."""
    port, cores = free_port(), len(os.sched_getaffinity(0))
    # --shutdown-timeout: room for the drain when a spinning (ACTIVE) engine shares the cores with a busy neighbour
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--num-blocks", "64", "--enforce-eager",
           "--engine-threads", str(cores), "--shutdown-timeout", "150"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_NUM_THREADS="1", **({"OMP_WAIT_POLICY": user_policy} if user_policy else {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    started: list[str] = []
    try:
        for line in proc.stdout:  # the server names its engine process before it starts serving
            started.append(line)
            if found := re.search(r"; engine process (\d+)\)$", line.strip()):
                engine_pid = int(found.group(1))
                break
        else:
            raise AssertionError("".join(started))
        # passive waits: small steps run on one thread (hf_paged.engine.step_threads)
        threads_line = next(line for line in started if "engine threads" in line)
        serial = re.search(r"steps of up to (\d+) tokens run on one", threads_line)
        assert bool(serial) == (user_policy is None and cores > 1 and step_threads.available()), threads_line
        assert _omp_wait_policy(engine_pid) == (user_policy or "PASSIVE")
        wait_until_healthy(proc, port, timeout=120)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60) as client:
            assert client.completions.create(model="hf-paged-demo", prompt="Hi", max_tokens=3).usage \
                .completion_tokens == 3
            first_token, finished = threading.Event(), []

            def in_flight():  # streamed: the signal comes once its first token is out, mid-request
                chunks = []
                for chunk in client.completions.create(
                        model="hf-paged-demo", prompt="Hello", max_tokens=IN_FLIGHT_TOKENS, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
                    first_token.set()
                finished.append((chunks[-1].usage, time.monotonic()))

            in_flight = threading.Thread(target=in_flight)
            if how != "SIGKILL":
                in_flight.start()
                assert first_token.wait(60)
            assert _pid_alive(engine_pid)
            signalled = time.monotonic()
            os.killpg(proc.pid, getattr(signal, how)) if how != "SIGKILL" else proc.kill()
            output, _ = proc.communicate(timeout=180)
            if how != "SIGKILL":
                in_flight.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _wait_gone(engine_pid, timeout=30), "the engine process outlived the server"
    if how != "SIGKILL":
        assert proc.returncode == 0 and "Application shutdown complete" in output, output
        assert "leaked" not in output, output  # the engine process's quick exit still unlinks its semaphores
        (usage, answered), = finished
        assert usage.completion_tokens == IN_FLIGHT_TOKENS and answered > signalled  # drained, not cut off


def test_engine_threads_on_every_core_wait_passively_unless_the_user_chose():
    from hf_paged.__main__ import engine_process_env

    cores = len(os.sched_getaffinity(0))
    assert engine_process_env(cores, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_process_env(cores + 1, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    if cores > 1:
        assert engine_process_env(cores - 1, {}) == {}  # a core is left to the server: spinning costs it nothing
    assert engine_process_env(cores, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert engine_process_env(cores, {"GOMP_SPINCOUNT": "1000"}) == {}


def test_the_engine_process_environment_is_set_only_while_it_starts(monkeypatch):
    from hf_paged.__main__ import _environment

    monkeypatch.setenv("HF_PAGED_TEST_KEPT", "before")
    monkeypatch.delenv("HF_PAGED_TEST_NEW", raising=False)
    with _environment({"HF_PAGED_TEST_KEPT": "during", "HF_PAGED_TEST_NEW": "during"}):
        assert os.environ["HF_PAGED_TEST_KEPT"] == os.environ["HF_PAGED_TEST_NEW"] == "during"
    assert os.environ["HF_PAGED_TEST_KEPT"] == "before" and "HF_PAGED_TEST_NEW" not in os.environ


def test_engine_threads_default_takes_every_core_only_on_two_cores_in_a_process_of_its_own(monkeypatch):
    import hf_paged.__main__ as cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, own, expected in [(1, True, 1), (2, True, 2), (2, False, 1), (4, True, 3), (4, False, 3)]:
        monkeypatch.setattr(cli, "_usable_cores", lambda: cores)
        assert cli.engine_threads(None, own)[0] == expected, (cores, own)
    assert cli.engine_threads(3, True) == (3, "--engine-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cli, "_usable_cores", lambda: 2)
    assert cli.engine_threads(None, True) == (1, "OMP_NUM_THREADS")


def test_an_engine_process_still_building_leaves_when_the_server_is_killed(tmp_path):
    """A server killed while its engine process builds (here: a build that takes a minute): the engine
    process leaves within a second or two instead of building for nobody."""
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent("""
        import functools, multiprocessing, sys, threading, time
        from hf_paged.demo import byte_tokenizer
        from hf_paged.serve.engine_process import EngineProcess

        def report():
            while not multiprocessing.active_children():
                time.sleep(0.05)
            print(multiprocessing.active_children()[0].pid, flush=True)

        if __name__ == "__main__":
            threading.Thread(target=report, daemon=True).start()
            EngineProcess(functools.partial(time.sleep, 60), byte_tokenizer())
    """))
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        engine_pid = int(server.stdout.readline())
        time.sleep(1.0)  # building
        assert _pid_alive(engine_pid)
    finally:
        server.kill()
        server.wait()
    assert _wait_gone(engine_pid, timeout=10), "the engine process kept building after its server was killed"
