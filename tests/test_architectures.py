"""Architectures: every ``*ForCausalLM`` of the installed transformers is classified by what hf_paged
relies on (``hf_paged.model_support``), the README's table is that classification, every architecture
classified as supported and buildable generates through the flag exactly as stock (tiny random
models, greedy and beam search, ``torch.equal``) and through ``LLMEngine``, refusals name the class
and a reason that is real, and a composite model (Gemma 3 with a vision tower) generates with and without images.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama import modeling_llama

import hf_paged
from hf_paged import kernels, model_support, state_layers
from hf_paged.model_support import INLINE, KV_CHANGED, OWN_MASK, Support
from tests.helpers.tiny_models import (
    UNSUPPORTED,
    build,
    build_gemma3_vision,
    image_prompts,
    left_padded,
    single_threaded_torch,
    transformers_at_least,
)

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT_LENGTHS = [3, 9, 14]  # left-padded; the longest crosses blocks of 4 and the tiny windows of 8
NEW_TOKENS = 5
BLOCK_SIZE = 4
INITIALIZER_RANGES = (0.3, 0.02, 1.0, 0.1)  # tried in turn until greedy output is varied

_entries: dict[str, model_support.Entry] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared CPU spinning threads cost 10x."""
    with single_threaded_torch():
        yield


def entries() -> dict[str, model_support.Entry]:
    """The classification of every entry, computed once (about 20 s)."""
    if not _entries:
        _entries.update((e.model_type, e) for e in model_support.causal_lm_entries())
    return _entries


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _generate(model, inputs: dict, paged: bool, **options):
    kwargs = dict(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **options)
    if not paged:
        return _quietly(model.generate, **kwargs)
    hf_paged.enable(model, block_size=BLOCK_SIZE)
    stored = []  # the caches the call stored K/V in (some outputs carry no cache: XLM's on transformers 5.17)
    update = hf_paged.PagedKVCache.update

    def counted_update(cache, *args, **kw):
        stored.append(cache)
        return update(cache, *args, **kw)

    try:
        with mock.patch.object(hf_paged.PagedKVCache, "update", counted_update):
            out = _quietly(model.generate, **kwargs, cache_implementation="hf_paged", return_dict_in_generate=True)
    finally:
        hf_paged.disable(model)
    cache = getattr(out, "cache", None)
    cache = getattr(out, "past_key_values", None) if cache is None else cache
    assert stored and all(c is stored[0] for c in stored) and stored[0].stats()["tokens_stored"] > 0
    assert cache is None or cache is stored[0]
    return out.sequences


def _prompts(inputs: dict) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]


