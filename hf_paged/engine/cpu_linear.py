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

The LM head also gets a oneDNN-prepacked copy of its weight (:class:`PrepackedWeight`, as vLLM's CPU
linears and inductor's frozen graphs do): 5.0 against 6.4 ms at 48 rows on the same 2 cores, the
largest matmul of every decode step. It costs a second copy of that weight, so by default only
where the copy is small (``PREPACK_LM_HEAD_MAX_BYTES``); the layers' own linears gain too little from
packing (~10%) to double the model's memory.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_linears: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its plain float32 nn.Linear
PREPACK_LM_HEAD_MAX_BYTES = 1 << 30  # the largest LM head weight that gets a prepacked copy by default
PACK_ROWS_HINT = 256  # the rows oneDNN packs for; any row count runs (48 rows gain as much as 256)


def available() -> bool:
    """Whether this torch has oneDNN's linear op (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _switchable(module: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass: quantized or parallel linears do their own thing) with
    dense float32 CPU weights."""
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and type(weight) is torch.nn.Parameter and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.layout == torch.strided)


class PrepackedWeight:
    """A oneDNN-prepacked copy of one linear's weight (``torch.ops.mkldnn._reorder_linear_weight``),
    packed again whenever the weight is replaced or changed in place, so it never runs stale weights."""

    def __init__(self, module: torch.nn.Linear):
        self.module = module
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        weight = self.module.weight
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key:
            self._packed = None  # the old copy goes before the new one is made
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            self._key = key
        return self._packed


def prepacked_lm_head(model: torch.nn.Module, enabled: bool | None = None) -> PrepackedWeight | None:
    """The prepacked LM head of ``model``'s engine forwards: ``enabled`` None prepacks a float32 CPU
    ``nn.Linear`` head of at most ``PREPACK_LM_HEAD_MAX_BYTES``, True any such head, False none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if enabled is False or head is None or not available() or not _switchable(head):
        return None
    if enabled is None and head.weight.nbytes > PREPACK_LM_HEAD_MAX_BYTES:
        return None
    return PrepackedWeight(head)


def _onednn_forward(module: torch.nn.Linear, prepacked: PrepackedWeight | None = None):
    weight, bias = prepacked.get() if prepacked is not None else module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.linear(x, module.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward


def _model_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    found = _linears.get(model)
    if found is None:
        found = [m for m in model.modules() if _switchable(m)]
        _linears[model] = found
    return found


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, enabled: bool = True, prepacked: tuple[PrepackedWeight, ...] = ()):
    """Run ``model``'s float32 CPU ``nn.Linear`` layers through oneDNN inside the block, those of
    ``prepacked`` on their packed weights."""
    modules = _model_linears(model) if enabled and available() else []
    packs = {id(p.module): p for p in prepacked}
    switched = []
    try:
        for module in modules:
            if _switchable(module) and "forward" not in module.__dict__:
                module.forward = _onednn_forward(module, packs.get(id(module)))
                switched.append(module)
        yield
    finally:
        for module in switched:
            del module.forward
