"""oneDNN for the linears of the engine's float32 forwards on CPU.

``nn.Linear`` on a float32 CPU tensor calls MKL's sgemm, which is slow for the LM head at the shapes
of an engine step (tens of rows against a 32,000-wide weight): on 2 cores, the 19M-parameter Llama's
head at 48 rows takes 16.2 ms through ``F.linear``, 8.0-8.4 ms through oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, what inductor uses on CPU) and 5.0-5.9 ms on a
oneDNN-prepacked copy of the weight (:class:`PrepackedWeight`, as vLLM's CPU linears and inductor's
frozen graphs do; it costs a second copy of that weight, so by default only where the copy is small,
``PREPACK_LM_HEAD_MAX_BYTES``).

The layers' own linears switch where this CPU runs oneDNN much faster than sgemm
(:func:`layer_linears`, measured once per weight shape: :func:`onednn_speedup`). On an AMD EPYC with
AVX-512 where MKL took its generic x86 code (``MKL_VERBOSE`` names no AVX-512; 2026-12-07), oneDNN
ran the issue-22 model's layer products 1.5-2.3x faster, and whole engine runs 3-8% (ShareGPT-like)
and 17-30% (1,000-token prompts) faster, in-process and interleaved. On the AVX-512 EPYC of
2026-12-04, where both ran near the cores' peak, the switch had made whole runs 1-17% slower
(RESULTS.md, "Against vLLM's CPU build — 2026-12-04, second run"): oneDNN builds a primitive for each
new row count and weight shape (~0.4-0.8 ms at its first call). They run on their own (live)
weights, or, where the layers' weights are small enough to hold twice (``PREPACK_LAYERS_MAX_BYTES``),
on prepacked copies (:func:`layer_packs`). On live weights, products of fewer than ``ONEDNN_MIN_ROWS``
rows stay on sgemm: oneDNN reorders a live weight into its own layout at each call, which at decode
row counts, with the weight out of cache, cost what it gained (the demo model's decode steps: those
products 124 ms through oneDNN against 94 on sgemm; at 128 rows and up, long prompts kept the whole
gain). Packed copies skip that reorder, so decode-sized products gain too: on the 2026-12-07 EPYC,
fresh engine runs of the issue-22 model 15% (ShareGPT-like) and 8% (1,000-token prompts) faster
than on live weights. Tiny products stay on sgemm (``ONEDNN_MIN_MACS``: oneDNN's ~10 us per call).
In compiled bodies they are one opaque op, ``hf_paged::onednn_linear``, which finds a weight's
packed copy through the running step (:func:`packed_layers`). Every oneDNN product runs at a
bucketed row count (:func:`bucketed_rows`), so a process builds a few hundred primitives rather
than one per row count its steps see.

Decode steps of a few sequences multiply in C instead (:mod:`hf_paged.kernels.cpu_gemv`): layer products
of at most ``LAYER_GEMV_MAX_ROWS`` rows and LM-head products of at most ``HEAD_GEMV_MAX_ROWS``, on the
live weights. Such steps are bound by reading the weights, which the step's head has just evicted:
on the 2026-12-07 EPYC a step's 28 layer products and head took 1.24 ms through sgemm and the packed
head against 0.46 ms in C at one row, 1.50 against 0.80 at four; at eight rows the head is faster
on oneDNN (1.22 ms with it against 1.56 all in C), hence its lower limit. The layers' few-row
products run in C whether or not oneDNN takes their larger ones (:func:`few_row_layers`): on a
2-core EPYC with slow memory (2026-12-07, later: a 256 MB copy ~5 GB/s), where oneDNN was no faster
than sgemm, the step's 28 layer products and the C head took 3.36 ms with sgemm layers against 2.09
all in C (one row), 4.63 against 3.84 (four), before the C loop read a weight row at a time.

Only the engine's forwards switch (:func:`onednn_linears`, :func:`layer_products`: context
managers): ``generate()`` and every other use of the model stay stock, bit for bit. oneDNN's
results differ from sgemm's in the last bits (a different summation order), as a compiled step's
would; the engine's tests compare tokens with stock ``generate()``. bfloat16 and float16 linears
already run through oneDNN in torch and are left alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Iterable

import torch

from hf_paged.engine import step_threads
from hf_paged.engine.tensor_parallel import tp_size_of
from hf_paged.kernels import cpu_gemv

PREPACK_LM_HEAD_MAX_BYTES = 1 << 30  # the largest LM head weight that gets a prepacked copy by default
PACK_ROWS_HINT = 256  # the rows oneDNN packs for; any row count runs (48 rows gain as much as 256)
ONEDNN_MIN_MACS = 1 << 20  # layer products smaller than this (rows x in x out) stay on sgemm
ONEDNN_MIN_ROWS = 128  # and products of fewer rows: oneDNN reorders the live weight at each call
ONEDNN_MIN_SPEEDUP = 1.25  # how much faster than sgemm oneDNN must be here for the layers to switch by default
CALIBRATION_ROWS = 256  # the rows of the product timed by onednn_speedup
ONEDNN_LAYERS_ENV = "HF_PAGED_ONEDNN_LAYERS"  # "0": engines built with onednn_layers=None keep sgemm
PREPACK_LAYERS_MAX_BYTES = 1 << 30  # the most bytes of oneDNN layer weights that get packed copies by default
PREPACK_LAYERS_ENV = "HF_PAGED_PREPACK_LAYERS"  # "0": engines built with prepack_layers=None pack none
LAYER_GEMV_MAX_ROWS = 16  # layer products of at most this many rows run in C (as many as cpu_gemv.max_rows())
FEW_ROW_LAYERS_ENV = "HF_PAGED_FEW_ROW_LAYERS"  # "0": layers oneDNN does not take keep sgemm at few rows too
HEAD_GEMV_MAX_ROWS = 4  # and LM head products of at most this many (more: oneDNN's packed kernel is faster)


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

    def product(x: torch.Tensor) -> torch.Tensor:
        few = x.numel() <= HEAD_GEMV_MAX_ROWS * x.shape[-1]
        out = cpu_gemv.try_linear_rows(x, module.weight, bias) if few else None
        return out if out is not None else onednn_product(x, weight, bias)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.linear(x, module.weight, bias)
        lead = getattr(_step, "head_rows", None)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        with step_threads.with_threads(threads) if threads else contextlib.nullcontext():
            if lead is None or not 0 < lead < rows:
                return product(x)
            flat = x.reshape(rows, x.shape[-1])
            return torch.cat([product(flat[:lead]), product(flat[lead:])]).view(*x.shape[:-1], -1)

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


# ``hf_paged::onednn_linear``: ``F.linear`` of a layer in a compiled body (:func:`layer_products` with
# ``traced``), see :func:`linear`. Defined through ``torch.library.Library`` rather than ``custom_op``:
# a call costs ~1.6 us over the function's own time against ~3.5 us, and a step calls it per layer linear.
_library = torch.library.Library("hf_paged", "FRAGMENT")
_library.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("onednn_linear", lambda x, weight, bias: linear(x, weight, bias), "CPU")
# ``hf_paged::few_row_linear``: the same for layers oneDNN does not take (:func:`few_row_linear`)
_library.define("few_row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("few_row_linear", lambda x, weight, bias: few_row_linear(x, weight, bias), "CPU")


def _product_shape(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


torch.library.register_fake("hf_paged::onednn_linear", _product_shape, lib=_library)
torch.library.register_fake("hf_paged::few_row_linear", _product_shape, lib=_library)


_step = threading.local()  # .packs (packed_layers), .head_rows (sampled_head_rows): the running step's


def sampled_head_rows(rows: int | None) -> contextlib.AbstractContextManager:
    """Inside, the LM head (:func:`onednn_linears`) multiplies its first ``rows`` rows (a step's
    sampled rows) apart from the rest (prompt rows scored for ``prompt_logprobs``): the sampled
    rows' logits are then the bits a step without scored rows gives them (the head's product
    depends on its row count: ``HEAD_GEMV_MAX_ROWS``)."""
    return _step_setting("head_rows", rows)


def packed_layers(packs: dict[int, PrepackedWeight] | None) -> contextlib.AbstractContextManager:
    """Inside, :func:`linear` runs the weights of ``packs`` (:func:`layer_packs`) on their packed
    copies, in eager steps and compiled ones (whose op cannot take the packed tensor as an input:
    Dynamo traces the live weights; the op looks their copies up here, on the stepping thread)."""
    return _step_setting("packs", packs)


@contextlib.contextmanager
def _step_setting(name: str, value):
    """``_step.<name>`` is ``value`` inside (on this thread), what it was before afterwards."""
    before = getattr(_step, name, None)
    setattr(_step, name, value)
    try:
        yield
    finally:
        setattr(_step, name, before)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in C for float32 CPU products of at most ``LAYER_GEMV_MAX_ROWS`` rows
    (:mod:`hf_paged.kernels.cpu_gemv`), through oneDNN where the product is large enough
    (``ONEDNN_MIN_MACS`` multiply-adds; on a live weight, one without a packed copy in the running
    step, also ``ONEDNN_MIN_ROWS`` rows), through sgemm otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out = _few_rows(x, weight, bias, rows)
    if out is not None:
        return out
    if rows * weight.numel() < ONEDNN_MIN_MACS or x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    packs = getattr(_step, "packs", None)
    pack = packs.get(weight.data_ptr()) if packs else None
    if pack is not None and pack.module.weight.data_ptr() == weight.data_ptr():  # still that module's weight
        weight = pack.get()
    elif rows < ONEDNN_MIN_ROWS or not weight.is_contiguous():
        return torch.nn.functional.linear(x, weight, bias)
    return onednn_product(x, weight, bias)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with float32 CPU products of at most ``LAYER_GEMV_MAX_ROWS`` rows in C: the
    layers' linears where oneDNN does not take them (:func:`few_row_layers`)."""
    out = _few_rows(x, weight, bias, x.numel() // x.shape[-1] if x.shape[-1] else 0)
    return out if out is not None else torch.nn.functional.linear(x, weight, bias)


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The product in C (:mod:`hf_paged.kernels.cpu_gemv`) for at most ``LAYER_GEMV_MAX_ROWS`` rows
    it takes, else None."""
    return cpu_gemv.try_linear_rows(x, weight, bias) if rows <= LAYER_GEMV_MAX_ROWS else None


def bucketed_rows(rows: int) -> int:
    """The row count oneDNN runs a product of ``rows`` rows at: the next multiple of 8 up to 256
    rows, of 32 up to 1,024, of 64 beyond. oneDNN builds a primitive for each new row count and
    weight shape (0.4-2.5 ms on the 2026-12-07 EPYC, ten times a decode-sized product), and an
    engine's steps see hundreds of row counts; in buckets a process builds ~100 per shape, and
    the padded rows cost little (small products are bound by reading the weight; from 257 rows
    at most 1/8 more, from 1,025 at most 1/16). Fresh engine processes, the issue-22 model:
    ShareGPT-like runs 13% faster with buckets, long prompts within noise."""
    step = 8 if rows <= 256 else 32 if rows <= 1024 else 64
    return -(-rows // step) * step


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN (``weight`` live or packed), its rows padded with zeros
    to :func:`bucketed_rows` (each row's result is its own: the padding is cut off)."""
    features = x.shape[-1]
    rows = x.numel() // features
    flat = x.reshape(rows, features)
    padded = bucketed_rows(rows)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, features)])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return (out[:rows] if padded != rows else out).view(*x.shape[:-1], out.shape[-1])


