"""Decode steps replayed from CUDA graphs at bucketed batch sizes, as vLLM runs decode on GPUs.

On a GPU an eager engine step is bound by its host work: the model's modules and the paged
attention launch a few hundred small kernels per step from Python (the H200 run of 2026-12-04,
benchmarks/RESULTS.md: ~21 ms of host time per decode step of a 1.1B model whose kernels take
about one). A CUDA graph records a step's launches once and replays them with one call. What must
hold for a replay to be the step it stands for:

* every tensor the kernels read or write stays at one address: the token ids, positions, logits
  rows, and per layer group the slots, block tables and context lengths are static buffers, filled
  before each replay; the K/V pools are allocated at full size before the first capture and never
  grow (the engine knows its block budget on a GPU);
* no launch depends on the step's values: the block tables have one width (the model's positions
  over the block size), so the decode kernel's split count is fixed per bucket;
* a step of ``n`` sequences replays the graph of the smallest bucket ``>= n``; its pad rows write
  their K/V into a scratch block that no sequence owns (one block past each group's managed
  blocks) and read the one key they wrote there.

Only pure-decode steps replay (every sequence one new token that needs its logits); prefills,
chunks and mixed steps run as before. Graphs are captured when the engine is built, one forward
per bucket. ``capture=False`` keeps the static buffers, buckets and scratch rows but runs the
recorded forward eagerly: how the tests check all of it on CPU, through the Triton kernels under
the interpreter (the route a GPU takes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from hf_paged.channel import BLOCK_TABLE_PAD, AttentionMetadata
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.step_cache import PackedStepCache
from hf_paged.engine.tensor_parallel import tp_size_of
from hf_paged.kinds import MLAAttentionSpec

if TYPE_CHECKING:
    from hf_paged.engine.model_runner import ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def unsupported(runner: ModelRunner, capture: bool = True) -> str | None:
    """Why ``runner``'s decode steps cannot replay from graphs (None: they can)."""
    if capture and runner.device.type != "cuda":
        return f"CUDA graphs need a model on a CUDA device (it is on {runner.device.type})"
    if tp_size_of(runner.model) > 1:
        return "tensor parallelism's collectives are not captured"
    if runner.per_sequence:
        return "models with recurrent layers step each sequence in a row of its own"
    if any(isinstance(spec, MLAAttentionSpec) for spec in runner.specs):
        return "latent (MLA) layers gather each sequence's whole context on the host"
    return None


class _StaticStep(PackedStepCache):
    """A step cache whose metadata are the graphs' static buffers (sliced to a bucket) and whose
    pools are sized to hold every managed block and the scratch block."""

    def __init__(self, runner: ModelRunner, metadata: list[AttentionMetadata], pool_blocks: list[int],
                 positions: torch.Tensor):
        # on a CPU stand-in the C read is the one that reads the static metadata (gather reads build
        # theirs from the step's host lists); on CUDA the decode kernel reads them
        super().__init__(runner.specs, runner.groups, runner.storage, SchedulerOutput(), positions, decode_read="c")
        self._static, self._pool_blocks = metadata, pool_blocks

    def num_blocks_for(self, layer_idx: int) -> int:
        return self._pool_blocks[self.group_index(layer_idx)]

    def metadata_for(self, layer_idx: int, device: torch.device) -> AttentionMetadata:
        return self._static[self.group_index(layer_idx)]


