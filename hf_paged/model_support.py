"""Which transformers architectures hf_paged can page, and why the others are refused.

The class flag ``_supports_attention_backend`` is not the test: StableLM and BioGPT route attention
through ``AttentionInterface`` without setting it. What hf_paged relies on is checked directly:

1. **decoder-only**: not an encoder-decoder model, and no cross-attention layers (the paged cache
   holds self-attention K/V only);
2. **layers the cache supports**: every layer is ``full_attention`` or ``sliding_attention``
   (no linear-attention / state-space / convolution / chunked / compressed layers), no layer reuses
   another layer's K/V, and keys and values have the same head size;
3. **attention through the interface, fed by the cache**: read from the source of every attention
   module the model holds that writes the cache (``cache.update(k, v, layer_idx)``): the K/V that
   ``update`` returns go unchanged into a function looked up in ``ALL_ATTENTION_FUNCTIONS`` by
   ``config._attn_implementation``, with the layer's own ``attention_mask`` (the mask built by
   ``transformers.masking_utils``); the module imports ``masking_utils``;
4. **switchable**: transformers agrees to switch the model's attention implementation
   (``_can_set_attn_implementation``, its own source heuristic) for the model and every sub-model
   that holds such a layer.

The source check looks at the classes the model *instance* holds, so a module that keeps an old
inline class next to one that routes through the interface (DiffLlama's, say) is judged by the class
in use. A runtime net remains: K/V stashed by ``update`` and never claimed by the attention function
make the next cache call raise, so a model that slips past this gate fails loudly, never silently.

``python -m hf_paged.model_support`` prints the table of every ``*ForCausalLM`` architecture of the
installed transformers (the README's "Supported models" section is this output).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import warnings
from collections.abc import Iterator

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
_STATE_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "recurrent"}
_CROSS_ATTENTION_NAME = re.compile(r"(^|\.)(encoder_attn|cross_?attn\w*|crossattention|cross_attention\w*)$")

# Reasons, one per kind of refusal (the table groups by these).
SUPPORTED = "supported"
ENCODER_DECODER = "encoder-decoder"
CROSS_ATTENTION = "cross-attention layers"
STATE_LAYERS = "hybrid layers (linear attention / state-space / convolution)"
OTHER_LAYERS = "layer types other than full/sliding attention"
KV_SHARING = "layers share KV"
HEAD_DIMS = "keys and values of different head sizes"
INLINE = "attention computed inline (no AttentionInterface)"
KV_CHANGED = "K/V changed between cache.update and attention"
OWN_MASK = "attention mask not the one masking_utils built"
NOT_SWITCHABLE = "transformers cannot switch its attention implementation"
NO_KV_CACHE = "no layer writes a KV cache"
NOT_BUILT = "cannot be built here"


@dataclasses.dataclass(frozen=True)
class Support:
    """The verdict on one model: ``kind`` is :data:`SUPPORTED` or a refusal kind, ``detail`` says why."""

    kind: str
    detail: str = ""

    @property
    def supported(self) -> bool:
        return self.kind == SUPPORTED

    def __str__(self) -> str:
        return self.kind if not self.detail else f"{self.kind}: {self.detail}"


# ---------------------------------------------------------------------------------------- layers
def layer_problem(config: PretrainedConfig) -> Support | None:
    """Why ``config``'s (text) layer structure cannot be paged, or None if it can."""
    if getattr(config, "num_kv_shared_layers", 0) or "reuse" in (getattr(config, "kv_sharing_modes", None) or ()):
        shared = getattr(config, "num_kv_shared_layers", 0)
        return Support(KV_SHARING, f"{shared} layers reuse another layer's K/V (num_kv_shared_layers)"
                       if shared else "some layers reuse another layer's K/V (kv_sharing_modes)")
    try:
        layer_types, _ = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError) as error:
        return Support(OTHER_LAYERS, f"no readable layer structure in {type(config).__name__} ({_short(error)})")
    if len(layer_types) != config.num_hidden_layers:
        return Support(KV_SHARING, f"{len(layer_types)} cache layers for {config.num_hidden_layers} layers")
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        kind = STATE_LAYERS if set(unsupported) & _STATE_LAYER_TYPES else OTHER_LAYERS
        return Support(kind, ", ".join(unsupported))
    return None


