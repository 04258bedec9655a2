"""oneDNN matmuls for the engine's float32 forwards on CPU.

``nn.Linear`` on a float32 CPU tensor calls MKL's sgemm, which is slow at the shapes of an engine
step (tens to hundreds of rows against a wide weight): on 2 cores, the 19M-parameter Llama's LM head
(64 rows x 256 -> 32,000) takes 14.1 ms through ``F.linear`` and 8.4 ms through oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, what inductor uses on CPU), on the same weights, with no
copy or repacking. Only the engine's forwards switch (:func:`onednn_linears`, a context manager):
``generate()`` and every other use of the model stay stock, bit for bit. The results differ from
sgemm's in the last bits (a different summation order), as a compiled step's would; the engine's
tests compare tokens with stock ``generate()``. bfloat16 and float16 linears already run through
oneDNN in torch and are left alone.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_linears: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its plain float32 nn.Linear


def available() -> bool:
    """Whether this torch has oneDNN's linear op (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _switchable(module: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass: quantized or parallel linears do their own thing) with
    dense float32 CPU weights."""
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and type(weight) is torch.nn.Parameter and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.layout == torch.strided)


def _onednn_forward(module: torch.nn.Linear):
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward


def _model_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    found = _linears.get(model)
    if found is None:
        found = [m for m in model.modules() if _switchable(m)]
        _linears[model] = found
    return found


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, enabled: bool = True):
    """Run ``model``'s float32 CPU ``nn.Linear`` layers through oneDNN inside the block."""
    modules = _model_linears(model) if enabled and available() else []
    switched = []
    try:
        for module in modules:
            if _switchable(module) and "forward" not in module.__dict__:
                module.forward = _onednn_forward(module)
                switched.append(module)
        yield
    finally:
        for module in switched:
            del module.forward
