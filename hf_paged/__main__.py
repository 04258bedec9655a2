"""``python -m hf_paged`` (also ``hf-paged``): the demo (default) and streamed generation.

    python -m hf_paged                      # demo on the built-in model
    python -m hf_paged demo --model PATH    # a local checkpoint instead
    python -m hf_paged generate "Once upon a time" --max-new-tokens 40
    python -m hf_paged bench [--quick]      # side-by-side benchmarks, JSON and plots
    python -m hf_paged serve [--port 8000]  # OpenAI-compatible HTTP server on the engine
    python -m hf_paged serve --enable-lora --lora-modules NAME=PATH  # LoRA adapters, named as models
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_paged.bench import SUITE_SECTIONS
from hf_paged.block_manager import NoFreeBlocksError
from hf_paged.process_exit import exit_process

if TYPE_CHECKING:
    from hf_paged import LLMEngine
    from hf_paged.serve.serving_models import LoRAModulePath

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

DEMO_PROMPTS = [
    "PagedAttention stores the KV cache in fixed-size blocks,",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Memory fragmentation wastes 60-80% of a contiguous KV cache because",
]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CliError(f"--device {name!r} is not a device torch knows ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name!r}: CUDA is not available on this machine")
    return device


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise CliError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def load(args) -> tuple:
    """(model, tokenizer) from ``--model PATH``, or the built-in demo model and byte tokenizer."""
    device, dtype = _device(args.device), _dtype(args.dtype)
    if args.model is None:
        from hf_paged.demo import byte_tokenizer, demo_model

        return demo_model(dtype=dtype).to(device), byte_tokenizer()
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(args.model)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise CliError(f"--model {args.model!r} could not be loaded: {err}") from None
    return model.to(device).eval(), tokenizer


def _tokenizer(path: str):
    """The checkpoint's tokenizer, padding on the left (a pad token borrowed from EOS if it has none)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise CliError(f"--model {path!r} is not a directory with a saved model (config.json, weights)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise CliError(f"--model {path!r} could not be loaded: {err}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_split(args) -> tuple:
    """Under torch.distributed (``torchrun``, or ``--tensor-parallel-size``): the model split over the
    ranks with transformers' ``tp_plan="auto"`` (the built-in demo model is saved to a temporary
    directory first: ``tp_plan`` loads from a checkpoint)."""
    import tempfile

    from hf_paged.engine import tensor_parallel

    if args.model is None:
        from hf_paged.demo import byte_tokenizer, demo_model

        path, tokenizer = tempfile.mkdtemp(prefix="hf-paged-demo-"), byte_tokenizer()
        demo = demo_model(dtype=_dtype(args.dtype))
        demo.save_pretrained(path)
    else:
        path, tokenizer = args.model, _tokenizer(args.model)
    try:
        model = tensor_parallel.load_model(path, dtype=_dtype(args.dtype))
    except ValueError as err:
        raise CliError(str(err)) from None
    if args.model is None:
        model.hf_paged_demo = demo.hf_paged_demo
    return model, tokenizer


def _model_name(model, args) -> str:
    """What the output says about the model in use (the built-in one: trained or random)."""
    from hf_paged.demo import describe_model

    return args.model if args.model else describe_model(model)


