"""Engine steps through a ``torch.compile``d decoder body, the paged read kept out as a custom op.

An engine step spends much of its time outside the big matmuls: per layer, transformers' modules
run about a hundred small tensor ops (norms, rotary, activations, views), each with its Python and
dispatch. Inductor fuses those into a few generated loops. The paged attention (writing into the
pools, the per-step metadata, the gather or compiled read) stays eager Python behind one opaque
custom op, ``hf_paged::packed_step_attention``, so the body compiles as one graph, without breaks.

What is compiled is the model's decoder body (``model.get_decoder()``: embeddings, layers, final
norm) run without a cache and without a mask; the causal LM's own forward around it (LM head,
``logits_to_keep``, softcapping) stays eager. During a step the body's ``forward`` is swapped for
the compiled one and put back afterwards, so the model is stock between steps. The op learns which
layer it serves from the order of the calls (layers run in order, each attends once; checked after
every step). The number of tokens is a dynamic size: one graph serves every step of two tokens or
more, and a step of a single token has one of its own (sizes of 1 are specialised). Both are
compiled when the engine is built (seconds; inductor caches its output on disk, so a later process
compiles faster), as vLLM compiles before it serves.

On a GPU the same body compiles to inductor's Triton kernels around the paged Triton kernels,
which cuts the host work per layer that bounds eager steps there (benchmarks/RESULTS.md, the H200
run of 2026-12-04); it is opt-in (``compile=True``) until measured on a device.

Inductor's fused loops round differently from eager kernels in the last bits, so compiled steps
are not bit-identical to stock ``generate()``; their tokens are compared with stock in the tests.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from typing import Callable

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from hf_paged.attention import COMPILED_ATTN_IMPLEMENTATION, paged_call
from hf_paged.channel import PackedStep
from hf_paged.engine import step_threads
from hf_paged.engine.tensor_parallel import tp_size_of
from hf_paged.kernels import cpu_ops
from hf_paged.kinds import ChunkedLocalAttentionSpec, FullAttentionSpec, KVSpec, SlidingWindowSpec
from hf_paged.model_info import max_positions

COMPILE_ENV = "HF_PAGED_COMPILE"  # "0": engines built with compile=None stay eager
# The multi-token graph is compiled on a step of this many tokens. Inductor decides which of its CPU
# loops run in parallel from the example's sizes (a loop of too few elements per thread stays on one
# thread) and keeps that for every size the graph then serves: compiled on 2 tokens, every pointwise
# loop of every prompt-sized step ran on one core (the issue-22 model prefilling 32 prompts of 1,000
# tokens on 2 cores: those loops 123 ms against 78 split, the prefill 3-7% slower). Inductor's
# on-disk cache does not tell examples apart, so these graphs are cached under a tag of their own
# (an entry compiled on 2 tokens by an older version would otherwise be reused: checked).
WARM_UP_TOKENS = 256
WARM_UP_CACHE_TAG = f"hf_paged-warm-up-{WARM_UP_TOKENS}"

_COMPILED_KINDS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
_thread = threading.local()


def default_on() -> bool:
    """Whether ``compile=None`` compiles (unless ``HF_PAGED_COMPILE=0``)."""
    return os.environ.get(COMPILE_ENV, "1") != "0"


class _StepCursor:
    """The step being run, how its layers attend, and which layer attends next."""

    def __init__(self, step: PackedStep | None, attend: Callable):
        self.step, self.attend, self.next = step, attend, 0


@torch.library.custom_op("hf_paged::packed_step_attention", mutates_args=())
def packed_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          sliding_window: int | None, softcap: float | None,
                          sinks: torch.Tensor | None) -> torch.Tensor:
    """The paged attention of the next layer of the running step (``query`` ``[1, heads, tokens,
    head_dim]``): stores ``key``/``value`` in the layer's blocks and returns ``[1, tokens, heads,
    head_dim]``. While the body compiles (no step) it returns zeros."""
    cursor: _StepCursor | None = getattr(_thread, "cursor", None)
    if cursor is None:
        raise RuntimeError(f"the {COMPILED_ATTN_IMPLEMENTATION!r} attention runs only inside an engine's compiled steps")
    layer = cursor.next
    cursor.next += 1
    if cursor.step is None:
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    options = {"scaling": scale, "sliding_window": sliding_window, "softcap": softcap, "s_aux": sinks}
    out, _ = cursor.attend(cursor.step, layer, query, key, value, True, **options)
    return out.contiguous()  # the strides the fake kernel promises (the read may return a transposed view)


@packed_step_attention.register_fake
def _(query, key, value, scale, sliding_window, softcap, sinks):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


# ``cpu_ops.decode_step_attention`` where a CPU body was built with it (set by CompiledBody, read while
# a graph is traced): float32 CPU layers call it, and it serves a step with a decode plan in C, any
# other step through hf_paged::packed_step_attention
_decode_step_op: torch._ops.OpOverload | None = None


def _compiled_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask, scaling: float | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, s_aux: torch.Tensor | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function of the compiled body (``"hf_paged_compiled"``)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    op = torch.ops.hf_paged.packed_step_attention
    if _decode_step_op is not None and query.device.type == "cpu" and query.dtype == torch.float32:
        op = _decode_step_op
    return op(query, key, value, scale, sliding_window, softcap, s_aux), None


def _no_mask(*args, **kwargs) -> None:
    """The compiled body builds no mask: each sequence's attention comes from its block tables."""
    return None


