"""Engine steps through the torch.compile'd decoder body (``hf_paged.engine.compiled_body``, issue 22):
greedy tokens equal to per-request stock generate() on several families, sampling equal to eager
steps, nothing compiled again after the engine is built, the model stock between steps, refusals and
a failed compile named; negative controls for the token comparison and the layer order."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams, state_layers
from hf_paged.engine import compiled_body
from tests.helpers.hybrid_models import build_hybrid
from tests.helpers.tiny_models import build

# lengths that mix decode steps, chunks of many tokens and steps of a single token
PROMPTS = [list(range(3, 3 + n)) for n in (45, 17, 3, 30)] + [[9] * 21, [4]]
MAX_NEW = 14


def _stock(model, prompts=PROMPTS, max_new=MAX_NEW):
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _engine_tokens(engine, prompts=PROMPTS, params=None):
    params = params or SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.kv.num_used_blocks() == 0
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3", "gpt2", "gpt_neox"])
def test_compiled_steps_give_stock_tokens(arch):
    """Families with a sliding window (mistral: 12 tokens), softcap and a window (gemma2), one KV
    head (qwen3), other body layouts (gpt2, gpt_neox: whose read returns a transposed view, which the
    op must hand back in the layout its fake kernel declares); max_num_batched_tokens 16 splits
    prompts in chunks."""
    model = build(arch)
    model.generation_config.eos_token_id = None
    engine = LLMEngine(model, compile=True, max_num_batched_tokens=16)
    assert engine.stats()["compiled"] and engine.compile_note is None
    assert _engine_tokens(engine) == _stock(model)


def _half_precision_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(8)]


@pytest.mark.parametrize("dtype, arch", [(torch.bfloat16, "llama"), (torch.float16, "mistral")],
                         ids=["bfloat16-llama", "float16-mistral"])
def test_half_precision_compiled_steps_give_stock_tokens(dtype, arch):
    """Inductor rounds to the model's dtype after each operation as eager steps do (fused, these two
    matched stock on 2 and 7 of the 8 prompts)."""
    model = build(arch).to(dtype)
    model.generation_config.eos_token_id = None
    engine = LLMEngine(model, compile=True)
    assert engine.stats()["compiled"]
    prompts = _half_precision_prompts()
    assert _engine_tokens(engine, prompts, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)) == \
        _stock(model, prompts, 30)


def test_negative_control_fused_half_precision_steps_give_other_tokens(monkeypatch):
    """Without the casts inductor keeps float32 between operations: the bfloat16 test can fail."""
    fused = {"guard_filter_fn": compiled_body.inductor_options(torch.float32)["guard_filter_fn"]}
    monkeypatch.setattr(compiled_body, "inductor_options", lambda dtype: fused)
    model = build("llama").to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    engine = LLMEngine(model, compile=True)
    prompts = _half_precision_prompts()
    assert _engine_tokens(engine, prompts, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)) != \
        _stock(model, prompts, 30)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_steps_on_the_triton_kernels_give_stock_tokens(arch, triton_launches):
    """The route a GPU's compiled steps take: the custom op reads and writes the blocks through the
    Triton kernels (the interpreter here), inside the compiled body; launches are counted, so a
    fallback to the torch reads fails."""
    model = build(arch)
    model.generation_config.eos_token_id = None
    engine = LLMEngine(model, compile=True, max_num_batched_tokens=16)
    assert engine.stats()["compiled"]
    prompts = PROMPTS[:3]
    assert _engine_tokens(engine, prompts) == _stock(model, prompts)
    layers = model.config.num_hidden_layers
    assert triton_launches["paged_attention_prefill"] >= layers
    assert triton_launches["paged_attention_decode"] >= (MAX_NEW - 1) * layers
    assert engine.runner.compiled.calls > MAX_NEW


def test_off_the_cpu_compiled_steps_are_opt_in(monkeypatch):
    """Off the CPU the default stays eager (not yet measured on a device) and says so; compile=True
    is not refused for the device."""
    monkeypatch.setenv(compiled_body.COMPILE_ENV, "1")
    model = build("llama").to("meta")
    body, note = compiled_body.compiled_body(model, [], lambda *a, **k: None, None)
    assert body is None and note == "off by default on meta (compile=True opts in)"
    assert compiled_body.unsupported(model, []) is None


def test_negative_control_a_cursor_stuck_on_the_first_layer_changes_tokens():
    model = build("llama")
    engine = LLMEngine(model, compile=True)
    attend = engine.runner.compiled.attend
    # every layer reads and writes the first layer's blocks (a cursor that does not move on)
    engine.runner.compiled.attend = lambda step, layer, *args, **kwargs: attend(step, 0, *args, **kwargs)
    assert _engine_tokens(engine) != _stock(model)


def test_negative_control_eager_tokens_of_a_perturbed_copy_differ():
    """The comparison with stock can fail: a copy with one weight changed gives other tokens."""
    model = build("llama")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    engine = LLMEngine(other, compile=True)
    assert _engine_tokens(engine) != _stock(model)


def test_seeded_sampling_equals_eager_steps():
    model = build("llama")
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=20, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]
    compiled = _engine_tokens(LLMEngine(model, compile=True), params=params)
    assert compiled == _engine_tokens(LLMEngine(model, compile=False), params=params)


def test_nothing_compiles_after_the_engine_is_built():
    """Both graphs (many tokens, one token) are compiled by the constructor: steps of every size
    after it, prefills, chunks, a lone decode, run what was compiled."""
    model = build("llama")
    engine = LLMEngine(model, compile=True, max_num_batched_tokens=16)
    with torch.compiler.set_stance("fail_on_recompile"):
        tokens = _engine_tokens(engine)
        tokens += _engine_tokens(engine, [[7, 8, 9]])  # one sequence: steps of one token
    assert len(tokens) == len(PROMPTS) + 1


def test_prompt_sized_steps_split_the_compiled_loops_over_the_threads(monkeypatch):
    """Inductor decides which CPU loops run in parallel from the sizes of the example it compiles
    on, and keeps that for every step the graph serves: the many-token graph, warmed up on
    ``WARM_UP_TOKENS`` tokens, splits every loop (norms, rotary, activations) over the threads, from
    a fresh compile or inductor's on-disk cache alike. (Warmed up on 2 tokens, none: checked.)"""
    from torch._inductor.codecache import PyCodeCache

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: inductor splits no loop")
    loaded, load = [], PyCodeCache.load_by_key_path

    def recording(cls, *args, **kwargs):
        module = load(*args, **kwargs)
        loaded.append(module)
        return module

    monkeypatch.setattr(PyCodeCache, "load_by_key_path", classmethod(recording))
    LLMEngine(build("llama"), compile=True)
    sources = [open(module.__file__).read() for module in loaded if getattr(module, "__file__", None)]
    attention = ("packed_step_attention", "decode_step_attention")  # the Python operator, or the C++ one before it
    many = [src for src in sources if any(op in src for op in attention) and "ks0" in src]  # a dynamic token count
    assert many, "no compiled graph of the engine's many-token steps was loaded"
    for src in many:
        loops, split = src.count("async_compile.cpp_pybinding"), src.count("#pragma omp parallel")
        assert loops and split == loops, f"{split} of the graph's {loops} loop kernels run in parallel"


