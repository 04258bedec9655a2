"""The systems compared, each run on the same model and requests, with one clock model.

Time is simulated around real work: a system starts work no earlier than the arrival of what it
works on, idles by jumping the clock to the next arrival (no sleeping), and every piece of work
advances the clock by its measured wall time. Offline runs have all arrivals at 0.

* ``padded_generate``: stock ``model.generate()`` in left-padded batches, static batching as a
  server would do it: when free, it takes up to ``batch_size`` requests that have arrived (or waits
  for the next one), and a batch runs until its longest request is done;
* ``paged_generate``: the same batches with ``cache_implementation="hf_paged"``;
* ``transformers_cb``: transformers' continuous batching manager (offline only: it runs its own
  thread in real time);
* ``engine``: ``hf_paged.LLMEngine``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hf_paged.bench.workloads import Workload
from hf_paged.model_info import kv_bytes_per_token


@dataclass
class RunResult:
    system: str
    wall_s: float
    tokens: list[list[int]]  # generated tokens of each request (first sample), in workload order
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    latency: list[float] = field(default_factory=list)  # arrival to last token, per request
    peak_kv_bytes: int | None = None
    max_running: int | None = 0  # None: the system does not say
    extra: dict = field(default_factory=dict)

    def summary(self, workload: Workload) -> dict:
        generated = sum(len(t) for t in self.tokens)
        out = {"system": self.system, "wall_s": round(self.wall_s, 3),
               "requests_per_s": len(self.tokens) / self.wall_s, "tokens_per_s": generated / self.wall_s,
               "generated_tokens": generated, "peak_kv_bytes": self.peak_kv_bytes, "max_running": self.max_running}
        for name, values in (("ttft_s", self.ttft), ("latency_s", self.latency)):
            if values:
                out.update({f"{name}_p{p}": _percentile(values, p) for p in (50, 90, 99)})
        if self.latency:
            per_token = [lat / max(1, len(t)) for lat, t in zip(self.latency, self.tokens)]
            out["normalized_latency_s_per_token"] = sum(per_token) / len(per_token)  # the paper's Figure 12
            out.update({f"normalized_latency_s_p{p}": _percentile(per_token, p) for p in (50, 90, 99)})
            # time per output token after the first (inter-token latency)
            tpot = [(lat - first) / (len(t) - 1) for lat, first, t in zip(self.latency, self.ttft, self.tokens)
                    if len(t) > 1]
            if tpot and len(self.ttft) == len(self.latency):
                out.update({f"tpot_s_p{p}": _percentile(tpot, p) for p in (50, 90, 99)})
        out.update(self.extra)
        return out


def _percentile(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class _Timestamps:
    """A generate() streamer that records when each step's tokens came out."""

    def __init__(self, clock):
        self.clock, self.times = clock, []

    def put(self, value):
        self.times.append(self.clock())

    def end(self):
        pass


def _kv_bytes_per_token(model) -> int:
    return kv_bytes_per_token(model.config.get_text_config(decoder=True), model.dtype)


@torch.inference_mode()
def batched_generate(model, workload: Workload, batch_size: int, paged: bool) -> RunResult:
    """Stock (or flagged) generate() in left-padded batches of ``batch_size``, in arrival order.
    Requests with ``n > 1`` sample (temperature 0.8, ``num_return_sequences``); with ``num_beams > 1``
    they run beam search (no streamer there, so no latencies)."""
    import hf_paged

    if paged:
        hf_paged.enable(model)
    else:
        hf_paged.disable(model)
    pad = model.generation_config.pad_token_id or 0
    reqs = workload.requests
    clock, start_wall = 0.0, time.perf_counter()
    tokens, ttft, latency = [None] * len(reqs), [0.0] * len(reqs), [0.0] * len(reqs)
    peak = 0
    per_token = _kv_bytes_per_token(model)
    lo = 0
    while lo < len(reqs):
        # When free, take what has arrived (up to batch_size); when nothing has, wait for the next one.
        clock = max(clock, reqs[lo].arrival)
        hi = lo + 1
        while hi < min(lo + batch_size, len(reqs)) and reqs[hi].arrival <= clock:
            hi += 1
        batch = reqs[lo:hi]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        max_new = max(r.max_new_tokens for r in batch)
        n, beams = max(r.n for r in batch), max(r.num_beams for r in batch)
        t0 = time.perf_counter()
        stamps = _Timestamps(lambda: time.perf_counter() - t0)
        kwargs = {"cache_implementation": "hf_paged", "return_dict_in_generate": True} if paged else {}
        if beams > 1:
            kwargs.update(num_beams=beams, do_sample=False)
        elif n > 1:
            kwargs.update(num_return_sequences=n, do_sample=True, temperature=0.8, top_k=0, streamer=stamps)
        else:
            kwargs.update(do_sample=False, streamer=stamps)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=max_new, min_new_tokens=max_new, eos_token_id=None, pad_token_id=pad,
                             **kwargs)
        elapsed = time.perf_counter() - t0
        sequences = out.sequences if paged else out
        if paged:
            stats = (getattr(out, "cache", None) or out.past_key_values).stats()
            peak = max(peak, stats["blocks_peak"] * stats["block_size"] * per_token)
            (getattr(out, "cache", None) or out.past_key_values).release()
        else:
            peak = max(peak, len(batch) * max(n, beams) * (width + max_new - 1) * per_token)
        step = n if beams == 1 else 1  # rows of one request in `sequences`
        for i, r in enumerate(batch):
            tokens[lo + i] = sequences[i * step, width : width + r.max_new_tokens].tolist()
            if stamps.times:
                ttft[lo + i] = clock + stamps.times[1] - r.arrival  # times[0]: the prompt itself
                latency[lo + i] = clock + stamps.times[min(r.max_new_tokens, len(stamps.times) - 1)] - r.arrival
        clock += elapsed
        lo = hi
    hf_paged.disable(model)
    wall = time.perf_counter() - start_wall
    if any(r.num_beams > 1 for r in reqs):
        ttft, latency = [], []
    return RunResult("paged_generate" if paged else "padded_generate", max(clock, 1e-9) if workload_is_online(workload)
                     else wall, tokens, ttft, latency, peak, batch_size)


