"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for one request: ``lora_name`` (what a server lists and requests name),
    ``lora_int_id`` (a positive int identifying it in the engine: requests of one id share its
    loaded weights and their cached prefix blocks), ``lora_path`` (a local folder holding
    ``adapter_config.json`` and ``adapter_model.safetensors``, as peft's ``save_pretrained``
    writes). ``base_model_name`` is what a server's ``/v1/models`` names as its parent."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False  # vLLM's: load the path again even if this id is loaded (a retrained adapter)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name the adapter's folder, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
