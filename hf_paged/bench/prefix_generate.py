"""Prefix caching in ``generate()`` against stock ``generate()`` and the flag without it, side by side.

    python -m hf_paged.bench.prefix_generate [--questions 128] [--prefix 1000] [--turns 8] [--out DIR]

Two workloads on one random Llama (4 layers x 256 hidden, MLP 1024, vocabulary 32000), float32:

* **few-shot**: ``questions`` questions (10-40 tokens) behind one ``prefix``-token few-shot prefix,
  through ``generate()`` in left-padded batches of 8, 16 new tokens each. Reported per system: wall
  time, tokens computed (real tokens at the model's input, counted by a hook on the embeddings)
  and the share of prefix tokens not recomputed.
* **multi-turn chat**: ``turns`` turns, each resending the whole conversation (the previous turns'
  prompts and answers, plus a new 120-token user message), 24 new tokens per turn; the latency of
  each turn.

Every system's sequences are compared with stock's (they must be identical).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from hf_paged.bench.optional import plot_or_note

NEW_TOKENS = 16
BATCH = 8
SYSTEMS = ("stock", "flag", "flag + prefix caching")


def bench_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, max_position_embeddings=4096, initializer_range=0.1,
                         pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(config).eval()


class _TokenCounter:
    def __init__(self, model):
        self.count = 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += int((args[0] != 0).sum())


def _systems(stock):
    import hf_paged

    flag = hf_paged.enable(copy.deepcopy(stock))
    cached = hf_paged.enable(copy.deepcopy(stock), prefix_caching=True)
    return dict(zip(SYSTEMS, (stock, flag, cached)))


def left_padded_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token-id rows, left-padded with id 0."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


@torch.inference_mode()
def _generate(model, name: str, rows: list[list[int]], new_tokens: int) -> torch.Tensor:
    ids, mask = left_padded_batch(rows)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0, eos_token_id=None)
    if name != "stock":
        kwargs["cache_implementation"] = "hf_paged"
    return model.generate(**kwargs)[:, ids.shape[1]:]


def few_shot(models: dict, questions: int, prefix_len: int, log=print) -> dict:
    """Batch by batch, every system on the same batch before the next (interleaved: a shared
    machine's drift reaches all systems alike)."""
    vocab = next(iter(models.values())).config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
    lengths = torch.randint(10, 41, (questions,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    counters = {name: _TokenCounter(model) for name, model in models.items()}
    wall = dict.fromkeys(models, 0.0)
    outputs: dict[str, list] = {name: [] for name in models}
    for i in range(0, questions, BATCH):
        for name, model in models.items():
            start = time.perf_counter()
            outputs[name] += _generate(model, name, prompts[i : i + BATCH], NEW_TOKENS).tolist()
            wall[name] += time.perf_counter() - start
    results = {}
    decode_tokens = questions * (NEW_TOKENS - 1)  # the last token is never fed back
    for name, counter in counters.items():
        counter.handle.remove()
        prompt_computed = counter.count - decode_tokens
        results[name] = {
            "wall_s": wall[name], "speedup_vs_stock": wall["stock"] / wall[name], "tokens_computed": counter.count,
            "prompt_tokens_computed": prompt_computed,
            "prefix_tokens_not_recomputed": 1 - max(prompt_computed - sum(lengths), 0) / (questions * prefix_len),
            "identical_to_stock": outputs[name] == outputs["stock"],
        }
        r = results[name]
        log(f"  few-shot {name:<22} {r['wall_s']:7.2f} s  {r['speedup_vs_stock']:5.2f}x stock  tokens computed "
            f"{r['tokens_computed']:7d}  prefix not recomputed {r['prefix_tokens_not_recomputed']:.1%}  "
            f"identical {r['identical_to_stock']}")
    return {"questions": questions, "prefix_tokens": prefix_len, "batch": BATCH, "new_tokens": NEW_TOKENS,
            "systems": results}


def multi_turn(models: dict, turns: int, log=print, message: int = 120, answer: int = 24) -> dict:
    """Turn by turn, every system on its own conversation (the same user messages; the answers
    are compared with stock's)."""
    vocab = next(iter(models.values())).config.vocab_size
    g = torch.Generator().manual_seed(2)
    conversations = {name: [] for name in models}
    latencies = {name: [] for name in models}
    answers = {name: [] for name in models}
    for _ in range(turns):
        user = torch.randint(3, vocab, (message,), generator=g).tolist()
        for name, model in models.items():
            conversations[name] += user
            start = time.perf_counter()
            reply = _generate(model, name, [conversations[name]], answer)[0].tolist()
            latencies[name].append(time.perf_counter() - start)
            answers[name].append(reply)
            conversations[name] += reply
    results = {}
    for name in models:
        results[name] = {"latency_s_per_turn": latencies[name], "identical_to_stock": answers[name] == answers["stock"],
                         "final_context_tokens": len(conversations[name])}
        log(f"  multi-turn {name:<22} per turn (s): {' '.join(f'{x:.3f}' for x in latencies[name])}  "
            f"identical {results[name]['identical_to_stock']}")
    return {"turns": turns, "message_tokens": message, "answer_tokens": answer, "systems": results}


def run(questions: int = 128, prefix_len: int = 1000, turns: int = 8, log=print) -> dict:
    models = _systems(bench_model())
    # warm-up, untimed: one-time costs (allocator, thread pools) of the first calls in a process
    warm = {name: model for name, model in models.items()}
    few_shot(warm, BATCH, 64, log=lambda *a: None)
    import hf_paged

    hf_paged.prefix_cache(models["flag + prefix caching"]).clear()
    log(f"few-shot: {questions} questions behind one {prefix_len}-token prefix, batches of {BATCH}:")
    results = {"few_shot": few_shot(models, questions, prefix_len, log)}
    hf_paged.prefix_cache(models["flag + prefix caching"]).clear()
    log(f"multi-turn chat, {turns} turns:")
    results["multi_turn"] = multi_turn(models, turns, log)
    results["prefix_cache_stats"] = hf_paged.prefix_cache(models["flag + prefix caching"]).stats()
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    few = results["few_shot"]["systems"]
    a1.bar(list(few), [r["wall_s"] for r in few.values()])
    a1.set(ylabel="wall time (s)", title=f"few-shot: {results['few_shot']['questions']} questions")
    for name, r in results["multi_turn"]["systems"].items():
        a2.plot(range(1, len(r["latency_s_per_turn"]) + 1), r["latency_s_per_turn"], "o-", label=name)
    a2.set(xlabel="turn", ylabel="latency (s)", title="multi-turn chat")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/cpu")
    args = parser.parse_args(argv)
    results = run(args.questions, args.prefix, args.turns)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_generate.json").write_text(json.dumps(results, indent=1))
    plot_or_note(plot, results, out / "prefix_generate.png")
    identical = all(r["identical_to_stock"] for part in ("few_shot", "multi_turn")
                    for r in results[part]["systems"].values())
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