def _stock_tokens(model, inputs: dict) -> list[list[int]]:
    """Stock greedy continuation of each prompt on its own (no padding): what the engine must give."""
    out = []
    for prompt in _prompts(inputs):
        ids = torch.tensor([prompt])
        tokens = _generate(model, dict(input_ids=ids, attention_mask=torch.ones_like(ids)), paged=False)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def _engine_tokens(model, inputs: dict) -> list[list[int]]:
    """The same prompts through ``LLMEngine`` (one packed forward per step, blocks of 4, chunks of 8)."""
    engine = hf_paged.LLMEngine(model, block_size=BLOCK_SIZE, max_num_batched_tokens=8)
    params = hf_paged.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    outs = _quietly(engine.generate, _prompts(inputs), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _varied_model(entry: model_support.Entry):
    """A tiny model of ``entry`` whose greedy output on the test batch is varied (not one token repeated)."""
    ids, mask = left_padded(PROMPT_LENGTHS)
    best = None
    for scale in INITIALIZER_RANGES:
        model = _quietly(model_support.build_tiny, entry.model_type, entry.class_name, initializer_range=scale)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
        stock = _generate(model, dict(input_ids=ids, attention_mask=mask), paged=False)
        distinct = len(set(stock[:, -NEW_TOKENS:].flatten().tolist()))
        if best is None or distinct > best[0]:
            best = (distinct, model, stock)
        if distinct >= 4:
            break
    return best[1], best[2], dict(input_ids=ids, attention_mask=mask)


# ------------------------------------------------------------------------------ classification
@pytest.mark.parametrize("model_type", list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_architecture_is_tested_or_refused_with_a_reason(model_type):
    """Tested: greedy and beam search through the flag equal stock. Supported but untested: says why.
    Refused: a reason, and ``enable()`` refuses a tiny instance (where one builds) naming the class."""
    entry = entries()[model_type]
    if entry.tested:
        model, stock, inputs = _varied_model(entry)
        assert torch.equal(_generate(model, inputs, paged=True), stock), f"{model_type}: greedy differs from stock"
        beams = _generate(model, inputs, paged=False, num_beams=2)
        assert torch.equal(_generate(model, inputs, paged=True, num_beams=2), beams), f"{model_type}: beams differ"
        engine = model_support.classify_routes(model).engine  # the tiny instance's (mimo_v2_flash: equal heads)
        if not engine.supported:  # generate() only: the engine refuses at construction, naming why
            with pytest.raises(ValueError, match=f"{re.escape(type(model).__name__)}.*generate\\(\\)") as refused:
                hf_paged.LLMEngine(model, block_size=BLOCK_SIZE)
            assert engine.kind in str(refused.value) and entry.generate_only
        else:
            assert _engine_tokens(model, inputs) == _stock_tokens(model, inputs), f"{model_type}: LLMEngine differs"
    elif entry.engine_tested and entry.engine_only:  # a pure state-space model: the engine serves it
        model, _, inputs = _varied_model(entry)
        with pytest.raises(NotImplementedError, match=re.escape(type(model).__name__)):
            hf_paged.enable(model)
        assert _engine_tokens(model, inputs) == _stock_tokens(model, inputs), f"{model_type}: LLMEngine differs"
    elif entry.support.supported:
        assert entry.note, f"{model_type} is supported but not tested, and the table does not say why"
    else:
        assert entry.support.kind and entry.support.detail, f"{model_type}: refused without a reason"
        if entry.tiny:
            model = _quietly(model_support.build_tiny, model_type, entry.class_name)
            if model_support.reference_problem(model) is None:  # only the default config's layers are refused
                assert entry.support.kind in (model_support.KV_SHARING, model_support.OTHER_LAYERS), entry.support
                return
            with pytest.raises(NotImplementedError, match=re.escape(type(model).__name__)) as refused:
                hf_paged.enable(model)
            assert entry.support.kind in str(refused.value)


def test_the_classification_covers_the_mapping_and_the_known_cases():
    found = entries()
    assert list(found) == list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for inline in ("bloom", "gpt_neo", "mpt"):  # generate()'s reference route pages them; the rest refuse
        assert found[inline].tested and found[inline].engine_support.kind == INLINE, found[inline]
        assert found[inline].kernels_support.kind == INLINE
    # falcon attended inline until transformers 5.25 moved it to the AttentionInterface: every route since
    falcon_inline = not transformers_at_least("5.25")
    assert found["falcon"].tested and (found["falcon"].engine_support.kind == INLINE) == falcon_inline
    assert found["falcon"].engine_support.supported != falcon_inline and found["falcon"].engine_tested != falcon_inline
    for variant in ("gpt_oss", "deepseek_v3", "glm4_moe_lite", "llama4_text", "gemma3n_text"):  # issue 20's kinds
        assert found[variant].tested and found[variant].engine_support.supported, found[variant]
    assert found["deepseek_v3"].kernels_support.kind == model_support.MLA_LATENT
    for routed in ("stablelm", "biogpt"):  # AttentionInterface without the class flag: now accepted
        assert found[routed].tested, found[routed].support
    without_flag = [e.class_name for e in found.values() if e.tested and not _flag(e)]
    assert {"StableLmForCausalLM", "BioGptForCausalLM"} <= set(without_flag)
    for composite in ("gemma3", "gemma4", "fuyu"):  # text-only through a composite class
        assert found[composite].tested, found[composite].support
    # KV-sharing layers: marked in kv_sharing_modes (5.24 on), derived from num_kv_shared_layers on 5.17
    assert found["gemma3n"].support.supported and found["gemma3n"].engine_support.supported, found["gemma3n"]
    if state_layers.STATE_API:  # hybrid models: generate() pages them, LLMEngine serves them too
        for hybrid in ("qwen3_next", "qwen3_5_text", "falcon_h1", "bamba", "jamba", "nemotron_h", "zamba2",
                       "granitemoehybrid", "lfm2"):
            assert found[hybrid].tested and found[hybrid].engine_support.supported, found[hybrid]
        for pure in ("mamba", "mamba2", "falcon_mamba"):  # state layers only: nothing to page; the engine serves them
            assert found[pure].support.kind == model_support.NO_KV_CACHE and found[pure].engine_only, found[pure]
            assert found[pure].engine_tested, found[pure]
    else:
        assert found["qwen3_next"].support.kind == model_support.STATE_LAYERS
    assert found["bart"].support.kind == model_support.CROSS_ATTENTION
    assert found["jetmoe"].engine_support.kind == KV_CHANGED and found["jetmoe"].tested
    assert found["doge"].engine_support.kind == OWN_MASK and found["doge"].tested


def _flag(entry) -> bool:
    import transformers

    return bool(getattr(getattr(transformers, entry.class_name), "_supports_attention_backend", False))


def test_the_readme_table_is_the_generated_one():
    text = README.read_text()
    pinned = re.search(r"transformers==([0-9.]+)", text).group(1)  # the test command's pin
    if transformers.__version__ != pinned:
        pytest.skip(f"the table is generated on the pinned transformers {pinned} (here {transformers.__version__})")
    begin, end = "<!-- supported-models:begin -->\n", "<!-- supported-models:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    in_readme = text.split(begin)[1].split(end)[0]
    generated = model_support.markdown_table(list(entries().values()))
    assert in_readme == generated, "README 'Supported models' is stale: paste `python -m hf_paged.model_support`"


@pytest.mark.parametrize("arch", list(UNSUPPORTED))
def test_inline_models_page_on_the_reference_route_and_the_engine_refuses_them(arch):
    """Inline attention (no AttentionInterface): generate()'s reference route hands the model what
    DynamicCache would and the model attends itself, so it pages; the kernel route is never taken
    for it; LLMEngine, whose packed steps need the interface, refuses it naming the reason."""
    model = build(arch, table=UNSUPPORTED)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids, mask = left_padded(PROMPT_LENGTHS)
    inputs = dict(input_ids=ids, attention_mask=mask)
    assert torch.equal(_generate(model, inputs, paged=True), _generate(model, inputs, paged=False))
    assert model_support.kernel_route_problem(model).kind == INLINE
    with pytest.raises(ValueError, match=f"{type(model).__name__}.*{re.escape(INLINE)}"):
        hf_paged.LLMEngine(model, block_size=BLOCK_SIZE)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_paged.enable(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------- negative controls of the source check
def _projections(attention, hidden_states, position_embeddings):
    """Llama's query, key and value (rotary applied), as its attention computes them."""
    shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    query = attention.q_proj(hidden_states).view(shape).transpose(1, 2)
    key = attention.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = attention.v_proj(hidden_states).view(shape).transpose(1, 2)
    return (*modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings), value)


class InlineAttention(modeling_llama.LlamaAttention):
    """Llama attention written inline: writes the cache, never calls ALL_ATTENTION_FUNCTIONS."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        query, key, value = _projections(self, hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        key = modeling_llama.repeat_kv(key, self.num_key_value_groups)
        value = modeling_llama.repeat_kv(value, self.num_key_value_groups)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        out = torch.matmul(torch.softmax(scores, dim=-1), value).transpose(1, 2)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class RepeatedKVAttention(modeling_llama.LlamaAttention):
    """Routes through the interface, but with K/V repeated after cache.update (not the stashed tensors)."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        query, key, value = _projections(self, hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        key = modeling_llama.repeat_kv(key, self.num_key_value_groups)
        value = modeling_llama.repeat_kv(value, self.num_key_value_groups)
        interface = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_llama.eager_attention_forward)
        out, weights = interface(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class OwnMaskAttention(modeling_llama.LlamaAttention):
    """Routes the cache's K/V through the interface, but with a mask of its own (none at all)."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        query, key, value = _projections(self, hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        interface = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_llama.eager_attention_forward)
        out, weights = interface(self, query, key, value, None, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


@pytest.mark.parametrize("attention, kind, words", [
    (InlineAttention, INLINE, "InlineAttention.forward writes the cache"),
    (RepeatedKVAttention, KV_CHANGED, "reassigns key/value after cache.update"),
    (OwnMaskAttention, OWN_MASK, "gives attention None"),
])
def test_negative_control_a_layer_that_breaks_a_rule_refuses_the_model(attention, kind, words):
    """Refused by the kernel route and the engine; generate()'s reference route still pages it."""
    model = build("llama")
    assert model_support.classify_model(model).supported  # the same model, stock layers: accepted
    layer = model.model.layers[1]
    layer.self_attn = attention(model.config, layer_idx=1)
    verdict = model_support.classify_model(model)
    assert verdict.kind == kind and words in verdict.detail, verdict
    assert model_support.kernel_route_problem(model) == verdict
    with pytest.raises(ValueError, match=f"LlamaForCausalLM.*{re.escape(kind)}"):
        hf_paged.LLMEngine(model, block_size=BLOCK_SIZE)
    hf_paged.enable(model)  # the reference route
    hf_paged.disable(model)


# --------------------------------------------------------------- refusals are real (gate bypassed)
def _bart_with_encoder_states():
    model = model_support.build_tiny("bart")
    return model, dict(encoder_hidden_states=torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)))