AttentionInterface.register(COMPILED_ATTN_IMPLEMENTATION, _compiled_attention)
AttentionMaskInterface.register(COMPILED_ATTN_IMPLEMENTATION, _no_mask)


def _run_body(body: torch.nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
              position_ids: torch.Tensor):
    """The decoder body's own forward without a cache (the op stores K/V) and without a mask."""
    return type(body).forward(body, input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                              use_cache=False)


_BODY_INPUTS = ("input_ids", "inputs_embeds", "position_ids")
_KEPT_GUARD_TYPES = ("GLOBAL_STATE", "DEFAULT_DEVICE", "TORCH_FUNCTION_MODE_STACK", "SHAPE_ENV")  # see _engine_guards


def _engine_guards(entries: list) -> list[bool]:
    """Which of Dynamo's guards a compiled body keeps (``guard_filter_fn``): those on the step's
    inputs and the shape guards on their sizes (which of the two graphs serves a call: without
    the shape guards one-token steps ran the many-token graph, traced for two tokens or more, and
    gemma4's, which checks that at run time, failed), on tensors that are not parameters (buffers
    such as rotary frequencies), and on the global state (grad mode, threads, device). Dynamo
    would otherwise re-check about 1,500 facts about the model's modules, parameters and the
    libraries' globals before every step (0.25-0.4 ms, 2% of a decode step of the issue-22 model):
    facts that stay as they were while an engine serves the model, as vLLM assumes of the model
    it owns. Parameters are read at each call, so weights changed in place or replaced by tensors
    of the same shape and dtype are used; a module swapped or reconfigured after the engine is
    built is not seen (or fails the step, when its parameters moved: an adapter wrapping a linear);
    build the engine again, or with ``compile=False``."""
    return [entry.name in _BODY_INPUTS or entry.guard_type in _KEPT_GUARD_TYPES
            or (entry.guard_type == "TENSOR_MATCH" and not isinstance(entry.value, torch.nn.Parameter))
            for entry in entries]


def unsupported(model: PreTrainedModel, specs: list[KVSpec | None], recurrent: bool = False) -> str | None:
    """Why the engine's steps of ``model`` cannot run compiled (None: they can): every layer a
    plain attention layer that stores its own K/V (no latent or KV-sharing layers, and no
    ``recurrent`` state beside attention, as Falcon-H1's layers have: those steps take other
    routes), and no tensor parallelism."""
    if tp_size_of(model) > 1:
        return "compiled steps do not run under tensor parallelism"
    kinds = {type(spec).__name__ if spec is not None else "a layer without K/V" for spec in specs
             if spec is None or not isinstance(spec, _COMPILED_KINDS) or not spec.stores}
    if recurrent:
        kinds.add("recurrent states")
    if kinds:
        return f"compiled steps need plain attention layers; {type(model).__name__} has {', '.join(sorted(kinds))}"
    if model.get_decoder() is model:
        return f"{type(model).__name__}: no decoder body apart from the LM head to compile"
    return None


def inductor_options(dtype: torch.dtype) -> dict:
    """The body's ``torch.compile`` options. In half precision, inductor rounds to the model's
    dtype after each operation as eager PyTorch does (``emulate_precision_casts``): fused, it kept
    float32 between them, and greedy tokens went another way wherever the last bits decided (a tiny
    bfloat16 Llama matched stock ``generate()`` on 2 of 8 prompts; with the casts, 16 of 16 on
    eight architectures in bfloat16 and float16)."""
    options = {"guard_filter_fn": _engine_guards}
    if dtype in (torch.float16, torch.bfloat16):
        options["emulate_precision_casts"] = True
    return options


