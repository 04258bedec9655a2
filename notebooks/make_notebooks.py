"""Writes the notebooks from the cell sources below (outputs cleared): edit here, then run
``python notebooks/make_notebooks.py``. The tests execute every notebook top to bottom."""

from pathlib import Path

import nbformat

HERE = Path(__file__).parent

SETUP = '''# Set MODEL_PATH to a local checkpoint directory to use a real model; None = the built-in tiny model.
MODEL_PATH = None

import torch
import hf_paged
from hf_paged.demo import byte_tokenizer, demo_model

if MODEL_PATH is None:
    model, tok = demo_model(), byte_tokenizer()
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL_PATH, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL_PATH, dtype=torch.float32).eval()
    tok.pad_token = tok.pad_token or tok.eos_token
print(type(model).__name__, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")'''

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        "# hf_paged quickstart\nA paged KV cache inside `model.generate()`: enable, generate with the cache flag, "
        "check token-equality with stock generate, read the cache's memory statistics.",
        SETUP,
        '''prompts = ["PagedAttention stores the KV cache", "Hello", "A much longer prompt that spans more than one block of sixteen tokens"]
enc = tok(prompts, return_tensors="pt", padding=True)
stock = model.generate(**enc, max_new_tokens=24, do_sample=False)      # stock: SDPA + DynamicCache

hf_paged.enable(model, block_size=16)                                   # adds the flag; without it generate is stock
out = model.generate(**enc, max_new_tokens=24, do_sample=False,
                     cache_implementation="hf_paged", return_dict_in_generate=True)
print("token-identical to stock generate:", torch.equal(stock, out.sequences))
assert torch.equal(stock, out.sequences)''',
        '''stats = out.past_key_values.stats()
for key in ("block_size", "blocks_used", "tokens_stored", "utilization", "bytes_used", "bytes_contiguous_equivalent"):
    print(f"{key:>28}: {stats[key]}")
print(f"paged KV uses {stats['bytes_used'] / stats['bytes_contiguous_equivalent']:.0%} of what DynamicCache holds")''',
        '''for text in tok.batch_decode(out.sequences, skip_special_tokens=True):
    print(repr(text[:80]))''',
    ],
    "02_memory.ipynb": [
        "# Memory: block tables, utilization, sharing\nThe block tables of a small batch, then the paper's "
        "Figure 2 (KV utilization by reservation scheme) and Figure 15 (blocks saved by sharing).",
        SETUP,
        '''import matplotlib.pyplot as plt
hf_paged.enable(model, block_size=4)
enc = tok(["short", "a medium prompt", "the longest prompt of the three"], return_tensors="pt", padding=True)
out = model.generate(**enc, max_new_tokens=6, do_sample=False, cache_implementation="hf_paged",
                     return_dict_in_generate=True)
cache = out.past_key_values
tables = cache.block_tables()
print("block tables (logical block -> physical block, -1 = none):")
print(tables)
fig, ax = plt.subplots(figsize=(6, 1.8))
ax.imshow(tables.clamp(min=-1), cmap="tab20", aspect="auto")
for (r, c), b in zip([(r, c) for r in range(tables.shape[0]) for c in range(tables.shape[1])], tables.flatten().tolist()):
    ax.text(c, r, b if b >= 0 else "", ha="center", va="center")
ax.set(xlabel="logical block", ylabel="sequence", title="physical block of each logical block")
plt.show()''',
        '''from hf_paged.bench import memory, workloads
vocab = model.config.vocab_size
share = workloads.dataset("sharegpt", 200, scale=0.25, vocab=vocab)
util = memory.kv_utilization(share, max_len=2048)
small = workloads.dataset("alpaca", 6, scale=0.5, vocab=vocab)
savings = {f"n={n}": memory.sharing_savings(model, workloads.with_sampling(small, n=n))["saving"] for n in (2, 4)}
savings.update({f"beam {k}": memory.sharing_savings(model, workloads.with_sampling(small, num_beams=k))["saving"] for k in (2, 4)})
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3))
a1.barh(list(util), [100 * v for v in util.values()]); a1.set(xlabel="% of reserved KV slots holding tokens")
a2.bar(list(savings), [100 * v for v in savings.values()]); a2.set(ylabel="% blocks saved by sharing")
plt.tight_layout(); plt.show()
util, savings''',
    ],
    "03_beam_search_and_sharing.ipynb": [
        "# Beam search, parallel sampling and prefix caching\nBeams fork block tables (copy-on-write "
        "of the partial last block only); samples share one prefill; the engine reuses cached prompt blocks.",
        SETUP,
        '''hf_paged.enable(model, block_size=16)
enc = tok(["Beam search over a paged cache"] * 1, return_tensors="pt")
out = model.generate(**enc, num_beams=4, num_return_sequences=2, max_new_tokens=20, do_sample=False,
                     cache_implementation="hf_paged", return_dict_in_generate=True)
hf_paged.disable(model)
stock = model.generate(**enc, num_beams=4, num_return_sequences=2, max_new_tokens=20, do_sample=False)
print("beam search token-identical to stock:", torch.equal(stock, out.sequences))
s = out.past_key_values.stats()
print({k: s[k] for k in ("blocks_used", "blocks_shared", "blocks_peak", "bytes_used", "bytes_contiguous_equivalent")})''',
        '''from hf_paged import LLMEngine, SamplingParams
engine = LLMEngine(model, tok, num_blocks=512, block_size=16)
res = engine.generate(["Parallel samples share one prefill"], SamplingParams(max_new_tokens=16, n=4, seed=0, temperature=0.9))
for c in res[0].outputs:
    print(c.index, repr(c.text))''',
        '''system = "You are a helpful assistant. Answer briefly and precisely. " * 6
questions = [system + q for q in ["What is paging?", "Why blocks?", "What is copy-on-write?", "Why share?"]]
engine = LLMEngine(model, tok, num_blocks=512, block_size=16)
engine.generate(questions, SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)
st = engine.stats()
print(f"prefix cache hit rate {st['prefix_cache_hit_rate']:.0%}; prompt tokens computed {st['computed_prompt_tokens']}"
      f" of {sum(len(tok(q).input_ids) for q in questions)}")''',
        "## Prefix caching inside `generate()`\nA few-shot prefix in front of every question: with "
        "`prefix_caching=True` the model keeps one pool of blocks across calls, and each row adopts its "
        "prompt's longest cached prefix. Tokens computed are counted at the model's input.",
        '''import copy, time
shots = "Q: what is a block? A: sixteen tokens of K/V.\\n" * 8          # the few-shot prefix
asked = [shots + f"Q: question number {i}? A:" for i in range(16)]
stock_model = copy.deepcopy(model)
hf_paged.enable(model, block_size=16, prefix_caching=True)
computed = {}

def few_shot(m, name, **flag):
    computed[name] = 0
    def count(module, args):
        computed[name] += int((args[0] != tok.pad_token_id).sum())
    hook = m.get_input_embeddings().register_forward_pre_hook(count)
    start, outs = time.perf_counter(), []
    for i in range(0, len(asked), 4):
        enc = tok(asked[i : i + 4], return_tensors="pt", padding=True)
        outs.append(m.generate(**enc, max_new_tokens=8, do_sample=False, **flag)[:, enc.input_ids.shape[1]:])
    hook.remove()
    return time.perf_counter() - start, torch.cat(outs)

t_stock, out_stock = few_shot(stock_model, "stock")
t_cached, out_cached = few_shot(model, "prefix caching", cache_implementation="hf_paged")
print("identical to stock:", torch.equal(out_stock, out_cached))
print(hf_paged.prefix_cache(model).stats())
print(f"tokens computed: stock {computed['stock']}, with prefix caching {computed['prefix caching']}; "
      f"time {t_stock:.2f} s vs {t_cached:.2f} s")''',
        '''import matplotlib.pyplot as plt
fig, (a, b) = plt.subplots(1, 2, figsize=(8, 2.5))
a.bar(list(computed), list(computed.values())); a.set_ylabel("tokens computed")
b.bar(["stock", "prefix caching"], [t_stock, t_cached]); b.set_ylabel("seconds")
plt.tight_layout(); plt.show()
hf_paged.disable(model)''',
    ],
    "04_throughput.ipynb": [
        "# Throughput: engine vs generate vs transformers' continuous batching\nSide by side on the same model "
        "and requests (a small ShareGPT-like workload; `python -m hf_paged bench` runs the full suite).",
        SETUP,
        '''from hf_paged.bench import systems, workloads
wl = workloads.dataset("sharegpt", 24, scale=0.15, vocab=model.config.vocab_size)
runs = {
    "padded generate": systems.batched_generate(model, wl, 8, paged=False),
    "generate + hf_paged flag": systems.batched_generate(model, wl, 8, paged=True),
    "transformers generate_batch": systems.transformers_cb(model, wl, num_blocks=512, max_batch_tokens=256),
    "hf_paged engine": systems.engine_run(model, wl, num_blocks=1024, max_num_batched_tokens=256),
}
tps = {k: v.summary(wl)["tokens_per_s"] for k, v in runs.items()}
base = tps["padded generate"]
for k, v in tps.items():
    print(f"{k:>28}: {v:7.1f} tok/s  ({v / base:.2f}x padded generate)")''',
        '''import matplotlib.pyplot as plt
plt.figure(figsize=(6, 2.5)); plt.barh(list(tps), list(tps.values())); plt.xlabel("generated tokens / s")
plt.tight_layout(); plt.show()''',
        "## Requests from asyncio code: `AsyncLLM`\nvLLM's `AsyncLLM`: one engine steps on a background thread and "
        "batches whatever the notebook's tasks send (a notebook runs `await` at the top level). One request streams "
        "its deltas while three others run beside it.",
        '''import asyncio
from hf_paged import AsyncLLM, RequestOutputKind, SamplingParams

llm = AsyncLLM(model, tok, block_size=16, num_blocks=512)

async def answer(prompt):
    async for out in llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0)):
        pass  # every step's whole output: keep the last
    return out.outputs[0].text

async def stream(prompt):
    delta = SamplingParams(max_tokens=48, temperature=0, output_kind=RequestOutputKind.DELTA)
    async for out in llm.generate(prompt, delta):
        print(out.outputs[0].text, end="", flush=True)  # only what is new
    print()

prompts = ["Return the", "Raise an error if", "The default value is"]
answers, _ = await asyncio.gather(asyncio.gather(*(answer(p) for p in prompts)), stream("Return a new list of"))
for p, a in zip(prompts, answers):
    print(f"{p!r} -> {a!r}")
llm.shutdown()''',
    ],
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(cells[0])] + [  # a later cell starting with "## " is markdown too
            nbformat.v4.new_markdown_cell(c) if c.startswith("## ") else nbformat.v4.new_code_cell(c) for c in cells[1:]]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    main()
