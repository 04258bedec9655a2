"""Every architecture the engine serves and tests, through compiled steps: compiled or eager, and why;
greedy tokens equal to per-request stock ``generate()``?

    python benchmarks/compiled_architectures.py [MODEL_TYPE ...] [--timeout 240]

For each entry that ``tests/test_architectures.py`` runs in ``LLMEngine`` (its tiny model with
varied greedy output, blocks of 4, chunks of 8, 5 new tokens), this builds the engine with its
default ``compile=None`` (``HF_PAGED_COMPILE`` forced to 1) and prints one line: compiled or not
(``engine.compile_note``), whether the tokens equal stock, and any request error. Exit status 1 when
a compiled model fails a request or differs from stock. About 20 minutes for all on 2 cores (most of
it inductor's C++ builds; cached on disk for a second run). Not a timed test: the suite's own check
is ``tests/test_compiled_body.py`` on six families.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

# the checkout's root instead of this folder, whose kernels.py would shadow the `kernels` package
sys.path[0] = str(Path(__file__).resolve().parents[1])
os.environ["HF_PAGED_COMPILE"] = "1"

import torch  # noqa: E402

import hf_paged  # noqa: E402
from tests.test_architectures import _prompts, _quietly, _stock_tokens, _varied_model, entries  # noqa: E402


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def check(entry) -> tuple[bool, bool, list[str], str | None]:
    """(compiled, equal to stock, request errors, why eager) for one architecture."""
    model, _, inputs = _varied_model(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = hf_paged.LLMEngine(model, block_size=4, max_num_batched_tokens=8)
    params = hf_paged.SamplingParams(max_new_tokens=5, temperature=0)
    outs = _quietly(engine.generate, _prompts(inputs), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    errors = [o.error for o in outs if o.error]
    return engine.stats()["compiled"], tokens == _stock_tokens(model, inputs), errors, engine.compile_note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per architecture")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: threads only spin
    signal.signal(signal.SIGALRM, _alarm)
    chosen = [e for e in entries().values() if e.engine_tested and (not args.model_types or e.model_type in args.model_types)]
    counts = {"compiled, equal": 0, "eager": 0, "failed": 0}
    for entry in chosen:
        start = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            compiled, equal, errors, note = check(entry)
            verdict = "failed" if compiled and (errors or not equal) else "compiled, equal" if compiled else "eager"
            detail = f"errors: {errors[0][:160]}" if errors else "" if equal else "tokens differ from stock"
            detail = detail or ("" if compiled else f"why: {note}")
        except _Timeout:
            verdict, detail = "failed", f"no answer in {args.timeout} s"
        except Exception as error:  # noqa: BLE001 - report and go on to the next architecture
            verdict, detail = "failed", f"{type(error).__name__}: {str(error)[:160]}"
        finally:
            signal.alarm(0)
        counts[verdict] += 1
        print(f"{entry.model_type:28s} {verdict:16s} {time.perf_counter() - start:5.0f} s  {detail}", flush=True)
    print(f"{len(chosen)} architectures: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
