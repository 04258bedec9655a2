"""Tiny models of the attention variants of issue 20, from transformers' own config classes:
attention sinks (gpt-oss), MLA latent caches (DeepSeek V3, GLM-4 MoE Lite), chunked local
attention (Llama 4 text) and KV-sharing layers (Gemma 3n text). Windows and chunks are small so
they matter at test lengths; gpt-oss's sinks are made large so they matter at all."""

from __future__ import annotations

import torch
import transformers

from hf_paged import model_support

VOCAB, PAD, EOS, BOS = 96, 0, 1, 2
SLIDING_WINDOW = 6
CHUNK = 8
_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, max_position_embeddings=512)


def _gpt_oss():
    config = transformers.GptOssConfig(
        **_COMMON, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=SLIDING_WINDOW, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.3)
    model = transformers.GptOssForCausalLM(config)
    for layer in model.model.layers:  # sinks that matter: a large share of each softmax
        layer.self_attn.sinks.data = torch.randn(config.num_attention_heads) * 2 + 1
    return model


def _llama4_text(floor_scale: int = 2):
    config = transformers.Llama4TextConfig(
        **_COMMON, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=CHUNK,
        floor_scale=floor_scale, attn_scale=0.5, num_local_experts=2, num_experts_per_tok=1, initializer_range=0.1)
    return transformers.Llama4ForCausalLM(config)


def _gemma3n_text():
    config = transformers.Gemma3nTextConfig(
        **_COMMON, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=[96] * 4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4, laurel_rank=8, initializer_range=0.02)
    return transformers.Gemma3nForCausalLM(config)


def _from_default_config(model_type: str, initializer_range: float):
    return lambda: model_support.build_tiny(model_type, initializer_range=initializer_range)


BUILDERS = {
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _from_default_config("deepseek_v3", 0.1),
    "glm4_moe_lite": _from_default_config("glm4_moe_lite", 0.1),
    "llama4_text": _llama4_text,
    "gemma3n_text": _gemma3n_text,
}
VARIANTS = list(BUILDERS)


def build_variant(name: str, seed: int = 0, **options) -> transformers.PreTrainedModel:
    """A float32 tiny model of ``name`` (a key of :data:`BUILDERS`), eval mode, EOS off."""
    torch.manual_seed(seed)
    model = BUILDERS[name](**options).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, None
    return model
