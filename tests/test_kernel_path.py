"""The Triton read path through whole models, on CPU under the Triton interpreter.

``kernels.set_backend("triton")`` makes the attention function take the same route it takes on CUDA
(decode kernel for one new token per row, varlen prefill kernel otherwise, no gather of K/V); the
outputs must still equal stock ``generate()``. Launches are counted, so a silent fallback to the
reference path fails the test.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import kernels
from tests.helpers.tiny_models import build, left_padded

MODES = {"greedy": dict(do_sample=False), "beam3": dict(do_sample=False, num_beams=3)}


@pytest.mark.parametrize(
    "arch, mode", [("llama", "greedy"), ("llama", "beam3"), ("mistral", "beam3"), ("gemma2", "greedy"), ("gpt2", "greedy")]
)
def test_kernel_path_is_token_exact(arch, mode, triton_launches):
    launches = triton_launches
    model = build(arch)
    ids, mask = left_padded([5, 19, 30])  # sliding windows 12 (Mistral) and 9 (Gemma2) are crossed
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **MODES[mode])
    hf_paged.enable(model, block_size=8)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, cache_implementation="hf_paged",
                         return_dict_in_generate=True, **MODES[mode])
    assert torch.equal(stock, out.sequences)
    layers = model.config.num_hidden_layers
    assert launches["paged_attention_prefill"] >= layers  # the prompts
    assert launches["paged_attention_decode"] >= 7 * layers  # one per layer per new token
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.reset()
    assert cache.manager.num_used_blocks == 0


def test_set_kernel_mode_is_a_deprecated_alias_of_the_one_switch():
    try:
        with pytest.warns(DeprecationWarning, match="kernels.set_backend"):
            hf_paged.set_kernel_mode("reference")
        assert kernels.get_backend() == "torch"
        with pytest.warns(DeprecationWarning):
            hf_paged.set_kernel_mode("triton")
        assert kernels.get_backend() == "triton"
        with pytest.raises(ValueError, match="kernel mode"):
            hf_paged.set_kernel_mode("cuda")
    finally:
        kernels.set_backend("auto")
    assert kernels.get_backend() is None