def workload_is_online(workload: Workload) -> bool:
    return any(r.arrival > 0 for r in workload.requests)


@torch.inference_mode()
def engine_run(model, workload: Workload, per_sequence: bool = False, **engine_kwargs) -> RunResult:
    """``LLMEngine`` with requests added as they arrive (simulated clock, see the module doc).
    ``per_sequence``: run the steps in the row layout of models with recurrent layers (each
    sequence its own batch row, :mod:`hf_paged.engine.model_runner`), to measure what it costs."""
    from hf_paged import LLMEngine, SamplingParams

    engine = LLMEngine(model, **engine_kwargs)
    engine.runner.per_sequence = engine.runner.per_sequence or per_sequence
    reqs = sorted(enumerate(workload.requests), key=lambda x: x[1].arrival)
    clock, start_wall, nxt = 0.0, time.perf_counter(), 0
    ids: dict[str, int] = {}
    tokens, ttft, latency = [None] * len(reqs), [0.0] * len(reqs), [0.0] * len(reqs)
    first: dict[str, float] = {}
    peak_blocks = max_running = 0
    per_block = _kv_bytes_per_token(model) * engine.kv.block_size
    while nxt < len(reqs) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and reqs[nxt][1].arrival > clock:
            clock = reqs[nxt][1].arrival  # idle: jump to the next arrival
        while nxt < len(reqs) and reqs[nxt][1].arrival <= clock:
            index, r = reqs[nxt]
            sampled = r.n > 1 and r.num_beams == 1  # parallel sampling; otherwise greedy or beam search
            params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.8 if sampled else 0,
                                    seed=index if sampled else None, ignore_eos=True, n=r.n, num_beams=r.num_beams)
            ids[engine.add_request(r.prompt, params)] = index
            nxt += 1
        t0 = time.perf_counter()
        outputs = engine.step()
        clock += time.perf_counter() - t0
        peak_blocks = max(peak_blocks, engine.kv.stats()["blocks_used"])
        max_running = max(max_running, sum(len(q.live_seqs) for q in engine.scheduler.running))
        for out in outputs:
            index = ids[out.request_id]
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = clock
                ttft[index] = clock - workload.requests[index].arrival
            if out.finished:
                tokens[index] = out.outputs[0].token_ids if out.outputs else []
                latency[index] = clock - workload.requests[index].arrival
    wall = time.perf_counter() - start_wall
    stats = engine.stats()
    extra = {k: stats[k] for k in ("preemptions_recompute", "preemptions_swap", "prefix_cache_hit_rate",
                                   "computed_prompt_tokens", "steps")}
    return RunResult("engine", clock if workload_is_online(workload) else wall, tokens, ttft, latency,
                     peak_blocks * per_block, max_running, extra)


@torch.inference_mode()
def transformers_cb(model, workload: Workload, *, num_blocks: int, max_batch_tokens: int) -> RunResult:
    """transformers' own continuous batching, each request with its own max_new_tokens.

    Its manager serves from its own thread in real time, so an online workload is fed in real time
    too (each request added at its arrival time, sleeping in between): this run takes as long as
    the arrivals span. Latencies come from the manager's own per-token timestamps.
    """
    import threading

    import hf_paged
    from transformers import ContinuousBatchingConfig, GenerationConfig

    hf_paged.disable(model)
    reqs = workload.requests
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in reqs),
                              eos_token_id=None, pad_token_id=model.generation_config.pad_token_id or 0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    results, failure = {}, []
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb,
                                                   warmup=False) as manager:
        start = time.perf_counter()

        def feed():
            try:
                for i, r in enumerate(reqs):
                    time.sleep(max(0.0, start + r.arrival - time.perf_counter()))
                    manager.add_request(r.prompt, request_id=str(i), max_new_tokens=r.max_new_tokens,
                                        record_timestamps=True)
            except Exception as err:  # surfaced below, in the caller's thread
                failure.append(err)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        while len(results) < len(reqs) and not failure:
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers continuous batching stalled")
            if result.is_finished():
                results[result.request_id] = result
        feeder.join()
    if failure:
        raise failure[0]
    wall = time.perf_counter() - start
    tokens = [list(results[str(i)].generated_tokens) for i in range(len(reqs))]
    ttft, latency = [], []
    for i, r in enumerate(reqs):
        stamps = results[str(i)].timestamps or []
        if stamps:
            ttft.append(stamps[0] - start - r.arrival)
            latency.append(stamps[-1] - start - r.arrival)
    if len(latency) != len(reqs):  # no per-token timestamps in this transformers version: throughput only
        ttft, latency = [], []
    return RunResult("transformers_cb", wall, tokens, ttft, latency, max_running=None)
