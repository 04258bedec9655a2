"""Issue 22's workloads on an accelerator (``python -m hf_paged.bench.on_device``): ``LLMEngine`` with
the Triton kernels against stock ``generate()`` (SDPA, ``DynamicCache``) and transformers' continuous
batching, in bfloat16, on the same model and requests. vLLM's CPU build cannot run there, so these
two are the systems to beat on a GPU.

Why it is built this way:

* **The vs_vllm workloads** (:func:`vs_vllm.sharegpt_requests`, :func:`vs_vllm.long_requests`):
  token-id prompts, greedy, EOS ignored, every requested token generated. Two models from code:
  the issue's 19M-parameter Llama and TinyLlama-1.1B's shape (random init), where the GPU has
  work to do.
* **One process, rounds interleaved**: an H200 is lent for minutes, so every system runs in this
  process, one round of all of them before the next, in alternating order; medians and per-round
  ratios are reported. Each system is warmed up on other prompts first (Triton compiles,
  transformers' CUDA-graph capture), and only the generate call is timed, between device syncs.
* **Each system as its users would run it**: the engine at its defaults but for a fixed KV budget
  (``--kv-gib``, so the systems do not each claim 90% of the card in turn), with eager steps (the
  default off the CPU), with its decoder body compiled (``compile=True``) and with decode steps
  replayed from CUDA graphs (``cuda_graphs=True``): the host work per layer bounds eager steps on a
  GPU; each engine is built (compiled, captured) once per model and kept across rounds, as a server
  keeps it, its prefix cache emptied before every run; stock ``generate()``
  on one left-padded batch of every request (the fastest way it has for an offline batch, each
  request's tokens taken up to its own length); continuous batching warmed up (CUDA graphs) with
  its memory share capped by ``--cb-memory``. Nothing else is tuned.
* **A deadline** (``--budget-s``): a lent machine's minutes are counted, so no new run starts
  when the next would not end in time, and results are written after every run.

Greedy agreement with stock is reported, not asserted: in bfloat16, batch shapes change the bits of
the matmuls, so near-ties break differently in every system (float32 equality on CUDA is
benchmarks/gpu_equality.py's; on CPU the test of this module asserts it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from hf_paged.bench import vs_vllm
from hf_paged.bench.vllm_worker import versions

SHAPES = {**vs_vllm.SHAPES,
          "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)}
SYSTEMS = ("engine", "engine_compiled", "engine_graphs", "stock_generate", "transformers_cb")
ENGINES = {"engine": {"compile": False}, "engine_compiled": {"compile": True},  # system -> LLMEngine keywords
           "engine_graphs": {"compile": False, "cuda_graphs": True}}


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-init Llama of ``shape`` (initialized on ``device``: a 1B model inits in seconds there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def sync_device(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued on it (CUDA; nothing to wait for elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_engine(model, kv_bytes: int, **options):
    """An ``LLMEngine`` at its defaults but ``kv_bytes`` of KV and ``options`` (:data:`ENGINES`:
    ``compile``, the decoder body through ``torch.compile``; ``cuda_graphs``, decode steps replayed
    from CUDA graphs; both set up here)."""
    from hf_paged import LLMEngine

    return LLMEngine(model, kv_cache_bytes=kv_bytes, **options)


@torch.inference_mode()
def run_engine(engine, requests: list[dict]) -> tuple[list[list[int]], float]:
    """``engine.generate`` of the requests, its prefix cache emptied first (each run starts cold, as a
    fresh engine would); (tokens, seconds)."""
    from hf_paged import SamplingParams

    model = engine.model
    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine has unfinished requests")
    params = [SamplingParams(max_new_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    sync_device(model.device)
    t0 = time.perf_counter()
    outs = engine.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    sync_device(model.device)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if engine.kv.stats()["blocks_used"]:
        raise RuntimeError("the engine kept blocks after its requests finished")
    return tokens, wall


@torch.inference_mode()
def run_stock(model, requests: list[dict]) -> tuple[list[list[int]], float]:
    """Stock generate() on one left-padded batch of every request, to the longest output."""
    import hf_paged

    hf_paged.disable(model)
    width = max(len(r["prompt"]) for r in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
        mask[i, width - len(r["prompt"]):] = 1
    longest = max(r["max_tokens"] for r in requests)
    sync_device(model.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=longest, min_new_tokens=longest, eos_token_id=None, pad_token_id=0)
    sync_device(model.device)
    wall = time.perf_counter() - t0
    return [out[i, width: width + r["max_tokens"]].tolist() for i, r in enumerate(requests)], wall


def run_cb(model, requests: list[dict], memory_share: float) -> tuple[list[list[int]], float]:
    """transformers' continuous batching, warmed up (untimed) before the requests go in. Not under
    inference_mode: its manager's thread updates tensors the warm-up makes, outside that mode."""
    import hf_paged
    from transformers import ContinuousBatchingConfig, GenerationConfig

    hf_paged.disable(model)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_tokens"] for r in requests),
                              eos_token_id=None, pad_token_id=0)
    on_gpu = model.device.type == "cuda"  # on CPU: a small pool (its default sizing is for GPU memory)
    cb = ContinuousBatchingConfig(max_memory_percent=memory_share) if on_gpu else ContinuousBatchingConfig(
        block_size=32, num_blocks=256, max_batch_tokens=512)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb,
                                                   warmup=on_gpu) as manager:
        sync_device(model.device)
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r["prompt"], request_id=str(i), max_new_tokens=r["max_tokens"])
        idle_since = time.monotonic()
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running() or time.monotonic() - idle_since > 60:
                    raise RuntimeError("transformers continuous batching stopped or stalled (see its log)")
                continue
            idle_since = time.monotonic()
            if result.is_finished():
                results[result.request_id] = result
        sync_device(model.device)
        wall = time.perf_counter() - t0
    return [list(results[str(i)].generated_tokens) for i in range(len(requests))], wall


