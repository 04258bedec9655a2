"""Two source trees of hf_paged side by side: same tokens? same speed?

    python benchmarks/compare_revisions.py BEFORE_TREE AFTER_TREE [--rounds 5] [--out FILE]

Each tree (a checkout, e.g. ``git worktree add /tmp/base <rev>``) runs the ShareGPT-like offline
part of ``python -m hf_paged bench --quick`` (built-in demo model, 64 requests, greedy; padded
``generate()`` in batches of 8, then the engine) in a fresh process, after the same untimed
warm-up. Rounds alternate between the trees, so both see the same drift of a shared machine.
Reported: whether every round's tokens are identical (engine and padded generate, across trees),
and engine / padded generate per round and its median per tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside the child process: imports hf_paged from TREE (its kernels/ folder as hf_paged.kernels),
# ahead of any installed copy.
_CHILD = r'''
import importlib.machinery, importlib.util, json, sys, time
from pathlib import Path

TREE = Path(sys.argv[1])
ROOTS = {"hf_paged": TREE / "hf_paged", "hf_paged.kernels": TREE / "kernels"}

class TreeFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ROOTS:
            return importlib.util.spec_from_file_location(
                name, ROOTS[name] / "__init__.py", submodule_search_locations=[str(ROOTS[name])])
        parent = name.rpartition(".")[0]
        if parent in ROOTS:
            return importlib.machinery.PathFinder.find_spec(name, [str(ROOTS[parent])])
        return None

sys.meta_path.insert(0, TreeFinder)
import torch
import hf_paged
from hf_paged.bench import systems, workloads
from hf_paged.demo import demo_model

assert Path(hf_paged.__file__).resolve().is_relative_to(TREE.resolve()), hf_paged.__file__
model = demo_model(dtype=torch.float32)
vocab = model.config.vocab_size
engine_kwargs = dict(block_size=16, num_blocks=4096, max_num_batched_tokens=512, max_num_seqs=256)
warm = workloads.dataset("sharegpt", 8, scale=0.25, vocab=vocab, seed=1)
systems.batched_generate(model, warm, 8, paged=False)
systems.engine_run(model, warm, **engine_kwargs)
share = workloads.dataset("sharegpt", 64, scale=0.25, vocab=vocab)
padded = systems.batched_generate(model, share, 8, paged=False)
engine = systems.engine_run(model, share, **engine_kwargs)
print(json.dumps({"padded_tok_s": padded.summary(share)["tokens_per_s"],
                  "engine_tok_s": engine.summary(share)["tokens_per_s"],
                  "padded_tokens": padded.tokens, "engine_tokens": engine.tokens}))
'''


def run(tree: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, tree], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the rounds and the summary as JSON")
    args = parser.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(run(tree))
            r = rounds[name][-1]
            print(f"round {i + 1} {name:<6} engine {r['engine_tok_s']:7.1f} tok/s, padded generate "
                  f"{r['padded_tok_s']:6.1f} tok/s, ratio {r['engine_tok_s'] / r['padded_tok_s']:.2f}x", flush=True)
    reference = rounds["before"][0]
    identical = all(r["engine_tokens"] == reference["engine_tokens"] and r["padded_tokens"] == reference["padded_tokens"]
                    for rs in rounds.values() for r in rs)
    summary = {"tokens_identical": identical, "rounds": args.rounds}
    for name, rs in rounds.items():
        ratios = [r["engine_tok_s"] / r["padded_tok_s"] for r in rs]
        summary[name] = {"engine_vs_padded_per_round": ratios, "median": statistics.median(ratios),
                         "engine_tok_s_median": statistics.median(r["engine_tok_s"] for r in rs)}
    print(json.dumps(summary, indent=1))
    if args.out:
        slim = {name: [{k: v for k, v in r.items() if not k.endswith("_tokens")} for r in rs] for name, rs in rounds.items()}
        Path(args.out).write_text(json.dumps({"summary": summary, "rounds": slim}, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
