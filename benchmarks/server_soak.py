#!/usr/bin/env python
"""Soak ``hf-paged serve`` (the built-in demo model, or ``--model PATH`` among the serve options)
under a random mix of request features from many concurrent clients, on a KV budget small enough
to preempt all the time.

    python benchmarks/server_soak.py [--requests 600] [--clients 32] [--seed 2] [-- SERVE OPTIONS]

Serve options default to ``--num-blocks 96 --max-num-seqs 16 --scheduling-policy priority``.
Every request is valid (completions, chat, a tenth to the Responses API, whose streamed text
deltas must join to its final text; streamed or not, some left mid-stream; n, seeds,
top-p/k, min-p, penalties, stop strings and ids, log-probs, echo, prompt log-probs, logit bias,
JSON / schema / regex / choice constraints, tools, beam search, priorities, vLLM's extras;
some clients give up on a whole answer after 0.3 s), so
every answer must be a 200 or a 400 that says the request does not fit the KV cache. Checked
per answer: as many choices as asked, streams end with ``[DONE]`` and open each chat choice with
one role chunk, a ``length`` finish has ``max_tokens`` tokens, usage counts the tokens returned,
constrained texts parse (when not cut by the length), forced tool calls are there. At the end the
server must be idle with every KV block free, and every greedy request without anything that
changes its tokens must equal an in-process engine's answer (batching and preemption change
nothing). Prints the problems found; exits 1 if there are any. A stress tool, not a test: it
found a request of 4 samples refused mid-stream after a preemption (fixed, 2026-12-06).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

# this folder's kernels.py would shadow the ``kernels`` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx  # noqa: E402

from hf_paged.bench.local_server import LocalServer, free_port  # noqa: E402

WORDS = ["the", "function", "returns", "a", "list", "of", "values", "for", "each", "item", "in", "data", "if",
         "None", "is", "given", "raise", "ValueError", "Return", "string", "éclair", "日本", "→"]
PREFIXES = ["Return the number of items in the list. " * 3, "Compute the hash of the given object and ",
            "This module provides functions for working with paths. " * 4]  # prefix-cache hits
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX, CHOICES = r"[a-z]{2,6}-\d{1,3}", ["alpha", "beta", "gamma delta"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
UNFIT = ("exceed the KV cache", "leaves no room in the KV cache", "needs more KV blocks than the cache has")
SERVE_DEFAULTS = ["--num-blocks", "96", "--max-num-seqs", "16", "--scheduling-policy", "priority"]


@dataclass
class Case:
    path: str
    body: dict
    constraint: str | None = None  # json_object, json_schema, regex, choice
    tool_choice: object = None
    beam: bool = False
    leave_early: bool = False  # a stream the client stops reading after 3 chunks, or a whole answer after 0.3 s
    plain_greedy: bool = False  # greedy and nothing else that changes tokens: compared with the engine


@dataclass
class Answer:
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    roles: dict[int, int] = field(default_factory=dict)  # chat streams: role chunks per choice
    calls: dict[int, list] = field(default_factory=dict)
    usage: dict | None = None


def words(rng: random.Random) -> str:
    head = rng.choice(PREFIXES) if rng.random() < 0.5 else ""
    return head + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))


def draw_response(rng: random.Random) -> Case:
    """A request to the Responses API: instructions, a JSON schema or a forced tool call sometimes."""
    case = Case("/v1/responses", {"input": words(rng), "max_output_tokens": rng.choice([1, 5, 16, 64, 200]),
                                  "temperature": rng.choice([0, 0.7, 1.0])})
    body = case.body
    if rng.random() < 0.3:
        body["instructions"] = "Be brief."
    if rng.random() < 0.15:
        case.constraint = "json_schema"
        body.update(max_output_tokens=200, text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}})
    elif rng.random() < 0.15:
        case.tool_choice = {"type": "function", "name": "add"}
        body.update(max_output_tokens=200, tool_choice=case.tool_choice,
                    tools=[{"type": "function", **t["function"]} for t in TOOLS])
    if rng.random() < 0.5:
        body["stream"] = True
        case.leave_early = rng.random() < 0.1
    elif rng.random() < 0.06:
        case.leave_early = True
    return case


def draw(rng: random.Random, priorities: bool = True) -> Case:
    """One random valid request (``priorities``: the server schedules by priority)."""
    if rng.random() < 0.1:
        return draw_response(rng)
    chat = rng.random() < 0.5
    if chat:
        messages = [{"role": "user", "content": words(rng)}]
        if rng.random() < 0.2:
            messages = [{"role": "system", "content": "Be brief."}, *messages,
                        {"role": "assistant", "content": "Sure."}, {"role": "user", "content": words(rng)}]
        case = Case("/v1/chat/completions", {"messages": messages})
    else:
        prompt = words(rng) if rng.random() < 0.8 else [rng.randint(3, 250) for _ in range(rng.randint(1, 90))]
        case = Case("/v1/completions", {"prompt": prompt})
    body = case.body
    greedy = rng.random() < 0.4
    body.update(max_tokens=rng.choice([1, 2, 5, 16, 32, 64, 128, 200]), temperature=0 if greedy else
                rng.choice([0.5, 1.0, 1.3]), return_token_ids=True)
    changes_tokens = False
    if not greedy:
        for name, value, p in (("seed", rng.randint(0, 1000), 0.5), ("top_p", rng.choice([0.5, 0.9]), 0.3),
                               ("top_k", rng.choice([1, 5, 40]), 0.3), ("min_p", 0.1, 0.2),
                               ("n", rng.randint(2, 4), 0.4)):
            if rng.random() < p:
                body[name] = value
    if rng.random() < 0.15:
        body.update(presence_penalty=0.5, frequency_penalty=0.3)
        changes_tokens = True
    if rng.random() < 0.1:
        body["repetition_penalty"], changes_tokens = 1.2, True
    if rng.random() < 0.2:
        body["stop"] = rng.sample([" the", "\n", "ing", ".", "ValueError"], rng.randint(1, 3))
    if rng.random() < 0.25:
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 5)} if chat else {"logprobs": rng.randint(0, 5)})
        if not chat and rng.random() < 0.3:
            body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, min(8, body["max_tokens"]))
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["logit_bias"], changes_tokens = {str(rng.randint(3, 250)): rng.choice([-100, -5, 5])}, True
    single = body.get("n", 1) == 1 and "stop" not in body
    if rng.random() < 0.15 and single:
        case.constraint = rng.choice(["json_object", "json_schema", "regex", "choice"])
        body.update({"json_object": {"response_format": {"type": "json_object"}},
                     "json_schema": {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": SCHEMA}}},
                     "regex": {"structured_outputs": {"regex": REGEX}},
                     "choice": {"structured_outputs": {"choice": CHOICES}}}[case.constraint])
    elif chat and rng.random() < 0.12 and single:
        case.tool_choice = rng.choice(["required", {"type": "function", "function": {"name": "add"}}, "auto"])
        body.update(tools=TOOLS, tool_choice=case.tool_choice)
    elif not chat and rng.random() < 0.08:
        case.beam = True
        for name in ("seed", "top_p", "top_k", "min_p", "stop", "logprobs", "echo", "prompt_logprobs", "min_tokens",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
            body.pop(name, None)
        best_of = rng.randint(2, 4)
        body.update(use_beam_search=True, best_of=best_of, n=rng.randint(1, best_of), temperature=0)
    if case.constraint or case.tool_choice:
        body["max_tokens"] = 200
        for name in ("min_tokens", "ignore_eos", "logit_bias", "echo"):  # (an echo would precede the text)
            body.pop(name, None)
    if rng.random() < 0.2 and priorities:
        body["priority"] = rng.randint(-5, 5)
    if not (case.constraint or case.tool_choice or case.beam):
        for name, value in (("stop_token_ids", [rng.randint(3, 250)]), ("bad_words", ["the"]),
                            ("include_stop_str_in_output", True), ("skip_special_tokens", False),
                            ("truncate_prompt_tokens", rng.choice([-1, 20])), ("return_tokens_as_token_ids", True),
                            ("spaces_between_special_tokens", False), ("allowed_token_ids", list(range(3, 200)))):
            if rng.random() < 0.06:
                body[name], changes_tokens = value, True
    if not case.beam and rng.random() < 0.5:
        body["stream"] = True
        body.pop("prompt_logprobs", None)  # refused with a stream (as vLLM)
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        case.leave_early = rng.random() < 0.12
    elif rng.random() < 0.06:  # (drawn last: every other field is what this seed drew before)
        case.leave_early = True
    case.plain_greedy = (greedy and not changes_tokens and not case.constraint and not case.tool_choice
                         and not case.beam and not body.get("echo") and "logprobs" not in body)
    return case


async def stream_events(client: httpx.AsyncClient, url: str, case: Case) -> AsyncIterator[dict | str | tuple]:
    """A streamed request's events: each data line's JSON (``"[DONE]"`` as is), or (status, body)
    alone for an answer other than 200. Closing it early closes the connection (the server aborts)."""
    async with client.stream("POST", url + case.path, json=case.body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            yield resp.status_code, resp.text
            return
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                yield data if data == "[DONE]" else json.loads(data)


async def post_whole(client: httpx.AsyncClient, url: str, case: Case) -> httpx.Response | None:
    """A request answered whole; None when its client gave up waiting (the server must abort it)."""
    try:
        return await client.post(url + case.path, json=case.body,
                                 timeout=0.3 if case.leave_early else httpx.USE_CLIENT_DEFAULT)
    except httpx.TimeoutException:
        if case.leave_early:
            return None
        raise


async def send(client: httpx.AsyncClient, url: str, case: Case) -> Answer | tuple[int, str] | None:
    """The answer, (status, body) for a non-200, or None for a stream left early."""
    if case.path == "/v1/responses":
        return await send_response(client, url, case)
    if not case.body.get("stream"):
        resp = await post_whole(client, url, case)
        if resp is None:
            return None
        if resp.status_code != 200:
            return resp.status_code, resp.text
        out, answer = resp.json(), Answer()
        answer.usage = out["usage"]
        for c in out["choices"]:
            i = c["index"]
            answer.texts[i] = (c["message"]["content"] if "message" in c else c["text"]) or ""
            answer.token_ids[i], answer.finish[i] = c.get("token_ids") or [], c["finish_reason"]
            answer.calls[i] = (c.get("message") or {}).get("tool_calls") or []
        return answer
    answer, chunks, done = Answer(), 0, False
    async with contextlib.aclosing(stream_events(client, url, case)) as events:
        async for chunk in events:
            if isinstance(chunk, tuple):
                return chunk
            if chunk == "[DONE]":
                done = True
                break
            if "error" in chunk:
                return 200, json.dumps(chunk)
            for c in chunk["choices"]:
                i, delta = c["index"], c.get("delta")
                if delta is not None and "role" in delta:
                    answer.roles[i] = answer.roles.get(i, 0) + 1
                piece = (delta.get("content") or "") if delta is not None else (c.get("text") or "")
                answer.texts[i] = answer.texts.get(i, "") + piece
                for call in (delta or {}).get("tool_calls") or []:  # streamed calls: name, then argument pieces
                    calls = answer.calls.setdefault(i, [])
                    while len(calls) <= call["index"]:
                        calls.append({"function": {"name": "", "arguments": ""}})
                    for key in ("name", "arguments"):
                        calls[call["index"]]["function"][key] += call.get("function", {}).get(key) or ""
                answer.token_ids.setdefault(i, []).extend(c.get("token_ids") or [])
                if c.get("finish_reason"):
                    answer.finish[i] = c["finish_reason"]
            chunks += 1
            if case.leave_early and chunks >= 3:
                return None
    if not done:
        answer.finish[-1] = "no [DONE]"
    return answer


def response_answer(response: dict) -> Answer:
    """A Response object as an answer of one choice (its text, calls, finish and usage)."""
    answer = Answer(usage=response["usage"])
    answer.texts[0] = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                              for part in item["content"])
    answer.calls[0] = [{"function": {"name": item["name"], "arguments": item["arguments"]}}
                       for item in response["output"] if item["type"] == "function_call"]
    answer.finish[0] = {"completed": "tool_calls" if answer.calls[0] else "stop",
                        "incomplete": "length"}.get(response["status"], response["status"])
    return answer


async def send_response(client: httpx.AsyncClient, url: str, case: Case) -> Answer | tuple[int, str] | None:
    """A Responses request; streamed, the text deltas must join to the final response's text."""
    if not case.body.get("stream"):
        resp = await post_whole(client, url, case)
        if resp is None:
            return None
        return response_answer(resp.json()) if resp.status_code == 200 else (resp.status_code, resp.text)
    deltas, count, final = [], 0, None
    async with contextlib.aclosing(stream_events(client, url, case)) as events:
        async for event in events:
            if isinstance(event, tuple):
                return event
            count += 1
            if event["type"] == "error":
                return 200, json.dumps(event)
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
            if case.leave_early and count >= 4:
                return None
    if final is None:
        answer = Answer()
        answer.finish[-1] = "no final event"
        return answer
    answer = response_answer(final)
    if "".join(deltas) != answer.texts[0]:
        answer.finish[-1] = f"deltas {''.join(deltas)!r} against the final text {answer.texts[0]!r}"
    return answer