def _system(name: str, opts: argparse.Namespace, engines: dict):
    """``name``'s run as a function of (model, requests); an engine is built on its first run and
    kept in ``engines`` for the later ones (built, and compiled, once per model, as a server would)."""
    if name in ENGINES:
        def run_held(model, reqs):
            if name not in engines:
                engines[name] = build_engine(model, int(opts.kv_gib * 2**30), **ENGINES[name])
            return run_engine(engines[name], reqs)
        return run_held
    if name == "stock_generate":
        return run_stock
    return lambda model, reqs: run_cb(model, reqs, opts.cb_memory)


def workloads_for(vocab: int, sizes: vs_vllm.Sizes) -> dict[str, tuple[list[dict], list[dict]]]:
    """name -> (timed requests, warm-up requests of the same kind from another seed)."""
    return {"sharegpt": (vs_vllm.sharegpt_requests(sizes.requests, sizes, vocab),
                         vs_vllm.sharegpt_requests(sizes.warmup, sizes, vocab, seed=1)),
            "long_prompts": (vs_vllm.long_requests(sizes.long_requests, sizes, vocab),
                             vs_vllm.long_requests(max(2, sizes.warmup // 2), sizes, vocab, seed=1))}


def run(opts: argparse.Namespace, log=print) -> dict:
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    deadline = time.monotonic() + opts.budget_s
    sizes = vs_vllm.SIZES[opts.sizes]
    systems = systems_of(opts.systems)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "device": _device_name(device), "dtype": opts.dtype,
                     "versions": versions("hf_paged", "torch", "transformers", "triton"),
                     "settings": {"kv_gib_engine": opts.kv_gib, "cb_max_memory_percent": opts.cb_memory,
                                  "rounds": opts.rounds, "sizes": opts.sizes, "systems": list(systems)},
                     "models": {}}
    out = Path(opts.out) if opts.out else None
    for shape in opts.shapes.split(","):
        model = build_model(shape, device, dtype)
        engines: dict = {}  # system -> its engine for this model
        entry = results["models"][shape] = {"shape": SHAPES[shape],
                                            "parameters": sum(p.numel() for p in model.parameters()), "workloads": {}}
        for wname, (reqs, warm) in workloads_for(model.config.vocab_size, sizes).items():
            section = entry["workloads"][wname] = {"workload": vs_vllm.describe(reqs), "runs": {}, "warmup_s": {}}
            if time.monotonic() > deadline - 30:
                section["skipped"] = "the budget was spent"
                continue
            tokens, last_cost = {}, {}
            for name in systems:  # warm-up, untimed: compiles, graph captures, allocator and cuBLAS for these shapes
                t0 = time.monotonic()
                try:
                    _system(name, opts, engines)(model, warm)
                    _system(name, opts, engines)(model, reqs)
                except Exception as err:  # noqa: BLE001 - one system failing must not hide the others
                    section["runs"][name] = {"failed": f"{type(err).__name__}: {err}"}
                    log(f"{shape} {wname} {name} failed in its warm-up: {type(err).__name__}: {err}")
                section["warmup_s"][name] = last_cost[name] = round(time.monotonic() - t0, 2)
                if name in engines:  # whether its steps run compiled (None), or why not
                    section.setdefault("compile_notes", {})[name] = engines[name].compile_note
                    section.setdefault("cuda_graphs", {})[name] = engines[name].stats()["cuda_graphs"]
                _release(device)
            for round_ in range(opts.rounds):
                order = systems if round_ % 2 == 0 else systems[::-1]
                for name in order:
                    run_ = section["runs"].setdefault(name, {"tokens_per_s": [], "wall_s": []})
                    if "failed" in run_:
                        continue
                    left = deadline - time.monotonic()
                    if left < 1.5 * last_cost.get(name, 1.0) + 5:
                        run_.setdefault("skipped", []).append(f"round {round_ + 1}: {left:.0f} s left of the budget")
                        continue
                    started = time.monotonic()
                    try:
                        toks, wall = _system(name, opts, engines)(model, reqs)
                    except Exception as err:  # noqa: BLE001
                        run_["failed"] = f"{type(err).__name__}: {err}"
                        log(f"{shape} {wname} {name} failed: {run_['failed']}")
                        continue
                    finally:
                        _release(device)
                    last_cost[name] = time.monotonic() - started  # warm-ups and pools included
                    tokens.setdefault(name, toks)
                    run_["wall_s"].append(round(wall, 4))
                    run_["tokens_per_s"].append(round(sum(map(len, toks)) / wall, 1))
                    log(f"{shape} {wname} round {round_ + 1}: {name:<16} {run_['tokens_per_s'][-1]:10.1f} tok/s")
            _summarize(section, tokens, reqs)
            if out:
                _write(out, results)
        del model, engines
        _release(device)
    if out:
        _write(out, results)
    return results


def systems_of(names: str) -> tuple[str, ...]:
    """The systems named (comma-separated), in :data:`SYSTEMS`' order; ValueError naming an unknown one."""
    asked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(asked) - set(SYSTEMS))
    if unknown or not asked:
        raise ValueError(f"--systems: unknown {unknown or 'none given'}; choose from {', '.join(SYSTEMS)}")
    return tuple(n for n in SYSTEMS if n in asked)


def _summarize(section: dict, tokens: dict, reqs: list[dict]) -> None:
    runs = section["runs"]
    asked = sum(r["max_tokens"] for r in reqs)
    for name, toks in tokens.items():
        runs[name]["generated_tokens"] = sum(map(len, toks))
        runs[name]["all_requested_tokens"] = runs[name]["generated_tokens"] == asked
    for run_ in runs.values():
        if run_.get("tokens_per_s"):
            run_["median_tokens_per_s"] = statistics.median(run_["tokens_per_s"])
    for engine_name in ENGINES:
        engine = runs.get(engine_name, {})
        ratios = section[f"{engine_name}_vs"] = {}
        for other in ("stock_generate", "transformers_cb") + (("engine",) if engine_name != "engine" else ()):
            a, b = engine.get("tokens_per_s", []), runs.get(other, {}).get("tokens_per_s", [])
            if a and b:
                ratios[other] = {"median_ratio": round(statistics.median(a) / statistics.median(b), 3),
                                 "per_round": [round(x / y, 3) for x, y in zip(a, b)]}
    section["agreement_with_stock"] = {name: vs_vllm.agreement(toks, tokens["stock_generate"])
                                       for name, toks in tokens.items()
                                       if name != "stock_generate" and "stock_generate" in tokens}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def _write(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "on_device.json").write_text(json.dumps(results, indent=1))


def report(results: dict) -> str:
    lines = [f"{results['device']}, {results['dtype']}, {results['versions']}"]
    for shape, entry in results["models"].items():
        for wname, section in entry["workloads"].items():
            lines.append(f"{shape} ({entry['parameters'] / 1e6:.0f}M), {wname}:")
            for name, run_ in section["runs"].items():
                if "failed" in run_:
                    lines.append(f"  {name:<16} failed: {run_['failed']}")
                elif run_.get("tokens_per_s"):
                    lines.append(f"  {name:<16} {run_['median_tokens_per_s']:10.1f} tok/s  rounds {run_['tokens_per_s']}")
            for engine_name in ENGINES:
                for other, ratio in section.get(f"{engine_name}_vs", {}).items():
                    lines.append(f"  {engine_name} / {other}: {ratio['median_ratio']}x (per round {ratio['per_round']})")
            for name, agree in section.get("agreement_with_stock", {}).items():
                lines.append(f"  {name} tokens identical to stock: {agree['identical']}/{agree['of']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--shapes", default="issue,tinyllama", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--sizes", default="full", choices=tuple(vs_vllm.SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=16.0, help="the engine's KV budget")
    parser.add_argument("--cb-memory", type=float, default=0.5, help="transformers CB: share of free memory for KV")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, in this order: {', '.join(SYSTEMS)}")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no run that would end past this")
    parser.add_argument("--out", help="write on_device.json here")
    return parser


def main(argv: list[str] | None = None) -> int:
    print(report(run(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