class DecodeGraphs:
    """The decode-step graphs of a :class:`~hf_paged.engine.model_runner.ModelRunner`.

    ``pool_blocks``: the blocks each layer group manages (its scratch block is the next one);
    ``max_positions``: the longest sequence (None: as many blocks as the pool has)."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, pool_blocks: list[int], max_positions: int | None,
                 *, capture: bool = True):
        reason = unsupported(runner, capture)
        if reason is not None:
            raise ValueError(f"cuda_graphs=True: {reason}")
        self.runner, self.capture = runner, capture
        device, bs = runner.device, runner.storage.block_size
        self.buckets = tuple(b for b in BUCKETS if b < max_num_seqs) + (max_num_seqs,)
        top = self.buckets[-1]
        self.scratch = list(pool_blocks)  # one block past each group's managed blocks
        self.pool_blocks = [n + 1 for n in pool_blocks]
        self.width = max(pool_blocks) if max_positions is None else -(-max_positions // bs)
        groups = len(pool_blocks)
        # one int64 and one int32 buffer, each filled by one copy per replay
        self._long = torch.zeros(2 + groups, top, dtype=torch.long, device=device)  # ids, positions, slots
        self._int = torch.zeros(groups, top, 1 + self.width, dtype=torch.int32, device=device)  # lens, tables
        self._host_long = np.zeros((2 + groups, top), dtype=np.int64)
        self._host_int = np.zeros((groups, top, 1 + self.width), dtype=np.int32)
        self._keep = torch.arange(top, device=device)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.replayed = 0  # steps served from a graph
        for bucket in reversed(self.buckets):  # the largest first: smaller graphs reuse its memory
            self._record(bucket)

    # ------------------------------------------------------------------ steps
    def applies(self, step: SchedulerOutput) -> bool:
        """Whether ``step`` replays: every sequence decodes one token that needs its logits, they
        fit the largest bucket, and their block tables fit the static width."""
        seqs = step.sequences
        return (step.num_decode == len(seqs) <= self.buckets[-1]
                and all(s.needs_logits for s in seqs)
                and all(len(table) <= self.width for group in step.groups for table in group.block_tables))

    def run(self, step: SchedulerOutput) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` of the step's sequences, from the replay of its bucket."""
        n = len(step.sequences)
        bucket = next(b for b in self.buckets if b >= n)
        self._fill(bucket, step)
        logits = self._replays[bucket]()
        self.replayed += 1
        return logits[:n].to(torch.float32, copy=True)  # the static rows are overwritten by the next replay

    # ------------------------------------------------------------------ buffers
    def _fill(self, bucket: int, step: SchedulerOutput | None) -> None:
        """Write the step's rows (none: every row a pad row) and ``bucket``'s pad rows into the
        static buffers: two host-to-device copies."""
        n = 0 if step is None else len(step.sequences)
        bs = self.runner.storage.block_size
        host, host_int = self._host_long, self._host_int
        host[:, n:bucket] = 0
        host_int[:, n:bucket, :] = BLOCK_TABLE_PAD
        host_int[:, n:bucket, 0] = 1  # a pad row reads the one key it wrote
        for g, scratch in enumerate(self.scratch):
            host[2 + g, n:bucket] = scratch * bs
            host_int[g, n:bucket, 1] = scratch
        if n:
            host[0, :n], host[1, :n] = step.input_ids, step.positions
            lens = step.context_lens
            for g, blocks in enumerate(step.groups):
                host[2 + g, :n] = blocks.slot_mapping
                host_int[g, :n, 0] = lens
                rows = host_int[g, :n, 1:]
                rows[:] = BLOCK_TABLE_PAD
                for i, table in enumerate(blocks.block_tables):
                    rows[i, : len(table)] = table
        self._long[:, :bucket].copy_(torch.from_numpy(host[:, :bucket]), non_blocking=False)
        self._int[:, :bucket].copy_(torch.from_numpy(host_int[:, :bucket]), non_blocking=False)

    def _step_cache(self, bucket: int) -> _StaticStep:
        metadata = [AttentionMetadata(slot_mapping=self._long[2 + g, :bucket],
                                      block_tables=self._int[g, :bucket, 1:],
                                      context_lens=self._int[g, :bucket, 0],
                                      cu_seqlens_q=self._int.new_zeros(1), num_decode=bucket)
                    for g in range(len(self.scratch))]
        return _StaticStep(self.runner, metadata, self.pool_blocks, self._long[1, :bucket])

    # ------------------------------------------------------------------ recording
    @torch.inference_mode()  # as the runner's steps run (a compiled body's graphs are kept per grad mode)
    def _record(self, bucket: int) -> None:
        """``bucket``'s forward over the static buffers: run once eagerly (pools allocated at full
        size, Triton kernels compiled, workspaces made), then captured (``capture``)."""
        runner, keep = self.runner, self._keep[:bucket]
        forward = {"input_ids": self._long[0:1, :bucket], "position_ids": self._long[1:2, :bucket],
                   "use_cache": True}
        if runner.takes_logits_to_keep:
            forward["logits_to_keep"] = keep

        def step() -> torch.Tensor:
            cache = self._step_cache(bucket)
            logits = runner.run_model({**forward, runner.cache_kwarg: cache},
                                      cache, compiled=runner.compiled is not None, num_tokens=bucket)
            return runner.packed_logits(logits, keep)

        self._fill(bucket, None)
        step()
        if not self.capture:
            self._replays[bucket] = step
            return
        torch.cuda.synchronize(runner.device)
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: CUDA calls of the process's other threads (servers, compilers) do not void it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = step()
        except Exception as err:  # e.g. a host sync or a host-to-device copy in the model's forward
            first_line = (str(err).strip().splitlines() or [""])[0]
            raise RuntimeError(f"cuda_graphs=True: capturing a decode step of {bucket} sequences failed "
                               f"({type(err).__name__}: {first_line}); build the engine with cuda_graphs=False") from err

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        self._replays[bucket] = replay
