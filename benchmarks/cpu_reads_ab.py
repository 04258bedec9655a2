"""The engine's CPU attention reads side by side: the C reads built for this CPU, the C reads built
for AVX2 (``HF_PAGED_CPU_MARCH=x86-64-v3``: 8-lane vectors, what an AVX2-only CPU builds for itself),
and torch's reads (gather + SDPA decode, SDPA prefill: the default on AVX2 CPUs before the C reads
had an 8-lane build).

    python benchmarks/cpu_reads_ab.py [--rounds 2] [--out FILE]

First the reads alone at the issue model's layout (2 K/V heads of 4 query heads of 32, blocks of 16,
2 threads, best of 7 x 10 calls): prefill of 2 prompts of 1,000 tokens, decode of 32 sequences of
1,100 (the C reads also with four layers' pools read in turn, out of the caches, as a decode step
reads them); the torch side is what the engine does without the C reads (SDPA per prompt on its gathered
keys, index_select gather + one SDPA for the decode rows). Then issue 22's offline workloads and model
(``hf_paged.bench.vs_vllm``: 64 ShareGPT-like requests, 32 of ~1,000-token prompts; equal settings,
2 threads), each variant in a fresh process after the same untimed warm-up, rounds interleaved.
Reported: output tok/s per round and its median, each variant against torch's reads, and whether
every variant's greedy tokens equal torch's reads'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/ (its kernels.py)

from hf_paged.bench import vs_vllm  # noqa: E402
from hf_paged.kernels import cpu_build  # noqa: E402

# name: (HF_PAGED_CPU_MARCH or None for this CPU, (decode_read, prefill_read))
VARIANTS = {"torch reads": (None, ("gather", "sdpa")), "C reads, AVX2 build": ("x86-64-v3", ("c", "c")),
            "C reads, native build": (None, ("c", "c"))}


def run_variant(name: str, requests: list[dict], warmup: list[dict], ctx: dict) -> dict:
    """``name``'s engine on ``requests`` in a fresh process (``vs_vllm.run_offline`` at equal settings)."""
    march, reads = VARIANTS[name]
    opts = vs_vllm.Options(hf_env={cpu_build.MARCH_VARIABLE: march} if march else {}, hf_reads=reads, log=print)
    return vs_vllm.run_offline(vs_vllm.Config("hf_paged", "equal"), requests, warmup, opts, ctx)