@functools.cache
def onednn_speedup(in_features: int, out_features: int, rows: int = CALIBRATION_ROWS) -> float:
    """sgemm's time over oneDNN's for a float32 ``[rows, in] x [in, out]`` product on this CPU, at
    torch's thread count (best of 5 rounds of 3 calls each, after a warm call that also builds
    oneDNN's primitive). Measured once per shape in a process."""
    g = torch.Generator().manual_seed(0)  # not the global generator: building an engine must not move it
    x, weight = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)

    def best(call) -> float:
        call()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(3):
                call()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        sgemm = best(lambda: torch.nn.functional.linear(x, weight))
        onednn = best(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
    return sgemm / onednn


def layer_linears(model: torch.nn.Module, enabled: bool | None = None) -> tuple[tuple[torch.nn.Linear, ...], str]:
    """The decoder body's linears that the engine's forwards run through oneDNN (:func:`layer_products`),
    and why (or why not). ``enabled`` None: the float32 CPU ``nn.Linear`` layers of a model without
    tensor parallelism, where oneDNN is at least ``ONEDNN_MIN_SPEEDUP`` times as fast as sgemm at
    the largest layer's shape (:func:`onednn_speedup`), unless the environment has
    ``HF_PAGED_ONEDNN_LAYERS=0``; True: such layers whatever the speed; False: none."""
    if enabled is False:
        return (), "off (onednn_layers=False)"
    if enabled is None and os.environ.get(ONEDNN_LAYERS_ENV, "1") == "0":
        return (), f"off ({ONEDNN_LAYERS_ENV}=0)"
    if not available():
        return (), "this torch has no oneDNN linear"
    if tp_size_of(model) > 1:
        return (), "off under tensor parallelism"
    modules = _body_linears(model)
    if not modules:
        return (), "no float32 CPU nn.Linear layers"
    if enabled:
        return modules, "on (onednn_layers=True)"
    largest = max(modules, key=lambda m: m.weight.numel())
    speedup = onednn_speedup(largest.in_features, largest.out_features)
    verdict = "on" if speedup >= ONEDNN_MIN_SPEEDUP else "off"
    return (modules if verdict == "on" else ()), (
        f"{verdict}: oneDNN {speedup:.2f}x sgemm's speed at {CALIBRATION_ROWS} x {largest.in_features} -> "
        f"{largest.out_features} (the bar: {ONEDNN_MIN_SPEEDUP}x)")


def _body_linears(model: torch.nn.Module) -> tuple[torch.nn.Linear, ...]:
    """The switchable linears of ``model``'s decoder body (not its LM head)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return tuple(m for m in body.modules() if _switchable(m) and m is not head)


def few_row_layers(model: torch.nn.Module) -> tuple[torch.nn.Linear, ...]:
    """The decoder body's linears whose products of at most ``LAYER_GEMV_MAX_ROWS`` rows the engine's
    forwards run in C where oneDNN does not take the layers (:func:`few_row_linear`): the float32
    CPU ``nn.Linear`` layers of a model without tensor parallelism, where the C products are built,
    unless the environment has ``HF_PAGED_FEW_ROW_LAYERS=0``."""
    if os.environ.get(FEW_ROW_LAYERS_ENV, "1") == "0" or tp_size_of(model) > 1:
        return ()
    modules = _body_linears(model)  # before building the library: a GPU or half-precision model needs none
    return modules if modules and cpu_gemv.ready() else ()


def layer_packs(modules: tuple[torch.nn.Linear, ...], enabled: bool | None = None
                ) -> tuple[dict[int, PrepackedWeight], str]:
    """Packed copies of the oneDNN layer linears ``modules`` (:func:`layer_linears`), made now, keyed
    by their weights' data pointers (for :func:`packed_layers`), and why (or why not). ``enabled``
    None: where the weights take at most ``PREPACK_LAYERS_MAX_BYTES`` (the copies double them),
    unless the environment has ``HF_PAGED_PREPACK_LAYERS=0``; True: whatever their size; False: none.
    A weight replaced later runs live (its pointer is not found); one changed in place is packed again."""
    if not modules:
        return {}, "no oneDNN layers to pack"
    if enabled is False:
        return {}, "off (prepack_layers=False)"
    if enabled is None and os.environ.get(PREPACK_LAYERS_ENV, "1") == "0":
        return {}, f"off ({PREPACK_LAYERS_ENV}=0)"
    weights = {m.weight.data_ptr(): m for m in modules}  # a weight shared by modules is packed once
    total = sum(m.weight.nbytes for m in weights.values())
    if enabled is None and total > PREPACK_LAYERS_MAX_BYTES:
        return {}, (f"off: the layers' weights take {total / 2**30:.1f} GiB, over the "
                    f"{PREPACK_LAYERS_MAX_BYTES / 2**30:.0f} GiB that get a second, packed copy by default")
    packs = {ptr: PrepackedWeight(module) for ptr, module in weights.items()}
    for pack in packs.values():
        pack.get()
    return packs, f"on: packed copies of {len(packs)} weights, {total / 2**20:.1f} MiB"


@contextlib.contextmanager
def layer_products(modules: Iterable[torch.nn.Linear], traced: bool = False, onednn: bool = True):
    """Run the layer linears ``modules`` through :func:`linear` inside the block, or (not ``onednn``)
    through :func:`few_row_linear`, their few-row products in C through the C++ operator where it is
    built (:func:`few_row_call`; ``traced``: for a compiled body being compiled or run, as operators).
    A module whose forward is already replaced keeps it (LoRA steps enter after this, wrapping these
    forwards)."""
    call = few_row_call(traced, onednn)
    switched = []
    try:
        for module in modules:
            if "forward" not in module.__dict__:
                module.forward = _layer_forward(module, call)
                switched.append(module)
        yield
    finally:
        for module in switched:
            del module.forward


def few_row_call(traced: bool = False, onednn: bool = False):
    """``call(x, weight, bias)`` of a layer linear in engine steps: the C++ operator
    (``cpu_gemv.linear_op``) where it is built, which runs the few-row products in C and hands the
    others to ``aten::linear`` or (``onednn``) to ``hf_paged::onednn_linear`` (:func:`linear`): no
    dispatch to Python for a decode step's products. Where it is not built: :func:`linear` or
    :func:`few_row_linear`, as their operators where ``traced``. The same bits either way."""
    op = cpu_gemv.linear_op()
    if op is not None:
        fallback = "hf_paged::onednn_linear" if onednn else "aten::linear"
        return lambda x, weight, bias: op(x, weight, bias, LAYER_GEMV_MAX_ROWS, fallback)
    if onednn:
        return torch.ops.hf_paged.onednn_linear if traced else linear
    return torch.ops.hf_paged.few_row_linear if traced else few_row_linear


def _layer_forward(module: torch.nn.Linear, call):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return call(x, module.weight, module.bias)

    return forward
