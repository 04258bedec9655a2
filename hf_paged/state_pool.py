"""Recurrent-state storage for the engine: per state layer, ``[num_slots, ...]`` tensors (no scheduling).

Each recurrent layer (:mod:`hf_paged.kinds.recurrent`) has, per state index, a conv-state pool
and (unless it only convolves, like LFM2's) a recurrent-state pool, with one row per slot. The
shapes are what transformers' own ``LinearAttentionLayer`` holds for one sequence, measured once
by :func:`probe_state_shapes` (a two-token forward with a stock ``DynamicCache``), so nothing
here knows how a mixer lays out its state.

A forward reads states through transformers' own cache-layer classes: :meth:`StatePool.layers_for`
builds, for the forward's rows, the layers ``DynamicCache`` would hold, with the rows' states
gathered from their slots (or empty for rows starting from scratch); :meth:`StatePool.store`
writes what the forward left back to the slots. Every call the model makes (``get_conv_state``,
``update_recurrent_state``, ``has_previous_state``...) is then the ``Cache`` base class's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from hf_paged.kinds import RecurrentStateSpec

StateKey = tuple[int, int, str]  # (layer, state index, "conv" or "recurrent")


@dataclass(frozen=True)
class StateShape:
    """One state tensor of one sequence: its shape (without the batch row) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return torch.Size(self.shape).numel() * (torch.finfo(self.dtype).bits // 8
                                                 if self.dtype.is_floating_point else torch.iinfo(self.dtype).bits // 8)


@torch.inference_mode()
def probe_state_shapes(model: PreTrainedModel, specs: Sequence[RecurrentStateSpec | None],
                       cache_kwarg: str) -> dict[StateKey, StateShape]:
    """Run two tokens through ``model`` with a stock ``DynamicCache`` and read the shape and dtype
    of every state its recurrent layers keep (what one slot holds)."""
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    model(input_ids=ids, **{cache_kwarg: cache}, use_cache=True)
    shapes = {}
    for layer, spec in enumerate(specs):
        if spec is None:
            continue
        held = cache.layers[layer]
        for index in range(spec.number_of_states):
            for kind, states in (("conv", held.conv_states), ("recurrent", held.recurrent_states)):
                if states.get(index) is not None:
                    shapes[(layer, index, kind)] = StateShape(tuple(states[index].shape[1:]), states[index].dtype)
    return shapes


class StatePool:
    """The state slots of every recurrent layer on one device (the model's, or the CPU swap space)."""

    def __init__(self, shapes: dict[StateKey, StateShape], specs: Sequence[RecurrentStateSpec | None],
                 num_slots: int, device: torch.device | str, pin_memory: bool = False):
        self.shapes, self.specs, self.num_slots = dict(shapes), list(specs), num_slots
        self.device = torch.device(device)
        self.tensors: dict[StateKey, torch.Tensor] = {
            key: torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=self.device,
                             pin_memory=pin_memory and self.device.type == "cpu")
            for key, s in self.shapes.items()
        }

    @property
    def layers(self) -> list[int]:
        return [i for i, spec in enumerate(self.specs) if spec is not None]

    def bytes_per_slot(self) -> int:
        """Bytes one sequence's states take over all recurrent layers."""
        return sum(s.bytes for s in self.shapes.values())

    # ------------------------------------------------------------------ a forward's states
    def layers_for(self, slots: torch.Tensor, has_previous: bool) -> dict[int, LinearAttentionCacheLayerMixin]:
        """Per recurrent layer, transformers' ``LinearAttentionLayer`` for the forward's rows
        (``slots[i]``: row i's slot): with the rows' states when they continue (``has_previous``),
        empty otherwise (the model initializes them, as in a fresh ``DynamicCache``)."""
        layers = {}
        for layer in self.layers:
            spec = self.specs[layer]
            held = LinearAttentionLayer(number_of_states=spec.number_of_states)
            if has_previous:
                for (l, index, kind), pool in self.tensors.items():
                    if l == layer:
                        self._load(held, index, kind, pool.index_select(0, slots))
            layers[layer] = held
        return layers

    @staticmethod
    def _load(held: LinearAttentionLayer, index: int, kind: str, state: torch.Tensor) -> None:
        held.device, held.dtype = state.device, state.dtype
        if kind == "conv":
            held.conv_states[index] = state
            held.conv_kernel_size[index] = state.shape[-1]
            held.is_conv_states_initialized[index] = True
        else:
            held.recurrent_states[index] = state
            held.is_recurrent_states_initialized[index] = True
        held.has_previous_state[index] = True

    def store(self, layers: dict[int, LinearAttentionCacheLayerMixin], slots: torch.Tensor) -> None:
        """Write the rows' states, as the forward left them in ``layers``, back to their slots."""
        for (layer, index, kind), pool in self.tensors.items():
            held = layers[layer]
            state = (held.conv_states if kind == "conv" else held.recurrent_states).get(index)
            if state is None:
                raise RuntimeError(f"layer {layer}: the forward left no {kind} state {index} to store")
            pool.index_copy_(0, slots.to(pool.device), state.to(pool.dtype))

    # ------------------------------------------------------------------ slot moves
    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy states between slots, all at once: every source is read before any destination is
        written (a destination may be another pair's source, see :mod:`hf_paged.state_slots`)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for pool in self.tensors.values():
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def transfer(self, other: StatePool, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy states of slots here to slots of ``other`` (a swap out or in)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=other.device)
        for key, pool in self.tensors.items():
            other.tensors[key].index_copy_(0, dst, pool.index_select(0, src).to(other.device))
