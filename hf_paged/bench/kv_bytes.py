"""KV bytes held against context length: stock ``DynamicCache`` against hf_paged, per layer structure.

    python -m hf_paged.bench.kv_bytes [--lengths 256 512 1024 2048 4096] [--out benchmarks/cpu]

One ``generate()`` call per model and context length (a prompt of ``length - 16`` tokens, 16 new
tokens, greedy) on a stock copy and an enabled copy of the same tiny random weights. Reported:
the bytes the returned caches hold (stock: its tensors; hf_paged: ``stats()["bytes_used"]``, the
blocks in use; both: a hybrid model's conv and recurrent states) and their ratio, and whether the
sequences are identical. Full-attention layers
cost the same in both (up to the last partial block); sliding layers cost stock its window, and
hf_paged its window plus at most two partial blocks since its sliding layer groups give blocks back.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import transformers

from hf_paged.bench.optional import plot_or_note

NEW_TOKENS = 16
_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=8192, initializer_range=0.1, pad_token_id=0)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    from hf_paged import state_layers

    hybrid = {}
    if state_layers.STATE_API:  # transformers with the state-layer cache API (after 5.17)
        hybrid["Qwen3.5-like hybrid (2 linear attention : 1 full)"] = transformers.Qwen3_5TextConfig(
            **_SMALL, num_hidden_layers=3, head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
    return {**hybrid, **{
        "Llama (full attention)": transformers.LlamaConfig(**_SMALL, num_hidden_layers=2),
        "Mistral (all sliding, window 64)": transformers.MistralConfig(**_SMALL, num_hidden_layers=2,
                                                                        sliding_window=64),
        "Gemma3-like (5 sliding : 1 full, window 512)": transformers.Gemma3TextConfig(
            **{**_SMALL, "initializer_range": 0.02}, num_hidden_layers=6, head_dim=16, sliding_window=512,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=16),
    }}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(cache) -> int:
    """Conv and recurrent states of a hybrid model's layers (the same classes in both caches)."""
    return sum(_tensor_bytes(list(getattr(layer, name, {}).values()))
               for layer in cache.layers for name in ("conv_states", "recurrent_states"))


def dynamic_cache_bytes(cache) -> int:
    """Bytes a transformers ``DynamicCache`` holds: its layers' K/V and any conv/recurrent states."""
    kv = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
    return _tensor_bytes(kv) + _state_bytes(cache)


@torch.inference_mode()
def run(lengths=(256, 512, 1024, 2048, 4096), block_size: int = 16, log=print) -> dict:
    """Per model: one row per context length with both caches' bytes and their ratio."""
    import hf_paged

    results = {"block_size": block_size, "new_tokens": NEW_TOKENS, "models": {}}
    for name, config in _configs().items():
        torch.manual_seed(0)
        stock = transformers.AutoModelForCausalLM.from_config(config).eval()
        paged = copy.deepcopy(stock)
        hf_paged.enable(paged, block_size=block_size)
        rows = []
        for length in lengths:
            ids = torch.randint(3, config.vocab_size, (1, length - NEW_TOKENS), generator=torch.Generator().manual_seed(length))
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
            want = stock.generate(**kwargs)
            got = paged.generate(**kwargs, cache_implementation="hf_paged")
            stock_bytes = dynamic_cache_bytes(want.past_key_values)
            paged_bytes = got.past_key_values.stats()["bytes_used"] + _state_bytes(got.past_key_values)
            rows.append({"context": length, "stock_bytes": stock_bytes, "hf_paged_bytes": paged_bytes,
                         "ratio": paged_bytes / stock_bytes, "identical": bool(torch.equal(got.sequences, want.sequences))})
            got.past_key_values.release()
            log(f"  {name:46s} {length:5d} tokens: stock {stock_bytes / 1024:8.1f} KiB, hf_paged "
                f"{paged_bytes / 1024:8.1f} KiB ({rows[-1]['ratio']:.3f}x), identical: {rows[-1]['identical']}")
        results["models"][name] = rows
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (name, rows) in enumerate(results["models"].items()):
        color = f"C{i}"
        x = [r["context"] for r in rows]
        ax.plot(x, [r["stock_bytes"] / 1024 for r in rows], "o--", color=color, label=f"{name}: stock DynamicCache")
        ax.plot(x, [r["hf_paged_bytes"] / 1024 for r in rows], "s-", color=color, label=f"{name}: hf_paged")
    ax.set(xlabel="context length (tokens)", ylabel="KV held (KiB)", xscale="log", yscale="log",
           title=f"KV bytes held at the end of generate() (block size {results['block_size']})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/cpu")
    args = parser.parse_args()
    results = run(args.lengths, args.block_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_bytes_vs_context.json").write_text(json.dumps(results, indent=1))
    plot_or_note(plot, results, out / "kv_bytes_vs_context.png")


if __name__ == "__main__":
    main()
