"""What an engine decode step costs against a plain forward (``python -m hf_paged.bench.decode_step``).

Issue 22's target: an ``LLMEngine`` decode step at 64 sequences (schedule, forward and token choice:
all of ``engine.step()``) within 1.15x a plain ``[64, 1]`` forward of the same weights with a stock
``DynamicCache`` holding the same context lengths (left-padded, with its attention mask). Both sides
run in this process, interleaved, on the issue's 19M-parameter Llama; medians are reported.

On an accelerator (``--device cuda --dtype bfloat16 --shape tinyllama``) both sides are timed
between device syncs. There a step is bound by its host work (benchmarks/RESULTS.md, the H200
run), so ``--profile N`` also runs N more steps of each side under torch's profiler and reports,
per step, the host time of the busiest operators and the device launches, syncs and copies it
made: what a step spends its host time on, side by side.

``--temperature`` (with ``--top-p``, ``--top-k``, ``--seed``) makes the engine's requests sample
instead of taking the argmax; the plain forward is the same, so the ratio then shows what sampling
adds to a step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import transformers

from hf_paged.bench.on_device import build_model, sync_device
from hf_paged.model_info import cache_kwarg

# The benchmark model: a random-init 19M-parameter Llama.
LLAMA_19M = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.05)
# runtime calls that launch device work or wait for the device, counted per step by --profile
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def llama_19m(seed: int = 0, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The issue's benchmark model (random weights, eval mode, EOS off)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_19M)).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_prompts(num: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``low`` to ``high`` random token ids (no special ids below 3)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


@contextlib.contextmanager
def engine_decoding(engine, prompts: list[list[int]], steps: int,
                    sampling: dict | None = None) -> Iterator[Callable[[], None]]:
    """``engine`` (idle) with every sequence of ``prompts`` decoding (prefills done, its prefix cache
    emptied first); yields ``engine.step`` for up to ``steps`` calls, then finishes the requests.
    One engine serves every round: a compiled one compiles once. ``sampling``: the requests'
    ``SamplingParams`` options (default greedy)."""
    from hf_paged import SamplingParams

    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine has unfinished requests")
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, **(sampling or {"temperature": 0}))
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for r in engine.scheduler.running for s in r.live_seqs) \
            or engine.scheduler.waiting:
        engine.step()
    yield engine.step
    while engine.has_unfinished_requests():
        engine.step()


@contextlib.contextmanager
def plain_decoding(model, prompts: list[list[int]]) -> Iterator[Callable[[], None]]:
    """A left-padded ``DynamicCache`` of the prompts; yields a function that runs one ``[rows, 1]``
    greedy decode forward (the next token's mask column and position are built outside it)."""
    device = model.device
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = (torch.arange(longest)[None] >= torch.tensor([longest - len(p) for p in prompts])[:, None]).long().to(device)
    cache = transformers.DynamicCache(config=model.config)
    keyword = cache_kwarg(model)  # the cache's keyword in this transformers: no deprecation warning
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{keyword: cache})
    state = {"token": out.logits[:, -1].argmax(-1, keepdim=True), "mask": mask, "positions": mask.sum(-1, keepdim=True)}

    @torch.inference_mode()
    def forward() -> None:
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["token"])], dim=1)
        out = model(input_ids=state["token"], attention_mask=state["mask"], position_ids=state["positions"],
                    use_cache=True, logits_to_keep=1, **{keyword: cache})
        state["token"], state["positions"] = out.logits[:, -1].argmax(-1, keepdim=True), state["positions"] + 1

    yield forward


