"""``generate()`` with the flag against stock ``generate()``: same model, same calls, side by side.

    python -m hf_paged.bench.generate_speed [--rounds 5] [--device cpu] [--dtype float32]

A random Llama, 4 layers x 256 hidden and LlamaConfig's defaults otherwise (32 heads, 32 KV heads,
MLP 11008, vocabulary 32000), is copied: one
copy stays stock, the other is enabled. Each workload runs on both copies, alternating which goes
first, for ``rounds`` rounds; the report is stock time / flag time per round and its median (> 1:
the flag is faster). Every call's sequences are compared too (they must be identical).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

NEW_TOKENS = 96


@dataclass
class Case:
    name: str
    lengths: list[int]  # prompt lengths of the batch (left-padded)
    options: dict = field(default_factory=dict)


def cases(scale: float = 1.0) -> tuple[Case, ...]:
    """The workloads, prompts ``scale`` times as long (a quick run shrinks them)."""
    def n(length: int) -> int:
        return max(1, round(length * scale))

    padded = [n(x) for x in (40, 77, 114, 151, 188, 225, 262, 300)]
    return (
        Case(f"batch 1, {n(300)}-token prompt", [n(300)]),
        Case(f"batch 8, left-padded {padded[0]}-{padded[-1]}", padded),
        Case(f"beam 4, {n(300)}-token prompt", [n(300)], {"num_beams": 4}),
        Case(f"sampling n=4, {n(200)}-token prompt", [n(200)], {"do_sample": True, "num_return_sequences": 4}),
        Case(f"beam 8, {n(1000)}-token prompt", [n(1000)], {"num_beams": 8}),
    )


CASES = cases()


def speed_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=256, num_hidden_layers=4, max_position_embeddings=4096, initializer_range=0.1,
                         pad_token_id=0, eos_token_id=2, bos_token_id=1)  # the rest: LlamaConfig's defaults
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _inputs(case: Case, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(len(case.lengths) * 1000 + max(case.lengths))
    width = max(case.lengths)
    ids = torch.zeros(len(case.lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(case.lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def _timed(model, case: Case, ids, mask, paged: bool, new_tokens: int) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "eos_token_id": None, "pad_token_id": 0,
              "do_sample": False, **case.options}
    if paged:
        kwargs["cache_implementation"] = "hf_paged"
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run(rounds: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32, cases=CASES, log=print,
        new_tokens: int = NEW_TOKENS) -> dict:
    """Per case: stock / flag time in each round, the median, and whether every sequence matched."""
    import hf_paged

    stock = speed_model(device, dtype)
    paged = hf_paged.enable(copy.deepcopy(stock))
    vocab = stock.config.vocab_size
    results = {}
    for case in cases:
        ids, mask = _inputs(case, vocab, device)
        for model, is_paged in ((stock, False), (paged, True)):  # untimed warm-up
            _timed(model, case, ids, mask, is_paged, new_tokens)
        ratios, identical = [], True
        for r in range(rounds):
            order = ((stock, False), (paged, True)) if r % 2 == 0 else ((paged, True), (stock, False))
            times, outs = {}, {}
            for model, is_paged in order:
                times[is_paged], outs[is_paged] = _timed(model, case, ids, mask, is_paged, new_tokens)
            ratios.append(times[False] / times[True])
            identical &= torch.equal(outs[False], outs[True])
        results[case.name] = {"stock_over_flag_per_round": ratios, "median": statistics.median(ratios),
                              "sequences_identical": identical, "new_tokens": new_tokens}
        log(f"  {case.name:<32} stock / flag: median {statistics.median(ratios):.2f}x "
            f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}), identical: {identical}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--only", help="run the cases whose name contains this text")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    results = run(args.rounds, args.device, getattr(torch, args.dtype), cases)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if all(r["sequences_identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
