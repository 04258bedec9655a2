"""``LLMEngine``: continuous batching on the paged KV cache (vLLM's API, in plain PyTorch).

A step flows one way: the scheduler decides (``SchedulerOutput``), the model runner executes it
(storage moves, one packed forward, logits), the output processor turns logits into tokens and
finished requests (``StepResult``), and the scheduler applies that to KV memory. ``generate``
runs steps until every request is done; ``add_request``/``step``/``abort``/``stream`` serve online.

A step is a transaction (``step()``): when executing or processing it raises, the step is
closed all the same (:meth:`Scheduler.abandon`), the requests it cannot continue fail with
``error_kind="fault"`` and their blocks are freed, and the next step runs normally. Faults that
belong to one request (non-finite logits, an exception while it is sampled) fail that request
alone. ``healthy`` turns False after ``max_consecutive_failures`` failed steps in a row.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Container, Iterable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_paged.block_manager import check_block_options
from hf_paged.engine import host_malloc
from hf_paged.engine.cuda_graphs import DecodeGraphs
from hf_paged.engine.intake import RequestIntake
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.model_runner import ModelRunner
from hf_paged.engine.output_processor import OutputProcessor
from hf_paged.engine.output_shaper import OutputShaper, shapes_outputs
from hf_paged.engine.outputs import FAULT, REJECTED, RequestOutput, request_failure
from hf_paged.engine.params import RequestOutputKind, SamplingParams
from hf_paged.engine.scheduler import Scheduler, check_scheduling_policy
from hf_paged.engine.scheduler_output import SchedulerOutput
from hf_paged.engine.sequence import Request
from hf_paged.engine.speculative import NgramProposer, SpeculativeConfig
from hf_paged.engine.structured import StructuredOutputManager
from hf_paged.engine.tensor_parallel import TensorParallelGroup, check_kv_heads, tp_size_of
from hf_paged import prefix_snapshot
from hf_paged.prefix_snapshot import SnapshotError
from hf_paged.kinds import NoKVSpec
from hf_paged.layer_groups import LayerGroup, layer_groups, sliding_cap, split_budget
from hf_paged.lora import LoRAManager, LoRARequest
from hf_paged.model_info import (cache_kwarg, check_engine_supported, eos_token_ids, kv_bytes_per_token, layer_kinds,
                                 max_positions, state_kinds)
from hf_paged.state_pool import StatePool, probe_state_shapes
from hf_paged.storage import PagedKVStorage

logger = logging.getLogger("hf_paged")


class LLMEngine:
    """Serve many requests at once on one model.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        tokenizer: optional; needed for string prompts, ``text`` outputs and ``stop`` strings.
        block_size: tokens per KV block.
        num_blocks: KV blocks on the model's device. ``None``: on CUDA, derived from free memory
            (``gpu_memory_utilization``); elsewhere from ``kv_cache_bytes`` or, without it, a pool
            that grows on demand (no preemption then).
        max_num_seqs / max_num_batched_tokens: per-step limits (sequences, tokens). The token budget's
            default, 4,096, is vLLM's on CPU: on 2 cores it ran ~1,000-token prompts 5-10% faster than
            2,048 (fewer prompts split across steps, larger matmuls; benchmarks/RESULTS.md).
        enable_prefix_caching: reuse cached full blocks of earlier prompts. ``None`` (default): on,
            except for models with recurrent layers, whose state at a prefix's end no block holds
            (an explicit True there is a ``ValueError``; ``stats()["prefix_caching"]`` says which).
        num_state_slots: models with recurrent layers (Mamba, linear attention, convolutions): the
            sequences whose states fit at once (default ``max_num_seqs``, fewer when a byte budget
            cannot hold that many beside one block per slot). Running sequences never exceed it.
        prepack_lm_head: float32 models on CPU: the engine's forwards run the LM head on a
            oneDNN-prepacked copy of its weight (faster decode steps, a second copy of that weight in
            memory). ``None`` (default): when the copy is at most 1 GiB; True / False: always / never.
        onednn_layers: float32 models on CPU: the engine's forwards run the layers' linear layers
            through oneDNN rather than MKL's sgemm (:mod:`hf_paged.engine.cpu_linear`: on CPUs where
            sgemm runs narrower vectors, 1.5-2.3x faster products). ``None`` (default): where oneDNN
            measured at least 1.25x sgemm's speed at the model's largest layer shape (once per shape
            and process, milliseconds); True / False: always / never. ``stats()["onednn_layers"]``
            says which, ``runner.onednn_layers_note`` why. Either way their products of at most 16
            rows (8 without AVX-512: decode steps of a few sequences) run in C
            (:mod:`hf_paged.kernels.cpu_gemv`), unless the environment has ``HF_PAGED_FEW_ROW_LAYERS=0``.
        prepack_layers: with ``onednn_layers`` on: their products run on oneDNN-prepacked copies of
            the weights (decode steps gain too: oneDNN need not reorder a weight at each call; a
            second copy of those weights in memory). ``None`` (default): when the copies take at
            most 1 GiB, unless the environment has ``HF_PAGED_PREPACK_LAYERS=0``; True / False:
            always / never. ``stats()["prepacked_layers"]`` says which, ``runner.layer_packs_note`` why.
        tune_malloc: set glibc's malloc thresholds for this process (:mod:`hf_paged.engine.host_malloc`:
            CPU steps then stop faulting in fresh pages for their buffers). Process-wide. ``None``
            (default): when the model is on CPU; True / False: always / never.
        compile: run the steps' decoder body through ``torch.compile`` with the paged read as a
            custom op (:mod:`hf_paged.engine.compiled_body`; compiled here, seconds; tokens may
            differ from eager steps where the last bits decide a near-tie). ``None`` (default): on
            CPU for models whose layers are all plain attention layers, unless the environment has
            ``HF_PAGED_COMPILE=0`` (on a GPU steps stay eager by default: compiled ones are not
            yet measured there); True: compile or raise naming why not; False: eager steps.
            ``stats()["compiled"]`` says which, :attr:`compile_note` why not.
        serial_small_steps: models on CPU with more than one torch thread: steps whose largest
            layer GEMM is small run on the stepping thread alone (:mod:`hf_paged.engine.step_threads`:
            with passive OpenMP waits each parallel region pays a wake-up that small work does not
            earn back). ``None`` (default): when ``OMP_WAIT_POLICY=PASSIVE``, as under ``hf-paged
            serve`` with the engine on every core; True / False: always / never.
            ``stats()["serial_step_max_tokens"]`` says up to which step size (0: none).
        cuda_graphs: models on CUDA: pure-decode steps replay CUDA graphs captured here at bucketed
            batch sizes (:mod:`hf_paged.engine.cuda_graphs`; the pools are allocated whole).
            ``None`` / False (default): eager steps (graphs are not yet measured on a device);
            True: capture, or raise naming why not.
        preemption_mode: ``"recompute"`` or ``"swap"`` (to ``swap_space_blocks`` CPU blocks).
        scheduling_policy: vLLM's: ``"fcfs"`` (first come, first served) or ``"priority"``: requests
            are served in order of the ``priority`` given to :meth:`add_request` (lower first, then
            arrival), and the one preempted when blocks run out is the last in that order.
        max_model_len: vLLM's: the most tokens a sequence may hold, prompt and output (default the
            model's positions; more is refused). A longer prompt is refused, an output stops there
            (``"length"``), and ``max_tokens=None`` means up to it.
        max_logprobs: vLLM's: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for
            (None or -1: the whole vocabulary; more is refused, naming the field).
        speculative_config: vLLM's, for its n-gram method: ``{"method": "ngram",
            "num_speculative_tokens": k, "prompt_lookup_max": M, "prompt_lookup_min": m}``. A decoding
            sequence whose last ``m`` .. ``M`` tokens occurred before proposes the ``k`` tokens that
            followed them, and one forward checks them all (:mod:`hf_paged.engine.speculative`):
            every token is the one decoding without it would give, seeded samples included.
            ``stats()`` counts ``spec_drafts`` (sequences' drafts), ``spec_draft_tokens`` and
            ``spec_accepted_tokens`` (vLLM's ``vllm:spec_decode_*`` series on the server). Models with
            recurrent layers are refused (their state cannot be rolled back).
        enable_lora: serve PEFT LoRA adapters (:mod:`hf_paged.lora`): each request may name one
            (``add_request(..., lora_request=LoRARequest(name, id, path))``); requests of different
            adapters and of the base model share steps, each token getting its own adapter's
            update. ``max_loras`` (vLLM's, default 1): adapters at most among the running requests
            (a request whose adapter would be one more waits); ``max_lora_rank`` (16): larger
            ranks are refused; ``max_cpu_loras`` (default ``max_loras``): adapters kept loaded
            when no request uses them. Not with tensor parallelism or CUDA graphs.
        max_consecutive_failures: failed steps in a row after which :attr:`healthy` is False (a
            step fails when its forward, block moves or processing raise, or when every logits
            row it computed is non-finite; a step in which only some requests failed, each for
            its own fault, does not count). The engine keeps serving; a clean step that ran a
            forward makes it healthy again.

    The engine's forwards run with the ``"hf_paged"`` attention implementation; everything else
    about ``model`` stays as it is (its ``generate``, its attention implementation between steps).

    Tensor parallelism (:mod:`hf_paged.engine.tensor_parallel`): build the engine in every rank on
    a model loaded with ``tp_plan="auto"``. Rank 0 takes requests and steps; the other ranks call
    :meth:`run_worker` (or ``generate`` with the same arguments, which returns rank 0's outputs).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any = None, *, block_size: int = 16, num_blocks: int | None = None,
        max_num_seqs: int = 256, max_num_batched_tokens: int = 4096, enable_prefix_caching: bool | None = None,
        preemption_mode: str = "recompute", swap_space_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9, kv_cache_bytes: int | None = None, max_consecutive_failures: int = 3,
        num_state_slots: int | None = None, prepack_lm_head: bool | None = None, onednn_layers: bool | None = None,
        prepack_layers: bool | None = None, tune_malloc: bool | None = None,
        compile: bool | None = None, serial_small_steps: bool | None = None, cuda_graphs: bool | None = None,
        max_model_len: int | None = None, max_logprobs: int | None = None, scheduling_policy: str = "fcfs",
        speculative_config: SpeculativeConfig | dict | None = None, enable_lora: bool = False, max_loras: int = 1,
        max_lora_rank: int = 16, max_cpu_loras: int | None = None,
    ):
        check_scheduling_policy(scheduling_policy)
        self.speculative_config = SpeculativeConfig.of(speculative_config)
        check_engine_supported(model)  # generate()-only models are refused here, naming why
        check_block_options(block_size, num_blocks)
        check_kv_heads(model.config, tp_size_of(model))
        self.tp = TensorParallelGroup.of(model)
        self.lora = self._lora_manager(model, enable_lora, max_loras, max_lora_rank, max_cpu_loras, cuda_graphs)
        self._lora_holders: dict[str, int] = {}  # request id -> the adapter it keeps loaded
        self._shard = None  # tensor parallelism: this rank's checked snapshot, waiting for rank 0's placement
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if max_logprobs is not None and (not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool)
                                         or max_logprobs < -1):
            raise ValueError(f"max_logprobs must be None, an int >= 0, or -1 (the whole vocabulary), "
                             f"got {max_logprobs!r}")
        if not isinstance(max_consecutive_failures, int) or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be an int >= 1, got {max_consecutive_failures!r}")
        self.max_consecutive_failures = max_consecutive_failures
        self._stopped: str | None = None  # tensor parallelism: why the group was stopped after a failure
        self.model = model.eval()
        self.tokenizer = tokenizer
        if tune_malloc or (tune_malloc is None and model.device.type == "cpu"):
            host_malloc.tune_malloc()
        self.config = model.config.get_text_config(decoder=True)
        groups = layer_groups(layer_kinds(self.config)[1])
        self.state_specs = state_kinds(self.config)
        self.prefix_caching_note: str | None = None  # why prefix caching is off, when the model rules it out
        states = swap_states = None
        if any(self.state_specs):
            enable_prefix_caching = self._refuse_prefix_cache(enable_prefix_caching)
            states = StatePool(probe_state_shapes(model, self.state_specs, cache_kwarg(model)), self.state_specs,
                               1, model.device)  # sized below, once the budget is known
            if not groups:  # a pure state-space model: one group without layers keeps the sequences' bookkeeping
                groups, num_blocks = [LayerGroup(NoKVSpec(), ())], None
            if num_state_slots is None:
                num_state_slots = max_num_seqs
            if self.speculative_config is not None:
                raise ValueError(f"speculative_config: {type(model).__name__} has recurrent layers, whose state "
                                 "cannot be rolled back past draft tokens that were not taken")
        elif num_state_slots is not None:
            raise ValueError(f"num_state_slots is for models with recurrent layers; {type(model).__name__} has none")
        if num_state_slots is not None and (not isinstance(num_state_slots, int) or num_state_slots < 1):
            raise ValueError(f"num_state_slots must be an int >= 1, got {num_state_slots!r}")
        if num_blocks is None and (groups[0].layers or states):
            caps = [sliding_cap(g, block_size, max_num_seqs, max_num_batched_tokens) for g in groups]
            per_slot = states.bytes_per_slot() if states else 0
            num_blocks, num_state_slots = self._derived_budget(block_size, groups, caps, gpu_memory_utilization,
                                                               kv_cache_bytes, per_slot, num_state_slots)
        if swap_space_blocks is None:
            swap_space_blocks = (num_blocks or 0) if preemption_mode == "swap" else 0
        swap_slots = num_state_slots if states and preemption_mode == "swap" else 0
        if states:
            states = StatePool(states.shapes, self.state_specs, num_state_slots, model.device)
            swap_states = StatePool(states.shapes, self.state_specs, swap_slots, "cpu",
                                    pin_memory=model.device.type == "cuda") if swap_slots else None
        self.kv = KVCacheManager(block_size, num_blocks, enable_prefix_caching=enable_prefix_caching is not False,
                                 swap_space_blocks=swap_space_blocks, groups=groups,
                                 num_state_slots=num_state_slots or 0, swap_state_slots=swap_slots)
        self.max_positions = _model_len(max_positions(self.config), max_model_len)
        proposer = self.speculative_config and NgramProposer(self.speculative_config, self.max_positions)
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   preemption_mode=preemption_mode, policy=scheduling_policy,
                                   split_prompts=all(s.continues_chunks for s in self.state_specs if s),
                                   proposer=proposer, max_loras=self.lora.max_loras if self.lora else None)
        swap_storage = PagedKVStorage(block_size, device="cpu", pin_memory=model.device.type == "cuda")
        self.runner = ModelRunner(model, PagedKVStorage(block_size), swap_storage, swap_space_blocks, groups=groups,
                                  states=states, swap_states=swap_states, prepack_lm_head=prepack_lm_head,
                                  compile=compile, serial_small_steps=serial_small_steps, lora=self.lora,
                                  onednn_layers=onednn_layers, prepack_layers=prepack_layers)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        if cuda_graphs:
            if num_blocks is None:
                raise ValueError("cuda_graphs=True needs a KV budget (num_blocks or kv_cache_bytes): graphs keep "
                                 "the pools at one address, so they are allocated whole")
            self.runner.graphs = DecodeGraphs(self.runner, max_num_seqs, list(self.kv.pool_sizes), self.max_positions)
        # structured outputs and logit_bias: grammars compiled off this thread, masks and matchers per step
        self.structured = StructuredOutputManager(tokenizer, self.config.vocab_size, self.eos_token_ids, model.device)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_positions, self.structured)
        self.intake = RequestIntake(tokenizer, vocab_size=self.config.vocab_size, max_positions=self.max_positions,
                                    eos_token_ids=self.eos_token_ids, kv=self.kv, device=model.device,
                                    max_num_seqs=max_num_seqs, prefill_chunk=self.scheduler.prefill_chunk,
                                    max_logprobs=None if max_logprobs == -1 else max_logprobs)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._counters = {"steps": 0, "generated_tokens": 0, "busy_s": 0.0, "failed_steps": 0,
                          "consecutive_failed_steps": 0, "spec_drafts": 0, "spec_draft_tokens": 0,
                          "spec_accepted_tokens": 0}
        self._held: list[RequestOutput] = []  # outputs of a step interrupted by a BaseException
        self._unclaimed: dict[str, RequestOutput] = {}  # see _keep_unclaimed
        self._shapers: dict[str, OutputShaper] = {}  # requests whose step() outputs are not every step's whole

    def _derived_budget(self, block_size: int, groups: list[LayerGroup], caps: list[int | None],
                        utilization: float, kv_cache_bytes: int | None, bytes_per_slot: int = 0,
                        num_state_slots: int | None = None) -> tuple[list[int] | None, int | None]:
        """Blocks per layer-group pool that fit ``kv_cache_bytes``, or free CUDA memory; None: grow
        on demand. Sliding groups get no more than they can ever hold (``sliding_cap``): the rest
        of the budget goes to the full-attention layers. Recurrent state slots (``bytes_per_slot``
        each) come out of the same budget first: as many of ``num_state_slots`` as leave every
        slot's sequence at least one block of each group."""
        if kv_cache_bytes is None and self.model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.model.device)
            kv_cache_bytes = int((total * utilization - (total - free)) * 0.9)  # 10% left for activations
        if kv_cache_bytes is None:
            return None, num_state_slots
        ranks = self.tp.size if self.tp else 1  # a rank holds its share of the heads
        per_block = [kv_bytes_per_token(self.config, self.model.dtype, g.layers) * block_size // ranks for g in groups]
        if bytes_per_slot:
            fits = kv_cache_bytes // (bytes_per_slot + sum(per_block))
            if fits < 1:
                raise ValueError(f"kv_cache_bytes={kv_cache_bytes} cannot hold one sequence's recurrent state "
                                 f"({bytes_per_slot} bytes) and one block")
            num_state_slots = min(num_state_slots, fits)
            kv_cache_bytes -= num_state_slots * bytes_per_slot
        if not any(per_block):  # no K/V at all (a pure state-space model): nothing else to budget
            return None, num_state_slots
        budget = split_budget(kv_cache_bytes, per_block, caps)
        return (self.tp.agree_min(budget) if self.tp else budget), num_state_slots  # ranks may see different memory

    def _lora_manager(self, model: PreTrainedModel, enable_lora: bool, max_loras: int, max_lora_rank: int,
                      max_cpu_loras: int | None, cuda_graphs: bool | None) -> LoRAManager | None:
        """The engine's adapters (None: LoRA off). Refused where steps cannot apply them."""
        if not isinstance(enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {enable_lora!r}")
        if not enable_lora:
            return None
        if self.tp:
            raise ValueError("enable_lora=True: LoRA adapters are not applied under tensor parallelism here")
        if cuda_graphs:
            raise ValueError("enable_lora=True with cuda_graphs=True: a graph cannot hold a step's adapters; "
                             "pass cuda_graphs=False")
        return LoRAManager(model, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)

    def _refuse_prefix_cache(self, enable_prefix_caching: bool | None) -> bool:
        """Models with recurrent layers run without prefix caching: a cached prefix's blocks hold
        its K/V, not the recurrent state at its end, so a hit could not restart the state there."""
        self.prefix_caching_note = ("off: the model has recurrent layers, whose state at a prefix's end is not kept "
                                 "(a hit could not restore it)")
        if enable_prefix_caching:
            raise ValueError(f"enable_prefix_caching=True: {type(self.model).__name__} has recurrent layers "
                             "(Mamba / linear attention / convolutions), whose state at the end of a cached prefix "
                             "no block holds; run it with enable_prefix_caching=False (or None)")
        return False

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """Queue a request; returns its id. Bad input raises ``ValueError`` and queues nothing.
        ``prompt``: a string, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``.
        ``priority`` (vLLM's): lower is served first, under ``scheduling_policy="priority"`` only
        (another value is refused under ``"fcfs"``, which would ignore it). ``lora_request``: the
        PEFT LoRA adapter it runs with (``enable_lora=True``; read on first use, ``ValueError``
        naming what is wrong with it)."""
        self._check_driver("add_request")
        self._check_priority(priority)
        if lora_request is not None and self.lora is None:
            raise ValueError(f"lora_request={lora_request!r} but LoRA is not enabled: start the engine with "
                             "enable_lora=True")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if isinstance(request_id, SamplingParams) or isinstance(params, (str, dict)):  # vLLM's argument order
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}: LLMEngine.add_request "
                             "takes (prompt, params, request_id=None), not vLLM's (request_id, prompt, params)")
        if request_id is None:  # a fresh number no request in flight uses (a caller's "2" included)
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        request = self.intake.request(str(request_id), prompt, params, taken=self.requests, lora_request=lora_request)
        request_id, request.priority = request.request_id, priority
        if lora_request is not None:
            request.seqs[0].cache_root = self.lora.acquire(lora_request).cache_root
            self._lora_holders[request_id] = lora_request.lora_int_id
        if request.prompt_logprobs is not None:  # their Logprob.decoded_token, decoded on first read
            request.prompt_logprobs.texts = self.output_processor.token_texts
        ready = self.structured.admit(request)  # False: its grammar compiles off this thread (see step())
        self.requests[request_id] = request
        if shapes_outputs(request.params):
            self._shapers[request_id] = OutputShaper(request.params, self.tokenizer, request.prompt_token_ids)
        if ready:
            self.scheduler.add(request)
        return request_id

    def _check_priority(self, priority: Any) -> None:
        """``ValueError`` unless ``priority`` is an int this engine's scheduling policy honours."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority and self.scheduler.policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine serves first "
                             "come, first served, and would ignore it); pass 0 or start the engine with "
                             "scheduling_policy='priority'")

    @torch.inference_mode()
    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks: one id or several (as vLLM's ``abort_request``
        takes them); ids of requests not in flight are ignored. An aborted request gives no further
        output (not even one a ``generate()`` call stepped past, left for ``step()``)."""
        for rid in [request_id] if isinstance(request_id, (str, int)) else request_id:
            request = self.requests.pop(str(rid), None)
            self._shapers.pop(str(rid), None)
            self._unclaimed.pop(str(rid), None)
            if request is None:
                continue
            for seq in request.live_seqs:
                seq.finish_reason = "abort"
            self._forget(request)
            self.scheduler.finish_request(request)

    # vLLM's LLMEngine names, for scripts written against it
    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """vLLM's name of :meth:`abort`."""
        self.abort(request_ids)

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (requests naming it later find it loaded); ``ValueError`` as
        :meth:`add_request` would raise for it."""
        self._check_lora("add_lora")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False when it is not loaded (``ValueError`` while requests use it)."""
        self._check_lora("remove_lora")
        return self.lora.remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded, whatever ``max_cpu_loras`` says."""
        self._check_lora("pin_lora")
        return self.lora.pin(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        return self.lora.list() if self.lora is not None else set()

    def _check_lora(self, what: str) -> None:
        if self.lora is None:
            raise ValueError(f"{what}: LoRA is not enabled; start the engine with enable_lora=True")

    def get_num_unfinished_requests(self) -> int:
        """The requests in flight (waiting, running, swapped, or waiting for their grammar)."""
        return len(self.requests)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has more to hand out: requests in flight, or the outputs of requests a
        ``generate()`` or ``stream()`` call stepped past (one that finished there still reaches a
        ``while engine.has_unfinished_requests(): engine.step()`` loop)."""
        return self._in_flight() or bool(self._unclaimed)

    def _in_flight(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held) or self.structured.has_waiting()

    @property
    def healthy(self) -> bool:
        """False after ``max_consecutive_failures`` failed steps in a row (until a clean step), and
        for good once a tensor-parallel group was stopped by a failure."""
        return self._stopped is None and self._counters["consecutive_failed_steps"] < self.max_consecutive_failures

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, process, update. Returns outputs of the requests that changed (and
        first the latest of those a ``generate()`` or ``stream()`` call stepped past: requests
        added with ``add_request`` meanwhile lose nothing).

        A transaction: when executing or processing the step raises, the step is closed anyway,
        the requests it cannot continue come back with ``error`` set (``error_kind="fault"``),
        the traceback is logged, and nothing is raised (a ``BaseException`` such as
        ``KeyboardInterrupt`` is re-raised after that; its failed outputs come with the next step)."""
        self._check_driver("step")
        if not self._unclaimed:  # the usual case: no list to join
            outputs = self._step()
        else:
            outputs = list(self._unclaimed.values())
            self._unclaimed.clear()
            outputs += self._step()
        return self._shaped(outputs) if self._shapers else outputs

    def _shaped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` as their requests' ``output_kind`` and ``stream_interval`` ask (see output_shaper.py)."""
        shaped = []
        for out in outputs:
            shaper = self._shapers.get(out.request_id)
            if shaper is None:
                shaped.append(out)
                continue
            if out.finished:
                del self._shapers[out.request_id]
            if (out := shaper.shape(out)) is not None:
                shaped.append(out)
        return shaped

    def _claim(self, ids: Container[str]) -> list[RequestOutput]:
        """A step for a ``generate()`` or ``stream()`` call: the outputs of its requests (``ids``),
        first those another call's step left unclaimed; the others' are kept for ``step()``."""
        claimed = [self._unclaimed.pop(rid) for rid in [rid for rid in self._unclaimed if rid in ids]]
        outputs = self._step()
        self._keep_unclaimed(out for out in outputs if out.request_id not in ids)
        return claimed + [out for out in outputs if out.request_id in ids]

    def _keep_unclaimed(self, outputs: Iterable[RequestOutput]) -> None:
        """Outputs of other requests a ``generate()`` or ``stream()`` call stepped past: the next
        ``step()`` returns the latest of each."""
        self._unclaimed.update((out.request_id, out) for out in outputs)

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs, self._held = self._held, []
        outputs += self._admit_compiled()
        scheduled = self.scheduler.schedule()
        try:
            logits = self._execute(scheduled)
            if scheduled.prompt_logprobs:
                self._record_prompt_logprobs(scheduled)
            result = self.output_processor.process(scheduled, logits, self.requests)
        except BaseException as err:
            failed = outputs + self._abandon(scheduled, err)
            self._counters["busy_s"] += time.perf_counter() - start
            if not isinstance(err, Exception):
                self._held = failed
                raise
            return failed
        self.scheduler.update_from_output(scheduled, result)
        for request in result.finished:
            self.requests.pop(request.request_id, None)
            self._forget(request)
        if scheduled.sequences:
            self._counters["steps"] += 1
            self._count_step(failed=result.all_logits_nonfinite)
        self._counters["generated_tokens"] += result.num_generated_tokens
        if result.num_draft_tokens:
            self._counters["spec_drafts"] += result.num_drafts
            self._counters["spec_draft_tokens"] += result.num_draft_tokens
            self._counters["spec_accepted_tokens"] += result.num_accepted_tokens
        self._counters["busy_s"] += time.perf_counter() - start
        return outputs + [self._output_of(r) for r in result.changed if r.request_id in self.requests or r.is_finished]

    def _execute(self, scheduled: SchedulerOutput) -> torch.Tensor | None:
        """Run the step here (and, under tensor parallelism, in every rank). Under tensor
        parallelism a failure stops the group: the ranks can no longer agree on what ran."""
        if not self.tp:
            return self.runner.execute(scheduled)
        try:
            self.tp.send("step", scheduled)
            return self.runner.execute(scheduled)
        except BaseException as err:
            self._stop_group(f"a tensor-parallel step failed ({type(err).__name__} on rank 0: {err})")
            raise

    def _record_prompt_logprobs(self, scheduled: SchedulerOutput) -> None:
        """Add the step's scored prompt rows to their requests' prompt log-probs."""
        for rows, scored in zip(scheduled.prompt_logprobs, self.runner.prompt_logprobs, strict=True):
            request = self.requests[scheduled.sequences[rows.index].request_id]
            request.prompt_logprobs.add_rows(rows.first, *scored)
        self.runner.prompt_logprobs = []

    def _abandon(self, scheduled: SchedulerOutput, err: BaseException) -> list[RequestOutput]:
        """Close a step that raised: fail what it cannot continue (and, once a tensor-parallel
        group is stopped, every request), free their blocks, count the failure."""
        touched = self.scheduler.abandon(scheduled)
        logger.error("engine step failed: %d requests fail with it", len(touched), exc_info=err)
        reason = f"the engine failed while running this request ({type(err).__name__}: {err})"
        if self._stopped:
            reason = f"{self._stopped}; the tensor-parallel engine is stopped"
        failed = [self._fail(self.requests[rid], why, REJECTED) for rid, why in scheduled.rejected
                  if rid in self.requests]
        failed += [self._fail(request, reason, FAULT) for request in touched if request.request_id in self.requests]
        if self._stopped:  # the group cannot run another step: nobody can be served any more
            failed += [self._fail(request, reason, FAULT) for request in list(self.requests.values())]
        self._counters["steps"] += bool(scheduled.sequences)
        self._count_step(failed=True)
        return failed

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled since the last step; fail those whose
        constraint did not compile (they never reach the scheduler)."""
        ready, failed = self.structured.ready(idle=not self.scheduler.has_unfinished())
        for request in ready:
            self.scheduler.add(request)
        return [self._fail(request, why, REJECTED) for request, why in failed]

    def _fail(self, request: Request, reason: str, kind: str) -> RequestOutput:
        """Fail ``request`` now, free its blocks and forget it; returns its last output."""
        self._forget(request)
        request.fail(reason, kind)
        self.scheduler.finish_request(request)
        self.requests.pop(request.request_id, None)
        return self.output_processor.request_output(request, with_text=False)

    def _forget(self, request: Request) -> None:
        """``request`` leaves the engine: its grammar state goes, and its hold on its adapter."""
        self.structured.forget(request)
        lora_int_id = self._lora_holders.pop(request.request_id, None)
        if lora_int_id is not None:
            self.lora.release(lora_int_id)

    def _output_of(self, request: Request) -> RequestOutput:
        """``request``'s output; when decoding its text raises, the request fails instead."""
        try:
            return self.output_processor.request_output(request)
        except Exception as err:  # noqa: BLE001 - one request's tokenizer fault is that request's alone
            logger.exception("request %s: decoding its output failed", request.request_id)
            reason = f"the engine failed while decoding this request's output ({type(err).__name__}: {err})"
            if request.is_finished:
                request.error, request.error_kind = request.error or reason, request.error_kind or FAULT
                return self.output_processor.request_output(request, with_text=False)
            return self._fail(request, reason, FAULT)

    def _count_step(self, failed: bool) -> None:
        """Health bookkeeping: failed steps in a row make the engine unhealthy, a clean one heals it."""
        was_healthy = self.healthy
        if failed:
            self._counters["failed_steps"] += 1
            self._counters["consecutive_failed_steps"] += 1
        else:
            self._counters["consecutive_failed_steps"] = 0
        if was_healthy and not self.healthy:
            logger.error("engine unhealthy: %d failed steps in a row", self._counters["consecutive_failed_steps"])
        elif self.healthy and not was_healthy:
            logger.warning("engine healthy again after a clean step")

    # ------------------------------------------------------------------ offline and streaming use
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 raise_on_invalid: bool = False, priority: int | list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in input order. A bad prompt or bad parameters
        give that request an output with ``error`` set; the others are served (``raise_on_invalid``:
        a ``ValueError`` naming the prompt's index instead, before anything runs, as vLLM's
        ``LLM.generate``). Under tensor parallelism every rank calls it; the others execute rank 0's
        steps and return its outputs. ``sampling_params`` is vLLM's name of ``params``; ``priority``
        and ``lora_request``: one for all prompts or one each (see :meth:`add_request`)."""
        if sampling_params is not None:
            if params is not None:
                raise TypeError("generate() got both params and sampling_params (vLLM's name of params): pass one")
            params = sampling_params
        if self.tp and not self.tp.is_driver:
            return self._follow(until="done")
        if isinstance(prompts, (str, dict, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        priorities = priority if isinstance(priority, (list, tuple)) else [priority or 0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora_requests")
        results: dict[str, RequestOutput] = {}
        order = []
        for index, (prompt, p, rank, lora) in enumerate(zip(prompts, params, priorities, loras)):
            try:
                order.append(self.add_request(prompt, p, priority=rank, lora_request=lora))
                self._shapers.pop(order[-1], None)  # generate() returns final outputs whatever output_kind says
            except ValueError as err:
                if raise_on_invalid:
                    self.abort(order)
                    if self.tp and not self._stopped:
                        self.tp.send("done", [])  # the other ranks' generate() returns too
                    raise ValueError(f"prompt {index}: {err}") from None
                rid = f"rejected-{next(self._ids)}"
                order.append(rid)
                ids, text = (prompt, prompt) if not isinstance(prompt, dict) else (
                    prompt.get("prompt_token_ids"), prompt.get("prompt"))
                results[rid] = RequestOutput(rid, ids if isinstance(ids, list) else [], [], finished=True,
                                             prompt=text if isinstance(text, str) else None, error=str(err),
                                             error_kind=REJECTED, num_cached_tokens=0)
        progress = _progress(len(order), use_tqdm)
        mine = set(order)
        while len(results) < len(order):
            for out in self._claim(mine):
                if out.finished and out.request_id not in results:
                    results[out.request_id] = out
                    progress.update(1)
            if not self._in_flight() and not any(rid in self._unclaimed for rid in mine):
                break
        progress.close()
        outputs = [results[rid] for rid in order]
        if self.tp and not self._stopped:
            self.tp.send("done", outputs)
        return outputs

    # ------------------------------------------------------------------ tensor parallelism
    def run_worker(self) -> None:
        """Ranks > 0: execute rank 0's steps until rank 0 calls :meth:`close`."""
        self._follow(until="stop")

    def close(self) -> None:
        """Under tensor parallelism, end the engine in every rank: rank 0 releases the others from
        :meth:`run_worker`; another rank calling it (code that runs the same calls in every rank)
        follows rank 0's steps until then. A no-op without tensor parallelism, or when done."""
        if not self.tp or self._closed or self._stopped:
            return
        if self.tp.is_driver:
            self.tp.send("stop")
            self.tp.barrier()
            self.tp.closed = True
        else:
            self.run_worker()

    @torch.inference_mode()
    def _follow(self, until: str):
        if self.tp is None or self.tp.is_driver:
            raise RuntimeError("only ranks > 0 of a tensor-parallel engine follow rank 0's steps")
        if self._closed:
            raise RuntimeError("rank 0 has closed this tensor-parallel engine")
        if self._stopped:
            raise RuntimeError(f"rank {self.tp.rank}: {self._stopped}")
        while True:
            kind, payload = self._receive()
            if kind == "step":
                self._follow_step(payload)
            elif kind == "save":
                self._save_shard(*payload)
            elif kind == "check":
                self._check_shard(payload)
            elif kind == "load":
                if self._shard is not None:
                    self._load_shard(self._shard, *payload)
            elif kind == "stop":
                self.tp.barrier()
                self.tp.closed = True
                if until == "stop":
                    return None
                raise RuntimeError("rank 0 closed the engine while this rank waited for a generate() call")
            elif kind in ("open", "exit"):  # rank 0 built its next engine, or exits, without close()
                self.tp.left(kind, payload)
                if until == "stop":
                    return None
                raise RuntimeError(f"rank 0 {'built another engine' if kind == 'open' else 'exited'} while this "
                                   "rank waited for a generate() call")
            elif kind == until:
                return payload

    @property
    def _closed(self) -> bool:
        """Tensor parallelism: rank 0 has released the other ranks from this engine."""
        return bool(self.tp and self.tp.closed)

    def _receive(self) -> tuple[str, object]:
        """Rank 0's next message; when the channel fails (rank 0 stopped the group or died), this
        rank stops too, with an error that says so."""
        try:
            return self.tp.receive()
        except Exception as err:
            self._stop_group(f"lost rank 0 ({type(err).__name__}: {err})")
            raise RuntimeError(f"rank {self.tp.rank}: {self._stopped}; the tensor-parallel group is stopped") from err

    def _follow_step(self, scheduled: SchedulerOutput) -> None:
        """Execute rank 0's step. A failure here stops the whole group (so that rank 0, waiting for
        this rank in a collective, fails at once instead of hanging) and ends this rank's loop."""
        try:
            self.runner.execute(scheduled)
        except BaseException as err:
            logger.error("rank %d: a tensor-parallel step failed; stopping the group", self.tp.rank, exc_info=err)
            self._stop_group(f"a tensor-parallel step failed on rank {self.tp.rank} ({type(err).__name__}: {err})")
            if not isinstance(err, Exception):
                raise
            raise RuntimeError(f"rank {self.tp.rank}: {self._stopped}; the tensor-parallel group is stopped") from err

    def _stop_group(self, reason: str) -> None:
        """After a failure under tensor parallelism: tear the process group down, so that every
        rank's pending or next collective fails fast, and refuse further work here."""
        if self._stopped is None:
            self._stopped = reason
            self.tp.stop()

    def _check_driver(self, what: str) -> None:
        if self.tp and not self.tp.is_driver:
            raise RuntimeError(f"{what}: under tensor parallelism requests go to rank 0; rank {self.tp.rank} "
                               "runs run_worker()")
        if self.tp and self._closed:
            raise RuntimeError(f"{what}: this tensor-parallel engine was closed (the other ranks have left)")
        if self._stopped:
            raise RuntimeError(f"{what}: this tensor-parallel engine is stopped: {self._stopped}")

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[dict]:
        """Serve one request (alongside any others queued) and yield its new tokens as they come:
        ``{"index", "token_ids", "text", "finished", "finish_reason", "num_cached_tokens",
        "prompt_logprobs"}`` deltas per completion (``prompt_logprobs``, as in vLLM's delta outputs,
        comes whole with the request's first delta, when asked for; it is None in the others).
        The text deltas add up to the final text: a character split over tokens goes out whole,
        and what may begin a stop string is held back until it does not (the server's streams).
        A request the engine fails raises ``RuntimeError`` after its last deltas (``ValueError``
        when it could never be served, e.g. a grammar that does not compile); one whose
        consumer stops early (``break``, an exception, closing the iterator) is aborted."""
        request_id = self.add_request(prompt, params)
        self._shapers.pop(request_id, None)  # stream() makes deltas whatever output_kind says
        request = self.requests[request_id]
        deltas = OutputShaper(request.params, self.tokenizer, request.prompt_token_ids, kind=RequestOutputKind.DELTA)
        ended = False
        try:
            while not ended:
                mine = self._claim({request_id})
                for out in mine:
                    delta = deltas.shape(out)  # its prompt log-probs: on the first delta only
                    for i, c in enumerate(delta.outputs if delta is not None else ()):
                        yield {"index": c.index, "token_ids": c.token_ids, "text": c.text, "finished": c.finished(),
                               "finish_reason": c.finish_reason, "num_cached_tokens": out.num_cached_tokens,
                               "prompt_logprobs": None if i else delta.prompt_logprobs}
                    if out.finished and out.error:
                        ended = True
                        raise request_failure(out)
                    ended = ended or out.finished
                ended = ended or (request_id not in self.requests and not mine)
        finally:
            if not ended:
                self.abort(request_id)

    # ------------------------------------------------------------------ prefix-cache snapshots
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block: after the model's weights change, cached blocks hold
        keys and values of the old weights. As vLLM's does, it changes nothing and returns False
        while requests are unfinished (their blocks enter the cache as they run); True once the
        cache is empty."""
        self._check_driver("reset_prefix_cache")
        if self._in_flight():
            return False
        self.kv.prefix.clear()
        return True

    @torch.inference_mode()
    def save_prefix_cache(self, path) -> int:
        """Write the prefix cache (its blocks' K/V, token chain and a fingerprint of the model, dtype,
        block size and sharding) to one safetensors file. Returns the number of blocks saved.

        Under tensor parallelism each rank writes its own heads to its own file
        (``prefix.rank1-of-2.safetensors``, ``prefix_snapshot.shard_path``). Call it on rank 0;
        another rank may make the same call (it then follows rank 0 until the files are written)."""
        if not self.tp:
            return prefix_snapshot.save_index(path, self.model, self.kv.prefix, self.runner.storage)
        if not self.tp.is_driver:
            return self._follow(until="done")
        self._check_driver("save_prefix_cache")
        exported = self.kv.prefix.export()
        self.tp.send("save", (str(path), exported))
        saved = self._save_shard(str(path), exported)
        self.tp.send("done", saved)
        return saved

    @torch.inference_mode()
    def load_prefix_cache(self, path) -> int:
        """Add a snapshot's cached blocks (saved by an engine or by ``generate()``'s prefix cache)
        to the prefix cache (those not cached yet, as far as a fixed budget's free blocks go; they
        are evictable like any cached block). A snapshot of another model, dtype, block size or
        sharding, or a damaged file, raises ``SnapshotError`` and loads nothing (under tensor
        parallelism: when any rank's file fails its checks). Returns the number of blocks loaded."""
        if self.tp and not self.tp.is_driver:
            result = self._follow(until="done")
            if isinstance(result, str):
                raise SnapshotError(result)
            return result
        if not self.kv.enable_prefix_caching:
            raise ValueError("load_prefix_cache needs an engine with enable_prefix_caching=True")
        if not self.tp:
            return prefix_snapshot.load_index(path, self.model, self.kv.prefix, self.runner.storage)
        self._check_driver("load_prefix_cache")
        self.tp.send("check", str(path))
        tensors, problems = self._check_shard(str(path))
        if problems:
            self.tp.send("done", problems)
            raise SnapshotError(problems)
        placed = prefix_snapshot.place(self.kv.prefix, tensors)
        self.tp.send("load", (placed, list(self.kv.pool_sizes)))
        loaded = self._load_shard(tensors, placed, list(self.kv.pool_sizes))
        self.tp.send("done", loaded)
        return loaded

    def _save_shard(self, path: str, exported) -> int:
        saved = prefix_snapshot.save_index(path, self.model, self.kv.prefix, self.runner.storage, self.tp.rank,
                                           self.tp.size, exported)
        self.tp.barrier()  # every rank's file is written
        return saved

    def _check_shard(self, path: str):
        """Read and check this rank's file; every rank learns every rank's problem (all load or none)."""
        try:
            tensors = prefix_snapshot.read_for(path, self.model, self.kv.prefix, self.tp.rank, self.tp.size)
            problem = None
        except SnapshotError as err:
            tensors, problem = None, f"rank {self.tp.rank}: {err}"
        self._shard = tensors
        return tensors, "; ".join(p for p in self.tp.gather(problem) if p)

    def _load_shard(self, tensors, placed, pool_sizes: list[int]) -> int:
        loaded = prefix_snapshot.write_blocks(tensors, self.kv.groups, placed, self.runner.storage, pool_sizes,
                                              self.model.device)
        self._shard = None
        self.tp.barrier()
        return loaded

    # ------------------------------------------------------------------ accounting
    @property
    def compile_note(self) -> str | None:
        """Why the steps run eager (None: they run compiled; see ``compile``)."""
        return self.runner.compiled_note

    def stats(self) -> dict[str, float | int | bool]:
        s, kv = self.scheduler, self.kv.stats()
        busy = self._counters["busy_s"]
        queried, hits = kv["prefix_queried_tokens"], kv["prefix_hit_tokens"]
        return {
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "blocks_total": kv["blocks_total"], "blocks_used": kv["blocks_used"],
            "blocks_free": kv["blocks_free"], "blocks_cached": kv["blocks_cached"],
            "swap_blocks_used": kv["swap_blocks_used"],
            "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
            "prefix_cache_hit_rate": hits / queried if queried else 0.0,
            "computed_prompt_tokens": s.num_computed_prompt_tokens,
            "preemptions_recompute": s.preemptions["recompute"], "preemptions_swap": s.preemptions["swap"],
            "steps": self._counters["steps"], "generated_tokens": self._counters["generated_tokens"],
            "tokens_per_second": self._counters["generated_tokens"] / busy if busy else 0.0,
            "healthy": self.healthy, "failed_steps": self._counters["failed_steps"],
            "consecutive_failed_steps": self._counters["consecutive_failed_steps"],
            "prefix_caching": self.kv.enable_prefix_caching, "compiled": self.runner.compiled is not None,
            "cuda_graphs": self.runner.graphs is not None, "onednn_layers": self.runner.onednn_layers,
            "prepacked_layers": bool(self.runner.layer_packs),
            "serial_step_max_tokens": self.runner.serial_steps.max_tokens if self.runner.serial_steps else 0,
            "state_slots_total": kv["state_slots_total"], "state_slots_used": kv["state_slots_used"],
            "state_slots_free": kv["state_slots_free"], "swap_state_slots_used": kv["swap_state_slots_used"],
            "state_bytes_per_slot": self.runner.states.bytes_per_slot() if self.runner.states else 0,
            "tensor_parallel_size": self.tp.size if self.tp else 1,
            "num_speculative_tokens": self.speculative_config.num_speculative_tokens if self.speculative_config else 0,
            "spec_drafts": self._counters["spec_drafts"], "spec_draft_tokens": self._counters["spec_draft_tokens"],
            "spec_accepted_tokens": self._counters["spec_accepted_tokens"],
            "kv_heads_per_rank": self._kv_heads // (self.tp.size if self.tp else 1),
            "lora_enabled": self.lora is not None, "loras_loaded": len(self.lora.adapters) if self.lora else 0,
            "lora_loads": self.lora.num_loads if self.lora else 0,
            "lora_compiled": self.runner.compiled_lora is not None,
        }

    @property
    def _kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or getattr(self.config, "num_attention_heads", 0)


class _NoProgress:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _model_len(positions: int | None, max_model_len: int | None) -> int | None:
    """The longest sequence the engine serves: ``max_model_len`` within the model's positions."""
    if max_model_len is None:
        return positions
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    if positions is not None and max_model_len > positions:
        raise ValueError(f"max_model_len={max_model_len} is more than the model's {positions} positions")
    return max_model_len


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc="requests", unit="req")
