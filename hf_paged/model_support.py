"""Which transformers architectures hf_paged can page, on which route, and why the others are refused.

The class flag ``_supports_attention_backend`` is not the test: StableLM and BioGPT route attention
through ``AttentionInterface`` without setting it. What hf_paged relies on is checked directly, per
route (:class:`Routes`):

1. **generate(), reference route** (:func:`reference_problem`): decoder-only (not an
   encoder-decoder model, no cross-attention layers: the paged cache holds self-attention K/V
   only); layers of a kind the cache holds (:mod:`hf_paged.kinds`: full, sliding, chunked, MLA,
   KV-sharing; beside them the state layers of :mod:`hf_paged.state_layers`); some module writes
   the cache through ``cache.update(k, v, layer_idx)``; no cache class of the model's own, no
   module that adds or replaces the cache's layers. ``update`` then returns what ``DynamicCache``
   returns and the model's own attention does the rest, inline or not.
2. **generate(), kernel route, and LLMEngine** (:func:`classify_model`), on top: read from the
   source of every module of the model *instance* that writes the cache, the K/V that ``update``
   returns go unchanged into a function looked up in ``ALL_ATTENTION_FUNCTIONS`` by
   ``config._attn_implementation``, with the layer's own ``attention_mask`` argument (the mask
   ``transformers.masking_utils`` built), and no keyword the paged reads do not implement
   (scaling, sliding window, softcap, attention sinks ``s_aux``); sliding layers get a
   sliding-window mask; keys and values of one head size. MLA layers (:mod:`hf_paged.kinds.mla`)
   expand what ``update`` returns by design: the engine serves them through its latent-context
   path, the kernel route does not (generate() reads them on the reference route). A model the
   kernel route refuses takes the reference route on every device.

Only modules that write the cache are judged, and only the classes the instance holds: a vision
tower's inline attention (it caches nothing) does not matter, and a modeling file that keeps an old
inline class next to one that routes through the interface is judged by the class in use. A
runtime net remains on the kernel route and in the engine: K/V stashed by ``update`` and never
claimed by the attention function make the next cache call raise, so a model that slips past this
gate fails loudly, never silently.

``python -m hf_paged.model_support`` prints the table of every ``*ForCausalLM`` architecture of the
installed transformers, a column per route (the README's "Supported models" section is this output).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import warnings
from collections.abc import Iterator

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from hf_paged import kinds, state_layers
from hf_paged.kinds.base import config_attr

SUPPORTED_LAYER_TYPES = tuple(t for t in kinds.LAYER_TYPE_SPECS if t not in ("hybrid", "hybrid_sliding"))
_NOT_MODEL_CODE = ("torch", "builtins", "transformers.modeling_utils", "transformers.generation",
                   "transformers.integrations", "transformers.utils", "transformers.modeling_layers")
_STATE_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "recurrent"}
# Keywords of an attention call that the paged read paths honour (scaling, sliding window, softcap,
# attention sinks ``s_aux``; dropout is 0 in eval; the rest are bookkeeping). Anything else would be
# dropped by the Triton kernels and by an engine step.
_HONOURED_KEYWORDS = {None, "module", "query", "key", "value", "attention_mask", "dropout", "scaling", "sliding_window",
                      "softcap", "s_aux", "position_ids", "use_cache", "output_attentions", "is_causal"}
_CROSS_ATTENTION_NAME = re.compile(r"(^|\.)(encoder_attn|cross_?attn\w*|crossattention|cross_attention\w*)$")

# Reasons, one per kind of refusal (the table groups by these).
SUPPORTED = "supported"
ENCODER_DECODER = "encoder-decoder"
CROSS_ATTENTION = "cross-attention layers"
STATE_LAYERS = "hybrid layers (linear attention / state-space / convolution)"
OTHER_LAYERS = "layer types the paged cache does not hold"
KV_SHARING = "layers share KV"
HEAD_DIMS = "keys and values of different head sizes"
INLINE = "attention computed inline (no AttentionInterface)"
KV_CHANGED = "K/V changed between cache.update and attention"
OWN_MASK = "attention mask not the one masking_utils built"
ATTENTION_OPTIONS = "attention options the paged kernels lack"
SLIDING_MASK = "sliding layers without a sliding-window mask"
NO_KV_CACHE = "no layer writes a KV cache"
CACHE_LAYERS_EDITED = "cache layers added or replaced by the model"
NO_LAYER_STRUCTURE = "no layer structure a cache can read"
NOT_BUILT = "cannot be built here"
OWN_CACHE = "a cache class of its own required by the model"
MLA_LATENT = "MLA latent read on the reference route"


@dataclasses.dataclass(frozen=True)
class Support:
    """The verdict on one model: ``kind`` is :data:`SUPPORTED` or a refusal kind, ``detail`` says why."""

    kind: str
    detail: str = ""

    @property
    def supported(self) -> bool:
        return self.kind == SUPPORTED

    @property
    def reads_latent(self) -> bool:
        """The kernel route's refusal of an MLA model (whose attention the engine does see)."""
        return self.kind == MLA_LATENT

    def __str__(self) -> str:
        return self.kind if not self.detail else f"{self.kind}: {self.detail}"


