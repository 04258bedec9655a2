"""LoRA inside an engine step: many adapters in one packed forward (S-LoRA / Punica's idea, in torch).

A step's tokens belong to sequences of different requests, each with its own adapter or none.
During the step every targeted linear layer adds, to its output rows of each adapter's tokens,
that adapter's update: ``out[rows] += (x[rows] A^T) B^T * scaling``, one gather, two small
matmuls and one scatter per adapter and layer (:func:`add_lora_rows`); rows of the base model
are left as the layer computed them. Outside steps the model's modules are stock: the forwards
are swapped in for the step's duration only (:meth:`LoRALayers.active`), and a step in which no
request has an adapter runs exactly as without LoRA.

The same arithmetic as peft's unmerged ``LoraLayer`` (``result + lora_B(lora_A(x)) * scaling``,
half-precision models computing the update in float32 and rounding the sum), so a request's tokens
are those of ``PeftModel.generate()`` on that adapter. The update is applied to the layer's output
only, never merged into the weights, so other requests in the batch see the base model.

A compiled decoder body (:mod:`hf_paged.engine.compiled_body`) cannot trace a step's grouping of
rows: there every linear layer the adapters may target calls one opaque custom op,
``hf_paged::lora_add_``, which applies the running step's adapters in eager Python.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_paged.lora.adapter import LoRAAdapter, LoRAWeights, module_shapes

_thread = threading.local()


def lora_delta(x: torch.Tensor, weights: LoRAWeights) -> torch.Tensor:
    """peft's update of one adapter for the rows ``x``: ``B(A(x)) * scaling``, in the weights' dtype."""
    if x.dtype != weights.lora_a.dtype:
        x = x.to(weights.lora_a.dtype)
    return F.linear(F.linear(x, weights.lora_a), weights.lora_b) * weights.scaling


def add_lora_rows(x: torch.Tensor, out: torch.Tensor, rows: slice | torch.Tensor, weights: LoRAWeights) -> None:
    """Add one adapter's update to ``out`` (``[tokens, out_features]``, in place) at ``rows`` of
    ``x`` (``[tokens, in_features]``): peft's ``out + B(A(x)) * scaling``, rounded to ``out``'s dtype."""
    if isinstance(rows, slice):
        out[rows] = _rounded(out[rows] + lora_delta(x[rows], weights), out.dtype)
    else:
        out.index_copy_(0, rows, _rounded(out.index_select(0, rows) + lora_delta(x.index_select(0, rows), weights),
                                          out.dtype))


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


@dataclass(frozen=True)
class StepLoRA:
    """A step's tokens by adapter: ``groups`` pairs each adapter with its rows of the step's
    tokens (a slice when they are one run, else an index tensor), in the packed forward's order.

    A layer that several of the step's adapters target gathers their rows once (sorted by
    adapter), runs each adapter on its contiguous share, and scatters the sums back once: the
    same arithmetic per row as :func:`add_lora_rows` one adapter at a time, in fewer operations."""

    groups: tuple[tuple[slice | torch.Tensor, LoRAAdapter], ...]
    _gathered: dict = field(default_factory=dict, compare=False)  # adapters (group indices) -> rows, spans

    @classmethod
    def of(cls, token_counts: list[int], adapter_ids: list[int], adapters: dict[int, LoRAAdapter],
           device: torch.device) -> StepLoRA | None:
        """The grouping of a step whose sequences compute ``token_counts`` tokens each, with
        adapters ``adapter_ids`` (0: the base model); None when no sequence has an adapter."""
        spans: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for count, adapter in zip(token_counts, adapter_ids):
            if adapter:
                runs = spans.setdefault(adapter, [])
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + count)
                else:
                    runs.append((start, start + count))
            start += count
        if not spans:
            return None
        groups = []
        for adapter, runs in spans.items():
            if len(runs) == 1:
                rows = slice(*runs[0])
            else:
                rows = torch.cat([torch.arange(lo, hi) for lo, hi in runs]).to(device)
            groups.append((rows, adapters[adapter]))
        return cls(tuple(groups))

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the update of every adapter that targets module ``name`` to ``out`` (in place)."""
        targeting = tuple(i for i, (_, adapter) in enumerate(self.groups) if name in adapter.modules)
        if not targeting:
            return
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if len(targeting) == 1:
            rows, adapter = self.groups[targeting[0]]
            add_lora_rows(flat_x, flat_out, rows, adapter.modules[name])
            return
        rows, spans = self._rows_of(targeting, flat_x.device)
        xs = flat_x.index_select(0, rows)
        deltas = [lora_delta(xs[lo:hi], self.groups[i][1].modules[name]) for i, (lo, hi) in zip(targeting, spans)]
        flat_out.index_copy_(0, rows, _rounded(flat_out.index_select(0, rows) + torch.cat(deltas), out.dtype))

    def _rows_of(self, targeting: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The rows of the adapters ``targeting`` (indices into ``groups``), one adapter after
        another, and each one's span in them (built once per step for each set of adapters)."""
        if targeting not in self._gathered:
            parts = [self.groups[i][0] for i in targeting]
            parts = [torch.arange(p.start, p.stop, device=device) if isinstance(p, slice) else p for p in parts]
            bounds = list(itertools.accumulate((len(p) for p in parts), initial=0))
            self._gathered[targeting] = (torch.cat(parts), list(zip(bounds, bounds[1:])))
        return self._gathered[targeting]

    def targets(self) -> set[str]:
        return {name for _, adapter in self.groups for name in adapter.modules}


@torch.library.custom_op("hf_paged::lora_add_", mutates_args=("out",))
def lora_add_(out: torch.Tensor, x: torch.Tensor, module: int) -> None:
    """Add the running step's adapter updates of linear layer ``module`` (its index in the
    compiled model's :class:`LoRALayers`) to ``out``. Outside a step (while compiling) nothing."""
    active = getattr(_thread, "active", None)
    if active is not None:
        layers, step = active
        step.apply(layers.names[module], x, out)


@lora_add_.register_fake
def _(out, x, module):
    return None


class LoRALayers:
    """The linear layers of ``model`` that adapters may target (the LM head excepted), and their
    forwards during LoRA steps."""

    def __init__(self, model: torch.nn.Module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        found = [(name, m) for name, m in model.named_modules() if module_shapes(m) is not None and m is not head]
        self.names = [name for name, _ in found]
        self.modules = dict(found)
        self._index = {name: i for i, name in enumerate(self.names)}

    def _forward(self, name: str, index: int, module: torch.nn.Module, traced: bool):
        base = module.forward  # the layer's own, or what the step runs it through (hf_paged.engine.cpu_linear)
        if traced:  # compiled bodies: the opaque op reads the running step

            def forward(x: torch.Tensor) -> torch.Tensor:
                out = base(x)
                torch.ops.hf_paged.lora_add_(out, x, index)
                return out
        else:
            step = _thread.active[1]

            def forward(x: torch.Tensor) -> torch.Tensor:
                out = base(x)
                step.apply(name, x, out)
                return out

        forward.lora_layer = name
        return forward

    @contextlib.contextmanager
    def active(self, step: StepLoRA | None, traced: bool = False):
        """Inside, the targeted layers add ``step``'s adapter updates: in eager steps only the
        layers its adapters target get a new forward; ``traced`` (a compiled body running or being
        compiled) every targetable layer calls the custom op (the graph holds the calls). Each new
        forward wraps the layer's current one (a forward replaced before, as the engine's oneDNN
        linears are, keeps computing the base output), which is put back afterwards."""
        names = self.names if traced else sorted(step.targets())
        if any(hasattr(self.modules[n].__dict__.get("forward"), "lora_layer") for n in names):
            raise RuntimeError("a LoRA step found a linear layer already running a LoRA step")
        _thread.active = (self, step) if step is not None else None
        swapped = []
        try:
            for name in names:
                module = self.modules[name]
                previous = module.__dict__.get("forward")
                module.forward = self._forward(name, self._index[name], module, traced)
                swapped.append((module, previous))
            yield
        finally:
            for module, previous in reversed(swapped):
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous
            _thread.active = None
