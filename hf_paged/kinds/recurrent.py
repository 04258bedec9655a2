"""Recurrent state (Mamba / Mamba2 / linear attention / short convolutions): one slot per sequence.

Such a layer keeps no K/V per token but a fixed-size state per sequence: a convolution window
and, for most, an SSM or linear-attention matrix (transformers' ``LinearAttentionLayer``; a
``"hybrid"`` layer, Falcon-H1's, has this and attention beside it). Nothing to page: in the
engine each running sequence owns one **slot** of a per-layer state pool for its whole life
(vLLM's ``MambaSpec``: one "block" per sequence), allocated at admission, copied at a fork
(``n > 1``, beams), moved to host memory on a swap, freed with the sequence. Bytes are per
sequence, not per token (measured from the model, :mod:`hf_paged.state_pool`).

What an engine step needs from these layers: each sequence as its own batch row (its state is its
own), and a prefill that may continue from a state saved at the end of the previous chunk. The
Mamba2-style and gated-delta mixers of transformers pass the cached state into their chunked
scans (``initial_states``); the Mamba (v1) mixers (Mamba, FalconMamba, Jamba, Zamba) do not: a
multi-token forward restarts the scan from zero. Those layers' prompts are computed in one
forward each (``continues_chunks`` False: the scheduler never splits them).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec

#: transformers layer types whose cache layer holds conv / recurrent state (the attention half
#: of ``hybrid`` layers is a :class:`~hf_paged.kinds.base.KVSpec` of its own).
STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")

#: Model types whose mixers restart their scan on a multi-token forward (no ``initial_states``).
RESTARTING_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "jamba", "zamba"})


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A layer with per-sequence recurrent state (vLLM V1's ``MambaSpec``).

    ``number_of_states``: state tensors of each kind the layer keeps (transformers'
    ``LinearAttentionLayer(number_of_states=...)``). ``continues_chunks``: whether a prefill may
    be split into chunks, each continuing from the state the previous one left.
    """

    layer_type: str
    number_of_states: int = 1
    continues_chunks: bool = True
    kind = "recurrent"

    @property
    def keeps(self) -> str:
        return "one state slot per sequence"

    def describe(self) -> str:
        return f"recurrent({self.layer_type})"


def state_specs(config, layer_types: list[str], layer_kwargs: list[dict]) -> list[RecurrentStateSpec | None]:
    """Each layer's state spec (None: no recurrent state), from ``get_layer_types_and_kwargs``."""
    continues = getattr(config, "model_type", None) not in RESTARTING_MODEL_TYPES
    return [RecurrentStateSpec(t, kw.get("number_of_states", 1), continues) if t in STATE_LAYER_TYPES else None
            for t, kw in zip(layer_types, layer_kwargs)]


@dataclass(frozen=True)
class NoKVSpec(KVSpec):
    """The block bookkeeping of a model with no K/V at all (a pure state-space model): one group
    without layers, which stores nothing, so its pool grows on demand and bounds nothing; the
    state slots bound what runs."""

    kind = "none"

    def bytes_per_token(self, layer_config, dtype_bytes: int) -> int:
        return 0
