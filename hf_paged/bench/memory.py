"""The paper's two memory figures: KV utilization (Figure 2) and sharing savings (Figure 15)."""

from __future__ import annotations

import torch

from hf_paged.bench.workloads import Workload


def kv_utilization(workload: Workload, max_len: int, block_sizes=(8, 16, 32)) -> dict[str, float]:
    """Fraction of reserved KV slots that hold real tokens, over the workload's final lengths."""
    lengths = [len(r.prompt) + r.max_new_tokens for r in workload.requests]
    used = sum(lengths)

    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    result = {
        "contiguous, reserve max length": used / (len(lengths) * max_len),
        "contiguous, reserve next power of two": used / sum(pow2(n) for n in lengths),
        "contiguous, reserve exact final length (oracle)": used / used,
    }
    for bs in block_sizes:
        result[f"paged, block size {bs}"] = used / sum(-(-n // bs) * bs for n in lengths)
    return result


@torch.inference_mode()
def sharing_savings(model, workload: Workload, block_size: int = 16) -> dict[str, float]:
    """Blocks in use with sharing vs the blocks the same sequences would hold without it, summed
    over every engine step (the paper's Figure 15: memory saved by parallel sampling / beams)."""
    from hf_paged import LLMEngine, SamplingParams

    engine = LLMEngine(model, block_size=block_size, enable_prefix_caching=False)
    for r in workload.requests:
        engine.add_request(r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.8, seed=0,
                                                    ignore_eos=True, n=r.n, num_beams=r.num_beams))
    shared = unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [s for q in engine.scheduler.running for s in q.live_seqs if engine.kv.holds(s)]
        shared += engine.kv.stats()["blocks_used"]
        unshared += sum(len(engine.kv.block_table(s)) for s in live)
    return {"blocks_with_sharing": shared, "blocks_without_sharing": unshared,
            "saving": 1 - shared / unshared if unshared else 0.0}
