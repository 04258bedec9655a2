"""Tiny random models of each supported architecture, built from configs (no downloads).

Each architecture gets the ``initializer_range`` (0.02-0.5, 0.3 for most) at which its greedy
output is varied rather than one repeated token, so equality tests compare meaningful sequences;
sliding windows are small so they matter at test lengths.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from packaging import version

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2

_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, initializer_range=0.3)
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, **_LLAMA_LIKE),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, **_LLAMA_LIKE, sliding_window=12),
    "qwen2": lambda: transformers.Qwen2Config(
        **_COMMON, **{**_LLAMA_LIKE, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=10,
        max_window_layers=1,
    ),
    "qwen3": lambda: transformers.Qwen3Config(  # multi-query attention: one KV head
        **{**_COMMON, "initializer_range": 0.1}, **{**_LLAMA_LIKE, "num_key_value_heads": 1}, head_dim=16,
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **{**_COMMON, "initializer_range": 0.02}, **_LLAMA_LIKE, head_dim=16, sliding_window=9, query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**_COMMON, "initializer_range": 0.02}, **{**_LLAMA_LIKE, "num_hidden_layers": 3}, head_dim=16, sliding_window=7,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, **_LLAMA_LIKE),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.5,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
    ),
    "opt": lambda: transformers.OPTConfig(
        **_COMMON, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=512, init_std=0.3,
    ),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=512, rotary_pct=0.5,
    ),
    "granite": lambda: transformers.GraniteConfig(**_COMMON, **_LLAMA_LIKE),
    "olmo2": lambda: transformers.Olmo2Config(**{**_COMMON, "initializer_range": 0.1}, **_LLAMA_LIKE),
}

ARCHITECTURES = list(CONFIGS)

# Architectures whose attention is written inline (not through AttentionInterface).
def transformers_at_least(release: str) -> bool:
    """Whether the installed transformers is ``release`` or newer (tests whose expectations changed there)."""
    return version.parse(transformers.__version__) >= version.parse(release)


@contextlib.contextmanager
def single_threaded_torch():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads wait on each other (tens of
    ms per tiny matmul) while the server's own threads want the cores too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


UNSUPPORTED = {
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                                 attention_types=[[["global", "local"], 1]]),
}
if not transformers_at_least("5.25"):  # 5.25 moved it to AttentionInterface
    UNSUPPORTED["falcon"] = lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                              num_attention_heads=4)


def build(arch: str, seed: int = 0, table: dict = CONFIGS) -> transformers.PreTrainedModel:
    """A tiny float32 model of ``arch`` with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    config = table[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model.eval()


def build_narrow_llama(seed: int = 0) -> transformers.PreTrainedModel:
    """The tiny Llama with 2 heads sharing 1 K/V head and 64 positions: for tests that run the Triton
    kernels through the interpreter, whose cost grows with the programs a launch runs (heads, and
    the block-table width that positions set); half the time of ``build("llama")`` there."""
    return build("llama", seed, {"llama": lambda: transformers.LlamaConfig(
        **_COMMON, **{**_LLAMA_LIKE, "num_attention_heads": 2, "num_key_value_heads": 1,
                      "max_position_embeddings": 64})})


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts of the given lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


# A composite (vision + text) model: Gemma 3 with a SigLIP tower, 16x16 images of 4x4 patches pooled
# to 4 image tokens each. Image ids sit inside the vocabulary, just below it.
IMAGE, BOI, EOI = VOCAB - 1, VOCAB - 3, VOCAB - 2
IMAGE_TOKENS = 4


def build_gemma3_vision(seed: int = 1, initializer_range: float = 0.02) -> transformers.PreTrainedModel:
    """A tiny float32 ``Gemma3ForConditionalGeneration`` (3 text layers, sliding/full/sliding, window 7)."""
    text = transformers.Gemma3TextConfig(
        **{**_COMMON, "initializer_range": initializer_range}, **{**_LLAMA_LIKE, "num_hidden_layers": 3}, head_dim=16,
        sliding_window=7, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=4, num_channels=3)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                                       image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
                                       initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # Gemma 3 initializes the image projection to zeros: images would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def image_prompts(lengths: list[int], seed: int = 0, images: bool = True) -> dict[str, torch.Tensor]:
    """Left-padded prompts with one image each (BOI, image tokens, EOI after the first text token),
    their ``pixel_values`` and ``token_type_ids`` (1 on image tokens), as a Gemma 3 processor gives.
    ``images=False``: the same text without the images. Text tokens stay below the image ids."""
    ids, mask = left_padded(lengths, seed)
    rows = []
    for row in range(ids.shape[0]):
        text = [t if t < BOI else t - 3 for t in ids[row][mask[row].bool()].tolist()]
        rows.append(text[:1] + [BOI] + [IMAGE] * IMAGE_TOKENS + [EOI] + text[1:] if images else text)
    width = max(map(len, rows))
    out_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    out_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        out_ids[row, width - len(tokens):] = torch.tensor(tokens)
        out_mask[row, width - len(tokens):] = 1
    if not images:
        return dict(input_ids=out_ids, attention_mask=out_mask)
    pixels = torch.randn(len(rows), 3, 16, 16, generator=torch.Generator().manual_seed(seed + 1))
    return dict(input_ids=out_ids, attention_mask=out_mask, pixel_values=pixels,
                token_type_ids=(out_ids == IMAGE).long())


def assert_engine_idle(engine) -> None:
    """Nothing in flight on an ``LLMEngine``: every KV block free, no constrained request or
    compiling grammar left behind, no request's output books (``output_kind`` / ``stream_interval``)."""
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks() == 0, "blocks leaked"
    assert not engine.structured.active and not engine.structured.has_waiting()
    assert not engine._shapers, "output books of requests no longer in flight kept"


def run_beside_an_older_request(engine, older: list[int], older_params, prompt: list[int],
                                params) -> tuple[str | None, list[list[int]], int]:
    """``older`` and then ``prompt`` into ``engine``, stepped to the end: the newer request's error,
    its sequences' tokens and the engine's recompute preemptions (tests of a request preempted by
    an older one and recomputed)."""
    engine.add_request(older, older_params)
    request_id = engine.add_request(prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    out = finals[request_id]
    return out.error, [c.token_ids for c in out.outputs], engine.stats()["preemptions_recompute"]