def engine_memory_line(engine) -> str:
    """What the engine keeps per sequence, and what bounds it (the server's startup line)."""
    stats = engine.stats()
    line = (f"KV blocks of {engine.kv.block_size} tokens" if engine.kv.stats()["groups"] else
            "no K/V (a pure state-space model: --num-blocks and --block-size do not apply)")
    if stats["state_slots_total"]:
        line += (f"; recurrent state: {stats['state_slots_total']} slots of {_human(stats['state_bytes_per_slot'])}, "
                 f"so at most {stats['state_slots_total']} sequences run at once (--num-state-slots)")
    caching = "on" if stats["prefix_caching"] else (engine.prefix_caching_note or "off")
    return f"{line}; prefix caching {caching}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def demo(args) -> int:
    """Stock generate vs the paged flag on the same prompts: equal tokens, less KV memory."""
    import hf_paged

    model, tokenizer = load(args)
    enc = tokenizer(DEMO_PROMPTS, return_tensors="pt", padding=True).to(model.device)
    runs = {
        "greedy": dict(do_sample=False),
        "beam search (4 beams)": dict(do_sample=False, num_beams=4),
        "sampling (n=4, seed 0)": dict(do_sample=True, num_return_sequences=4),
    }
    print(f"model: {_model_name(model, args)} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), "
          f"{len(DEMO_PROMPTS)} prompts, {args.max_new_tokens} new tokens, block size {args.block_size}\n")
    header = f"{'mode':<24}{'tokens equal':>13}{'paged KV':>12}{'contiguous':>12}{'saved':>8}{'util.':>8}" \
             f"{'stock s':>9}{'paged s':>9}"
    print(header + "\n" + "-" * len(header))
    all_equal = True
    for name, kwargs in runs.items():
        hf_paged.disable(model)
        torch.manual_seed(0)
        start = time.perf_counter()
        stock = model.generate(**enc, max_new_tokens=args.max_new_tokens, **kwargs)
        stock_s = time.perf_counter() - start
        hf_paged.enable(model, block_size=args.block_size, num_blocks=args.num_blocks)
        torch.manual_seed(0)
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, cache_implementation="hf_paged",
                             return_dict_in_generate=True, **kwargs)
        paged_s = time.perf_counter() - start
        stats = (getattr(out, "cache", None) or out.past_key_values).stats()
        equal = torch.equal(stock, out.sequences)
        all_equal &= equal
        saved = 1 - stats["bytes_used"] / stats["bytes_contiguous_equivalent"]
        print(f"{name:<24}{str(equal):>13}{_human(stats['bytes_used']):>12}"
              f"{_human(stats['bytes_contiguous_equivalent']):>12}{saved:>8.0%}{stats['utilization']:>8.1%}"
              f"{stock_s:>9.2f}{paged_s:>9.2f}")
    text = tokenizer.decode(out.sequences[0], skip_special_tokens=True)
    print(f"\nfirst sample: {text[:120]!r}")
    print("paged KV = blocks in use at the end; contiguous = what DynamicCache holds for the same batch "
          "(pads and repeated beams included).\n")
    _engine_demo(model, tokenizer, args)
    if not all_equal and model.dtype == torch.float32:
        print("MISMATCH: the paged path produced different tokens", file=sys.stderr)
        return 1
    return 0


def _engine_demo(model, tokenizer, args) -> None:
    """The request batcher on a batch of mixed-length prompts, against padded generate()."""
    import random

    from hf_paged import LLMEngine, SamplingParams
    from hf_paged.model_info import kv_bytes_per_token

    rng = random.Random(0)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)][: rng.randrange(8, 60)] for i in range(32)]
    lengths = [rng.randrange(4, 2 * args.max_new_tokens) for _ in prompts]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    engine = LLMEngine(model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks or 2048,
                       max_num_batched_tokens=512)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=True)
    engine_s = time.perf_counter() - start
    import hf_paged

    hf_paged.disable(model)
    start = time.perf_counter()
    for i in range(0, len(prompts), 8):
        enc = tokenizer(prompts[i : i + 8], return_tensors="pt", padding=True).to(model.device)
        model.generate(**enc, max_new_tokens=max(lengths[i : i + 8]), do_sample=False, eos_token_id=None)
    padded_s = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = engine.stats()
    kv = engine.kv.stats()
    per_block = kv_bytes_per_token(model.config.get_text_config(decoder=True), model.dtype) * args.block_size
    per_token = per_block / args.block_size
    contiguous = max(8 * (max(len(tokenizer(p).input_ids) for p in prompts[i : i + 8]) + max(lengths[i : i + 8]))
                     for i in range(0, len(prompts), 8)) * per_token
    print(f"\n{'engine (32 requests)':<26}{'tok/s':>10}{'speedup':>10}")
    print(f"{'padded generate, batch 8':<26}{generated / padded_s:>10.1f}{1.0:>9.2f}x")
    print(f"{'hf_paged LLMEngine':<26}{generated / engine_s:>10.1f}{padded_s / engine_s:>9.2f}x")
    print(f"KV blocks used at peak by the engine: {kv['blocks_peak']} x {_human(per_block)} = "
          f"{_human(kv['blocks_peak'] * per_block)} for 32 requests at once; the largest padded batch "
          f"of 8 held {_human(contiguous)}; {stats['steps']} engine steps")


def generate(args) -> int:
    """Stream completions of prompts (arguments or --file, one per line) through the paged cache."""
    import hf_paged
    from transformers import TextStreamer

    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                prompts += [line.rstrip("\n") for line in fh if line.strip()]
        except OSError as err:
            raise CliError(f"--file {args.file!r}: {err.strerror}") from None
    if not prompts:
        raise CliError("no prompts: give them as arguments or with --file")
    model, tokenizer = load(args)
    print(f"model: {_model_name(model, args)}", file=sys.stderr)
    hf_paged.enable(model, block_size=args.block_size, num_blocks=args.num_blocks)
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt").to(model.device)
        streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
        model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                       temperature=args.temperature or None, cache_implementation="hf_paged", streamer=streamer)
    return 0


