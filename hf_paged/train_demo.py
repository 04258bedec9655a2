"""Train the built-in demo model, once, on text every machine has offline: the docstrings of
Python's standard library (read from its source files with ``ast``: nothing is imported).

    python -m hf_paged.train_demo [--minutes 6] [--out demo_model.safetensors]
    python -m hf_paged.train_demo --out hf_paged/data/demo_model.safetensors   # replace the shipped weights

The result ships with the package (float16, a few MB) and is what ``hf_paged.demo.demo_model()``
loads by default, so the demo, ``generate`` and ``serve`` write readable, if simple, text.
A byte-level model of 2.3M parameters trained for minutes on a CPU: expect English-looking
phrases about Python, not answers.
"""

from __future__ import annotations

import argparse
import ast
import math
import sysconfig
import time
from pathlib import Path

import torch

from hf_paged.demo import DEMO_WEIGHTS, byte_tokenizer, demo_config

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip"}


def stdlib_docstrings(limit_bytes: int = 6_000_000) -> str:
    """Module, class and function docstrings of the standard library, one paragraph each."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen, parts, size = set(), [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40 and doc not in seen:
                    seen.add(doc)
                    parts.append(doc.strip())
                    size += len(doc)
        if size > limit_bytes:
            break
    return "\n\n".join(parts)


def train(minutes: float, out: Path, seq_len: int = 128, batch: int = 24, lr: float = 3e-3, seed: int = 0,
          log=print) -> dict:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    text = stdlib_docstrings()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
    split = int(len(ids) * 0.98)
    train_ids, held_out = ids[:split], ids[split:]
    log(f"{len(text) / 1e6:.1f} MB of docstrings, {len(ids) / 1e6:.2f}M byte tokens")
    model = LlamaForCausalLM(demo_config()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    deadline = time.monotonic() + minutes * 60
    start, step = time.monotonic(), 0
    while time.monotonic() < deadline:
        progress = (time.monotonic() - start) / (minutes * 60)
        for group in optimizer.param_groups:  # warm-up, then cosine decay to 10% over the time budget
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1))))
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,))
        x = torch.stack([train_ids[s : s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 100 == 0:
            log(f"step {step}: loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)")
    model.eval()
    with torch.no_grad():
        chunks = held_out[: (len(held_out) // seq_len) * seq_len].view(-1, seq_len)[:64]
        held_loss = model(input_ids=chunks, labels=chunks).loss.item()
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embeddings
    metadata = {"steps": str(step), "minutes": f"{minutes:g}", "held_out_loss": f"{held_loss:.4f}",
                "data": "CPython standard-library docstrings", "seq_len": str(seq_len), "batch": str(batch)}
    save_file(state, str(out), metadata=metadata)
    log(f"{step} steps; held-out loss {held_loss:.3f} nats/byte; wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return metadata


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--minutes", type=float, default=6.0, help="training time (default: 6)")
    parser.add_argument("--out", type=Path, default=Path("demo_model.safetensors"),
                        help=f"where the weights go (default: ./demo_model.safetensors; the shipped ones, which "
                             f"demo_model() loads, are {DEMO_WEIGHTS}: name it to replace them)")
    args = parser.parse_args(argv)
    train(args.minutes, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
