"""N-gram speculative decoding against plain decoding, side by side in one run.

    python benchmarks/speculative.py [--out FILE] [--rounds 2]

For each model (the built-in demo model, and a larger random Llama whose weights no cache holds:
hidden 1024, 8 layers, ~150M parameters) and batch size, the same greedy requests (random prompts
of 16-256 tokens, 128 new tokens, EOS ignored) run through an ``LLMEngine`` without and with
``speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}``, alternating, best of ``--rounds`` each. Random models fall into loops, so
their drafts are often taken (the acceptance is printed): read the ratios as what drafts are worth
when outputs repeat their context, not as a property of real text. Reported: output tok/s of each,
the ratio, drafts proposed and taken, and whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/ (its kernels.py)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_paged import LLMEngine, SamplingParams  # noqa: E402
from hf_paged.demo import demo_model  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def larger_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         initializer_range=0.02)
    return LlamaForCausalLM(config).eval()


def measure(model, prompts, params, config, rounds: int) -> tuple[float, list, dict]:
    engine = LLMEngine(model, speculative_config=config)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    best, outputs = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    stats = engine.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / best, [o.outputs[0].token_ids for o in outputs], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = []
    for name, build, batches in (("demo", demo_model, (1, 4, 16, 64)), ("llama-150M", larger_model, (1, 4, 16))):
        model = build()
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompts = [torch.randint(3, vocab, (int(torch.randint(16, 256, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(max(batches))]
        params = SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True)
        for batch in batches:
            plain, plain_tokens, _ = measure(model, prompts[:batch], params, None, args.rounds)
            drafted, drafted_tokens, stats = measure(model, prompts[:batch], params, NGRAM, args.rounds)
            row = {"model": name, "batch": batch, "plain_tok_s": round(plain, 1), "drafted_tok_s": round(drafted, 1),
                   "ratio": round(drafted / plain, 3), "draft_tokens": stats["spec_draft_tokens"],
                   "accepted_tokens": stats["spec_accepted_tokens"], "tokens_identical": plain_tokens == drafted_tokens}
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "config": NGRAM, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
