"""oneDNN for the LM head of the engine's float32 forwards on CPU.

``nn.Linear`` on a float32 CPU tensor calls MKL's sgemm, which is slow for the LM head at the shapes
of an engine step (tens of rows against a 32,000-wide weight): on 2 cores, the 19M-parameter Llama's
head at 48 rows takes 16.2 ms through ``F.linear``, 8.0-8.4 ms through oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, what inductor uses on CPU) and 5.0-5.9 ms on a
oneDNN-prepacked copy of the weight (:class:`PrepackedWeight`, as vLLM's CPU linears and inductor's
frozen graphs do; it costs a second copy of that weight, so by default only where the copy is small,
``PREPACK_LM_HEAD_MAX_BYTES``).

Only the head switches: the layers' own linears stay on sgemm. Through oneDNN they were as fast or
faster in isolation, yet whole engine runs were 1-17% slower (in-process, interleaved, both the
ShareGPT-like and the 1,000-token-prompt workloads: RESULTS.md, "Against vLLM's CPU build —
2026-12-04, second run"), and oneDNN builds a primitive for every new row count (~0.8 ms per weight
shape) that its default cache evicts when a run sees many.

Only the engine's forwards switch (:func:`onednn_linears`, a context manager): ``generate()`` and
every other use of the model stay stock, bit for bit. The head's results differ from sgemm's in the
last bits (a different summation order), as a compiled step's would; the engine's tests compare
tokens with stock ``generate()``. bfloat16 and float16 linears already run through oneDNN in torch
and are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from hf_paged.engine import step_threads

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


def switchable_lm_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """``model``'s LM head where oneDNN can run it: a plain float32 CPU ``nn.Linear``, and this torch has oneDNN."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if head is not None and available() and _switchable(head) else None


def prepacked_lm_head(model: torch.nn.Module, enabled: bool | None = None) -> PrepackedWeight | None:
    """The prepacked LM head of ``model``'s engine forwards: ``enabled`` None prepacks a float32 CPU
    ``nn.Linear`` head of at most ``PREPACK_LM_HEAD_MAX_BYTES``, True any such head, False none."""
    head = switchable_lm_head(model)
    if enabled is False or head is None:
        return None
    if enabled is None and head.weight.nbytes > PREPACK_LM_HEAD_MAX_BYTES:
        return None
    return PrepackedWeight(head)


def _onednn_forward(module: torch.nn.Linear, prepacked: PrepackedWeight | None = None, threads: int | None = None):
    weight, bias = prepacked.get() if prepacked is not None else module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.linear(x, module.weight, bias)
        with step_threads.with_threads(threads) if threads else contextlib.nullcontext():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward


@contextlib.contextmanager
def onednn_linears(modules: Iterable[torch.nn.Linear], prepacked: tuple[PrepackedWeight, ...] = (),
                   threads: int | None = None):
    """Run the float32 CPU ``nn.Linear`` ``modules`` through oneDNN inside the block, those of
    ``prepacked`` on their packed weights, on ``threads`` threads when given (a step otherwise on
    one thread: :mod:`hf_paged.engine.step_threads`)."""
    packs = {id(p.module): p for p in prepacked}
    switched = []
    try:
        for module in modules if available() else ():
            if _switchable(module) and "forward" not in module.__dict__:
                module.forward = _onednn_forward(module, packs.get(id(module)), threads)
                switched.append(module)
        yield
    finally:
        for module in switched:
            del module.forward