def test_the_model_is_stock_between_compiled_steps():
    model = build("llama")
    reference = copy.deepcopy(model)
    engine = LLMEngine(model, compile=True)
    _engine_tokens(engine)
    assert "forward" not in vars(model.model)  # the compiled forward is swapped in for steps only
    assert model.config._attn_implementation == reference.config._attn_implementation
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False),
                       reference.generate(ids, max_new_tokens=8, do_sample=False))
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_default_compiles_on_cpu_unless_the_environment_says_0(monkeypatch):
    model = build("llama")
    monkeypatch.setenv(compiled_body.COMPILE_ENV, "1")
    assert LLMEngine(model).stats()["compiled"]
    monkeypatch.setenv(compiled_body.COMPILE_ENV, "0")
    engine = LLMEngine(model)
    assert not engine.stats()["compiled"] and "HF_PAGED_COMPILE=0" in engine.compile_note
    engine = LLMEngine(model, compile=False)
    assert not engine.stats()["compiled"] and "compile=False" in engine.compile_note


@pytest.mark.skipif(not state_layers.STATE_API, reason="transformers lacks the state-layer cache API")
@pytest.mark.parametrize("name, why", [("lfm2", "a layer without K/V"),  # short convolutions beside attention
                                       ("falcon_h1", "recurrent states")])  # Mamba2 beside attention in every layer
def test_models_with_other_layers_stay_eager_and_compile_true_names_why(monkeypatch, name, why):
    model = build_hybrid(name)
    monkeypatch.setenv(compiled_body.COMPILE_ENV, "1")
    engine = LLMEngine(model)
    assert not engine.stats()["compiled"] and why in engine.compile_note
    with pytest.raises(ValueError, match=f"compile=True: compiled steps need plain attention layers.*{why}"):
        LLMEngine(model, compile=True)


