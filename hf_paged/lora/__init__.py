"""Serving LoRA adapters: many PEFT adapters over one base model, batched in the same steps.

:class:`LoRARequest` names a request's adapter (vLLM's); :mod:`hf_paged.lora.adapter` reads and
checks an adapter; :mod:`hf_paged.lora.layers` applies a step's adapters inside its forward;
:class:`LoRAManager` keeps the loaded ones.
"""

from hf_paged.lora.adapter import LoRAAdapter, LoRAWeights, load_adapter
from hf_paged.lora.layers import LoRALayers, StepLoRA, add_lora_rows, lora_delta
from hf_paged.lora.manager import LoRAManager
from hf_paged.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRALayers", "LoRAManager", "LoRARequest", "LoRAWeights", "StepLoRA", "add_lora_rows",
           "load_adapter", "lora_delta"]