# ---------------------------------------------------------------------------------------- layers
def layer_problem(config: PretrainedConfig, layer_types: list[str] | None = None) -> Support | None:
    """Why ``config``'s (text) layer structure cannot be paged, or None if it can.

    ``layer_types``: what ``get_layer_types_and_kwargs(config)`` gives, when the caller has it already.
    """
    shared = config_attr(config, "num_kv_shared_layers") or 0
    try:  # the config's kv_sharing_modes (transformers >= 5.24), else derived as 5.17's modeling code does
        sharing = "reuse" in kinds.kv_sharing_modes(config)
    except ValueError as error:
        return Support(KV_SHARING, f"{shared} layers reuse another layer's K/V (num_kv_shared_layers): {error}")
    if shared and not sharing:
        return Support(KV_SHARING, f"{shared} layers reuse another layer's K/V (num_kv_shared_layers), and no "
                                   "layer is marked as reusing (kv_sharing_modes)")
    try:
        layer_types = layer_types if layer_types is not None else get_layer_types_and_kwargs(config)[0]
    except (AttributeError, TypeError, ValueError) as error:
        return Support(NO_LAYER_STRUCTURE, f"{type(config).__name__} has no single decoder stack ({_short(error)})")
    # transformers 5.17 builds no cache layer for the sharing layers (the last num_kv_shared_layers)
    cache_layers = {config.num_hidden_layers, config.num_hidden_layers - (shared if sharing else 0)}
    if len(layer_types) not in cache_layers:
        return Support(KV_SHARING, f"{len(layer_types)} cache layers for {config.num_hidden_layers} layers")
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES) - set(state_layers.STATE_LAYER_TYPES))
    if unsupported:
        kind = STATE_LAYERS if set(unsupported) & _STATE_LAYER_TYPES else OTHER_LAYERS
        detail = ", ".join(unsupported)
        if kind == STATE_LAYERS and not state_layers.STATE_API:
            detail += (f" (transformers {transformers_version()} lacks the state-layer cache API, "
                       "Cache.update_conv_state and friends, that hf_paged's hybrid support uses)")
        return Support(kind, detail)
    if sharing:
        try:
            _, layer_kwargs = get_layer_types_and_kwargs(config)
            if isinstance(layer_kwargs, dict):  # transformers < 5.24: one dict for all layers
                layer_kwargs = [layer_kwargs] * len(layer_types)
            kinds.layer_specs(config, list(layer_types), list(layer_kwargs))
        except NotImplementedError as error:  # e.g. an assistant model reading its target model's K/V
            return Support(KV_SHARING, str(error))
    return None


def state_only(config: PretrainedConfig) -> bool:
    """Whether ``config``'s layers are all recurrent-state (or MLP-only) layers, at least one of
    them stateful: a pure state-space model (Mamba, Mamba2, FalconMamba). Nothing to page, so
    ``generate()`` refuses it; ``LLMEngine`` serves it with state slots (:mod:`hf_paged.kinds.recurrent`)."""
    try:
        types = set(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])
    except Exception:  # noqa: BLE001 - layer_problem judges configs without a layer structure
        return False
    stateful = types & set(kinds.STATE_LAYER_TYPES)
    return state_layers.STATE_API and bool(stateful) and types <= stateful | set(state_layers.NO_CACHE_TYPES)


def check_engine_supported(model: PreTrainedModel) -> None:
    """Raise unless ``LLMEngine`` can run ``model`` (its engine route, :func:`classify_routes`):
    ``NotImplementedError`` where no route can (as :func:`check_supported`), ``ValueError`` for a
    model only ``generate()`` pages. A pure state-space model runs in the engine alone."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"LLMEngine expects a transformers PreTrainedModel, got {type(model).__name__}")
    routes = classify_routes(model)
    if routes.engine.supported:
        return
    if not routes.reference.supported:
        check_supported(model)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    raise ValueError(
        f"LLMEngine cannot run {type(model).__name__} (model type {model_type!r}): {routes.engine}. LLMEngine's packed "
        "steps read K/V through the 'hf_paged' attention function, which this model's attention does not reach as it "
        "needs (see README, 'Supported models'). It is supported in generate() with cache_implementation='hf_paged' "
        "(after hf_paged.enable(model)), on the reference route"
    )


def _per_layer(config: PretrainedConfig) -> list[PretrainedConfig]:
    try:
        return list(config.per_layer_config)
    except Exception:  # noqa: BLE001
        return [config]


def _key_head_dim(config: PretrainedConfig) -> int | None:
    if config_attr(config, "qk_head_dim") is not None:
        return config_attr(config, "qk_head_dim")
    if config_attr(config, "qk_nope_head_dim") is not None:
        return config_attr(config, "qk_nope_head_dim") + (config_attr(config, "qk_rope_head_dim") or 0)
    return config_attr(config, "head_dim")


# ------------------------------------------------------------------------------- source checks
@dataclasses.dataclass(frozen=True)
class _Verdict:
    writes_cache: bool  # some method calls cache.update(k, v, layer_idx)
    problem: Support | None  # None: every cache write feeds an AttentionInterface call unchanged
    edits_cache_layers: str | None = None  # the method that adds or replaces a cache's layers, if any


def _functions(cls: type) -> Iterator[tuple[str, ast.FunctionDef]]:
    """The methods ``cls`` runs (resolved through its MRO), parsed, that transformers defines and
    that may write a cache or edit its layers (see :func:`_parsed`)."""
    seen = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith(_NOT_MODEL_CODE):
            continue
        for name, fn in vars(klass).items():
            if name in seen or not inspect.isfunction(fn):
                continue
            seen.add(name)
            node = _parsed(fn)
            if node is not None:
                yield f"{klass.__name__}.{name}", node


@functools.lru_cache(maxsize=None)
def _parsed(fn: types.FunctionType) -> ast.FunctionDef | None:
    """``fn``'s definition, parsed once (subclasses inherit most methods: half the reads were repeats);
    None where it cannot matter: a method that neither updates a cache nor touches its layers."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if "update" not in source and "layers" not in source:
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    node = tree.body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@functools.lru_cache(maxsize=None)  # by node identity: each parsed method is read once
def _edits_cache_layers(fn: ast.AST) -> bool:
    """``cache.layers += ...``, ``cache.layers[i] = ...``, ``cache.layers.append(...)`` (a cache-named object)."""
    def is_layers(node):
        return (isinstance(node, ast.Attribute) and node.attr == "layers"
                and re.search(r"cache|past", ast.unparse(node.value)) is not None)
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            if is_layers(t) or (isinstance(t, ast.Subscript) and is_layers(t.value)):
                return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("append", "extend"):
            if is_layers(n.func.value):
                return True
    return False


