"""Prometheus text for ``/metrics``: the engine's own counters plus latencies the server measures.

The engine reports its queues, KV blocks, state slots, prefix-cache hits, preemptions and tokens
(``LLMEngine.stats()``); time to first token and inter-token latency are measured by the engine
loop as outputs come out of each step, so they include scheduling but not HTTP. Written by hand
(the format is a few lines) to keep ``prometheus_client`` out of the dependencies.

The main series of vLLM's server follow under vLLM's names (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ... labelled ``model_name``), so that what reads a vLLM server (an
autoscaler on its queue, an inference gateway picking the least loaded replica, a dashboard)
reads this one unchanged. With LoRA adapters served, vLLM's ``vllm:lora_requests_info`` says which
adapters the running and the waiting requests use (:func:`engine_stats` reads them in the engine).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_paged.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "hf_paged"

# engine stats key -> (metric name, type, help)
_ENGINE_METRICS = {
    "running": ("requests_running", "gauge", "Requests being computed."),
    "waiting": ("requests_waiting", "gauge", "Requests queued, not yet scheduled."),
    "swapped": ("requests_swapped", "gauge", "Requests preempted to the CPU swap pool."),
    "blocks_total": ("kv_blocks_total", "gauge", "KV blocks in the device pools (summed over layer groups)."),
    "blocks_used": ("kv_blocks_used", "gauge", "KV blocks held by sequences."),
    "blocks_free": ("kv_blocks_free", "gauge", "KV blocks that can be handed out (free or evictable cached)."),
    "blocks_cached": ("kv_blocks_cached", "gauge", "KV blocks registered in the prefix cache (held or evictable)."),
    "swap_blocks_used": ("kv_swap_blocks_used", "gauge", "CPU swap blocks in use."),
    "state_slots_total": ("state_slots_total", "gauge", "Recurrent-state slots (models with recurrent layers; 0 else)."),
    "state_slots_used": ("state_slots_used", "gauge", "Recurrent-state slots held by sequences."),
    "state_slots_free": ("state_slots_free", "gauge", "Recurrent-state slots that can be handed out."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / looked up."),
    "prefix_cache_queried_tokens": ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up."),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found cached."),
    "computed_prompt_tokens": ("prompt_tokens_computed_total", "counter", "Prompt tokens computed (hits excluded)."),
    "generated_tokens": ("generation_tokens_total", "counter", "Tokens generated."),
    "steps": ("engine_steps_total", "counter", "Engine steps that ran a forward."),
    "tokens_per_second": ("generation_tokens_per_second", "gauge", "Generated tokens per second of engine busy time."),
    "healthy": ("engine_healthy", "gauge", "1 while engine steps succeed, 0 after too many failed in a row."),
    "failed_steps": ("engine_failed_steps_total", "counter", "Engine steps that failed (their requests got errors)."),
    "spec_drafts": ("spec_drafts_total", "counter", "Speculative decoding: drafts (one per sequence and step)."),
    "spec_draft_tokens": ("spec_draft_tokens_total", "counter", "Speculative decoding: draft tokens computed."),
    "spec_accepted_tokens": ("spec_accepted_tokens_total", "counter", "Speculative decoding: draft tokens taken."),
}


def engine_stats(engine: LLMEngine) -> dict:
    """What a scrape reads where the engine runs (module-level: an engine process runs it by
    reference): ``engine.stats()``, and with LoRA on, the names of the adapters of the running
    requests and of the waiting ones (swapped out included), and ``max_loras``."""
    stats = engine.stats()
    if engine.lora is not None:
        scheduler = engine.scheduler
        stats["lora_running"] = _adapter_names(scheduler.running)
        stats["lora_waiting"] = _adapter_names([*scheduler.waiting, *scheduler.swapped])
        stats["max_loras"] = engine.lora.max_loras
    return stats


def _adapter_names(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if getattr(r, "lora_request", None) is not None})


class Histogram:
    """A cumulative Prometheus histogram (buckets are upper bounds in seconds)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, full: str | None = None, labels: str = "") -> list[str]:
        """The exposition under ``full`` (default ``hf_paged_<name>``), each sample with ``labels``
        (``'a="b"'``) too."""
        full = full or f"{PREFIX}_{self.name}"
        out = [f"# HELP {full} {self.help}", f"# TYPE {full} histogram"]
        running, before = 0, f"{labels}," if labels else ""
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            out.append(f'{full}_bucket{{{before}le="{"+Inf" if bound == float("inf") else repr(bound)}"}} {running}')
        tail = f"{{{labels}}}" if labels else ""
        return out + [f"{full}_sum{tail} {self.sum!r}", f"{full}_count{tail} {self.count}"]


