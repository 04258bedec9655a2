"""What structured outputs cost the engine (``python -m hf_paged.bench.structured``).

Side by side in one process, interleaved rounds, medians: the same batch of ``--batch`` requests
(default 32) run unconstrained and with every sequence constrained by a JSON schema, on the
built-in demo model (and, with ``--vocab N``, a random model of the same shape with a byte-level
BPE vocabulary of N tokens trained here on Python's docstrings: mask work grows with the
vocabulary). Reported:

* **engine-thread time of the constraint per sequence and step**: the time spent in the two hooks
  (:meth:`StructuredOutputManager.mask`: batched bitmask fill, UTF-8 guard, in-place apply;
  :meth:`~StructuredOutputManager.advance`: matchers over the new tokens), divided by the
  constrained sequences of the step (target: <= 30 us);
* **step time**, constrained over unconstrained, on steps where the whole batch decodes (target:
  <= 1.15x): seeded sampling (both batches sample row by row: the difference is the constraint)
  and greedy (both take the batched argmax; a constrained row is masked in place before it);
* for reference, the fill alone: xgrammar's batched fill of 32 matchers against a Python loop
  over them (what the issue measured at about 28 us per matcher on a large vocabulary).

The schema keeps every sequence inside a long string field for the whole run, so every step has
the full batch constrained. Engine threads: one intra-op torch thread (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.constraints import StructuredOutputsParams
from hf_paged.demo import byte_tokenizer, demo_config, demo_model

SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string", "minLength": 200, "maxLength": 300},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["api", "io", "text", "math"]}, "maxItems": 3}},
    "required": ["summary", "rating", "tags"]}
PROMPTS = ["Return a new list", "Open the file and", "Convert the string", "Compute the sum of",
           "Raise ValueError if", "Read the config", "Parse the header", "Close the socket"]


class _Timed:
    """Wraps the manager's hooks: seconds spent in them, and constrained rows seen, per step."""

    def __init__(self, engine: LLMEngine):
        self.hook_s, self.rows = 0.0, 0
        manager = engine.structured
        for name in ("mask", "advance"):
            setattr(manager, name, self._wrap(getattr(manager, name), name == "mask"))

    def _wrap(self, fn, counts_rows: bool):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.hook_s += time.perf_counter() - start
                if counts_rows:
                    self.rows += sum(s.needs_logits for s in args[0].sequences)
        return timed


def _run(engine: LLMEngine, params: SamplingParams, batch: int) -> dict:
    """One batch to completion; step times of the steps where all ``batch`` sequences decode."""
    timer = engine.structured.__dict__.get("_bench_timer")
    for i in range(batch):
        engine.add_request(PROMPTS[i % len(PROMPTS)] + f" #{i}", params)
    full_steps, hook_s, rows = [], 0.0, 0
    while engine.has_unfinished_requests():
        before = (timer.hook_s, timer.rows) if timer else (0.0, 0)
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        decoding = sum(len(r.live_seqs) for r in engine.scheduler.running)
        if decoding == batch and not any(o.finished for o in outputs) and engine.stats()["waiting"] == 0:
            full_steps.append(elapsed)
            if timer:
                hook_s += timer.hook_s - before[0]
                rows += timer.rows - before[1]
    return {"step_s": full_steps, "hook_s": hook_s, "rows": rows}