def problems_of(case: Case, answer: Answer) -> list[str]:
    if case.path == "/v1/responses":
        return response_problems(case, answer)
    body, found = case.body, []
    want = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) and body["prompt"]
                               and isinstance(body["prompt"][0], list) else 1)
    if sorted(answer.finish) != list(range(want)):
        found.append(f"finish reasons {answer.finish} for {want} choices")
    if body.get("stream") and "messages" in body and set(answer.roles.values()) != {1}:
        found.append(f"role chunks per choice: {answer.roles}")
    for i, text in answer.texts.items():
        finish, ids = answer.finish.get(i), answer.token_ids.get(i, [])
        if finish not in ("stop", "length", "tool_calls"):
            found.append(f"choice {i}: finish {finish!r}")
        if finish == "length" and len(ids) != body["max_tokens"]:
            found.append(f"choice {i}: finish 'length' after {len(ids)} of max_tokens={body['max_tokens']}")
        if case.constraint and finish == "stop" and not constrained_text_ok(case.constraint, text):
            found.append(f"choice {i}: {case.constraint} text {text!r}")
        if case.tool_choice not in (None, "auto") and finish != "length":
            found.extend(f"choice {i}: {p}" for p in calls_problems(case.tool_choice, answer.calls.get(i, [])))
    if answer.usage is not None and not case.beam:
        if answer.usage["completion_tokens"] != sum(len(ids) for ids in answer.token_ids.values()):
            found.append(f"usage {answer.usage} against the tokens returned")
    return found


