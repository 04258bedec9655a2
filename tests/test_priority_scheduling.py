"""vLLM's ``scheduling_policy="priority"``: requests are admitted in order of their ``priority``
(lower first, then arrival), the running request preempted when blocks run out is the last in
that order, and a waiting request that outranks every swapped-out one does not wait for them.
``"fcfs"`` (the default) is unchanged, and refuses a nonzero priority rather than ignore it.

The scheduler is played by hand as in tests/test_scheduler.py; the engine tests check that the
policy changes who runs when, never the tokens. Every test ends with every KV block free.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Request, Status
from tests.helpers.serving import MODEL, assert_all_free, serving
from tests.helpers.tiny_models import build, single_threaded_torch
from tests.test_scheduler import BS, add, play, request, run_to_end


def scheduler(policy: str, num_blocks: int = 64, *, max_seqs: int = 16, mode: str = "recompute",
              swap: int = 0) -> Scheduler:
    kv = KVCacheManager(BS, num_blocks, enable_prefix_caching=False, swap_space_blocks=swap)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=64, preemption_mode=mode, policy=policy)


def ranked(rid: str, priority: int, prompt: int = 4, new: int = 3) -> Request:
    r = request(rid, prompt, new)
    r.priority = priority
    return r


def first_scheduled(outputs) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order = []
    for out in outputs:
        for scheduled in out.sequences:
            if scheduled.request_id not in order:
                order.append(scheduled.request_id)
    return order


@pytest.mark.parametrize("policy, expected", [("priority", ["d", "b", "a", "c"]), ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_requests_are_admitted_in_priority_order(policy, expected):
    s = scheduler(policy, max_seqs=1)
    requests = add(s, ranked("a", 5), ranked("b", 0), ranked("c", 5), ranked("d", -1))
    assert first_scheduled(run_to_end(s, requests)) == expected


def test_equal_priorities_keep_arrival_order_and_match_fcfs():
    """With one priority for all (and room for everyone: no preemption), the two policies make the same steps."""
    steps = {}
    for policy in ("fcfs", "priority"):
        s = scheduler(policy, max_seqs=3)
        requests = add(s, *[ranked(f"r{i}", 2, prompt=3 + i, new=2 + i % 3) for i in range(8)])
        steps[policy] = [[(q.request_id, q.num_tokens) for q in out.sequences] for out in run_to_end(s, requests)]
    assert steps["priority"] == steps["fcfs"]


def decoding_pair(policy: str, mode: str = "recompute", swap: int = 0):
    """``low`` (priority 5) admitted first, then ``high`` (priority 0): both decode until their blocks
    run out (each prompt fills 2 of the 5 blocks; the next token needs a third block each)."""
    s = scheduler(policy, num_blocks=5, mode=mode, swap=swap)
    requests = add(s, ranked("low", 5, prompt=2 * BS - 1, new=8))
    play(s, s.schedule(), requests)
    requests |= add(s, ranked("high", 0, prompt=2 * BS - 1, new=8))
    return s, requests


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_the_request_preempted_is_the_last_in_priority_order(policy, victim):
    s, requests = decoding_pair(policy)
    while not s.preemptions["recompute"]:
        play(s, s.schedule(), requests)
    assert requests[victim].status == Status.WAITING and requests[victim].num_preemptions == 1
    survivor = requests["high" if victim == "low" else "low"]
    assert survivor.status == Status.RUNNING and survivor.num_preemptions == 0
    run_to_end(s, requests)


def test_a_waiting_request_that_outranks_the_swapped_ones_is_admitted():
    """One of the pair swapped out, too big to come back while the other runs; then ``urgent``
    (priority -1, small enough for the free blocks) is admitted at once by priority, while under
    FCFS it waits for the swapped-out request."""
    admitted = {}
    for policy in ("priority", "fcfs"):
        s, requests = decoding_pair(policy, mode="swap", swap=8)
        while not s.preemptions["swap"]:
            play(s, s.schedule(), requests)
        assert requests["low" if policy == "priority" else "high"].status == Status.SWAPPED
        requests |= add(s, ranked("urgent", -1, prompt=BS, new=2))
        out = s.schedule()
        admitted[policy] = sorted(q.request_id for q in out.sequences)
        assert len(s.swapped) == 1, "the swapped-out request came back: the test would not see the policy"
        play(s, out, requests)
        run_to_end(s, requests)
    assert admitted == {"priority": ["high", "urgent"], "fcfs": ["low"]}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        scheduler("lifo")


# ---------------------------------------------------------------------------- the engine
PROMPTS = [[5, 9, 13, 2], [7, 7, 3], [40, 41, 42, 43, 44], [11, 12]]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    with single_threaded_torch():
        yield build("llama")


def finish_order(engine: LLMEngine, priorities: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """Prompt indices in the order their requests finished, and each one's tokens."""
    ids = {engine.add_request(p, GREEDY, priority=rank): i for i, (p, rank) in enumerate(zip(PROMPTS, priorities))}
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(ids[out.request_id])
                tokens[ids[out.request_id]] = out.outputs[0].token_ids
    assert engine.kv.num_used_blocks() == 0
    return order, tokens