def measure(model, tokenizer, *, batch: int, tokens: int, rounds: int, log=print) -> dict:
    """Interleaved rounds of the unconstrained and constrained batches, greedy and sampled."""
    engine = LLMEngine(model, tokenizer, num_blocks=4096, max_num_seqs=batch, max_num_batched_tokens=4096)
    engine.structured.__dict__["_bench_timer"] = _Timed(engine)
    constraint = StructuredOutputsParams(json=SCHEMA)
    engine.structured.compiler.compile(constraint)  # compiled once, before the clock runs
    results = {}
    for mode, sampling in (("sampled", dict(temperature=1.0, seed=0)), ("greedy", dict(temperature=0))):
        kinds = {"unconstrained": SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling),
                 "json schema": SamplingParams(max_new_tokens=tokens, structured_outputs=constraint, **sampling)}
        _run(engine, kinds["unconstrained"], batch)  # warm-up
        runs = {name: [] for name in kinds}
        for round_ in range(rounds):
            for name, params in kinds.items():
                runs[name].append(_run(engine, params, batch))
                last = runs[name][-1]
                log(f"  {mode} round {round_ + 1}: {name:<14} step {1e3 * statistics.median(last['step_s']):6.2f} ms"
                    + (f", hooks {1e6 * last['hook_s'] / max(last['rows'], 1):5.1f} us/seq" if last["rows"] else ""))
        plain = statistics.median(statistics.median(r["step_s"]) for r in runs["unconstrained"])
        constrained = statistics.median(statistics.median(r["step_s"]) for r in runs["json schema"])
        per_seq = statistics.median(r["hook_s"] / r["rows"] for r in runs["json schema"])
        ratios = [statistics.median(c["step_s"]) / statistics.median(u["step_s"])
                  for u, c in zip(runs["unconstrained"], runs["json schema"])]
        results[mode] = {"unconstrained_step_ms": 1e3 * plain, "constrained_step_ms": 1e3 * constrained,
                         "ratio": constrained / plain, "per_round_ratios": ratios,
                         "hook_us_per_sequence": 1e6 * per_seq,
                         "steps_measured": sum(len(r["step_s"]) for r in runs["json schema"])}
    results["fill"] = fill_micro(engine, constraint, batch)
    return results


def fill_micro(engine: LLMEngine, constraint: StructuredOutputsParams, batch: int, repeats: int = 200) -> dict:
    """xgrammar's batched fill against a Python loop over the matchers (same states)."""
    import xgrammar as xgr

    grammar = engine.structured.compiler.compile(constraint)
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
    for i, matcher in enumerate(matchers):  # different states: inside the string, at its start, a key
        matcher.accept_string('{"summary": "' + "abc def "[: i % 8])
    bitmask = xgr.allocate_token_bitmask(batch, engine.config.vocab_size)
    filler = xgr.BatchGrammarMatcher(1)

    def batched():
        filler.batch_fill_next_token_bitmask(matchers, bitmask)

    def looped():
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    out = {}
    for name, fn in (("batched", batched), ("python loop", looped)):
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = 1e6 * (time.perf_counter() - start) / repeats / batch
    return {"us_per_matcher": out}


def bpe_setup(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on the standard library's
    docstrings (as the demo model was), and a random model of the demo's shape over it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from hf_paged.train_demo import stdlib_docstrings

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = stdlib_docstrings(2_000_000)
    core.train_from_iterator((text[i:i + 10_000] for i in range(0, len(text), 10_000)), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config(vocab_size=len(tokenizer))).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model, tokenizer


def report(name: str, results: dict) -> str:
    lines = [f"{name}:", "| decoding | unconstrained step | JSON-schema step | ratio (per round) | "
                         "constraint time per sequence and step |", "| --- | --- | --- | --- | --- |"]
    for mode in ("sampled", "greedy"):
        r = results[mode]
        rounds = ", ".join(f"{x:.3f}" for x in r["per_round_ratios"])
        lines.append(f"| {mode} | {r['unconstrained_step_ms']:.2f} ms | {r['constrained_step_ms']:.2f} ms | "
                     f"{r['ratio']:.3f}x ({rounds}) | {r['hook_us_per_sequence']:.1f} us |")
    fill = results["fill"]["us_per_matcher"]
    lines.append(f"fill alone: batched {fill['batched']:.2f} us per matcher, Python loop {fill['python loop']:.2f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--vocab", type=int, default=0, help="also measure a BPE vocabulary of this size")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"built-in demo model (259-token byte vocabulary)":
               measure(demo_model(), byte_tokenizer(), batch=args.batch, tokens=args.tokens, rounds=args.rounds)}
    if args.vocab:
        model, tokenizer = bpe_setup(args.vocab)
        results[f"demo shape, {len(tokenizer)}-token BPE vocabulary"] = measure(
            model, tokenizer, batch=args.batch, tokens=args.tokens, rounds=args.rounds)
    for name, result in results.items():
        print(report(name, result))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
