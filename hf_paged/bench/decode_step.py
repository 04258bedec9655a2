"""What an engine decode step costs against a plain forward (``python -m hf_paged.bench.decode_step``).

Issue 22's target: an ``LLMEngine`` decode step at 64 sequences (schedule, forward and token choice:
all of ``engine.step()``) within 1.15x a plain ``[64, 1]`` forward of the same weights with a stock
``DynamicCache`` holding the same context lengths (left-padded, with its attention mask). Both sides
run in this process, interleaved, on the issue's 19M-parameter Llama; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings

import torch
import transformers

from hf_paged.model_info import cache_kwarg

# The benchmark model: a random-init 19M-parameter Llama.
LLAMA_19M = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.05)


def llama_19m(seed: int = 0, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The issue's benchmark model (random weights, eval mode, EOS off)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_19M)).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompts(num: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


@torch.inference_mode()
def engine_decode_steps(model, prompts: list[list[int]], steps: int, **engine_kwargs) -> list[float]:
    """Seconds per ``engine.step()`` once every sequence decodes (prefills are done first)."""
    from hf_paged import LLMEngine, SamplingParams

    engine = LLMEngine(model, **engine_kwargs)
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for r in engine.scheduler.running for s in r.live_seqs) \
            or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return times


@torch.inference_mode()
def plain_decode_steps(model, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds per ``[rows, 1]`` forward with a left-padded ``DynamicCache`` of the prompts."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = (torch.arange(longest)[None] >= torch.tensor([longest - len(p) for p in prompts])[:, None]).long()
    cache = transformers.DynamicCache(config=model.config)
    keyword = cache_kwarg(model)  # the cache's keyword in this transformers: no deprecation warning
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{keyword: cache})
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    positions = mask.sum(-1, keepdim=True)
    times = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        start = time.perf_counter()
        out = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **{keyword: cache})
        times.append(time.perf_counter() - start)
        token, positions = out.logits[:, -1].argmax(-1, keepdim=True), positions + 1
    return times


def run(num_seqs: int = 64, low: int = 16, high: int = 512, steps: int = 32, rounds: int = 3,
        threads: int | None = None, log=print) -> dict:
    if threads:
        torch.set_num_threads(threads)
    model = llama_19m()
    prompts = _prompts(num_seqs, low, high, model.config.vocab_size)
    engine_kwargs = dict(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)
    engine_runs, plain_runs = [], []
    for round_ in range(rounds):
        engine_runs.append(statistics.median(engine_decode_steps(model, prompts, steps, **engine_kwargs)))
        plain_runs.append(statistics.median(plain_decode_steps(model, prompts, steps)))
        log(f"  round {round_ + 1}: engine step {engine_runs[-1] * 1e3:.2f} ms, plain [{num_seqs}, 1] forward "
            f"{plain_runs[-1] * 1e3:.2f} ms, ratio {engine_runs[-1] / plain_runs[-1]:.3f}")
    ratios = [e / p for e, p in zip(engine_runs, plain_runs)]
    result = {"num_seqs": num_seqs, "prompt_lengths": [low, high], "steps": steps, "threads": torch.get_num_threads(),
              "engine_step_ms": statistics.median(engine_runs) * 1e3,
              "plain_forward_ms": statistics.median(plain_runs) * 1e3,
              "ratio": statistics.median(ratios), "ratio_per_round": ratios,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    log(f"engine decode step / plain forward: {result['ratio']:.3f} (median of {rounds} rounds)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", help="write the result as JSON")
    args = parser.parse_args(argv)
    result = run(args.num_seqs, steps=args.steps, rounds=args.rounds, threads=args.threads)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
