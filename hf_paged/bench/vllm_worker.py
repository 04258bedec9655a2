"""The vLLM side of ``python -m hf_paged.bench.vs_vllm``, run by path with vLLM's own python.

vLLM's venv has no hf_paged (and hf_paged's has no vLLM), so this file imports nothing but the
standard library at the top and ``vllm`` inside the one function that runs it. The coordinator
starts it as ``VLLM_PYTHON vllm_worker.py SPEC.json RESULT.json`` (a fresh process per run: vLLM
spawns an engine-core and a worker process of its own, hence the ``__main__`` guard).

It also holds the helpers both sides need without hf_paged: the CPU time of a process tree read
from /proc (vLLM's work happens in child processes, which ``os.times()`` does not see while they
live), the CPU time everything else on the machine took meanwhile (on a shared machine, what a run
competed with), and the versions record.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time


def tree_pids(root: int) -> list[int]:
    """``root`` and every process below it (from the parent ids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of ``root`` (default: this process) and its live descendants,
    all threads included: what a process tree has cost the machine so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in tree_pids(os.getpid() if root is None else root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Around a block: its wall time, the CPU time of the process trees ``roots`` (default: this
    process), and ``other_load_cores``, the CPU the rest of the machine used per wall second."""

    def __init__(self, *roots: int):
        self.roots = roots or (os.getpid(),)

    def __enter__(self) -> Meter:
        self._busy, self._cpu = machine_busy_seconds(), [tree_cpu_seconds(r) for r in self.roots]
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = [tree_cpu_seconds(r) - c for r, c in zip(self.roots, self._cpu)]
        others = machine_busy_seconds() - self._busy - sum(self.cpu_s)
        self.other_load_cores = max(0.0, others / self.wall_s)


def versions(*modules: str) -> dict:
    """Python and each module's ``__version__`` (None where it does not import)."""
    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - a missing or broken module is recorded, not raised
            out[name] = None
    return out


def _resolved(llm) -> dict:
    """The settings vLLM ended up with (its defaults filled in), for the results."""
    config = llm.llm_engine.vllm_config
    return {"block_size": config.cache_config.block_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "enforce_eager": config.model_config.enforce_eager,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "compilation_mode": str(getattr(config.compilation_config, "mode", None))}


def run_offline(spec: dict) -> dict:
    """``LLM.generate`` on the spec's requests after an untimed warm-up call; only the timed call's
    wall and process-tree CPU time are counted."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(**spec["engine"])

    def call(requests: list[dict]) -> tuple[list[list[int]], Meter]:
        prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
        params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False,
                                 **spec.get("sampling", {"temperature": 0.0})) for r in requests]
        loras = [LoRARequest(*r["lora"]) if r.get("lora") else None for r in requests]  # [name, id, path]
        with Meter() as meter:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None)
        return [list(o.outputs[0].token_ids) for o in outs], meter

    call(spec["warmup"])
    tokens, meter = call(spec["requests"])
    return {"wall_s": meter.wall_s, "cpu_s": meter.cpu_s[0], "other_load_cores": meter.other_load_cores,
            "tokens": tokens, "resolved": _resolved(llm), "versions": versions("vllm", "torch", "transformers")}


def run_child(argv: list[str], run, usage: str) -> int:
    """A child process of the benchmark: ``argv`` is ``SPEC.json RESULT.json``; ``run(spec)``'s JSON
    result goes to the second."""
    if len(argv) != 2:
        print(f"usage: {usage} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


def main(argv: list[str]) -> int:
    return run_child(argv, run_offline, "VLLM_PYTHON vllm_worker.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
