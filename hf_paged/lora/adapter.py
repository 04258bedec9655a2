"""Reading a PEFT LoRA adapter from disk and checking it against the model it will run on.

An adapter is a folder as peft's ``save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), tensors named
``base_model.model.<module>.lora_A.weight`` / ``...lora_B.weight``. Each targeted module gets
``y = base(x) + (x A^T) B^T * scaling`` with peft's scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` / ``alpha_pattern`` per module). What peft
can save but this engine does not run is refused by name (DoRA, biases, ``modules_to_save``,
embedding or LM-head targets, ...), never silently dropped: serving an adapter without a part of
it would give other tokens than the adapter's own.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from transformers.pytorch_utils import Conv1D

from hf_paged.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# adapter_config.json keys that ask for more than plain LoRA on linear layers, refused when set
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora) adapters",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "adapters that also replace whole modules (modules_to_save)",
    "trainable_token_indices": "adapters that train token embeddings (trainable_token_indices)",
    "layer_replication": "adapters that replicate layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters, e.g. MoE experts)",
    "megatron_config": "Megatron-parallel adapters (megatron_config)",
}


@dataclass(frozen=True)
class LoRAWeights:
    """One module's low-rank update: ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]``, ``scaling``."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its request, its largest rank, its weights by module name, and which load
    of its id this is (``generation``: weights read again under the same id, e.g. ``load_inplace``
    or a folder changed while it was evicted, must not meet K/V cached with the old ones)."""

    request: LoRARequest
    rank: int
    modules: dict[str, LoRAWeights]
    generation: int = 0

    @property
    def cache_root(self) -> tuple[str, int, int]:
        """Where the prefix-cache keys of its sequences chain from (:meth:`PrefixIndex.keys_of`)."""
        return ("lora", self.request.lora_int_id, self.generation)


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters compute in: float32 for half-precision models (as peft upcasts adapter
    weights and casts the input, then rounds the sum back), else the model's."""
    return torch.float32 if model_dtype in (torch.float16, torch.bfloat16) else model_dtype


def pattern_key(patterns, name: str) -> str | None:
    """The ``rank_pattern`` / ``alpha_pattern`` key that applies to module ``name`` (peft's rule:
    the pattern matches the end of the name, after a dot), or None."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", name)), None)


def read_config(path: str) -> dict:
    """``adapter_config.json`` of the adapter at ``path``, checked for what this engine runs."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r} is a {kind} adapter; only LoRA adapters are served")
    for key, what in _REFUSED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} (trained biases) is not supported; "
                         "only bias='none'")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} needs a positive {key!r}, got {value!r}")
    return config


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (safetensors, or a ``.bin`` read with ``weights_only``)."""
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's fault, said as such
            raise ValueError(f"LoRA adapter {path!r}: {name} is not readable ({type(error).__name__}: {error})") from None
    raise ValueError(f"LoRA adapter {path!r} has no weights ({' or '.join(WEIGHT_FILES)})")


def module_shapes(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a module LoRA can target here (a linear layer), else None."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # GPT-2's linears: weight [in, out]
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _pairs(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors by module name: ``{module: {"A": ..., "B": ...}}``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            what = "LoRA on embeddings" if "lora_embedding" in key else (
                "DoRA magnitudes" if "lora_magnitude" in key else "a tensor that is no LoRA A or B weight")
            raise ValueError(f"LoRA adapter {path!r}: {key!r} is {what}, which is not supported")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    return pairs


def load_adapter(request: LoRARequest, model: torch.nn.Module, max_lora_rank: int) -> LoRAAdapter:
    """Read ``request``'s adapter and check it against ``model`` (every targeted module exists, is
    a linear layer of the matching shape, and is not the LM head; rank at most ``max_lora_rank``).
    Weights land on the model's device, in :func:`compute_dtype`. ``ValueError`` names what is wrong."""
    path = request.lora_path
    config = read_config(path)
    pairs = _pairs(path, read_tensors(path))
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    device = next(model.parameters()).device
    dtype = compute_dtype(next(model.parameters()).dtype)
    modules, rank = {}, 0
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {name!r} has lora_{''.join(pair)} but not both A and B")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"LoRA adapter {path!r} targets {name!r}, which {type(model).__name__} does not have "
                             "(an adapter for another architecture?)") from None
        if module is head:
            raise ValueError(f"LoRA adapter {path!r} targets the LM head ({name!r}), which is not supported")
        shapes = module_shapes(module)
        if shapes is None:
            raise ValueError(f"LoRA adapter {path!r} targets {name!r}, a {type(module).__name__}; only linear "
                             "layers take LoRA here")
        r_key, alpha_key = (pattern_key(config.get(k) or {}, name) for k in ("rank_pattern", "alpha_pattern"))
        r = (config.get("rank_pattern") or {}).get(r_key, config["r"]) if r_key else config["r"]
        alpha = (config.get("alpha_pattern") or {}).get(alpha_key, config["lora_alpha"]) if alpha_key else \
            config["lora_alpha"]
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, shapes[0]) or b.shape != (shapes[1], r):
            raise ValueError(f"LoRA adapter {path!r}: {name!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; its "
                             f"rank {r} and the module ({shapes[0]} -> {shapes[1]}) need A {(r, shapes[0])} and "
                             f"B {(shapes[1], r)}")
        if r > max_lora_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {r} ({name!r}) is greater than max_lora_rank "
                             f"{max_lora_rank}; start the engine with a larger max_lora_rank")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[name] = LoRAWeights(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), scaling)
        rank = max(rank, r)
    return LoRAAdapter(request, rank, modules)