def response_problems(case: Case, answer: Answer) -> list[str]:
    """A Response: one finish (completed or incomplete), usage as many tokens as asked when cut,
    a schema's text parses, a forced call is there with JSON arguments."""
    found, finish, usage = [], answer.finish, answer.usage or {}
    if list(finish) != [0] or finish[0] not in ("stop", "length", "tool_calls"):
        found.append(f"response finish {finish}")
    if finish.get(0) == "length" and usage.get("output_tokens") != case.body["max_output_tokens"]:
        found.append(f"incomplete after {usage.get('output_tokens')} of {case.body['max_output_tokens']} tokens")
    if case.constraint and finish.get(0) == "stop" and not constrained_text_ok(case.constraint, answer.texts[0]):
        found.append(f"json_schema text {answer.texts[0]!r}")
    if case.tool_choice and finish.get(0) != "length":
        found += calls_problems(case.tool_choice, answer.calls.get(0, []))
    return found


def calls_problems(tool_choice: object, calls: list[dict]) -> list[str]:
    """The calls a forced ``tool_choice`` asked for are there (a named tool's alone), each with
    arguments that parse as JSON."""
    found = []
    if not calls or (isinstance(tool_choice, dict) and {call["function"]["name"] for call in calls} != {"add"}):
        found.append(f"tool_choice {tool_choice} gave calls {calls}")
    for call in calls:
        try:
            json.loads(call["function"]["arguments"])
        except ValueError:
            found.append(f"arguments {call['function']['arguments']!r} are not JSON")
    return found


