"""The adapters an engine serves: loaded on first use, shared by the requests naming them.

vLLM's knobs, with its meanings and defaults: ``max_loras`` adapters at most among the running
requests (the scheduler passes over a request whose adapter would be one more), ``max_lora_rank``
the largest rank accepted, ``max_cpu_loras`` adapters kept loaded (those of requests in flight
and pinned ones always; beyond that the least recently used go, and are read again when named).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

import torch

from hf_paged.lora.adapter import LoRAAdapter, load_adapter
from hf_paged.lora.layers import LoRALayers, StepLoRA
from hf_paged.lora.request import LoRARequest

if TYPE_CHECKING:
    from hf_paged.engine.scheduler_output import SchedulerOutput


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class LoRAManager:
    """Loaded adapters by ``lora_int_id`` (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None):
        self.model = model
        self.max_loras = _positive("max_loras", max_loras)
        self.max_lora_rank = _positive("max_lora_rank", max_lora_rank)
        self.max_cpu_loras = max_loras if max_cpu_loras is None else _positive("max_cpu_loras", max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.layers = LoRALayers(model)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._in_use: Counter[int] = Counter()  # requests in flight per adapter
        self._pinned: set[int] = set()
        self.num_loads = 0

    def add(self, request: LoRARequest, hold: bool = False) -> LoRAAdapter:
        """The adapter of ``request``, read from its path unless loaded (or ``load_inplace``);
        ``hold``: one more request in flight uses it (counted before anything is evicted, so the
        adapter it needs is never the one that goes). ``ValueError`` when it cannot be served, or
        when its id is loaded under another name or path."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        loaded = self.adapters.get(request.lora_int_id)
        if loaded is not None and not request.load_inplace:
            known = loaded.request
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} "
                                 f"({known.lora_path}); give {request.lora_name!r} an id of its own")
            self.adapters.move_to_end(request.lora_int_id)
            self._hold(request.lora_int_id, hold)
            return loaded
        if loaded is not None and self._in_use[request.lora_int_id]:
            raise ValueError(f"LoRA adapter {request.lora_int_id} is in use by requests in flight; it cannot be "
                             "loaded again (load_inplace) until they finish")
        adapter = dataclasses.replace(load_adapter(request, self.model, self.max_lora_rank), generation=self.num_loads)
        self.adapters[request.lora_int_id] = adapter
        self.adapters.move_to_end(request.lora_int_id)
        self.num_loads += 1
        self._hold(request.lora_int_id, hold)
        self._evict()
        return adapter

    def acquire(self, request: LoRARequest) -> LoRAAdapter:
        """:meth:`add`, holding it for one more request in flight (kept loaded until released)."""
        return self.add(request, hold=True)

    def _hold(self, lora_int_id: int, hold: bool) -> None:
        if hold:
            self._in_use[lora_int_id] += 1

    def release(self, lora_int_id: int) -> None:
        """A request using the adapter finished."""
        self._in_use[lora_int_id] -= 1
        if self._in_use[lora_int_id] <= 0:
            del self._in_use[lora_int_id]
            self._evict()

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter (vLLM's ``remove_lora``): False when it is not loaded; ``ValueError``
        while requests in flight use it."""
        if lora_int_id not in self.adapters:
            return False
        if self._in_use[lora_int_id]:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {self._in_use[lora_int_id]} request(s) in "
                             "flight; abort them or let them finish first")
        del self.adapters[lora_int_id]
        self._pinned.discard(lora_int_id)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter loaded whatever ``max_cpu_loras`` says (vLLM's ``pin_lora``)."""
        if lora_int_id not in self.adapters:
            raise ValueError(f"LoRA adapter {lora_int_id} is not loaded")
        self._pinned.add(lora_int_id)
        return True

    def list(self) -> set[int]:
        return set(self.adapters)

    def _evict(self) -> None:
        """Unload least recently used adapters no request uses and none pinned, down to ``max_cpu_loras``."""
        for lora_int_id in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if not self._in_use[lora_int_id] and lora_int_id not in self._pinned:
                del self.adapters[lora_int_id]

    def step(self, step: SchedulerOutput, device: torch.device) -> StepLoRA | None:
        """The step's tokens by adapter (None: no sequence of the step has one)."""
        if not step.has_lora:
            return None
        return StepLoRA.of([s.num_tokens for s in step.sequences], [s.lora_int_id for s in step.sequences],
                           self.adapters, device)
