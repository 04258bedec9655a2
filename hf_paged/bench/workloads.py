"""Benchmark workloads from fixed seeds, shaped like the paper's datasets and scaled to the machine.

ShareGPT-like: long-tailed (log-normal) prompt and output lengths with the paper's means 161.31 /
337.99 tokens; Alpaca-like: 19.31 / 58.45. ``scale`` shrinks lengths for a small CPU. Shared
prefixes model one-shot and five-shot prompts. Arrivals are offline (all at t=0) or Poisson.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
SIGMA = {"sharegpt": 0.9, "alpaca": 0.6}  # spread of log(length); ShareGPT's tail is longer


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0  # seconds after the start
    n: int = 1
    num_beams: int = 1


@dataclass
class Workload:
    name: str
    requests: list[Request] = field(default_factory=list)

    @property
    def mean_prompt(self) -> float:
        return sum(len(r.prompt) for r in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(r.max_new_tokens for r in self.requests) / len(self.requests)


def _lognormal_int(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma**2 / 2  # so that the mean of the distribution is `mean`
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def dataset(kind: str, num: int, *, scale: float = 0.25, vocab: int = 259, max_len: int = 1024,
            seed: int = 0) -> Workload:
    """``num`` requests with ShareGPT-like or Alpaca-like lengths times ``scale``."""
    if kind not in PAPER_MEANS:
        raise ValueError(f"unknown dataset {kind!r}: one of {sorted(PAPER_MEANS)}")
    rng = random.Random(seed)
    mean_in, mean_out = (m * scale for m in PAPER_MEANS[kind])
    sigma = SIGMA[kind]
    requests = []
    for _ in range(num):
        prompt_len = _lognormal_int(rng, mean_in, sigma, 1, max_len // 2)
        output_len = _lognormal_int(rng, mean_out, sigma, 1, max_len - prompt_len)
        requests.append(Request(_tokens(rng, prompt_len, vocab), output_len))
    return Workload(f"{kind}-like x{scale:g}", requests)


def shared_prefix(num: int, shots: int, *, shot_len: int = 80, scale: float = 1.0, vocab: int = 259,
                  seed: int = 0) -> Workload:
    """Alpaca-like requests behind one common few-shot prefix (``shots`` examples of ``shot_len``)."""
    rng = random.Random(seed + 1000 * shots)
    prefix = _tokens(rng, shots * shot_len, vocab)
    base = dataset("alpaca", num, scale=scale, vocab=vocab, seed=seed)
    for r in base.requests:
        r.prompt = prefix + r.prompt
    base.name = f"{shots}-shot prefix ({len(prefix)} tokens) + alpaca-like"
    return base


def with_sampling(workload: Workload, *, n: int = 1, num_beams: int = 1) -> Workload:
    reqs = [Request(r.prompt, r.max_new_tokens, r.arrival, n=n, num_beams=num_beams) for r in workload.requests]
    suffix = f"beam search width {num_beams}" if num_beams > 1 else f"parallel sampling n={n}"
    return Workload(f"{workload.name}, {suffix}", reqs)


def poisson(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """The same requests arriving as a Poisson process of ``rate`` requests per second."""
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    for r in workload.requests:
        t += rng.expovariate(rate)
        reqs.append(Request(r.prompt, r.max_new_tokens, t, r.n, r.num_beams))
    return Workload(f"{workload.name} @ {rate:g} req/s", reqs)
