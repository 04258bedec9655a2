"""The built-in demo model and byte-level tokenizer, built from code (nothing is downloaded).

The weights are random, so the text is gibberish; what the demo shows is memory and
token-exactness, which do not depend on training.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte, plus <pad>, <s>, </s> (ids 0, 1, 2)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def demo_config(**overrides) -> LlamaConfig:
    """A small Llama-shaped config (GQA, RoPE) sized for a 2-core CPU."""
    options = dict(
        vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.05,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    options.update(overrides)
    return LlamaConfig(**options)


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    """The built-in tiny model with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config(**overrides)).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model