class ServingMetrics:
    """What the server measures itself; written by the engine loop, read by ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds", "From arrival at the engine loop to the first token.")
        self.itl = Histogram("inter_token_latency_seconds", "Between consecutive steps that gave a request tokens.")
        self.finished: Counter[str] = Counter()  # finish reason (stop, length, abort, error) -> requests
        self.rejected: Counter[str] = Counter()  # why (invalid, overloaded) -> engine requests refused
        self.stream_timeouts = 0  # streams aborted because their client read nothing for too long

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def reject(self, why: str, count: int = 1) -> None:
        with self._lock:
            self.rejected[why] += count

    def stream_timeout(self) -> None:
        with self._lock:
            self.stream_timeouts += 1

    def render(self, engine_stats: dict, model_name: str = "hf-paged") -> str:
        """The whole exposition: engine stats first, then the server's own series, then vLLM's
        names of the main ones (labelled ``model_name``)."""
        lines = []
        for key, (name, kind, help_text) in _ENGINE_METRICS.items():
            if key in engine_stats:
                lines += _sample(name, kind, help_text, [("", engine_stats[key])])
        lines += _sample("preemptions_total", "counter", "Requests preempted, by mode.",
                         [('{mode="recompute"}', engine_stats.get("preemptions_recompute", 0)),
                          ('{mode="swap"}', engine_stats.get("preemptions_swap", 0))])
        with self._lock:
            lines += _sample("requests_finished_total", "counter",
                             "Engine requests finished, by finish reason (of their first completion).",
                             [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            lines += _sample("requests_rejected_total", "counter", "Engine requests refused before queueing.",
                             [(f'{{reason="{r}"}}', n) for r, n in sorted(self.rejected.items())])
            lines += _sample("stream_timeouts_total", "counter",
                             "Streams aborted because their client read nothing for --stream-timeout seconds.",
                             [("", self.stream_timeouts)])
            lines += self.ttft.lines() + self.itl.lines()
            lines += self._vllm_lines(engine_stats, model_name)
        return "\n".join(lines) + "\n"

    def _vllm_lines(self, stats: dict, model_name: str) -> list[str]:
        """vLLM's series (its names, types and ``model_name`` label) from the same numbers. Prompt
        tokens are those computed plus those found cached; waiting requests exclude swapped-out ones
        (``vllm:num_requests_swapped``, vLLM V0's name); the KV usage is of the device blocks."""
        label = f'model_name="{_label(model_name)}"'
        total = stats.get("blocks_total") or 0
        gauges = {"num_requests_running": ("Requests being computed.", stats.get("running", 0)),
                  "num_requests_waiting": ("Requests waiting to be scheduled.", stats.get("waiting", 0)),
                  "num_requests_swapped": ("Requests swapped out to CPU.", stats.get("swapped", 0)),
                  "kv_cache_usage_perc": ("KV-cache usage: 1 means 100 percent.",
                                          stats.get("blocks_used", 0) / total if total else 0.0)}
        counters = {
            "prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache.",
                                           stats.get("prefix_cache_queried_tokens", 0)),
            "prefix_cache_hits_total": ("Prompt tokens found in the prefix cache.",
                                        stats.get("prefix_cache_hit_tokens", 0)),
            "num_preemptions_total": ("Cumulative number of preemptions.",
                                      stats.get("preemptions_recompute", 0) + stats.get("preemptions_swap", 0)),
            "prompt_tokens_total": ("Prompt tokens processed (computed or found cached).",
                                    stats.get("computed_prompt_tokens", 0) + stats.get("prefix_cache_hit_tokens", 0)),
            "generation_tokens_total": ("Generation tokens processed.", stats.get("generated_tokens", 0)),
        }
        if stats.get("num_speculative_tokens"):  # as vLLM, only with speculative decoding on
            counters |= {"spec_decode_num_drafts_total": ("Number of spec decoding drafts.", stats["spec_drafts"]),
                         "spec_decode_num_draft_tokens_total": ("Number of draft tokens.", stats["spec_draft_tokens"]),
                         "spec_decode_num_accepted_tokens_total": ("Number of accepted tokens.",
                                                                   stats["spec_accepted_tokens"])}
        lines = []
        for kind, table in (("gauge", gauges), ("counter", counters)):
            for name, (help_text, value) in table.items():
                lines += _series(f"vllm:{name}", kind, help_text, [(f"{{{label}}}", value)])
        lines += _series("vllm:request_success_total", "counter", "Finished requests, by finish reason.",
                         [(f'{{{label},finished_reason="{r}"}}', self.finished[r])
                          for r in sorted({"stop", "length", "abort", "error", *self.finished})])
        if "max_loras" in stats:  # as vLLM: the adapters in labels, the time of the reading as the value
            adapters = (f'max_lora="{stats["max_loras"]}",'
                        f'running_lora_adapters="{_label(",".join(stats["lora_running"]))}",'
                        f'waiting_lora_adapters="{_label(",".join(stats["lora_waiting"]))}"')
            lines += _series("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                             [(f"{{{adapters}}}", time.time())])
        return lines + self.ttft.lines("vllm:time_to_first_token_seconds", label) + \
            self.itl.lines("vllm:inter_token_latency_seconds", label)


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, kind: str, help_text: str, values: list[tuple[str, float]]) -> list[str]:
    return _series(f"{PREFIX}_{name}", kind, help_text, values)


def _series(full: str, kind: str, help_text: str, values: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"] + [
        f"{full}{labels} {int(value) if isinstance(value, bool) else value!r}" for labels, value in values]