@functools.lru_cache(maxsize=None)  # by node identity, as _edits_cache_layers
def _writes_cache(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _is_cache_update(n) for n in ast.walk(fn))


def _is_cache_update(call: ast.Call) -> bool:
    """``<cache>.update(key, value, layer_idx, ...)``: three positional arguments, the third a layer index."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "update" and len(call.args) >= 3):
        return False
    return "layer" in ast.unparse(call.args[2])


def _mentions(node: ast.AST, name: str) -> bool:
    """``name`` appears in ``node``, bare or as an attribute (``modeling_x.ALL_ATTENTION_FUNCTIONS``)."""
    return any((isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
               for n in ast.walk(node))


def _lookup_by_implementation(node: ast.AST) -> bool:
    """``ALL_ATTENTION_FUNCTIONS.get_interface(<..._attn_implementation>, ...)`` or
    ``ALL_ATTENTION_FUNCTIONS[<..._attn_implementation>]``: the implementation the config names."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get_interface":
            if (_mentions(n.func.value, "ALL_ATTENTION_FUNCTIONS") and n.args
                    and "_attn_implementation" in ast.unparse(n.args[0])):
                return True
        if isinstance(n, ast.Subscript) and _mentions(n.value, "ALL_ATTENTION_FUNCTIONS"):
            if "_attn_implementation" in ast.unparse(n.slice):
                return True
    return False


def _cross_attention_branches(fn: ast.AST) -> set[int]:
    """ids of the nodes under ``if <...cross...>:`` (the body of a branch a cross-attention module takes)."""
    inside = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and re.search(r"cross|encoder_hidden_states|key_value_states", ast.unparse(n.test)):
            if not isinstance(n.test, ast.UnaryOp):  # not `if not is_cross_attention:`
                inside.update(id(sub) for stmt in n.body for sub in ast.walk(stmt))
    return inside