def _attr(config: PretrainedConfig, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - heterogeneous configs refuse global reads of per-layer values
        return None


def _per_layer(config: PretrainedConfig) -> list[PretrainedConfig]:
    try:
        return list(config.per_layer_config)
    except Exception:  # noqa: BLE001
        return [config]


def _key_head_dim(config: PretrainedConfig) -> int | None:
    if _attr(config, "qk_head_dim") is not None:
        return _attr(config, "qk_head_dim")
    if _attr(config, "qk_nope_head_dim") is not None:
        return _attr(config, "qk_nope_head_dim") + (_attr(config, "qk_rope_head_dim") or 0)
    return _attr(config, "head_dim")


# ------------------------------------------------------------------------------- source checks
@dataclasses.dataclass(frozen=True)
class _Verdict:
    writes_cache: bool  # some method calls cache.update(k, v, layer_idx)
    problem: Support | None  # None: every cache write feeds an AttentionInterface call unchanged


def _functions(cls: type) -> Iterator[tuple[str, ast.FunctionDef]]:
    """The methods ``cls`` runs (resolved through its MRO), parsed, that transformers defines."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        for name, fn in vars(klass).items():
            if name in seen or not inspect.isfunction(fn):
                continue
            seen.add(name)
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                continue
            node = tree.body[0]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{klass.__name__}.{name}", node


def _is_cache_update(call: ast.Call) -> bool:
    """``<cache>.update(key, value, layer_idx, ...)``: three positional arguments, the third a layer index."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "update" and len(call.args) >= 3):
        return False
    return "layer_idx" in ast.unparse(call.args[2]) or "layer" in ast.unparse(call.args[2])


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _lookup_by_implementation(node: ast.AST) -> bool:
    """``ALL_ATTENTION_FUNCTIONS.get_interface(<..._attn_implementation>, ...)`` or ``ALL_ATTENTION_FUNCTIONS[<...>]``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get_interface":
            if _mentions(n.func.value, "ALL_ATTENTION_FUNCTIONS") and n.args and "_attn_implementation" in ast.unparse(n.args[0]):
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
            return Support(KV_CHANGED, f"{where} passes {key.id}/{value.id}, not what cache.update returned")
        _, _, line = max(feeding, key=lambda w: w[2])
        changed = sorted({n for n, at in assignments if n in (key.id, value.id) and line < at < call.lineno})
        if changed:
            return Support(KV_CHANGED, f"{where} reassigns {'/'.join(changed)} after cache.update")
        mask = _argument(call, 4, "attention_mask")
        if not (isinstance(mask, ast.Name) and mask.id in params and not any(n == mask.id for n, _ in assignments)):
            shown = ast.unparse(mask) if mask is not None else "no mask"
            return Support(OWN_MASK, f"{where} passes {shown} instead of the attention_mask it was given")
    return None


@functools.lru_cache(maxsize=None)
def source_verdict(cls: type) -> _Verdict:
    """Read ``cls``'s methods: does it write the cache, and does every write reach the interface unchanged?"""
    writes, problem = False, None
    for where, fn in _functions(cls):
        if not any(isinstance(n, ast.Call) and _is_cache_update(n) for n in ast.walk(fn)):
            continue
        writes = True
        problem = problem or _check_function(where, fn)
    if writes and problem is None:
        source = inspect.getsource(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else ""
        if "masking_utils" not in source:
            problem = Support(OWN_MASK, f"{cls.__module__} does not use transformers.masking_utils")
    return _Verdict(writes, problem)


# ------------------------------------------------------------------------------------ the gate
def config_problem(config: PretrainedConfig) -> Support | None:
    """What a (top-level) config alone rules out: cross-attention layers, unsupported layers, KV sharing."""
    text = config.get_text_config(decoder=True)
    for holder in [config] if text is config else [config, text]:
        if _attr(holder, "add_cross_attention") or _attr(holder, "cross_attention_layers"):
            return Support(CROSS_ATTENTION, f"{type(holder).__name__} declares cross-attention layers")
    return layer_problem(text)


def head_dim_problem(config: PretrainedConfig) -> Support | None:
    """Keys and values of different head sizes (multi-head latent attention): one pool shape per layer."""
    for layer_config in _per_layer(config.get_text_config(decoder=True)):
        k_dim, v_dim = _key_head_dim(layer_config), _attr(layer_config, "v_head_dim")
        if v_dim is not None and k_dim is not None and v_dim != k_dim:
            return Support(HEAD_DIMS, f"key head {k_dim}, value head {v_dim}; a paged layer stores one head size")
    return None


def classify_model(model: PreTrainedModel, reference: PretrainedConfig | None = None) -> Support:
    """Whether ``model`` (an instance) can be paged; if not, the kind of reason and its detail.

    ``reference``: the config whose layer structure is judged (default: the model's own). The table
    judges a tiny instance's modules against its architecture's default config.
    """
    reference = reference if reference is not None else model.config
    if _attr(model.config, "is_encoder_decoder"):
        return Support(ENCODER_DECODER, "an encoder-decoder model (the paged cache is for decoder-only models)")
    problem = config_problem(reference)
    if problem is not None:
        return problem
    writers: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        if source_verdict(type(module)).writes_cache:
            writers.setdefault(type(module), []).append(name)
    if not writers:
        return Support(NO_KV_CACHE, "no module calls cache.update(key, value, layer_idx)")
    for cls, names in writers.items():
        cross = [n for n in names if _CROSS_ATTENTION_NAME.search(n)] or (names if "CrossAttention" in cls.__name__ else [])
        if cross:
            return Support(CROSS_ATTENTION, f"{cls.__name__} at {cross[0]} attends to encoder/vision states")
    for cls in writers:
        problem = source_verdict(cls).problem
        if problem is not None:
            return problem
    problem = head_dim_problem(reference)
    if problem is not None:
        return problem
    holders = [model] + [m for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model
                         and any(type(sub) in writers for sub in m.modules())]
    for holder in holders:
        if not type(holder)._can_set_attn_implementation():
            return Support(NOT_SWITCHABLE, f"{type(holder).__module__.rsplit('.', 1)[-1]} has an attention class "
                                           "without ALL_ATTENTION_FUNCTIONS.get_interface, so "
                                           f"set_attn_implementation leaves {type(holder).__name__} as it is")
    return Support(SUPPORTED)


def check_supported(model: PreTrainedModel) -> None:
    """Raise, naming the class, unless ``model`` can be paged (``TypeError`` for a non-model)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hf_paged.enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    verdict = classify_model(model)
    if not verdict.supported:
        raise NotImplementedError(
            f"{type(model).__name__} cannot be paged by hf_paged: {verdict}. hf_paged needs a decoder-only model whose "
            "attention layers pass the K/V returned by cache.update to transformers' AttentionInterface, with "
            "full or sliding-window attention layers only (see README, 'Supported models')"
        )


# ------------------------------------------------------------------------------- tiny configs
_TINY = dict(
    vocab_size=96, hidden_size=64, d_model=64, n_embd=64, intermediate_size=96, ffn_dim=96, n_inner=96,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_key_value_heads=2, num_kv_heads=2, head_dim=16,
    max_position_embeddings=512, n_positions=512, n_ctx=512, sliding_window=8, sliding_window_size=8,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, n_group=1, topk_group=1, num_expert_group=1,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16, qk_head_dim=16,
    index_head_dim=16, index_n_heads=2, index_topk=8, first_k_dense_replace=1,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    vocab_size_per_layer_input=96, hidden_size_per_layer_input=16,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.3,
)
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
        if key in values and not isinstance(values[key], bool) and (values[key] is not None or key in _TOKEN_IDS):
            kwargs[key] = value
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
@dataclasses.dataclass(frozen=True)
class Entry:
    """One ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry: its verdict, and whether a tiny model of it builds."""

    model_type: str
    class_name: str
    support: Support
    tiny: bool  # a tiny model was built from tiny_config(default config): the tests run it

    @property
    def tested(self) -> bool:
        return self.support.supported and self.tiny


def _quiet():
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


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


def build_tiny(model_type: str, class_name: str | None = None, seed: int = 0) -> PreTrainedModel:
    """A tiny float32 model of ``model_type`` (its ``*ForCausalLM`` class by default), random weights, eval mode."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls, config_class = _model_class(model_type, class_name or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(config_class())
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=torch.float32).eval()


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
        return Entry(model_type, class_name, classify_model(build_tiny(model_type, class_name), config), True)
    except Exception as error:  # noqa: BLE001
        try:  # the default config on the meta device: modules, no memory
            with torch.device("meta"):
                model = cls._from_config(config)
        except Exception:  # noqa: BLE001
            return Entry(model_type, class_name, Support(NOT_BUILT, f"tiny model: {_short(error)}"), False)
        return Entry(model_type, class_name, classify_model(model), False)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:120]}" + ("..." if len(text) > 120 else "")


def causal_lm_entries() -> list[Entry]:
    """Every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, classified."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _quiet()
    return [classify_entry(t, c) for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]


def markdown_table(entries: list[Entry]) -> str:
    raise NotImplementedError


if __name__ == "__main__":
    for e in causal_lm_entries():
        print(f"{e.model_type:28s} {e.class_name:42s} {'T' if e.tiny else ' '} {e.support}")
