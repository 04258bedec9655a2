"""One rank of the tensor-parallel tests, started by ``torch.distributed.run`` (see tests/test_tensor_parallel.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/tp_worker.py CHECKPOINT BAD_CHECKPOINT OUT.json

Every scenario runs in every rank (the forwards of a split model need all ranks); rank 0 writes
what it saw, plus what the other ranks reported, to ``OUT.json``. The last scenario, a fault in
rank 1's forward, stops the group: each rank writes what it saw to ``fault-rank<R>.json`` next
to ``OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from hf_paged import LLMEngine, SamplingParams, enable
from hf_paged.engine.tensor_parallel import load_model

PROMPTS = [[5, 17, 33, 8, 61, 12, 9], [44, 3, 71, 29], list(range(10, 40)), [88, 7, 19, 23, 54, 66, 2, 90, 31]]
TINY_PROMPTS, TINY_BUDGET = [PROMPTS[0], PROMPTS[1], PROMPTS[3]], 8  # 12 blocks of 4 needed at once: preemptions


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


CONSTRAINED_REGEX = r"[A-Z]{2}-[0-9]{1,3}"


def constrained_requests():
    """Structured outputs and logit_bias under tensor parallelism (rank 0 samples; the tiny
    model's 96 tokens are the byte tokenizer's first ones: '!' to '}')."""
    from hf_paged.constraints import StructuredOutputsParams

    regex = StructuredOutputsParams(regex=CONSTRAINED_REGEX)
    return [SamplingParams(max_new_tokens=8, temperature=0, structured_outputs=regex),
            SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=2, structured_outputs=regex),
            SamplingParams(max_new_tokens=4, temperature=0, logit_bias={40: 100.0})]


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def main(checkpoint: str, bad_checkpoint: str, out_path: str) -> None:
    model = load_model(checkpoint)
    rank = dist.get_rank()
    report: dict = {"world_size": dist.get_world_size()}

    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True)
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    report["greedy"] = _token_ids(engine.generate(PROMPTS, greedy, use_tqdm=False))  # every rank calls it
    report["sampled"] = _token_ids(engine.generate(PROMPTS[:2], sampled, use_tqdm=False))
    report["stats"] = {k: v for k, v in engine.stats().items() if k in ("tensor_parallel_size", "kv_heads_per_rank")}
    drafting = LLMEngine(model, block_size=4, num_blocks=64, speculative_config=SPECULATIVE)  # drafts rank 0 decides
    report["drafted"] = [_token_ids(drafting.generate(PROMPTS, greedy, use_tqdm=False)),
                         _token_ids(drafting.generate(PROMPTS[:2], sampled, use_tqdm=False))]
    report["draft_tokens"] = drafting.stats()["spec_draft_tokens"]
    from hf_paged.demo import byte_tokenizer

    constrained = LLMEngine(model, byte_tokenizer(), block_size=4, num_blocks=64)
    report["constrained"] = _token_ids(constrained.generate(PROMPTS[:3], constrained_requests(), use_tqdm=False))
    pools = {layer: list(pool.shape) for layer, pool in engine.runner.storage.key_pools.items()}

    # Online: requests arrive at rank 0 only, between steps; the other ranks follow.
    if rank == 0:
        online: dict[str, list[int]] = {}
        engine.add_request(PROMPTS[0], greedy, request_id="a")
        for step in range(200):
            if step == 3:
                engine.add_request(PROMPTS[1], greedy, request_id="b")
            for out in engine.step():
                if out.finished:
                    online[out.request_id] = out.outputs[0].token_ids
            if len(online) == 2:
                break
        engine.close()
        report["online"] = online
        report["blocks_used_after"] = engine.stats()["blocks_used"]
    else:
        engine.run_worker()
        try:
            engine.add_request(PROMPTS[0], greedy)
        except RuntimeError as err:
            report["follower_refuses_requests"] = str(err)

    # Preemption under a tiny budget (recompute and swap).
    tiny = {}
    for mode in ("recompute", "swap"):
        small = LLMEngine(model, block_size=4, num_blocks=TINY_BUDGET, max_num_seqs=4, preemption_mode=mode)
        tiny[mode] = {"tokens": _token_ids(small.generate(TINY_PROMPTS, greedy, use_tqdm=False)),
                      "preemptions": small.stats()[f"preemptions_{mode}"]}
    report["tiny_budget"] = tiny

    # Prefix-cache snapshots: one file per rank, saved and loaded by every rank making the same calls.

    from hf_paged import SnapshotError
    from hf_paged.prefix_snapshot import shard_path

    shared = list(range(50, 66))  # 4 blocks of 4
    snap = os.path.join(os.path.dirname(out_path), "prefix.safetensors")
    saver = LLMEngine(model, block_size=4, num_blocks=64)
    saver.generate([shared + [7, 8, 9]], greedy, use_tqdm=False)
    report["snapshot_saved"] = saver.save_prefix_cache(snap)
    loader = LLMEngine(model, block_size=4, num_blocks=64)
    report["snapshot_loaded"] = loader.load_prefix_cache(snap)
    report["snapshot_tokens"] = _token_ids(loader.generate([shared + [11, 12]], greedy, use_tqdm=False))
    report["snapshot_hits"] = loader.stats()["prefix_cache_hit_tokens"]
    dist.barrier()
    if rank == 0:  # damage rank 1's file: nobody loads anything
        victim = shard_path(snap, 1, 2)
        data = bytearray(victim.read_bytes())
        data[-50:] = bytes(50)
        victim.write_bytes(bytes(data))
    dist.barrier()
    refused = LLMEngine(model, block_size=4, num_blocks=64)
    try:
        refused.load_prefix_cache(snap)
    except SnapshotError as err:
        report["snapshot_refused"] = str(err)
    report["blocks_cached_after_refusal"] = refused.stats()["blocks_cached"]

    # A KV budget from bytes that differ by rank (as free memory would): every rank takes the smallest.
    budgeted = LLMEngine(model, block_size=4, kv_cache_bytes=(1 + rank) * 64 * 1024)
    report["agreed_pool_sizes"] = list(budgeted.kv.pool_sizes)

    # The flag in generate(), every rank calling generate() the same way.
    enable(model, block_size=4)
    ids = torch.tensor([PROMPTS[1]])
    flagged = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, cache_implementation="hf_paged")
    report["generate_flag"] = flagged[0, ids.shape[1]:].tolist()

    # Heads that do not divide by the world size.
    try:
        load_model(bad_checkpoint)
    except ValueError as err:
        report["bad_heads_error"] = str(err)

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"pools": pools, **{k: v for k, v in report.items() if k != "world_size"}})
    if rank == 0:
        report["ranks"] = everyone
        with open(out_path, "w") as fh:
            json.dump(report, fh)
    fault = fault_in_rank_1(model, rank)
    with open(os.path.join(os.path.dirname(out_path), f"fault-rank{rank}.json"), "w") as fh:
        json.dump(fault, fh)
    if dist.is_initialized():
        dist.destroy_process_group()


FAULT_AT_STEP = 3


def fault_in_rank_1(model, rank: int) -> dict:
    """Rank 1's forward raises at its third step: rank 1 tears the group down and leaves
    run_worker with an error; rank 0, waiting for it inside the forward's all-reduce, fails the
    step and every request at once, and refuses more work. Nobody hangs."""
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    seen: dict = {}
    start = time.monotonic()
    if rank != 0:
        execute, calls = engine.runner.execute, [0]

        def faulty(step):
            calls[0] += 1
            if calls[0] == FAULT_AT_STEP:
                raise RuntimeError(f"injected fault in rank {rank}'s forward")
            return execute(step)

        engine.runner.execute = faulty
        try:
            engine.run_worker()
        except RuntimeError as err:
            seen["error"] = str(err)
    else:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(prompt, greedy, request_id=str(i))
        finished = {}
        while engine.has_unfinished_requests() and time.monotonic() - start < 60:
            finished.update({o.request_id: (o.error, o.error_kind) for o in engine.step() if o.finished})
        seen.update(finished=finished, healthy=engine.healthy, stats_healthy=engine.stats()["healthy"])
        for what, call in (("add_request", lambda: engine.add_request(PROMPTS[0], greedy)), ("step", engine.step)):
            try:
                call()
            except RuntimeError as err:
                seen[f"refused_{what}"] = str(err)
    seen["seconds"] = time.monotonic() - start
    return seen


if __name__ == "__main__":
    main(*sys.argv[1:4])
