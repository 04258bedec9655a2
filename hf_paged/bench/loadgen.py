"""The load generator of ``python -m hf_paged.bench.vs_vllm``'s online section, run by path
(``python loadgen.py SPEC.json RESULT.json``) with hf_paged's python, beside the server it drives.

Like :mod:`hf_paged.bench.vllm_worker`, it imports no hf_paged: the package brings torch and
transformers, seconds of the CPU that the server under test is starting on; the ``openai`` client
is all it needs.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

if __package__:
    from .vllm_worker import Meter, run_child, versions
else:  # run by path: this folder is first on sys.path
    from vllm_worker import Meter, run_child, versions


def chunk_token_ids(chunk, token_pattern: str | None = None) -> list[int]:
    """The token ids a streamed completion chunk carries (vLLM's and hf_paged's ``token_ids``), or
    where it has none, those ``token_pattern`` finds in its text."""
    ids = [t for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
    if not ids and token_pattern:
        ids = [int(i) for c in chunk.choices for i in re.findall(token_pattern, c.text or "")]
    return ids


async def _stream_one(client, request: dict, sampling: dict, token_pattern: str | None = None
                      ) -> tuple[list[int], float, float]:
    """One streamed completion: its tokens, latency and time to the first token. A server that
    sends no token ids (llama.cpp's) has them read from the text with ``token_pattern`` (a regex
    whose group is the id: the benchmark model's vocabulary spells each token with its id)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model="bench", prompt=request["prompt"], max_tokens=request["max_tokens"], stream=True, **sampling,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens, ttft = [], 0.0
    async for chunk in stream:
        new = chunk_token_ids(chunk, token_pattern)
        if new and not tokens:
            ttft = time.perf_counter() - t0
        tokens += new
    return tokens, time.perf_counter() - t0, ttft


async def closed_loop(url: str, requests: list[dict], concurrency: int, sampling: dict,
                      token_pattern: str | None = None, keepalive: bool = True) -> dict:
    """``concurrency`` streaming ``openai`` clients, each sending its next request when its last one
    is answered; wall time from the first request to the last answer. ``keepalive`` False: a new
    connection per request (with llama.cpp's server, reused connections failed at 32 clients:
    "Server disconnected without sending a response")."""
    import httpx
    import openai

    n = len(requests)
    todo = list(range(n))[::-1]
    tokens, latency, ttft = [None] * n, [0.0] * n, [0.0] * n
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency if keepalive else 0)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
        async def worker() -> None:
            while todo:
                i = todo.pop()
                tokens[i], latency[i], ttft[i] = await _stream_one(client, requests[i], sampling, token_pattern)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "latency_s": latency, "ttft_s": ttft}


def loadgen(spec: dict) -> dict:
    """The load generator process: an untimed warm-up, then the timed closed loop, with the server's
    process-tree CPU time read around it (and this process's own)."""
    options = {"token_pattern": spec.get("token_pattern"), "keepalive": spec.get("keepalive", True)}
    asyncio.run(closed_loop(spec["url"], spec["warmup"], spec["concurrency"], spec["sampling"], **options))
    with Meter(spec["server_pid"], os.getpid()) as meter:
        result = asyncio.run(closed_loop(spec["url"], spec["requests"], spec["concurrency"], spec["sampling"],
                                         **options))
    return {**result, "server_cpu_s": meter.cpu_s[0], "loadgen_cpu_s": meter.cpu_s[1],
            "other_load_cores": meter.other_load_cores, "versions": versions("openai", "httpx")}


def main(argv: list[str]) -> int:
    return run_child(argv, loadgen, "python loadgen.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