def _assigned_names(node: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every plain-name assignment in ``node``, outside cross-attention branches."""
    out = []
    skip = _cross_attention_branches(node)
    for n in ast.walk(node):
        if id(n) in skip:
            continue
        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = [n.target]
        elif isinstance(n, (ast.For, ast.comprehension)):
            targets = [n.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Name):
                    out.append((leaf.id, n.lineno if hasattr(n, "lineno") else t.lineno))
    return out


def _argument(call: ast.Call, position: int, keyword: str) -> ast.AST | None:
    if len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _check_function(where: str, fn: ast.FunctionDef) -> Support | None:
    """Problems of one method that writes the cache (None: its writes all reach the interface unchanged)."""
    updates = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _is_cache_update(n)]
    parents = {child: parent for parent in ast.walk(fn) for child in ast.iter_child_nodes(parent)}
    interface_names = set()
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and _lookup_by_implementation(n.value):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    interface_names.add(t.id)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id in interface_names) or _lookup_by_implementation(n.func))]
    if not calls:
        return Support(INLINE, f"{where} writes the cache but calls no function from ALL_ATTENTION_FUNCTIONS")
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    assignments = _assigned_names(fn)
    written = []  # (key name, value name, line) of each update whose result is unpacked into two names
    for update in updates:
        parent = parents.get(update)
        target = parent.targets[0] if isinstance(parent, ast.Assign) and len(parent.targets) == 1 else None
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2
                and all(isinstance(e, ast.Name) for e in target.elts)):
            return Support(KV_CHANGED, f"{where} does not unpack cache.update(...) into (key, value)")
        written.append((target.elts[0].id, target.elts[1].id, update.lineno))
    for call in calls:
        key, value = _argument(call, 2, "key"), _argument(call, 3, "value")
        if not (isinstance(key, ast.Name) and isinstance(value, ast.Name)):
            return Support(KV_CHANGED, f"{where} passes computed K/V to the attention function")
        feeding = [(k, v, line) for k, v, line in written if (k, v) == (key.id, value.id) and line < call.lineno]
        if not feeding:
            stored = "/".join(dict.fromkeys(f"{k}/{v}" for k, v, _ in written))
            return Support(KV_CHANGED, f"{where} stores {stored} with cache.update but gives attention "
                                       f"{key.id}/{value.id} derived from them")
        _, _, line = max(feeding, key=lambda w: w[2])
        changed = sorted({n for n, at in assignments if n in (key.id, value.id) and line < at < call.lineno})
        if changed:
            return Support(KV_CHANGED, f"{where} reassigns {'/'.join(changed)} after cache.update")
        unknown = sorted(k.arg for k in call.keywords if k.arg not in _HONOURED_KEYWORDS)
        if unknown:
            return Support(ATTENTION_OPTIONS, f"{where} passes {', '.join(unknown)} to attention, which the paged "
                                              "kernels and engine steps do not implement")
        mask = _argument(call, 4, "attention_mask")
        if isinstance(mask, ast.Name) and mask.id in params:
            if any(n == mask.id for n, _ in assignments):
                return Support(OWN_MASK, f"{where} replaces its {mask.id} argument before the attention call")
        else:
            shown = ast.unparse(mask) if mask is not None else "no mask"
            return Support(OWN_MASK, f"{where} gives attention {shown}, not the mask it was passed")
    return None


@functools.lru_cache(maxsize=None)
def source_verdict(cls: type) -> _Verdict:
    """Read ``cls``'s methods: does it write the cache, and does every write reach the interface unchanged?"""
    writes, problem, edits = False, None, None
    for where, fn in _functions(cls):
        if edits is None and _edits_cache_layers(fn):
            edits = where
        if not _writes_cache(fn):
            continue
        writes = True
        problem = problem or _check_function(where, fn)
    if writes and problem is None:
        source = inspect.getsource(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else ""
        if "masking_utils" not in source:
            problem = Support(OWN_MASK, f"{cls.__module__} does not use transformers.masking_utils")
    return _Verdict(writes, problem, edits)


# ------------------------------------------------------------------------------------ the gate
def config_problem(config: PretrainedConfig) -> Support | None:
    """What a (top-level) config alone rules out: cross-attention layers, unsupported layers, KV sharing."""
    text = config.get_text_config(decoder=True)
    for holder in [config] if text is config else [config, text]:
        if config_attr(holder, "add_cross_attention") or config_attr(holder, "cross_attention_layers"):
            return Support(CROSS_ATTENTION, f"{type(holder).__name__} declares cross-attention layers")
    return layer_problem(text)


def head_dim_problem(config: PretrainedConfig) -> Support | None:
    """Keys and values of different head sizes (multi-head latent attention): one pool shape per layer."""
    for layer_config in _per_layer(config.get_text_config(decoder=True)):
        k_dim, v_dim = _key_head_dim(layer_config), config_attr(layer_config, "v_head_dim")
        if v_dim is not None and k_dim is not None and v_dim != k_dim:
            return Support(HEAD_DIMS, f"key head {k_dim}, value head {v_dim}; a paged layer stores one head size")
    return None


def classify_model(model: PreTrainedModel, reference: PretrainedConfig | None = None) -> Support:
    """Whether ``model`` (an instance) can be paged; if not, the kind of reason and its detail.

    ``reference``: the config whose layer structure is judged (default: the model's own). The table
    judges a tiny instance's modules against its architecture's default config.
    """
    reference = reference if reference is not None else model.config
    writers = _cache_writers(model)
    problem = _structure_problem(model, reference, writers)
    if problem is not None:
        return problem
    mla = kinds.is_mla_config(reference.get_text_config(decoder=True))
    for cls in writers:
        problem = source_verdict(cls).problem
        if problem is not None and not (mla and problem.kind == KV_CHANGED):  # MLA expands what update returns
            return problem
    problem = ((None if mla else head_dim_problem(reference)) or sliding_mask_problem(reference, writers)
               or own_cache_problem(model))
    if problem is not None:
        return problem
    return Support(SUPPORTED)


@dataclasses.dataclass(frozen=True)
class Routes:
    """The verdict on one model per route: ``generate()`` on the reference route (CPU; update
    returns DynamicCache's K/V to the model's own attention), ``generate()`` on the kernel route
    (the Triton kernels read the blocks; where refused, generate() takes the reference route on
    every device) and ``LLMEngine`` (packed steps through the ``"hf_paged"`` attention function)."""

    reference: Support
    kernels: Support
    engine: Support


def reference_problem(model: PreTrainedModel, reference: PretrainedConfig | None = None) -> Support | None:
    """What rules out even the reference route: it needs a decoder-only model whose layers keep
    their K/V in the cache through ``cache.update(key, value, layer_idx)`` (how the model then
    attends, inline or through the interface, is its own business), layers the cache can hold, no
    cross-attention, and no cache class or cache-layer edits of the model's own."""
    reference = reference if reference is not None else model.config
    return _structure_problem(model, reference, _cache_writers(model)) or own_cache_problem(model)


def _cache_writers(model: PreTrainedModel) -> dict[type, list[str]]:
    """The module classes of ``model`` that call ``cache.update``, each with its modules' names."""
    writers: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        if source_verdict(type(module)).writes_cache:
            writers.setdefault(type(module), []).append(name)
    return writers


def _structure_problem(model: PreTrainedModel, reference: PretrainedConfig,
                       writers: dict[type, list[str]]) -> Support | None:
    """What every route needs of the model's structure: decoder-only, a config whose layers the cache
    can hold, modules that keep K/V through ``cache.update`` and leave ``cache.layers`` alone, and no
    cross-attention."""
    if config_attr(model.config, "is_encoder_decoder"):
        return Support(ENCODER_DECODER, "an encoder-decoder model (the paged cache is for decoder-only models)")
    problem = config_problem(reference)
    if problem is not None:
        return problem
    if not writers:
        return Support(NO_KV_CACHE, "no module calls cache.update(key, value, layer_idx)")
    for cls in {type(m) for m in model.modules()}:
        where = source_verdict(cls).edits_cache_layers
        if where:
            return Support(CACHE_LAYERS_EDITED, f"{where} adds or replaces entries of cache.layers")
    for cls, names in writers.items():
        cross = [n for n in names if _CROSS_ATTENTION_NAME.search(n)]
        cross = cross or (names if "CrossAttention" in cls.__name__ else [])
        if cross:
            return Support(CROSS_ATTENTION, f"{cls.__name__} at {cross[0]} attends to encoder/vision states")
    return None


def classify_routes(model: PreTrainedModel, reference: PretrainedConfig | None = None) -> Routes:
    """:class:`Routes` for ``model``: the reference route's rules (:func:`reference_problem`), then
    what the kernels and the engine need on top (:func:`classify_model`; MLA reads on the
    reference route in generate()). Recurrent layers run in every route; a model of nothing but
    recurrent layers has nothing to page and runs in the engine alone (:func:`state_only`)."""
    reference = reference if reference is not None else model.config
    problem = reference_problem(model, reference)
    if problem is not None and problem.kind == NO_KV_CACHE and state_only(reference):
        nothing = Support(NO_KV_CACHE, "a pure state-space model: no K/V to page (LLMEngine serves it with state slots)")
        return Routes(nothing, nothing, Support(SUPPORTED))
    if problem is not None:
        return Routes(problem, problem, problem)
    strict = classify_model(model, reference)
    if not strict.supported:
        return Routes(Support(SUPPORTED), strict, strict)
    kernels_route = strict
    if kinds.is_mla_config(reference.get_text_config(decoder=True)):
        kernels_route = Support(MLA_LATENT, "the model expands the cached latent after update; the kernels do not "
                                            "attend in latent space")
    return Routes(strict, kernels_route, strict)


def own_cache_problem(model: PreTrainedModel) -> Support | None:
    """A modeling file that defines a ``Cache`` subclass and checks ``isinstance(..., ThatCache)``
    (MiniMax raises for any other cache): a paged cache is never accepted there."""
    from transformers import Cache

    for module_name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        own = [c.__name__ for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module_name]
        if not own:
            continue
        source = inspect.getsource(module)
        for name in own:
            if re.search(rf"isinstance\(\s*\w+\s*,\s*{name}\s*\)", source):
                return Support(OWN_CACHE, f"{module_name.rsplit('.', 1)[-1]} requires its own {name}")
    return None


def sliding_mask_problem(config: PretrainedConfig, writers) -> Support | None:
    """Sliding layers whose model never builds a sliding-window mask: stock then attends the whole
    prompt at prefill and only the cache's window afterwards, which an engine step cannot mirror."""
    try:
        types = get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]
    except Exception:  # noqa: BLE001 - layer_problem has judged this config already
        return None
    if "sliding_attention" not in types:
        return None
    for cls in writers:
        source = inspect.getsource(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else ""
        if not any(name in source for name in ("create_sliding_window_causal_mask", "create_masks_for_generate")):
            return Support(SLIDING_MASK, f"sliding_attention layers, but {cls.__module__.rsplit('.', 1)[-1]} builds "
                                         "only full causal masks")
    return None


def check_supported(model: PreTrainedModel) -> None:
    """Raise, naming the class, unless ``model`` can be paged (``TypeError`` for a non-model)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hf_paged.enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    verdict = reference_problem(model)
    if verdict is not None:
        raise NotImplementedError(
            f"{type(model).__name__} cannot be paged by hf_paged: {verdict}. hf_paged needs a decoder-only model whose "
            "layers keep their K/V in the cache through cache.update(key, value, layer_idx), with attention layers "
            "of the kinds in hf_paged.kinds (see README, 'Supported models')"
        )


def kernel_route_problem(model: PreTrainedModel) -> Support | None:
    """Why ``generate()`` reads ``model`` on the reference route on every device (None: the
    kernels may read its blocks where Triton runs)."""
    kernels_route = classify_routes(model).kernels
    return None if kernels_route.supported else kernels_route


# ------------------------------------------------------------------------------- tiny configs
_TINY = dict(
    vocab_size=96, hidden_size=64, d_model=64, n_groups=1, n_embd=64, intermediate_size=96, ffn_dim=96, n_inner=96,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_key_value_heads=2, num_kv_heads=2, head_dim=16,
    max_position_embeddings=512, n_positions=512, n_ctx=512, sliding_window=8, sliding_window_size=8,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, n_group=1, topk_group=1, num_expert_group=1,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16, qk_head_dim=16,
    index_head_dim=16, index_n_heads=2, index_topk=8, first_k_dense_replace=1,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    vocab_size_per_layer_input=96, hidden_size_per_layer_input=16, rotary_dim=8, moe_k=2, moe_topk=2,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.3, emb_dim=64,
    # state-space layers: 8 heads of 16 and a state of 16 (the defaults' 128 heads of 64 and states of 256 made
    # one tiny hybrid's generate() take seconds on the reference scan)
    mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=16, mamba_num_heads=8, mamba_head_dim=16,
    ssm_state_size=16, linear_num_heads=4, linear_head_dim=16,
)
_NONE_MEANS_OFF = ("sliding_window", "sliding_window_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                   "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "index_head_dim", "index_n_heads", "index_topk",
                   "first_k_dense_replace", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                   "vocab_size_per_layer_input", "hidden_size_per_layer_input", "n_inner")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def tiny_config(config: PretrainedConfig) -> PretrainedConfig:
    """A tiny copy of ``config`` (hidden 64, 2+ layers, vocab 96, small windows, a few experts) for tests.

    Layer types keep one layer of each distinct type (so a sliding/full model stays mixed); sub-configs
    (text, vision) are shrunk too. Raises whatever the config class raises when it cannot be shrunk.
    """
    values = config.to_dict()
    kwargs = {}
    layers = 2
    types = values.get("layer_types")
    if isinstance(types, list) and types:
        distinct = list(dict.fromkeys(types))
        layers = max(2, len(distinct))
        kwargs["layer_types"] = (distinct * 2)[:layers]
    old_layers = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    for key in _LAYER_COUNTS:
        if isinstance(values.get(key), int) and not isinstance(values.get(key), bool):
            kwargs[key] = layers
    for key, value in _TINY.items():
        if key not in values or isinstance(values[key], bool):
            continue
        if values[key] is not None or key not in _NONE_MEANS_OFF:
            kwargs[key] = value
    if kwargs.get("kv_lora_rank") is not None and "num_key_value_heads" in kwargs:  # MLA: one K/V per query head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", _TINY["num_attention_heads"])
    if kwargs.get("kv_lora_rank") is not None and "head_dim" in kwargs and kwargs.get("qk_rope_head_dim"):
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA configs rotate head_dim = qk_rope_head_dim dims
    if isinstance(values.get("expand"), int) and {"num_heads", "head_dim", "hidden_size"} <= kwargs.keys():
        kwargs["expand"] = max(1, kwargs["num_heads"] * kwargs["head_dim"] // kwargs["hidden_size"])  # Mamba2's rule
    if values.get("use_cache") is False:  # MPT's default: generate() would cache (and so page) nothing
        kwargs["use_cache"] = True
    if "is_decoder" in values:  # BERT-style and Reformer causal LMs are decoders only with this set
        kwargs["is_decoder"] = True
    for key, value in values.items():
        if key in kwargs or key == "layer_types":
            continue
        if isinstance(value, list) and old_layers and len(value) == old_layers and key not in _TOKEN_IDS:
            kwargs[key] = value[:layers]
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig) and key in getattr(config, "sub_configs", {}):
            kwargs[key] = tiny_config(sub)
    return type(config)(**kwargs)


# ------------------------------------------------------------------------------------ the table
# Architectures whose tiny model builds but that the generic text test cannot drive.
UNTESTED = {
    "musicgen_melody": "audio-codebook ids and its own delay-pattern generate(); the text test does not apply",
    "inkling2_text": "its tiny model fails in stock generate() (an embedding index out of range)",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry: its verdict, and whether the tests run a tiny model of it."""

    model_type: str
    class_name: str
    support: Support  # generate() on the reference route: whether the model can be paged at all
    tiny: bool  # a tiny model was built from tiny_config(its default config)
    note: str = ""  # why a supported architecture is not tested; what configs of it are refused
    kernels: Support | None = None  # generate() on the kernel route (None: as ``support``)
    engine: Support | None = None  # LLMEngine (None: as ``support``)

    @classmethod
    def of(cls, model_type: str, class_name: str, routes: Routes, tiny: bool, note: str = "") -> Entry:
        return cls(model_type, class_name, routes.reference, tiny, note, routes.kernels, routes.engine)

    @property
    def kernels_support(self) -> Support:
        return self.kernels or self.support

    @property
    def engine_support(self) -> Support:
        return self.engine or self.support

    @property
    def generate_only(self) -> bool:
        """generate() pages it, LLMEngine refuses it (attention the engine cannot read)."""
        return self.support.supported and not self.engine_support.supported

    @property
    def engine_only(self) -> bool:
        """LLMEngine serves it, generate() has nothing to page (a pure state-space model)."""
        return not self.support.supported and self.engine_support.supported

    @property
    def engine_tested(self) -> bool:
        """LLMEngine serves it and tests/test_architectures.py runs it there (equal to stock)."""
        return self.engine_support.supported and self.tiny and self.model_type not in UNTESTED

    @property
    def tested(self) -> bool:
        """Supported, and run by tests/test_architectures.py (greedy and beam search equal to stock)."""
        return self.support.supported and self.tiny and self.model_type not in UNTESTED


@contextlib.contextmanager
def _quiet():
    """Building ~200 default configs and tiny models warns a lot: keep it out of the output."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def _model_class(model_type: str, class_name: str) -> tuple[type, type]:
    """The model class and the config class it is built from (a decoder's own config, e.g. Musicgen's)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = getattr(transformers, class_name)
    config_class = CONFIG_MAPPING[model_type]
    own = getattr(cls, "config_class", None)
    if isinstance(own, type) and not issubclass(config_class, own):
        config_class = own
    return cls, config_class


_NO_ATTENTION_BY_DEFAULT = ("its default config has no attention layer: a pure state-space model, which generate() "
                            "refuses (nothing to page) and LLMEngine serves")
# Hybrid architectures whose tiny copy (2 layers, config defaults) would have no attention layer:
# the layer pattern their tiny model gets instead, and what the table says about it.
HYBRID_TINY_LAYERS = {
    "bamba": (dict(attn_layer_indices=[1]), _NO_ATTENTION_BY_DEFAULT),
    "granitemoehybrid": (dict(layer_types=["linear_attention", "full_attention"]), _NO_ATTENTION_BY_DEFAULT),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1), ""),
    "zamba": (dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]), ""),
    "zamba2": (dict(hybrid_layer_ids=[1], layers_block_type=["linear_attention", "hybrid"]), ""),
}
# KV-sharing architectures: a tiny copy needs layers that store before the ones that share.
_GEMMA3N_SHARING = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                        num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4, intermediate_size=[96] * 4)
SHARING_TINY_LAYERS = {"gemma3n_text": _GEMMA3N_SHARING, "gemma3n": {"text_config": _GEMMA3N_SHARING}}