def constrained_text_ok(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 8 and type(value["age"]) is int and 0 <= value["age"] <= 120)


def fits_shared(case: Case, kv_tokens: int, block_size: int) -> bool:
    """Whether the request surely fits ``kv_tokens`` of KV cache with its sequences sharing the prompt (the
    byte tokenizer: a token per byte; a chat template adds under 64, and its tools' JSON twice at
    most): a refusal is then wrong."""
    body = case.body
    if "input" in body:
        prompt = len(body["input"].encode()) + 80
    elif "messages" in body:
        prompt = sum(len(m["content"].encode()) for m in body["messages"]) + 64
    else:
        prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].encode()) + 1
    width = max(body.get("n", 1), body.get("best_of", 1))
    prompt += 2 * len(json.dumps(body.get("tools", [])).encode())
    max_tokens = body.get("max_tokens", body.get("max_output_tokens"))
    blocks = -(-prompt // block_size) + width * (-(-max_tokens // block_size) + 1)
    return blocks * block_size <= kv_tokens


async def soak(url: str, cases: list[Case], clients: int, kv_tokens: int, block_size: int) -> tuple[list, list, dict]:
    problems, greedy, counts = [], [], {"answered": 0, "left early": 0, "too large for the KV cache": 0}
    queue = list(enumerate(cases))

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            while queue:
                i, case = queue.pop(0)
                tag = f"request {i}: {case.path} {json.dumps(case.body, ensure_ascii=False)[:300]}"
                try:
                    answer = await send(client, url, case)
                except (httpx.HTTPError, ValueError) as err:
                    problems.append(f"{tag}: {err!r}")
                    continue
                if answer is None:
                    counts["left early"] += 1
                elif isinstance(answer, tuple):
                    status, text = answer
                    unfit = any(why in text for why in UNFIT)
                    if status == 400 and unfit and not fits_shared(case, kv_tokens, block_size):
                        counts["too large for the KV cache"] += 1
                    else:
                        problems.append(f"{tag}: {status} {text[:300]}")
                else:
                    counts["answered"] += 1
                    problems.extend(f"{tag}: {p}" for p in problems_of(case, answer))
                    if case.plain_greedy and answer.token_ids:
                        greedy.append((case, answer.token_ids[0]))

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return problems, greedy, counts


def idle_problems(url: str) -> list[str]:
    """The server is idle and every KV block free (a moment after the last answer)."""
    time.sleep(2)
    metrics = httpx.get(url + "/metrics").text
    found = []
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:kv_cache_usage_perc"):
        value = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)", metrics, re.M)
        if value is None or float(value.group(1)) != 0:
            found.append(f"after the soak {name} is {value and value.group(1)}")
    preemptions = re.search(r"^vllm:num_preemptions_total{[^}]*} (\S+)", metrics, re.M)
    print(f"preemptions: {preemptions and preemptions.group(1)}")
    return found