def test_the_engine_serves_by_priority_and_the_tokens_do_not_change(model):
    fcfs = LLMEngine(model, max_num_seqs=1, num_blocks=64)
    by_priority = LLMEngine(model, max_num_seqs=1, num_blocks=64, scheduling_policy="priority")
    order, tokens = finish_order(by_priority, [3, 1, 2, 0])
    plain_order, plain = finish_order(fcfs, [0, 0, 0, 0])
    assert (order, plain_order) == ([3, 1, 2, 0], [0, 1, 2, 3])
    assert tokens == plain
    outputs = by_priority.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[1, 0, 0, 1])  # generate passes them
    assert [o.outputs[0].token_ids for o in outputs] == [plain[i] for i in range(4)]


def test_fcfs_refuses_a_priority_it_would_ignore(model):
    engine = LLMEngine(model, num_blocks=16)
    with pytest.raises(ValueError, match="priority=2 needs scheduling_policy='priority'"):
        engine.add_request([5, 6], GREEDY, priority=2)
    with pytest.raises(ValueError, match="priority must be an int, got True"):
        engine.add_request([5, 6], GREEDY, priority=True)
    request_id = engine.add_request([5, 6], GREEDY, priority=0)
    assert engine.generate([[5, 6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'sjf'"):
        LLMEngine(model, num_blocks=16, scheduling_policy="sjf")
    assert [out.request_id for out in engine.step() if out.finished] == [request_id]  # it finished in generate()
    assert engine.kv.num_used_blocks() == 0 and not engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- over HTTP
def _waiting(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r'^vllm:num_requests_waiting\{[^}]*\} (\S+)$', text, re.M).group(1))


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_priority_server_serves_the_request_field_in_order():
    """One sequence at a time, in an engine process: while a stream holds the engine, ``later``
    (priority 5) and then ``sooner`` (priority -5) queue; once the stream ends, ``sooner`` runs
    first. A fcfs server refuses a nonzero priority, naming the field."""
    with serving({"num_blocks": 64, "max_num_seqs": 1, "scheduling_policy": "priority"},
                 engine_process=True) as (server, loop):
        holder = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = holder.completions.create(model=MODEL, prompt="Hold", max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        finished: list[str] = []

        def ask(name: str, priority: int) -> None:
            resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": name}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True, "priority": priority})
            assert resp.status_code == 200, resp.text
            finished.append(name)

        threads = [threading.Thread(target=ask, args=("later", 5)), threading.Thread(target=ask, args=("sooner", -5))]
        threads[0].start()
        _until(lambda: _waiting(server) == 1)
        threads[1].start()
        _until(lambda: _waiting(server) == 2)
        stream.close()
        for thread in threads:
            thread.join(60)
        assert finished == ["sooner", "later"]
        assert_all_free(loop)
    with serving({"num_blocks": 64}) as (server, loop):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        refused = httpx.post(server.url + "/v1/completions", json={**body, "priority": 1}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
        assert "--scheduling-policy priority" in refused.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/completions", json={**body, "priority": 0}, timeout=60).status_code == 200
        assert_all_free(loop)