def test_a_failed_compile_warns_and_steps_run_eager(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(compiled_body.CompiledBody, "warm_up", lambda self, *args: "BackendCompilerFailed: no")
    monkeypatch.setenv(compiled_body.COMPILE_ENV, "1")
    with pytest.warns(UserWarning, match="steps stay eager, torch.compile failed: BackendCompilerFailed"):
        engine = LLMEngine(model)
    assert not engine.stats()["compiled"]
    assert _engine_tokens(engine) == _stock(model)
    with pytest.raises(RuntimeError, match="compile=True: torch.compile failed"), warnings.catch_warnings():
        LLMEngine(model, compile=True)


def test_a_step_whose_layers_attend_a_wrong_number_of_times_fails_its_requests():
    model = build("llama")
    engine = LLMEngine(model, compile=True)
    engine.runner.compiled.num_layers += 1  # as if a layer had not attended
    out, = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, temperature=0), use_tqdm=False)
    assert out.error_kind == "fault" and "attended 2 times for 3 layers" in out.error
    assert engine.kv.num_used_blocks() == 0
    engine.runner.compiled.num_layers -= 1
    assert _engine_tokens(engine) == _stock(model)


def test_the_compiled_attention_outside_an_engine_step_says_so():
    model = build("llama")
    model.config._attn_implementation = "hf_paged_compiled"
    with pytest.raises(RuntimeError, match="runs only inside an engine's compiled steps"):
        model(torch.tensor([[3, 4, 5]]))


def test_weights_changed_after_the_engine_is_built_are_used():
    """The compiled body drops Dynamo's guards on parameters (``_engine_guards``) but reads them at
    every call: a weight scaled in place and a parameter replaced by another of the same shape are
    used, with nothing compiled again; the change matters (the tokens before it differ). (No prefix
    caching: blocks cached before the change would hold the old weights' keys and values.)"""
    model = build("llama")
    engine = LLMEngine(model, compile=True, enable_prefix_caching=False)
    before = _engine_tokens(engine)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        old = model.model.layers[1].self_attn.o_proj.weight
        model.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(old.flip(0).clone())
    with torch.compiler.set_stance("fail_on_recompile"):
        after = _engine_tokens(engine)
    assert after == _stock(model) and after != before


class _Entry:
    def __init__(self, name, guard_type, value=None):
        self.name, self.guard_type, self.value = name, guard_type, value


def test_the_compiled_body_keeps_guards_on_inputs_buffers_and_global_state_only():
    kept = compiled_body._engine_guards([
        _Entry("input_ids", "TENSOR_MATCH", torch.zeros(1)), _Entry("position_ids", "NONE_MATCH"),
        _Entry("inputs_embeds", "NONE_MATCH"), _Entry("", "GLOBAL_STATE"), _Entry("", "SHAPE_ENV"),
        _Entry("body._buffers['inv_freq']", "TENSOR_MATCH", torch.zeros(1)),
        _Entry("body._parameters['weight']", "TENSOR_MATCH", torch.nn.Parameter(torch.zeros(1))),
        _Entry("body._modules['layers']", "ID_MATCH"), _Entry("G['torch']", "ID_MATCH")])
    assert kept == [True] * 6 + [False] * 3


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_a_one_token_step_runs_a_graph_of_its_own(arch):
    """The many-token graph holds for two tokens or more (Dynamo's shape guards say so, and the
    guard filter keeps them); steps of one token run a graph of their own, compiled with the engine,
    and both give stock's tokens. (With the shape guards dropped, one graph served every step, and
    gemma4's, which checks at run time a size it traced as two or more, failed the one-token
    warm-up: its steps stayed eager.)"""
    from hf_paged import model_support

    if arch == "llama":
        model = build("llama")
    else:  # (model_support.causal_lm_entries() names its class, but takes ~10 s to list them all)
        model = model_support.build_tiny(arch, "Gemma4ForConditionalGeneration", initializer_range=0.3)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None  # as ignore_eos
    engine = LLMEngine(model, compile=True)
    assert engine.stats()["compiled"], engine.compile_note
    body = engine.runner.compiled
    code = body._compiled._torchdynamo_orig_callable.__code__
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 2
    with torch.compiler.set_stance("fail_on_recompile"):
        ours = _engine_tokens(engine) + _engine_tokens(engine, [[7, 8, 9]])  # alone: steps of one token
    assert ours == _stock(model) + _stock(model, [[7, 8, 9]])