def _mimo_with_small_value_heads():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = model_support.tiny_config(CONFIG_MAPPING["mimo_v2_flash"]())
    config.v_head_dim = 8  # keys 16 wide, values 8
    assert model_support.head_dim_problem(config) is not None
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval(), {}


@pytest.mark.parametrize("name, make", [
    ("bloom (inline)", lambda: (model_support.build_tiny("bloom"), {})),
    ("jetmoe (K/V repeated after update)", lambda: (model_support.build_tiny("jetmoe"), {})),
    ("diffllama (V split after update)", lambda: (model_support.build_tiny("diffllama"), {})),
    ("doge (its own mask)", lambda: (model_support.build_tiny("doge"), {})),
    ("bart (cross-attention)", _bart_with_encoder_states),
    ("mimo_v2_flash (value heads narrower than key heads)", _mimo_with_small_value_heads),
])
def test_refused_models_really_fail_when_the_gate_is_bypassed(monkeypatch, name, make):
    """On the kernel route (how CUDA runs; here the Triton interpreter), which reads the blocks
    itself. (generate()'s CPU reference route hands the model DynamicCache-shaped K/V from update and
    so would run some of these; the gate is for every route and the engine.)"""
    model, extra = _quietly(make)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids, mask = left_padded([3, 7])
    inputs = dict(input_ids=ids, attention_mask=mask, **extra)
    stock = _generate(model, inputs, paged=False)
    monkeypatch.setattr(model_support, "classify_model", lambda *args, **kwargs: Support(model_support.SUPPORTED))
    monkeypatch.setattr(model_support, "reference_problem", lambda *args, **kwargs: None)
    kernels.set_backend("triton")
    try:
        paged = _generate(model, inputs, paged=True)
    except Exception:  # noqa: BLE001 - failing loudly is one of the two outcomes expected
        return
    finally:
        kernels.set_backend("auto")
    assert not torch.equal(paged, stock), f"{name}: refused, yet the paged output equals stock"