def _timed(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(steps):
        sync_device(device)
        start = time.perf_counter()
        step()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return times


def engine_decode_steps(engine, prompts: list[list[int]], steps: int, sampling: dict | None = None) -> list[float]:
    """Seconds per ``engine.step()`` once every sequence decodes (prefills are done first)."""
    with engine_decoding(engine, prompts, steps, sampling) as step:
        return _timed(step, steps, engine.model.device)


def plain_decode_steps(model, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds per ``[rows, 1]`` forward with a left-padded ``DynamicCache`` of the prompts."""
    with plain_decoding(model, prompts) as forward:
        return _timed(forward, steps, model.device)


def profile_steps(step: Callable[[], None], steps: int, device: torch.device, top: int = 15) -> dict:
    """``steps`` calls of ``step`` under torch's profiler: per step, the operators with the most host
    self time (ms, calls), and the device launches, syncs and host-device copies the host made."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync_device(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync_device(device)
    events = prof.key_averages()
    busiest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": steps,
        "host_ops": [{"name": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                      "calls_per_step": e.count / steps} for e in busiest],
        "launches_per_step": sum(e.count for e in events if e.key in _LAUNCHES) / steps,
        "syncs_per_step": sum(e.count for e in events if e.key in _SYNCS) / steps,
        "copies_per_step": sum(e.count for e in events if e.key.startswith("cudaMemcpy")) / steps,
    }


def bench_model(shape: str, device: torch.device, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """The benchmark's model: the issue's 19M Llama on CPU, else :func:`on_device.build_model`'s ``shape``."""
    if shape == "issue" and device.type == "cpu":
        return llama_19m(dtype=dtype)
    return build_model(shape, device, dtype)


def run(num_seqs: int = 64, low: int = 16, high: int = 512, steps: int = 32, rounds: int = 3,
        threads: int | None = None, device: str = "cpu", dtype: str = "float32", shape: str = "issue",
        profile: int = 0, compile: bool | None = None, cuda_graphs: bool = False, sampling: dict | None = None,
        log=print) -> dict:
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device)
    model = bench_model(shape, device, getattr(torch, dtype))
    high = min(high, model.config.max_position_embeddings // 2)  # room to decode (the tiny shape has 512 positions)
    prompts = random_prompts(num_seqs, low, high, model.config.vocab_size)
    from hf_paged import LLMEngine

    budget = {"kv_cache_bytes": 16 << 30} if cuda_graphs else {}  # graphs allocate the pools whole
    engine = LLMEngine(model, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256, compile=compile,
                       cuda_graphs=cuda_graphs, **budget)
    engine_runs, plain_runs = [], []
    for round_ in range(rounds):
        engine_runs.append(statistics.median(engine_decode_steps(engine, prompts, steps, sampling)))
        plain_runs.append(statistics.median(plain_decode_steps(model, prompts, steps)))
        log(f"  round {round_ + 1}: engine step {engine_runs[-1] * 1e3:.2f} ms, plain [{num_seqs}, 1] forward "
            f"{plain_runs[-1] * 1e3:.2f} ms, ratio {engine_runs[-1] / plain_runs[-1]:.3f}")
    ratios = [e / p for e, p in zip(engine_runs, plain_runs)]
    result = {"num_seqs": num_seqs, "prompt_lengths": [low, high], "steps": steps, "threads": torch.get_num_threads(),
              "device": str(device), "dtype": dtype, "shape": shape, "compile": compile,
              "compile_note": engine.compile_note, "cuda_graphs": cuda_graphs, "sampling": sampling or "greedy",
              "engine_step_ms": statistics.median(engine_runs) * 1e3,
              "plain_forward_ms": statistics.median(plain_runs) * 1e3,
              "ratio": statistics.median(ratios), "ratio_per_round": ratios,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    log(f"engine decode step / plain forward: {result['ratio']:.3f} (median of {rounds} rounds)")
    if profile:
        with engine_decoding(engine, prompts, profile + 1, sampling) as step:
            step()  # one step outside the profile: the profiler's own first-call costs
            result["profile_engine"] = profile_steps(step, profile, device)
        with plain_decoding(model, prompts) as forward:
            forward()
            result["profile_plain"] = profile_steps(forward, profile, device)
        log(profile_report(result))
    return result


def profile_report(result: dict) -> str:
    """The two profiles of :func:`run` as text tables."""
    lines = []
    for side in ("engine", "plain"):
        prof = result[f"profile_{side}"]
        lines += [f"{side}: per step {prof['launches_per_step']:.0f} device launches, {prof['syncs_per_step']:.1f} "
                  f"syncs, {prof['copies_per_step']:.1f} copies; busiest operators (host self ms, calls, per step):"]
        lines += [f"  {op['self_ms_per_step']:8.3f}  {op['calls_per_step']:7.1f}  {op['name']}"
                  for op in prof["host_ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--shape", default="issue", help="issue (the 19M Llama), tinyllama (1.1B), tiny")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps of each side")
    parser.add_argument("--compile", choices=("default", "on", "off"), default="default",
                        help="the engine's compile= (default: its own, compiled on CPU, eager elsewhere)")
    parser.add_argument("--cuda-graphs", action="store_true", help="the engine replays decode steps from CUDA graphs")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="each request's seed (default: unseeded)")
    parser.add_argument("--out", help="write the result as JSON")
    args = parser.parse_args(argv)
    sampling = None
    if args.temperature:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    result = run(args.num_seqs, steps=args.steps, rounds=args.rounds, threads=args.threads, device=args.device,
                 dtype=args.dtype, shape=args.shape, profile=args.profile,
                 compile={"default": None, "on": True, "off": False}[args.compile], cuda_graphs=args.cuda_graphs,
                 sampling=sampling)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
