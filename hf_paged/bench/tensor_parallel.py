"""Tensor parallelism: the engine on 2 ranks against 1 process, same model and requests.

    python -m hf_paged.bench.tensor_parallel [--requests 48] [--ranks 2] [--out benchmarks/cpu]

The built-in demo model (4 layers x 256 hidden, 8 heads, 2 KV heads), greedy, ShareGPT-like
lengths. One process uses as many torch threads as the ranks together (``--ranks``), so both
sides get the same cores; each rank runs one thread and its forwards all-reduce over gloo.
Reports generated tokens per second of each, their ratio, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

MODULE = "hf_paged.bench.tensor_parallel"


def _workload(requests: int, vocab: int):
    from hf_paged.bench import workloads

    return workloads.dataset("sharegpt", requests, scale=0.15, vocab=vocab, seed=3)


def _run_engine(model, requests: int) -> dict:
    from hf_paged import LLMEngine, SamplingParams

    wl = _workload(requests, model.config.vocab_size)
    engine = LLMEngine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512)
    params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0, ignore_eos=True) for r in wl.requests]
    prompts = [r.prompt for r in wl.requests]
    engine.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    engine.close()
    return {"wall_s": wall, "generated_tokens": tokens, "tokens_per_s": tokens / wall,
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def _worker(checkpoint: str, requests: int, out: str) -> None:
    import torch.distributed as dist

    from hf_paged.engine.tensor_parallel import load_model

    torch.set_num_threads(1)
    result = _run_engine(load_model(checkpoint), requests)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run(requests: int = 48, ranks: int = 2, log=print) -> dict:
    from hf_paged.demo import demo_model
    from hf_paged.engine.tensor_parallel import launch

    model = demo_model()
    before = torch.get_num_threads()
    torch.set_num_threads(ranks)
    try:
        single = _run_engine(model, requests)
    finally:
        torch.set_num_threads(before)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out = os.path.join(tmp, "tp.json")
        env_before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            status = launch(["--worker", tmp, str(requests), out], ranks, module=MODULE)
        finally:
            if env_before is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = env_before
        if status:
            raise RuntimeError(f"the tensor-parallel ranks failed (exit status {status})")
        split = json.loads(Path(out).read_text())
    result = {
        "requests": requests, "ranks": ranks,
        "single_process": {k: v for k, v in single.items() if k != "token_ids"},
        "tensor_parallel": {k: v for k, v in split.items() if k != "token_ids"},
        "tp_over_single": split["tokens_per_s"] / single["tokens_per_s"],
        "identical_outputs": split["token_ids"] == single["token_ids"],
    }
    log(f"  1 process, {ranks} threads: {single['tokens_per_s']:.1f} tok/s; {ranks} ranks x 1 thread: "
        f"{split['tokens_per_s']:.1f} tok/s ({result['tp_over_single']:.2f}x); identical: {result['identical_outputs']}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(argv[1], int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/cpu")
    args = parser.parse_args(argv)
    result = run(args.requests, args.ranks)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tensor_parallel.json").write_text(json.dumps(result, indent=1))
    return 0 if result["identical_outputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