class CompiledBody:
    """The decoder body of ``model`` compiled for engine steps (see the module's docstring).
    ``attend(step, layer_idx, query, key, value, stores, **options)`` is the engine's paged
    attention of a packed step (:func:`hf_paged.attention.packed_attention`)."""

    def __init__(self, model: PreTrainedModel, attend: Callable, num_layers: int, planner=None):
        global _decode_step_op
        self.model, self.body = model, model.get_decoder()
        self.attend, self.num_layers = attend, num_layers
        # float32 CPU steps of decode rows only: every layer's attention in C from a plan
        # (hf_paged.kernels.cpu_ops; planner: hf_paged.attention.DecodePlanner)
        self._planner = None
        if planner is not None and model.device.type == "cpu" and model.dtype == torch.float32:
            op = cpu_ops.decode_step_attention()
            if op is not None and planner.attach():
                _decode_step_op, self._planner = op, planner
        self.planned_steps = 0  # steps whose layers attended from a plan
        # a code object of its own: Dynamo keeps compiled entries (and their limit) per code object,
        # so engines of other models in this process do not evict or recompile this one
        code = _run_body.__code__.replace(co_name=f"_run_body_{id(self):x}")
        # fullgraph: a body Dynamo cannot capture whole (a graph break) stays eager rather than
        # compiling pieces again on the serving path as shapes change
        self._compiled = torch.compile(types.FunctionType(code, _run_body.__globals__), dynamic=False, fullgraph=True,
                                       options=inductor_options(model.dtype))
        self.calls = 0  # forwards that went through the compiled body

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs):
        """Stands in for the body's ``forward`` during a step (the cache and mask it is given are unused)."""
        self.calls += 1
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens.shape[1] > 1:  # the token count changes from step to step
            for tensor in (tokens, position_ids):
                if tensor is not None:  # some causal LMs leave the positions to the body
                    torch._dynamo.mark_dynamic(tensor, 1)
        return self._compiled(self.body, input_ids, inputs_embeds, position_ids)

    @contextlib.contextmanager
    def active(self, step: PackedStep | None):
        """Inside, the body runs compiled and its layers read and write ``step``'s blocks."""
        cursor = _StepCursor(step, self.attend)
        _thread.cursor = cursor
        self.body.forward = self.forward
        plan, served = None, 0
        try:
            plan = self._planner.plan(step) if step is not None and self._planner is not None else None
            yield
        finally:
            if plan is not None:
                served = plan.end()
            del self.body.forward
            _thread.cursor = None
        planned = plan is not None
        self.planned_steps += planned
        if cursor.next + served != self.num_layers or (planned and served != self.num_layers):
            raise RuntimeError(f"a compiled step attended {cursor.next + served} times for {self.num_layers} layers"
                               + (f" ({served} from its plan)" if planned else ""))

    @torch.inference_mode()
    def warm_up(self, device: torch.device, also_one_thread: bool = False,
                around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> str | None:
        """Compile both graphs (two tokens or more, one token) by running the whole model on dummy
        tokens (``WARM_UP_TOKENS``, then one), as a step calls it, and (``also_one_thread``) both
        again for steps run on one thread (:mod:`hf_paged.engine.step_threads`: Dynamo's
        global-state guard records the thread count);
        returns why that failed (None: compiled). ``around``: what steps of this body run inside
        (LoRA steps: the layers' forwards that call the adapters' op, traced into the graphs)."""
        threads = [contextlib.nullcontext] + ([step_threads.one_thread] if also_one_thread else [])
        # a model whose positions end sooner warms up on fewer (inductor then splits less)
        many = max(2, min(WARM_UP_TOKENS, max_positions(self.model.config) or WARM_UP_TOKENS))
        try:
            for context in threads:
                for tokens in (many, 1):
                    ids = torch.ones(1, tokens, dtype=torch.long, device=device)
                    positions = torch.arange(tokens, device=device)[None]
                    with (paged_call(self.model, COMPILED_ATTN_IMPLEMENTATION), self.active(None), context(),
                          around(), torch.compiler.config.patch(cache_key_tag=WARM_UP_CACHE_TAG)):
                        self.model(input_ids=ids, position_ids=positions, use_cache=False)
        except Exception as error:  # noqa: BLE001 - any failure to compile leaves the engine eager
            return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if self.calls != 2 * len(threads):
            return f"{type(self.model).__name__}'s forward does not run its decoder body (get_decoder()) once per call"
        return None


def compiled_body(model: PreTrainedModel, specs: list[KVSpec | None], attend: Callable, compile: bool | None,
                  recurrent: bool = False, also_one_thread: bool = False,
                  around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                  planner=None) -> tuple[CompiledBody | None, str | None]:
    """The engine's compiled body, or None and why not. ``compile``: None compiles on CPU where
    :func:`unsupported` allows it (and ``HF_PAGED_COMPILE`` is not ``0``; on other devices the
    default stays eager until compiled steps are measured there); True must compile
    (``ValueError`` naming why it cannot); False never does. ``also_one_thread``: some steps will
    run on one thread, warmed up too. ``around``: see :meth:`CompiledBody.warm_up`. ``planner``: the
    engine's ``hf_paged.attention.DecodePlanner``, for float32 CPU steps of decode rows only."""
    if compile is False or (compile is None and not default_on()):
        return None, "off (compile=False)" if compile is False else f"off ({COMPILE_ENV}=0)"
    if compile is None and model.device.type != "cpu":
        return None, f"off by default on {model.device.type} (compile=True opts in)"
    reason = unsupported(model, specs, recurrent)
    if reason is not None:
        if compile:
            raise ValueError(f"compile=True: {reason}")
        return None, reason
    body = CompiledBody(model, attend, len(specs), planner)
    failure = body.warm_up(model.device, also_one_thread, around)
    if failure is not None:
        if compile:
            raise RuntimeError(f"compile=True: torch.compile failed: {failure}")
        warnings.warn(f"hf_paged: engine steps stay eager, torch.compile failed: {failure}", stacklevel=3)
        return None, f"torch.compile failed: {failure}"
    return body, None