def greedy_problems(greedy: list[tuple[Case, list[int]]], model_path: str | None) -> list[str]:
    """Greedy answers against an in-process engine on the same model (near ties allowed)."""
    from hf_paged import LLM, SamplingParams
    from hf_paged.demo import byte_tokenizer, demo_model

    if model_path is None:
        model, tokenizer = demo_model(), byte_tokenizer()
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    llm, found = LLM(model, tokenizer), []
    for case, got in greedy:
        body = case.body
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], stop=body.get("stop") or [],
                                min_tokens=body.get("min_tokens", 0), ignore_eos=body.get("ignore_eos", False),
                                logprobs=2)
        if "messages" in body:
            ref = llm.chat(body["messages"], params, use_tqdm=False)[0].outputs[0]
        else:
            prompt = body["prompt"]
            ref = llm.generate([{"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt], params,
                               use_tqdm=False)[0].outputs[0]
        want = list(ref.token_ids)
        step = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if got == want or (step is not None and got[step] in ref.logprobs[step]
                           and abs(ref.logprobs[step][got[step]].logprob - ref.logprobs[step][want[step]].logprob)
                           < 1e-4):
            continue
        found.append(f"greedy {json.dumps(body, ensure_ascii=False)[:200]}: served {got[:20]}, engine {want[:20]}")
    print(f"greedy answers compared with the engine: {len(greedy)}")
    return found


def serve_options(options: list[str]) -> argparse.Namespace:
    """What the soak needs to know of the server's options: its model, block size and block budget."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int)
    return parser.parse_known_args(options)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("serve_options", nargs="*", help="after --: options of hf-paged serve")
    args = parser.parse_args()
    rng, options = random.Random(args.seed), args.serve_options or SERVE_DEFAULTS
    served = serve_options(options)
    priorities = "--scheduling-policy=priority" in options or "priority" in options[1:] and \
        options[options.index("priority") - 1] == "--scheduling-policy"
    cases = [draw(random.Random(rng.getrandbits(32)), priorities) for _ in range(args.requests)]
    port = free_port()
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--device", "cpu", "--port", str(port), *options]
    start = time.monotonic()
    log = Path(tempfile.gettempdir()) / "hf_paged_server_soak.log"
    print(f"server log: {log}")
    with LocalServer(cmd, port, name="hf-paged serve", log_path=log) as server:
        kv_tokens = served.num_blocks * served.block_size if served.num_blocks else 0  # (per layer group)
        problems, greedy, counts = asyncio.run(soak(server.url, cases, args.clients, kv_tokens, served.block_size))
        print(f"{args.requests} requests from {args.clients} clients in {time.monotonic() - start:.0f} s: {counts}")
        problems += idle_problems(server.url)
    problems += greedy_problems(greedy, served.model)
    print(f"{len(problems)} problems")
    for problem in problems:
        print(" -", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