def _with_layers(config: PretrainedConfig, overrides: dict) -> PretrainedConfig:
    """``config`` rebuilt with ``overrides`` (a sub-config's under its key, e.g. ``text_config``)."""
    values = config.to_dict()
    for key, value in overrides.items():
        values[key] = {**values[key], **value} if isinstance(value, dict) else value
    return type(config)(**values)


def _hybrid_tiny_note(model_type: str) -> str:
    if model_type not in HYBRID_TINY_LAYERS or not state_layers.STATE_API:
        return ""
    layers, why = HYBRID_TINY_LAYERS[model_type]
    pattern = ", ".join(f"{k}={v}" for k, v in layers.items())
    return f"tested with attention layers ({pattern})" + (f"; {why}" if why else "")


def build_tiny(model_type: str, class_name: str | None = None, seed: int = 0,
               initializer_range: float | None = None) -> PreTrainedModel:
    """A tiny float32 model of ``model_type`` (its ``*ForCausalLM`` class by default), random weights, eval mode."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls, config_class = _model_class(model_type, class_name or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(config_class())
    if model_type in HYBRID_TINY_LAYERS and state_layers.STATE_API:
        config = _with_layers(config, HYBRID_TINY_LAYERS[model_type][0])
    if model_type in SHARING_TINY_LAYERS:
        config = _with_layers(config, SHARING_TINY_LAYERS[model_type])
    if initializer_range is not None:
        for sub in [config, *(getattr(config, key) for key in getattr(config, "sub_configs", {}))]:
            if isinstance(sub, PretrainedConfig):
                sub.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32).eval()
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):  # X-MOD's adapters
        model.set_default_language(config.languages[0])
    return model


def classify_entry(model_type: str, class_name: str) -> Entry:
    """Classify one architecture: the modules of a tiny instance, the layers of the default config."""
    try:
        cls, config_class = _model_class(model_type, class_name)
        config = config_class()
    except Exception as error:  # noqa: BLE001 - the reason goes into the table
        return Entry(model_type, class_name, Support(NOT_BUILT, f"default config: {_short(error)}"), False)
    problem = config_problem(config)
    if problem is not None:  # no instance needed
        return Entry(model_type, class_name, problem, False)
    try:
        return Entry.of(model_type, class_name, classify_routes(build_tiny(model_type, class_name), config), True)
    except Exception as error:  # noqa: BLE001
        why = f"no tiny model: {_short(error)}"
        try:  # the default config on the meta device: modules, no memory
            with torch.device("meta"):
                model = cls._from_config(config)
        except Exception:  # noqa: BLE001 - judge every class of its module instead
            why += "; the default config does not build"
            return Entry.of(model_type, class_name, module_verdict(cls), False, why)
        return Entry.of(model_type, class_name, classify_routes(model), False, why)


def module_verdict(cls: type) -> Routes:
    """Judge a model class that cannot be built by the source of every module class in its modeling file."""
    module = sys.modules[cls.__module__]
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
               and c.__module__ == module.__name__]
    writers = [c for c in classes if source_verdict(c).writes_cache]
    if not writers:
        refused = Support(NO_KV_CACHE, f"no class of {module.__name__.rsplit('.', 1)[-1]} calls cache.update")
        return Routes(refused, refused, refused)
    edits = next((source_verdict(c).edits_cache_layers for c in classes if source_verdict(c).edits_cache_layers), None)
    if edits:
        refused = Support(CACHE_LAYERS_EDITED, f"{edits} adds or replaces entries of cache.layers")
        return Routes(refused, refused, refused)
    strict = next((source_verdict(c).problem for c in writers if source_verdict(c).problem is not None),
                  Support(SUPPORTED))
    return Routes(Support(SUPPORTED), strict, strict)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:120]}" + ("..." if len(text) > 120 else "")


def _refused_configs(cls: type) -> str:
    """A supported architecture whose modeling code also has layers the paged cache refuses (by config)."""
    source = inspect.getsource(sys.modules[cls.__module__])
    marks = {}
    if not state_layers.STATE_API:  # hybrid layers need transformers' state-layer cache API
        marks["conv / linear-attention layers"] = ("update_conv_state", "update_recurrent_state")
    kinds = [what for what, found in marks.items() if any(mark in source for mark in found)]
    return f"configs with {' or '.join(kinds)} are refused" if kinds else ""


def causal_lm_entries() -> list[Entry]:
    """Every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, classified (about 20 s)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    entries = []
    with _quiet():
        for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
            entry = classify_entry(model_type, class_name)
            if entry.support.supported:
                cls, config_class = _model_class(model_type, class_name)
                cache_off = "its default config has use_cache=False (nothing is cached, so nothing paged); tested with " \
                            "use_cache=True" if getattr(config_class(), "use_cache", True) is False else ""
                notes = [UNTESTED.get(model_type, ""), entry.note, _refused_configs(cls), _hybrid_tiny_note(model_type),
                         cache_off]
                entry = dataclasses.replace(entry, note="; ".join(n for n in notes if n))
            entries.append(entry)
    return entries


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def markdown_table(entries: list[Entry]) -> str:
    """The README's table: a summary line, then one row per architecture and a column per route."""
    tested = sum(e.tested for e in entries)
    untested = sum(e.support.supported and not e.tested for e in entries)
    refused = collections.Counter(e.support.kind for e in entries if not e.support.supported)
    kernels_ok = sum(e.support.supported and e.kernels_support.supported for e in entries)
    engine_ok = sum(e.support.supported and e.engine_support.supported for e in entries)
    engine_tested = sum(e.tested and e.engine_support.supported for e in entries)
    engine_only = [e for e in entries if e.engine_only]
    lines = [
        f"{len(entries)} `*ForCausalLM` architectures in transformers {transformers_version()}: "
        f"**{tested} supported and tested** in generate(), {untested} supported but not tested, "
        f"{sum(refused.values())} refused ("
        + ", ".join(f"{kind}: {n}" for kind, n in sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))) + "). "
        f"Of the supported, {kernels_ok} are read by the kernels where Triton runs (the others take the reference "
        f"route on every device) and {engine_ok} run in LLMEngine ({engine_tested} tested there). "
        f"LLMEngine also serves {len(engine_only)} pure state-space models that generate() refuses "
        f"({sum(e.engine_tested for e in engine_only)} tested).",
        "",
        "| model type | class | generate(): reference route | generate(): kernel route | LLMEngine | why / notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        if not e.support.supported:
            refusal = f"refused: {e.support.kind}"
            engine = ("tested" if e.engine_tested else "supported, not tested") if e.engine_only else refusal
            lines.append(f"| {e.model_type} | {e.class_name} | {refusal} | {refusal} | {engine} | "
                         f"{_cell(e.support.detail)} |")
            continue
        reference = "tested" if e.tested else "supported, not tested"
        kernels_cell = "kernels" if e.kernels_support.supported else f"reference route: {e.kernels_support.kind}"
        engine = (("tested" if e.tested else "supported, not tested") if e.engine_support.supported
                  else f"refused: {e.engine_support.kind}")
        routes: dict[str, list[str]] = {}  # a refusal's detail -> the routes it refuses
        for route, verdict in (("kernel route", e.kernels_support), ("LLMEngine", e.engine_support)):
            if not verdict.supported and verdict.detail:
                routes.setdefault(verdict.detail, []).append(route)
        why = "; ".join(n for n in [e.note] + [f"{' and '.join(r)}: {d}" for d, r in routes.items()] if n)
        lines.append(f"| {e.model_type} | {e.class_name} | {reference} | {kernels_cell} | {engine} | {_cell(why)} |")
    return "\n".join(lines) + "\n"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        prog="python -m hf_paged.model_support",
        description="Print README's supported-models table: every causal LM of the installed transformers, "
                    "each judged on a tiny instance").parse_args()
    print(markdown_table(causal_lm_entries()), end="")