@pytest.mark.parametrize("model_type", [
    "jetmoe",  # K/V repeated after cache.update: the attention function never sees the stashed K/V
    "moshi",  # sliding layers, full causal masks: stock attends the whole prompt at prefill
])
def test_refused_models_really_differ_in_the_engine_when_the_gate_is_bypassed(monkeypatch, model_type):
    model = _quietly(model_support.build_tiny, model_type)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids, mask = left_padded(PROMPT_LENGTHS)
    inputs = dict(input_ids=ids, attention_mask=mask)
    stock = _stock_tokens(model, inputs)
    monkeypatch.setattr(model_support, "classify_model", lambda *args, **kwargs: Support(model_support.SUPPORTED))
    assert _engine_tokens(model, inputs) != stock


# ----------------------------------------------------------------------------- a composite model
@pytest.mark.parametrize("images, beams", [(False, 1), (False, 2), (True, 1), (True, 2)])
def test_composite_gemma3_with_a_vision_tower_generates_like_stock(images, beams):
    model = build_gemma3_vision()
    model.generation_config.eos_token_id = None
    assert model_support.classify_model(model).supported
    inputs = image_prompts([5, 9, 12], images=images)
    stock = _generate(model, inputs, paged=False, num_beams=beams)
    assert torch.equal(_generate(model, image_prompts([5, 9, 12], images=images), paged=True, num_beams=beams), stock)
    if images:  # the image really steers the text: other pixels, other tokens
        other = dict(inputs, pixel_values=torch.randn_like(inputs["pixel_values"]) * 3)
        assert not torch.equal(_generate(model, other, paged=False, num_beams=beams), stock)