def time_reads() -> dict:
    """ms per call of each read at the issue model's layout, in this process (the C reads built for
    each target in turn: the library is chosen per call by ``HF_PAGED_CPU_MARCH``)."""
    import time

    import torch

    from hf_paged.kernels import cpu_decode, cpu_prefill

    torch.manual_seed(0)
    torch.set_num_threads(2)
    kv_heads, group, head_dim, block_size, scale = 2, 4, 32, 16, 32 ** -0.5

    def pools(lens: list[int]):
        width = max(-(-n // block_size) for n in lens)
        k = torch.randn(len(lens) * width, block_size, kv_heads, head_dim)
        tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
        return k, torch.randn_like(k), tables, torch.tensor(lens, dtype=torch.int32)

    def best_ms(call) -> float:
        call(), call()
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(10):
                call()
            best = min(best, (time.perf_counter() - start) / 10 * 1e3)
        return round(best, 3)

    k, v, tables, lens = pools([1000, 1000])
    cu = torch.tensor([0, 1000, 2000], dtype=torch.int32)
    q = torch.randn(2000, kv_heads * group, head_dim)

    def sdpa_prefill():
        for i in range(2):
            keys, values = (pool[tables[i].long()].flatten(0, 1)[:1000].transpose(0, 1)[None] for pool in (k, v))
            torch.nn.functional.scaled_dot_product_attention(q[None, 1000 * i:1000 * (i + 1)].transpose(1, 2), keys,
                                                             values, is_causal=True, scale=scale, enable_gqa=True)

    dk, dv, dtables, dlens = pools([1100] * 32)
    dq = torch.randn(32, kv_heads * group, head_dim)
    slots = (dtables.long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :1100].reshape(-1)

    def gather_decode():
        keys, values = (pool.view(-1, kv_heads * head_dim).index_select(0, slots).view(32, 1100, kv_heads, head_dim)
                        .transpose(1, 2) for pool in (dk, dv))
        torch.nn.functional.scaled_dot_product_attention(dq.view(32, kv_heads, group, head_dim), keys, values,
                                                         scale=scale)

    # the decode read with the pools in DRAM: four layers' pools in turn (72 MiB, more than the caches
    # hold), blocks in table order, as a decode step reads them
    layers = [pools([1100] * 32)[:2] for _ in range(4)]

    def c_decode_in_dram():
        for lk, lv in layers:
            cpu_decode.paged_decode_cpu(dq, lk, lv, dtables, dlens, scale)

    out = {"torch reads": {"prefill_ms": best_ms(sdpa_prefill), "decode_ms": best_ms(gather_decode)}}
    for name, (march, _) in VARIANTS.items():
        if name == "torch reads":
            continue
        os.environ.pop(cpu_build.MARCH_VARIABLE, None)
        if march:
            os.environ[cpu_build.MARCH_VARIABLE] = march
        out[name] = {"prefill_ms": best_ms(lambda: cpu_prefill.paged_prefill_cpu(q, k, v, tables, cu, lens, scale)),
                     "decode_ms": best_ms(lambda: cpu_decode.paged_decode_cpu(dq, dk, dv, dtables, dlens, scale)),
                     "decode_in_dram_ms_per_layer": round(best_ms(c_decode_in_dram) / len(layers), 3),
                     "vector_lanes": cpu_build.library((kv_heads, group, head_dim, block_size)).vector_lanes()}
    os.environ.pop(cpu_build.MARCH_VARIABLE, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/cpu_reads_ab.json")
    parser.add_argument("--reads-only", action="store_true", help="only the reads alone, no engine runs")
    args = parser.parse_args()
    os.environ.pop(cpu_build.MARCH_VARIABLE, None)  # "native" is this CPU, whatever the caller's environment says
    import torch
    from transformers import AutoConfig

    from hf_paged.model_info import kv_bytes_per_token

    with tempfile.TemporaryDirectory(prefix="reads-ab-") as tmp:
        work = Path(tmp)
        model = vs_vllm.build_checkpoint(work / "model")
        config = AutoConfig.from_pretrained(work / "model")
        ctx = {"model_dir": str(work / "model"), "work_dir": tmp, "ids": iter(range(10**6)),
               "kv_bytes_per_token": kv_bytes_per_token(config, torch.float32)}
        sizes, vocab = vs_vllm.Sizes(), config.vocab_size
        warmup = vs_vllm.sharegpt_requests(sizes.warmup, replace(sizes, output=(sizes.output[0],) * 2), vocab, seed=99)
        workloads = {"sharegpt": vs_vllm.sharegpt_requests(sizes.requests, sizes, vocab),
                     "long_prompts": vs_vllm.long_requests(sizes.long_requests, sizes, vocab, seed=7)}
        results = {"model": model, "cpu": _cpu_model(), "flags_avx512f": b"avx512f" in cpu_build.cpu_flags().split(),
                   "reads_ms": time_reads(), "workloads": {}}
        print(json.dumps(results["reads_ms"], indent=1), flush=True)
        if args.reads_only:
            workloads = {}
        for workload, requests in workloads.items():
            runs = {name: [] for name in VARIANTS}
            for round_ in range(args.rounds):
                for name in VARIANTS:
                    runs[name].append(run_variant(name, requests, warmup, ctx))
                    print(f"{workload} round {round_ + 1} {name}: {runs[name][-1]['tokens_per_s']:,.0f} tok/s",
                          flush=True)
            base = runs["torch reads"][0]["tokens"]
            medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
            results["workloads"][workload] = {
                "describe": vs_vllm.describe(requests),
                "tokens_per_s": {name: [round(r["tokens_per_s"], 1) for r in rs] for name, rs in runs.items()},
                "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
                "vs_torch_reads": {k: round(v / medians["torch reads"], 3) for k, v in medians.items()},
                "tokens_equal_torch_reads": {name: all(r["tokens"] == base for r in rs) for name, rs in runs.items()}}
            print(json.dumps(results["workloads"][workload], indent=1), flush=True)
        results["versions"] = vs_vllm.versions("hf_paged", "torch", "transformers")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
