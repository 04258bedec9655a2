"""GPU check: generate() through the paged cache with the Triton kernels on CUDA equals the CPU paged path.

float32, IEEE fp32 dots in the kernels, tiny random models of several architectures, greedy and
beam search. The CPU paged path is itself token-exact with stock transformers (tests/test_equality.py),
so equality here means the kernels reproduce stock outputs. Also counts kernel launches, so a
silent fallback to the reference path cannot pass.

    python benchmarks/gpu_equality.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# the repository root (tests.helpers) in place of this script's folder, whose kernels.py would shadow
# Hugging Face's `kernels` package that transformers imports
sys.path[0] = str(Path(__file__).resolve().parents[1])

import hf_paged  # noqa: E402
from hf_paged import kernels  # noqa: E402
from tests.helpers.tiny_models import build, left_padded  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2", "opt"]
MODES = {
    "greedy_batch": dict(do_sample=False),
    "beam4_n2": dict(do_sample=False, num_beams=4, num_return_sequences=2),
}


def _count_calls(counter: dict):
    """Wrap the kernel entry points to count the Triton launches that the attention function makes."""
    for name in ("paged_attention_decode", "paged_attention_prefill"):
        original = getattr(kernels, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if args[0].is_cuda:
                counter[_name] = counter.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(kernels, name, wrapped)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    rows, cols = torch.nonzero(a != b, as_tuple=True)
    return f"row {int(rows[0])}, column {int(cols[0])}" if len(rows) else "none"


def check_model_equality(out_dir: str | os.PathLike | None = None) -> dict:
    if not torch.cuda.is_available():
        print("gpu_equality: CUDA not available, skipped")
        return {"skipped": "no CUDA"}
    if hasattr(kernels, "set_fp32_precision"):
        kernels.set_fp32_precision("ieee")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    counter: dict[str, int] = {}
    _count_calls(counter)
    ids, mask = left_padded([5, 19, 40, 70])
    results = []
    for arch in ARCHS:
        for mode, kwargs in MODES.items():
            for block_size in (16,):
                row = {"arch": arch, "mode": mode, "block_size": block_size}
                try:
                    model = hf_paged.enable(build(arch), block_size=block_size)
                    outs = {}
                    for device in ("cpu", "cuda"):
                        model.to(device)
                        before = dict(counter)
                        start = time.perf_counter()
                        outs[device] = model.generate(
                            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=24,
                            cache_implementation="hf_paged", **kwargs,
                        ).cpu()
                        row[f"{device}_s"] = round(time.perf_counter() - start, 3)
                        if device == "cuda":
                            row["kernel_calls"] = {k: counter.get(k, 0) - before.get(k, 0) for k in counter}
                    row["equal"] = bool(torch.equal(outs["cpu"], outs["cuda"]))
                    row["kernels_used"] = sum(row.get("kernel_calls", {}).values()) > 0
                    if not row["equal"]:
                        row["first_difference"] = _first_difference(outs["cpu"], outs["cuda"])
                except Exception as err:  # keep going: one failure must not hide the rest
                    row["error"] = f"{type(err).__name__}: {err}"
                results.append(row)
                status = "PASS" if row.get("equal") and row.get("kernels_used") else "FAIL"
                print(f"[{status}] {arch:<9} {mode:<13} bs={block_size:<3} "
                      f"{ {k: v for k, v in row.items() if k not in ('arch', 'mode', 'block_size')} }", flush=True)
    results += check_engine_equality(counter)
    passed = sum(1 for r in results if r.get("equal") and r.get("kernels_used"))
    summary = {"passed": passed, "total": len(results), "results": results}
    print(f"gpu_equality: {passed}/{len(results)} token-identical with kernels active")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu_equality.json").write_text(json.dumps(summary, indent=1))
    return summary


def check_engine_equality(counter: dict) -> list[dict]:
    """LLMEngine on CUDA (packed decode + varlen prefill kernels, preemption; eager steps, steps
    through the compiled decoder body, decode steps replayed from CUDA graphs) vs per-request CPU
    generate()."""
    from hf_paged import LLMEngine, SamplingParams

    results = []
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 100, (16,), generator=g)]
    for arch, mode, num_blocks, compile, graphs in (
            ("llama", "recompute", 40, False, False), ("gemma2", "swap", 40, False, False),
            ("qwen2", "recompute", None, False, False), ("llama", "recompute", 40, True, False),
            ("gemma2", "swap", 40, True, False), ("llama", "recompute", 40, False, True),
            ("gemma2", "swap", 40, True, True)):
        row = {"arch": arch, "mode": f"engine-{mode}" + ("-compiled" if compile else "") + ("-graphs" if graphs else ""),
               "block_size": 8}
        try:
            model = build(arch)
            refs = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(p):].tolist() for p in prompts]
            model.to("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a dry run of this check
            before = dict(counter)
            start = time.perf_counter()
            engine = LLMEngine(model, block_size=8, num_blocks=num_blocks, max_num_batched_tokens=128,
                               preemption_mode=mode, compile=compile, cuda_graphs=graphs and model.device.type == "cuda")
            row["compiled"] = engine.stats()["compiled"]
            row["cuda_graphs"] = engine.stats()["cuda_graphs"]
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
            row["cuda_s"] = round(time.perf_counter() - start, 3)
            row["kernel_calls"] = {k: counter.get(k, 0) - before.get(k, 0) for k in counter}
            row["kernels_used"] = sum(row["kernel_calls"].values()) > 0
            mismatches = [i for i, (r, o) in enumerate(zip(refs, outs)) if r != o.outputs[0].token_ids]
            row["equal"] = not mismatches
            row["mismatched_prompts"] = mismatches
            stats = engine.stats()
            row.update(blocks_total=stats["blocks_total"], preemptions=stats[f"preemptions_{mode}"],
                       leaked_blocks=engine.kv.num_used_blocks())
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
        print(f"[{'PASS' if row.get('equal') and row.get('kernels_used') else 'FAIL'}] {row}", flush=True)
        results.append(row)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    summary = check_model_equality(parser.parse_args().out)
    sys.exit(0 if summary.get("passed") == summary.get("total") else 1)
