"""PEFT LoRA adapters for the tests, made here with peft (random, not no-op: ``init_lora_weights=False``)
and saved as peft saves them; and the stock reference: ``PeftModel`` over a stock copy of the weights."""

from __future__ import annotations

import copy
import os

import torch


def save_adapter(model: torch.nn.Module, path: str, seed: int, **lora_config) -> str:
    """Save a random LoRA adapter for ``model``'s architecture at ``path`` (``lora_config``: peft's
    ``LoraConfig`` fields; default r=4, alpha=8 on the attention projections); ``model`` is untouched.
    ``scale`` multiplies the saved B matrices (a larger update changes more tokens)."""
    from peft import LoraConfig, get_peft_model

    scale = lora_config.pop("scale", 1.0)
    options = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    options.update(lora_config)
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**options))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors"))
    return path


def peft_model(model: torch.nn.Module, path: str | None) -> torch.nn.Module:
    """A stock copy of ``model`` with the adapter at ``path`` loaded by peft (None: the copy alone)."""
    from peft import PeftModel

    stock = copy.deepcopy(model).eval()
    if path is None:
        return stock
    return PeftModel.from_pretrained(stock, path).eval()


def stock_greedy(model: torch.nn.Module, path: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Stock ``generate()`` (SDPA, DynamicCache) of ``model`` with the adapter at ``path``: the new tokens."""
    reference = peft_model(model, path)
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
