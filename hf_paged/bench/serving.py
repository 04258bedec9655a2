"""What HTTP costs: ``hf-paged serve`` against the in-process ``LLMEngine`` on the same model and
requests (``python -m hf_paged.bench.serving``).

Both run a closed loop of ``--concurrency`` clients (32): each sends its next request when the
last one is answered. The engine side adds requests to one engine and steps it; the server side
is ``python -m hf_paged serve`` in a subprocess driven by asyncio ``httpx`` clients in this one
(so the clients' own work does not share the server's interpreter). Rounds alternate the two,
each round with new prompts (the prefix cache would otherwise serve a repeat), and medians are
reported: throughput (generated tokens / wall time), request latency p50/p99, time to first
token p50/p99 (streamed requests) and, separately, the added latency of one tiny request alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_paged.bench import workloads
from hf_paged.bench.local_server import LocalServer, free_port
from hf_paged.bench.optional import MissingDependency, require

ENGINE_ARGS = dict(block_size=16, num_blocks=4096, max_num_batched_tokens=512, max_num_seqs=256)


@dataclass
class Run:
    """One system's pass over a workload."""

    wall_s: float
    tokens: list[list[int]]
    latency_s: list[float]
    ttft_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        generated = sum(map(len, self.tokens))
        out = {"wall_s": self.wall_s, "generated_tokens": generated, "tokens_per_s": generated / self.wall_s,
               "requests_per_s": len(self.tokens) / self.wall_s, **_percentiles("latency_s", self.latency_s)}
        return {**out, **_percentiles("ttft_s", self.ttft_s)} if self.ttft_s else out


