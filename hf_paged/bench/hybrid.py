"""Hybrid models in the engine (``python -m hf_paged bench --section hybrid``, or ``python -m hf_paged.bench.hybrid``).

Two measurements, each side by side in one process, interleaved rounds, medians reported:

1. **Throughput on a Qwen3.5-like hybrid** (gated-delta linear attention in three of every four
   layers, full attention in the fourth; random weights): ``LLMEngine`` against stock
   ``generate()`` in left-padded batches of 8, on the ShareGPT-like workload (64 requests, greedy,
   EOS ignored). Greedy tokens are compared too.
2. **What the row layout costs** (each sequence its own batch row, as recurrent layers need)
   against the packed layout (one ``[1, tokens]`` row), on an attention-only model of the same
   size, where both layouts are exact and only speed differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import torch
import transformers

from hf_paged.bench import systems, workloads

QWEN35_LIKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, vocab_size=8192, max_position_embeddings=4096,
                   layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                   + ["full_attention"], linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, linear_conv_kernel_dim=4, initializer_range=0.05)


def qwen35_like(seed: int = 0) -> transformers.PreTrainedModel:
    """A Qwen3.5-like hybrid text model, random weights (float32, eval, EOS off)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN35_LIKE)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def attention_only_twin(seed: int = 0) -> transformers.PreTrainedModel:
    """A Llama of the same width, depth and vocabulary (every layer full attention)."""
    torch.manual_seed(seed)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "initializer_range")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: QWEN35_LIKE[k] for k in keys})).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _median_rounds(thunks: dict, workload, rounds: int, log) -> dict:
    runs: dict[str, list] = {name: [] for name in thunks}
    for round_ in range(rounds):
        for name, fn in thunks.items():
            runs[name].append(fn())
            log(f"  round {round_ + 1}: {name:<22} {runs[name][-1].summary(workload)['tokens_per_s']:8.1f} tok/s")
    return {name: sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2] for name, rs in runs.items()}, runs


def run(num_requests: int = 64, scale: float = 0.25, batch_size: int = 8, rounds: int = 3, log=print) -> dict:
    engine_kwargs = dict(block_size=16, max_num_batched_tokens=512, max_num_seqs=64)
    results: dict = {"settings": {"num_requests": num_requests, "scale": scale, "batch_size": batch_size,
                                  "rounds": rounds, "engine": engine_kwargs, "model": QWEN35_LIKE}}
    hybrid = qwen35_like()
    wl = workloads.dataset("sharegpt", num_requests, scale=scale, vocab=hybrid.config.vocab_size)
    warm = workloads.dataset("sharegpt", 4, scale=scale, vocab=hybrid.config.vocab_size, seed=1)
    log(f"Qwen3.5-like hybrid, ShareGPT-like: {num_requests} requests, mean prompt {wl.mean_prompt:.1f}, "
        f"mean output {wl.mean_output:.1f} tokens")
    thunks = {"padded_generate": lambda w=wl: systems.batched_generate(hybrid, w, batch_size, paged=False),
              "engine": lambda w=wl: systems.engine_run(hybrid, w, **engine_kwargs)}
    for fn in thunks.values():  # warm-up, untimed
        fn(warm)
    medians, runs = _median_rounds(thunks, wl, rounds, log)
    summaries = {k: v.summary(wl) for k, v in medians.items()}
    per_round = [e.summary(wl)["tokens_per_s"] / p.summary(wl)["tokens_per_s"]
                 for e, p in zip(runs["engine"], runs["padded_generate"])]
    results["hybrid_throughput"] = {
        "systems": summaries,
        "engine_vs_padded_generate": summaries["engine"]["tokens_per_s"] / summaries["padded_generate"]["tokens_per_s"],
        "engine_vs_padded_generate_per_round": per_round,
        "greedy_mismatches": sum(a != b for a, b in zip(medians["engine"].tokens, medians["padded_generate"].tokens)),
    }
    log(f"  engine vs padded generate (batch {batch_size}): "
        f"{results['hybrid_throughput']['engine_vs_padded_generate']:.2f}x (rounds "
        f"{', '.join(f'{r:.2f}' for r in per_round)}), greedy mismatches "
        f"{results['hybrid_throughput']['greedy_mismatches']} of {num_requests}")

    twin = attention_only_twin()
    wl = workloads.dataset("sharegpt", num_requests, scale=scale, vocab=twin.config.vocab_size)
    log("row layout vs packed layout, attention-only twin:")
    thunks = {"packed": lambda w=wl: systems.engine_run(twin, w, **engine_kwargs),
              "rows": lambda w=wl: systems.engine_run(twin, w, per_sequence=True, **engine_kwargs)}
    for fn in thunks.values():
        fn(warm)
    medians, runs = _median_rounds(thunks, wl, rounds, log)
    ratios = [r.wall_s / p.wall_s for r, p in zip(runs["rows"], runs["packed"])]
    results["row_layout_cost"] = {
        "systems": {k: v.summary(wl) for k, v in medians.items()},
        "rows_time_over_packed_time": statistics.median(ratios), "per_round": ratios,
        "tokens_identical": medians["rows"].tokens == medians["packed"].tokens,
    }
    log(f"  rows / packed wall time: {statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}),"
        f" tokens identical: {results['row_layout_cost']['tokens_identical']}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args(argv)
    results = run(args.num_requests, args.scale, args.batch_size, args.rounds)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
