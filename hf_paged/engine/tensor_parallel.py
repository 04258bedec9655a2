"""Tensor parallelism for the engine: rank 0 decides, every rank computes the same step.

A model loaded with transformers' ``tp_plan="auto"`` holds a slice of the heads on each rank of a
``torch.distributed`` group, and its forwards all-reduce across ranks: every rank must run the
same forwards in the same order. So only rank 0 takes requests, schedules and samples; before
each forward it broadcasts the step's ``SchedulerOutput`` (plain Python data: the tokens to feed,
which include the tokens sampled at the previous step, their positions, slots, block tables and
block moves). The other ranks execute exactly that (:meth:`LLMEngine.run_worker`), so their
block books cannot differ from rank 0's, and no rank samples on its own. Each rank's pools hold
its own K/V heads only. Control messages go over a gloo group (CPU objects, whatever the
model's backend: gloo on CPU, NCCL on CUDA).

Messages (rank 0 to the others): ``("step", SchedulerOutput)``, ``("done", outputs)`` at the end
of a ``generate`` call (followers' ``generate`` returns rank 0's outputs), ``("stop", None)``
from :meth:`LLMEngine.close` (ends ``run_worker``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel


def tp_size_of(model: PreTrainedModel) -> int:
    """Ranks the model's weights are split over (1 without tensor parallelism)."""
    return int(getattr(model, "tp_size", None) or 1)


def check_kv_heads(config: PretrainedConfig, size: int) -> None:
    """Each rank must hold whole K/V heads: refuse a head count that does not divide by ``size``."""
    config = config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if size > 1 and (heads % size or config.num_attention_heads % size):
        raise ValueError(
            f"tensor-parallel size {size} does not divide the model's heads (num_key_value_heads={heads}, "
            f"num_attention_heads={config.num_attention_heads}): each rank must hold whole K/V heads; "
            f"use a size that divides {heads}")


@dataclass
class TensorParallelGroup:
    """This process's place among the ranks of a tensor-parallel model, and the control channel."""

    rank: int
    size: int
    group: Any  # a gloo process group for control messages

    @classmethod
    def of(cls, model: PreTrainedModel) -> TensorParallelGroup | None:
        size = tp_size_of(model)
        if size <= 1:
            return None
        if not dist.is_initialized():
            raise RuntimeError(f"{type(model).__name__} is split over {size} ranks but torch.distributed is not "
                               "initialized in this process")
        if dist.get_world_size() != size:
            raise ValueError(f"the model is split over {size} ranks but the process group has "
                             f"{dist.get_world_size()}: one tensor-parallel group per engine")
        group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        return cls(dist.get_rank(), size, group)

    @property
    def is_driver(self) -> bool:
        """Rank 0: takes requests, schedules, samples."""
        return self.rank == 0

    def send(self, kind: str, payload: Any = None) -> None:
        dist.broadcast_object_list([(kind, payload)], src=0, group=self.group)

    def receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree_min(self, values: list[int]) -> list[int]:
        """The smallest of every rank's values, element by element (a KV budget all ranks can hold)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tensor.tolist()


def load_model(path: str, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """Load a checkpoint split over the ranks of ``torch.distributed`` (transformers' ``tp_plan="auto"``), after
    checking that its heads divide by the world size. Call it in every rank (e.g. under
    ``torchrun``); it initializes the default process group from the environment if needed
    (gloo on CPU, NCCL on CUDA)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    check_kv_heads(AutoConfig.from_pretrained(path), dist.get_world_size())
    plan = DistributedConfig(tp_size=dist.get_world_size(), tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=plan, dtype=dtype, **kwargs).eval()