def _percentiles(name: str, values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {f"{name}_p50": pick(0.5), f"{name}_p99": pick(0.99)}


# ---------------------------------------------------------------------------- the in-process engine
def engine_closed_loop(engine, requests: list[workloads.Request], concurrency: int) -> Run:
    """``concurrency`` requests in flight at once in one engine, refilled as they finish."""
    from hf_paged import SamplingParams

    todo = list(range(len(requests)))[::-1]
    inflight: dict[str, tuple[int, float]] = {}
    first: dict[str, float] = {}
    tokens, latency, ttft = [None] * len(requests), [0.0] * len(requests), [0.0] * len(requests)
    start = time.perf_counter()
    while todo or inflight:
        while todo and len(inflight) < concurrency:
            i = todo.pop()
            params = SamplingParams(max_new_tokens=requests[i].max_new_tokens, temperature=0, ignore_eos=True)
            inflight[engine.add_request(requests[i].prompt, params)] = (i, time.perf_counter())
        for out in engine.step():
            i, t0 = inflight[out.request_id]
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
                ttft[i] = now - t0
            if out.finished:
                del inflight[out.request_id]
                tokens[i], latency[i] = out.outputs[0].token_ids, now - t0
    return Run(time.perf_counter() - start, tokens, latency, ttft)


# ---------------------------------------------------------------------------- the server
async def _http_request(client, url: str, r: workloads.Request, stream: bool,
                        model: str) -> tuple[list[int], float, float]:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_new_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        resp = await client.post(url, json=body)
        resp.raise_for_status()
        return resp.json()["choices"][0]["token_ids"], time.perf_counter() - t0, 0.0
    tokens, ttft = [], 0.0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            new = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if new and not tokens:
                ttft = time.perf_counter() - t0
            tokens += new
    return tokens, time.perf_counter() - t0, ttft


async def http_closed_loop(base_url: str, requests: list[workloads.Request], concurrency: int,
                           stream: bool = False, model: str = "hf-paged-demo") -> Run:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    import httpx

    todo = list(range(len(requests)))[::-1]
    tokens, latency, ttft = [None] * len(requests), [0.0] * len(requests), [0.0] * len(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while todo:
                i = todo.pop()
                tokens[i], latency[i], ttft[i] = await _http_request(client, base_url + "/v1/completions",
                                                                     requests[i], stream, model)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return Run(wall, tokens, latency, ttft if stream else [])


class ServerProcess(LocalServer):
    """``python -m hf_paged serve`` on a free loopback port with the engine settings of the bench
    (started in ``__enter__``, never left behind: :class:`~hf_paged.bench.local_server.LocalServer`)."""

    def __init__(self, threads: int):
        port = free_port()
        cmd = [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--device", "cpu",
               "--block-size", str(ENGINE_ARGS["block_size"]), "--num-blocks", str(ENGINE_ARGS["num_blocks"]),
               "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
               "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]), "--max-waiting", "100000"]
        super().__init__(cmd, port, name="hf-paged serve", env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                         start_timeout=180, stop_timeout=30)


# ---------------------------------------------------------------------------- the comparison
def _single_request_latency(engine, url: str, repeats: int) -> dict:
    """One 8-token prompt, one new token, nothing else in flight: the cost of the HTTP round trip."""
    tiny = [workloads.Request([65 + i % 26 for i in range(8 + k % 3)], 1) for k in range(repeats)]
    in_process = [engine_closed_loop(engine, [r], 1).latency_s[0] for r in tiny]
    served = [asyncio.run(http_closed_loop(url, [r], 1)).latency_s[0] for r in tiny]
    p_engine, p_server = statistics.median(in_process), statistics.median(served)
    return {"engine_p50_ms": 1e3 * p_engine, "server_p50_ms": 1e3 * p_server,
            "http_overhead_ms": 1e3 * (p_server - p_engine)}


def run(*, num_requests: int = 256, concurrency: int = 32, scale: float = 0.25, rounds: int = 3, threads: int = 1,
        log=print) -> dict:
    """Closed-loop clients against the server and the in-process engine, ``rounds`` interleaved rounds
    (:class:`~hf_paged.bench.optional.MissingDependency` before anything starts without httpx)."""
    require("the serving benchmark", "httpx")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(num_requests, concurrency, scale, rounds, threads, log)
    finally:
        torch.set_num_threads(before)


def _run(num_requests: int, concurrency: int, scale: float, rounds: int, threads: int, log) -> dict:
    from hf_paged import LLMEngine
    from hf_paged.demo import byte_tokenizer, demo_model

    engine = LLMEngine(demo_model(), byte_tokenizer(), **ENGINE_ARGS)
    runs: dict[str, list[Run]] = {"engine": [], "server": [], "server_streaming": []}
    mismatches = 0
    with ServerProcess(threads) as server:
        warm = workloads.dataset("sharegpt", 16, scale=scale, seed=99).requests
        engine_closed_loop(engine, warm, concurrency)
        asyncio.run(http_closed_loop(server.url, warm, concurrency))
        for r in range(rounds):
            requests = workloads.dataset("sharegpt", num_requests, scale=scale, seed=r).requests
            streamed = workloads.dataset("sharegpt", num_requests, scale=scale, seed=1000 + r).requests
            order = ["engine", "server"] if r % 2 == 0 else ["server", "engine"]
            for name in order:
                if name == "engine":
                    runs[name].append(engine_closed_loop(engine, requests, concurrency))
                else:
                    runs[name].append(asyncio.run(http_closed_loop(server.url, requests, concurrency)))
                log(f"  round {r + 1}: {name:<8} {runs[name][-1].summary()['tokens_per_s']:8.1f} tok/s")
            mismatches += sum(a != b for a, b in zip(runs["engine"][-1].tokens, runs["server"][-1].tokens))
            runs["server_streaming"].append(asyncio.run(http_closed_loop(server.url, streamed, concurrency, True)))
        single = _single_request_latency(engine, server.url, repeats=30)
    medians = {name: _median_run(rs) for name, rs in runs.items()}
    ratio = medians["server"]["tokens_per_s"] / medians["engine"]["tokens_per_s"]
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "settings": {"num_requests": num_requests, "concurrency": concurrency, "scale": scale, "rounds": rounds,
                     "torch_threads": threads, "engine": ENGINE_ARGS, "model": "built-in demo (4 layers, 256 hidden)",
                     "workload": "ShareGPT-like lengths (bench.workloads), greedy, ignore_eos"},
        "systems": medians,
        "server_vs_engine_throughput": ratio,
        "server_vs_engine_throughput_per_round": [s.summary()["tokens_per_s"] / e.summary()["tokens_per_s"]
                                                  for s, e in zip(runs["server"], runs["engine"])],
        "token_mismatches_server_vs_engine": mismatches,
        "single_request": single,
    }


def _median_run(runs: list[Run]) -> dict:
    summaries = [r.summary() for r in runs]
    best = sorted(summaries, key=lambda s: s["tokens_per_s"])[len(summaries) // 2]
    return {**best, "tokens_per_s_all_rounds": [s["tokens_per_s"] for s in summaries]}


def report(results: dict) -> str:
    lines = ["| system | tok/s | req/s | latency p50 | latency p99 | TTFT p50 | TTFT p99 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in results["systems"].items():
        ttft = (f"{s['ttft_s_p50']:.3f} s | {s['ttft_s_p99']:.3f} s" if "ttft_s_p50" in s else "- | -")
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {s['requests_per_s']:.2f} | {s['latency_s_p50']:.2f} s | "
                     f"{s['latency_s_p99']:.2f} s | {ttft} |")
    single = results["single_request"]
    lines += ["", f"server / engine throughput: {results['server_vs_engine_throughput']:.3f} "
                  f"(per round {[round(x, 3) for x in results['server_vs_engine_throughput_per_round']]}); "
                  f"token mismatches: {results['token_mismatches_server_vs_engine']}",
              f"one tiny request alone: engine {single['engine_p50_ms']:.1f} ms, "
              f"server {single['server_p50_ms']:.1f} ms "
              f"(HTTP adds {single['http_overhead_ms']:.1f} ms)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged.bench.serving",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--scale", type=float, default=0.25, help="length scale of the ShareGPT-like workload")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--out", default="benchmarks/out", help="where serving.json goes")
    args = parser.parse_args(argv)
    try:
        results = run(num_requests=args.num_requests, concurrency=args.concurrency, scale=args.scale,
                      rounds=args.rounds, threads=args.threads)
    except MissingDependency as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
