"""Tiny hybrid and state-space models for the engine tests (issue 21), from transformers' own
config classes: gated-delta linear attention (Qwen3.5 text, Qwen3-Next), Mamba2 beside attention
(Falcon-H1: both in every layer; Granite 4 hybrid), short convolutions (LFM2), Mamba (v1) with
attention (Jamba) and a pure Mamba2. Float32 or float64, random weights, EOS off."""

from __future__ import annotations

import torch
import transformers

VOCAB, PAD, EOS, BOS = 96, 0, 1, 2
_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, initializer_range=0.1,
               max_position_embeddings=512)
_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8,
               mamba_d_conv=4, mamba_expand=1)
_GATED_DELTA = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4)

CONFIGS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **_COMMON, **_ATTENTION, **_GATED_DELTA, intermediate_size=96, num_hidden_layers=3, head_dim=16),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **_COMMON, **_ATTENTION, **_GATED_DELTA, intermediate_size=96, num_hidden_layers=3, head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1),
    "falcon_h1": lambda: transformers.FalconH1Config(  # every layer is both: Mamba2 and attention in parallel
        **_COMMON, **_ATTENTION, **_MAMBA2, intermediate_size=96, num_hidden_layers=2, head_dim=16, mamba_d_ssm=64),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(  # Granite 4 hybrid: Mamba2 and attention
        **_COMMON, **_ATTENTION, **_MAMBA2, intermediate_size=96, num_hidden_layers=3, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=64,
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "lfm2": lambda: transformers.Lfm2Config(  # short convolutions: conv state, no recurrent state
        **_COMMON, **_ATTENTION, intermediate_size=96, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    "jamba": lambda: transformers.JambaConfig(  # Mamba (v1) mixers: a prefill is never split
        **_COMMON, **_ATTENTION, intermediate_size=96, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=1, mamba_dt_rank=8, use_mamba_kernels=False),
    "mamba2": lambda: transformers.Mamba2Config(  # a pure state-space model: no K/V at all
        **_COMMON, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, expand=1, n_groups=1,
        state_size=16, conv_kernel=4, chunk_size=8),
}
HYBRIDS = list(CONFIGS)


def build_hybrid(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny model of ``name`` (a key of :data:`CONFIGS`) in ``dtype``, eval mode, EOS off."""
    torch.manual_seed(seed)
    options = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # grouped_mm has no float64
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype, **options).eval()
    if name == "jamba":  # a slowly decaying state, so that what a chunk inherits matters at test lengths
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.data.fill_(-4.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, None
    return model