def bench(args) -> int:
    """Side-by-side benchmarks on the same model and requests (see hf_paged/bench)."""
    from hf_paged.bench import suite

    if args.section == "hybrid":  # its own models (a Qwen3.5-like hybrid and an attention-only twin)
        from hf_paged.bench import hybrid

        results = hybrid.run(num_requests=args.num_requests, scale=args.scale, batch_size=args.batch_size,
                             rounds=1 if args.quick else min(args.repeats, 3))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_hybrid.json").write_text(json.dumps(results, indent=1, default=str))
        return 0
    model, _ = load(args)
    results = suite.run(model, num_requests=args.num_requests, scale=args.scale, batch_size=args.batch_size,
                        out_dir=args.out, block_size=args.block_size, num_blocks=args.num_blocks or 4096,
                        quick=args.quick, repeats=1 if args.quick else args.repeats, skip=tuple(args.skip))
    failed = [name for name, why in results.get("sections_not_run", {}).items() if "failed" in why]
    return 1 if failed else 0  # a section skipped for a missing optional package is said, not an error


def serve(args) -> int:
    """The OpenAI-compatible HTTP server (hf_paged/serve) on one LLMEngine, which runs in a process
    of its own (serve/engine_process.py) unless ``--no-engine-process`` or tensor parallelism."""
    if args.tensor_parallel_size < 1:
        raise CliError("--tensor-parallel-size must be positive")
    for name in ("port", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_body_bytes", "max_n",
                 "max_tokens_limit", "max_consecutive_failures", "max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise CliError(f"--{name.replace('_', '-')} must be positive")
    if args.max_logprobs < -1:
        raise CliError("--max-logprobs must be >= 0, or -1 (the whole vocabulary)")
    if not args.shutdown_timeout >= 0 or not args.stream_timeout > 0:
        raise CliError("--shutdown-timeout must be >= 0 and --stream-timeout > 0")
    engine_threads(args.engine_threads)  # checked here, not in the engine process
    lora_modules = _lora_modules(args)  # checked before the model loads
    from hf_paged.engine import tensor_parallel
    from hf_paged.serve import ServerSettings, build_app, server
    from hf_paged.serve.engine_process import EngineProcess

    if args.tensor_parallel_size > 1 and "RANK" not in os.environ:  # start the ranks, each running this command
        return tensor_parallel.launch(args.argv, args.tensor_parallel_size)
    api_key = args.api_key or os.environ.get("HF_PAGED_API_KEY") or None
    in_process = "RANK" in os.environ or not args.engine_process
    if in_process:
        engine = serving_engine(args)
        if engine.tp and not engine.tp.is_driver:
            engine.run_worker()  # until rank 0's server stops
            return 0
        where = "engine in this process"
    else:
        tokenizer = _byte_tokenizer() if args.model is None else _tokenizer(args.model)
        # by reference to hf_paged.__main__ as an importable module: run as ``python -m hf_paged``
        # this module is __main__, which a spawned process does not import
        build = functools.partial(importlib.import_module("hf_paged.__main__").serving_engine, args)
        try:
            threads, _ = engine_threads(args.engine_threads, own_process=True)
            with _environment(engine_process_env(threads)):  # read as the engine process starts
                engine = EngineProcess(build, tokenizer)
        except RuntimeError as err:
            raise CliError(str(err)) from None
        where = f"engine process {engine.process.pid}"
    settings = ServerSettings(model_name=_served_model_name(args), api_key=api_key,
                              max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting, max_n=args.max_n,
                              max_tokens=args.max_tokens_limit, max_logprobs=args.max_logprobs,
                              shutdown_timeout_s=args.shutdown_timeout,
                              stream_timeout_s=args.stream_timeout, generation_config=args.generation_config,
                              chat_template=_chat_template(args.chat_template),
                              trust_request_chat_template=args.trust_request_chat_template,
                              lora_modules=tuple(lora_modules),
                              allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    try:
        app = build_app(engine, settings)
        if app.state.sampling_defaults:
            defaults = ", ".join(f"{k}={v}" for k, v in app.state.sampling_defaults.items())
            print(f"hf-paged serve: request defaults from the model's generation config: {defaults} "
                  f"(--generation-config vllm to ignore them)", flush=True)
        print(f"hf-paged serve: '{settings.model_name}' on http://{args.host}:{args.port}/v1 "
              f"(API key {'required' if api_key else 'not required'}; {where})", flush=True)
        return server.run(app, args.host, args.port, api_key)
    finally:
        engine.close()  # the engine process, or the other tensor-parallel ranks


def _served_model_name(args) -> str:
    """The name clients give as ``model`` for the base model."""
    return args.served_model_name or args.model or "hf-paged-demo"


def _lora_modules(args) -> list[LoRAModulePath]:
    """``--lora-modules`` in vLLM's forms (``name=path`` or JSON items), checked: a bad item, a name
    given twice or the served model's, or adapters without ``--enable-lora`` (vLLM fails at start
    then too) are a ``CliError`` naming the item."""
    from hf_paged.serve.serving_models import lora_requests, parse_lora_modules

    try:
        modules = parse_lora_modules(args.lora_modules or [])
        lora_requests(modules, _served_model_name(args))
    except ValueError as err:
        raise CliError(str(err)) from None
    if modules and not args.enable_lora:
        raise CliError(f"--lora-modules {' '.join(args.lora_modules)}: the engine serves adapters only with "
                       "--enable-lora")
    return modules


def _load_lora_modules(engine: LLMEngine, args) -> None:
    """Read and check every ``--lora-modules`` adapter in the engine at start (as vLLM does), so a
    bad one stops the server now rather than failing its first request."""
    from hf_paged.serve.serving_models import lora_requests

    for lora in lora_requests(_lora_modules(args), _served_model_name(args)).values():
        try:
            engine.add_lora(lora)
        except ValueError as err:
            raise CliError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {err}") from None
        print(f"hf-paged serve: LoRA adapter '{lora.lora_name}' from {lora.lora_path}", flush=True)


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (vLLM takes both)."""
    if value is None or "{" in value:
        return value
    try:
        return Path(value).read_text()
    except OSError as err:
        raise CliError(f"--chat-template {value!r}: not a readable file ({err.strerror}) nor a Jinja template") from None


def _speculative_config(value: str | None) -> dict | None:
    """``--speculative-config``: vLLM's JSON object (``{"method": "ngram", "num_speculative_tokens": 4, ...}``)."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise CliError(f"--speculative-config {value!r}: not JSON ({err})") from None


def serving_engine(args) -> LLMEngine:
    """``hf-paged serve``'s engine, built where it will run (this process, or the engine process),
    which prints what it serves."""
    from hf_paged import LLMEngine
    from hf_paged.kernels import cpu_decode

    threads = None if "RANK" in os.environ else engine_threads(args.engine_threads, args.engine_process)  # ranks: TP's
    if threads:
        torch.set_num_threads(threads[0])  # before the model compiles: its kernels keep the count they were built for
    model, tokenizer = load_split(args) if "RANK" in os.environ else load(args)
    try:
        engine = LLMEngine(model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_consecutive_failures=args.max_consecutive_failures,
                           num_state_slots=args.num_state_slots, compile=False if args.enforce_eager else None,
                           cuda_graphs=args.cuda_graphs, max_model_len=args.max_model_len,
                           scheduling_policy=args.scheduling_policy,
                           speculative_config=_speculative_config(args.speculative_config),
                           enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                           max_cpu_loras=args.max_cpu_loras)
    except ValueError as err:  # an option the model or device rules out
        raise CliError(str(err)) from None
    if engine.tp and not engine.tp.is_driver:
        return engine
    print(f"hf-paged serve: model {_model_name(model, args)}", flush=True)
    print(f"hf-paged serve: {engine_memory_line(engine)}", flush=True)
    if threads:
        serial = engine.stats()["serial_step_max_tokens"]
        small = f"; steps of up to {serial} tokens run on one" if serial else ""
        print(f"hf-paged serve: engine threads {threads[0]} ({threads[1]}{small})", flush=True)
    print(f"hf-paged serve: engine steps {'eager: ' + engine.compile_note if engine.compile_note else 'compiled'}",
          flush=True)
    if cpu_decode.failure():
        print(f"hf-paged serve: the C reads did not build, gather + SDPA reads instead: {cpu_decode.failure()}",
              flush=True)
    _load_lora_modules(engine, args)
    return engine


EVERY_CORE_UP_TO = 2  # an engine in its own process on at most this many cores takes them all (measured on 2)


def engine_threads(requested: int | None, own_process: bool = True) -> tuple[int, str]:
    """``(torch threads for the served engine, why)``: ``--engine-threads``, else ``OMP_NUM_THREADS``,
    else every core this process may use but one. The server's own process (HTTP, tokenization,
    detokenization, and on a small machine often the clients too) needs a core: when the engine's
    OpenMP threads take them all, every wake-up of the server preempts one of them and the others
    wait for it at the end of each parallel region. vLLM reserves a core for the same reason
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``).

    Except on a machine of ``EVERY_CORE_UP_TO`` cores with the engine in a process of its own,
    where a reserved core is half the machine: there the engine takes every core, waits passively
    (:func:`engine_process_env`) and runs small steps on one thread (:mod:`hf_paged.engine.step_threads`),
    so decode steps leave a core to the server while prompts get both. 32 streaming clients on 2
    cores: 1,638-1,800 tok/s against 1,633-1,737 with one thread, time to the first token of a burst
    of new prompts (p99) 0.41-0.42 s against 0.61-0.67 s (benchmarks/RESULTS.md, tenth run)."""
    if requested is not None:
        if requested < 1:
            raise CliError("--engine-threads must be positive")
        return requested, "--engine-threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cores = _usable_cores()
    if cores == 1:
        return 1, "the only core"
    if own_process and cores <= EVERY_CORE_UP_TO:
        return cores, f"every one of {cores} cores, waiting passively; --engine-threads to change"
    return cores - 1, f"{cores} cores, one left to the server's process; --engine-threads to change"


def engine_process_env(threads: int, environ: dict | None = None) -> dict[str, str]:
    """OpenMP settings for the engine process. When its threads take every core this process may
    use, one of them shares a core with the server's own process (HTTP, tokenization, on a small
    machine often the clients): idle OpenMP threads then spin at each barrier while the thread they
    wait for is preempted. Passive waiting gives that core back (2 threads on 2 cores, 32 clients:
    the server's CPU per token 1.25 -> 0.79 ms, throughput +10%; benchmarks/RESULTS.md, sixth run).
    A user's own OpenMP wait settings are left alone."""
    environ = os.environ if environ is None else environ
    if threads < _usable_cores() or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in os.environ for the block (a spawned process copies the environment as it starts)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _byte_tokenizer():
    from hf_paged.demo import byte_tokenizer

    return byte_tokenizer()


DEFAULT_MAX_NEW_TOKENS = 32


def _common_options(defaults: bool, max_new_tokens: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. Only the top level has defaults:
    a subcommand's own default would overwrite what was given before its name."""
    common = argparse.ArgumentParser(add_help=False, argument_default=None if defaults else argparse.SUPPRESS)
    given = (lambda value: {"default": value}) if defaults else (lambda value: {})
    common.add_argument("--model", help="local checkpoint directory (default: the built-in demo model)")
    common.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    common.add_argument("--dtype", **given("float32"), help="float32 | float16 | bfloat16 (default: float32)")
    common.add_argument("--block-size", type=int, **given(16), help="tokens per KV block (default: 16)")
    common.add_argument("--num-blocks", type=int, help="fixed block budget (default: grow)")
    if max_new_tokens:
        common.add_argument("--max-new-tokens", type=int,
                            help=f"tokens to generate per prompt (demo, generate; default: {DEFAULT_MAX_NEW_TOKENS})")
    return common


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hf-paged", description=__doc__.split("\n")[0],
                                  parents=[_common_options(defaults=True, max_new_tokens=True)])
    common, generating = _common_options(False, False), _common_options(False, True)
    sub = top.add_subparsers(dest="command")
    sub.add_parser("demo", parents=[generating], help="stock vs paged generate: equality and KV memory")
    gen = sub.add_parser("generate", parents=[generating], help="stream completions of prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--file", help="a text file with one prompt per line")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b = sub.add_parser("bench", parents=[common], help="side-by-side throughput, latency and memory benchmarks")
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--scale", type=float, default=0.25, help="length scale of the ShareGPT-like workload")
    b.add_argument("--batch-size", type=int, default=8, help="batch size of the generate() baselines")
    b.add_argument("--out", default="benchmarks/out", help="where JSON and plots go")
    b.add_argument("--quick", action="store_true",
                   help="a smoke run: no Poisson-rate sweep, one round offline, fewer requests, shorter prompts")
    b.add_argument("--repeats", type=int, default=5, help="offline rounds (median reported)")
    b.add_argument("--section", choices=("all", "hybrid"), default="all",
                   help="all: the suite on --model; hybrid: hybrid models in the engine (hf_paged/bench/hybrid.py)")
    b.add_argument("--skip", action="append", default=[], choices=SUITE_SECTIONS, metavar="SECTION",
                   help="leave out a section of the suite (repeatable): " + ", ".join(SUITE_SECTIONS))
    s = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/...)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes on this machine (tp_plan='auto', gloo/NCCL)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="sequences per engine step")
    s.add_argument("--num-state-slots", type=int, default=None,
                   help="models with recurrent layers: sequences whose state is held at once (default: --max-num-seqs)")
    s.add_argument("--max-num-batched-tokens", type=int, default=4096, help="tokens per engine step")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="the most tokens a sequence may hold, prompt and output (default: the model's positions)")
    s.add_argument("--max-waiting", type=int, default=512, help="queued requests beyond which new ones get 503")
    s.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: first come, first served (a request's nonzero priority is a 400); priority: requests "
                        "run in order of their priority field (lower first), the last in that order preempted first")
    s.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding by n-gram lookup, vLLM\'s form: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (every token '
                        'as without it; pays where outputs repeat their context, at small batches on a CPU)')
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $HF_PAGED_API_KEY)")
    s.add_argument("--served-model-name", help="the model name clients pass (default: --model, or hf-paged-demo)")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    s.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto (default, as vLLM): the temperature, top_p, top_k, min_p, repetition_penalty and "
                        "max_new_tokens (a chat's max_tokens) of the model's generation_config.json are the "
                        "defaults of requests that set none; vllm: ignore them")
    s.add_argument("--chat-template", help="a Jinja chat template, or a file holding one, used instead of the "
                                           "tokenizer's (which a model without one needs for chat)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template (else a 400)")
    s.add_argument("--max-n", type=int, default=16, help="the largest n (and best_of) a request may ask for")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask for")
    s.add_argument("--max-logprobs", type=int, default=20,
                   help="the most top log-probs a request may ask for (logprobs, top_logprobs, prompt_logprobs); "
                        "-1: the whole vocabulary, which requests then get with -1 (vLLM's)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (then they end with an error)")
    s.add_argument("--stream-timeout", type=float, default=60.0,
                   help="a stream whose client reads nothing for this many seconds is aborted")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, apart from HTTP (default; not with tensor "
                        "parallelism): in one process they contend for the GIL and the cores")
    s.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the engine (default: $OMP_NUM_THREADS, else every core but one, which "
                        "the server's process keeps; on 2 cores, both for an engine in its own process)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="run engine steps eager (default: compiled with torch.compile at start where supported)")
    s.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: replay decode steps from CUDA graphs captured at start (opt-in; needs --num-blocks "
                        "or the default GPU budget)")
    s.add_argument("--max-consecutive-failures", type=int, default=3,
                   help="failed engine steps in a row after which /health answers 503 (a clean step resets it)")
    s.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters over the model (vLLM's): a request names one as its model")
    s.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH|JSON",
                   help='adapters served from the start, vLLM\'s forms: name=path, or \'{"name": ..., "path": ..., '
                        '"base_model_name": ...}\' (several, or the flag again; needs --enable-lora)')
    s.add_argument("--max-loras", type=int, default=1,
                   help="the most adapters among the requests of one step (vLLM's; others wait; default 1)")
    s.add_argument("--max-lora-rank", type=int, default=16, help="adapters of a larger rank are refused (default 16)")
    s.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded, least recently used unloaded first (default: --max-loras)")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which this server reads too)")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv  # what ranks started by --tensor-parallel-size run again
    try:
        if args.block_size < 1 or (args.num_blocks is not None and args.num_blocks < 1):
            raise CliError("--block-size and --num-blocks must be positive")
        if args.max_new_tokens is not None and args.command in ("bench", "serve"):
            raise CliError(f"--max-new-tokens is for demo and generate; {args.command} does not read it")
        if args.max_new_tokens is None:
            args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        return {"generate": generate, "bench": bench, "serve": serve}.get(args.command, demo)(args)
    except CliError as err:
        print(f"hf-paged: error: {err}", file=sys.stderr)
        return 2
    except NoFreeBlocksError as err:
        print(f"hf-paged: error: {err}", file=sys.stderr)  # it says what to change
        return 2


def cli() -> None:
    """The ``hf-paged`` command: :func:`main`, then a quick exit (see :func:`exit_process`)."""
    exit_process(main())


if __name__ == "__main__":
    cli()
