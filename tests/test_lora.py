"""Multi-LoRA serving in ``LLMEngine`` (``enable_lora=True``, ``add_request(..., lora_request=)``).

Every request's tokens are those of stock ``generate()`` on a stock copy of the weights with its
adapter loaded by peft (``PeftModel``), whichever adapters (or none) share its steps; adapters never
share prefix-cache blocks with the base model or each other; what an adapter holds that the engine
does not run is refused by name; loaded adapters are kept, counted and evicted as vLLM's knobs say.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.lora import LoRARequest, StepLoRA
from tests.helpers.lora_adapters import peft_model, save_adapter, stock_greedy
from tests.helpers.tiny_models import VOCAB, assert_engine_idle, build

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 20, 33, 41], [3, 4, 5], list(range(7, 30)), [60, 61, 62, 63, 64, 65, 66, 67, 68]]


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Three adapters: attention projections (r=4); the MLP and o_proj (r=8, rsLoRA, a per-module
    alpha); and every projection (r=2, only in the first layer, larger updates)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": save_adapter(llama, str(root / "attn"), seed=1, scale=3.0),
        "mlp": save_adapter(llama, str(root / "mlp"), seed=2, r=8, lora_alpha=16, use_rslora=True, scale=3.0,
                            target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                            alpha_pattern={"down_proj": 4}),
        "all": save_adapter(llama, str(root / "all"), seed=3, r=2, lora_alpha=4, layers_to_transform=[0],
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"], scale=6.0),
    }


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, 1 + list(adapters).index(name), adapters[name])


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def mixed_jobs(adapters):
    """Every prompt with every adapter and with none."""
    return [(p, name) for p in PROMPTS for name in [*adapters, None]]


def run_jobs(engine, adapters, jobs, params=GREEDY):
    outs = engine.generate([p for p, _ in jobs], params, use_tqdm=False,
                           lora_request=[lora(adapters, n) if n else None for _, n in jobs])
    assert all(out.error is None for out in outs), [out.error for out in outs]
    return outs


@pytest.fixture(scope="module")
def stock(llama, adapters):
    """Stock generate()'s greedy tokens per (prompt, adapter), with peft."""
    return {(tuple(p), n): stock_greedy(llama, adapters[n] if n else None, p, GREEDY.max_tokens)
            for p, n in mixed_jobs(adapters)}


# ---------------------------------------------------------------- tokens against peft
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_mixed_batch_of_adapters_gives_each_request_peft_generates_tokens(llama, adapters, stock, block_size):
    engine = LLMEngine(llama, block_size=block_size, enable_lora=True, max_loras=3)
    jobs = mixed_jobs(adapters)
    got = tokens(run_jobs(engine, adapters, jobs))
    for (p, name), out in zip(jobs, got):
        assert out == stock[tuple(p), name], (p, name)
    # the adapters matter: each changes the tokens of most prompts
    for name in adapters:
        assert sum(stock[tuple(p), name] != stock[tuple(p), None] for p in PROMPTS) >= 2, name
    assert engine.stats()["loras_loaded"] == 3 and engine.stats()["lora_loads"] == 3
    assert_engine_idle(engine)
    assert not engine.lora._in_use


def test_negative_control_without_the_updates_the_tokens_are_the_base_models(llama, adapters, stock, monkeypatch):
    """The comparison above can fail: with the updates skipped, adapter requests get the base
    model's tokens, which differ from peft's."""
    monkeypatch.setattr(StepLoRA, "apply", lambda self, name, x, out: None)
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=3)
    jobs = [(p, "attn") for p in PROMPTS]
    got = tokens(run_jobs(engine, adapters, jobs))
    assert got == [stock[tuple(p), None] for p in PROMPTS]
    assert got != [stock[tuple(p), "attn"] for p in PROMPTS]
    assert_engine_idle(engine)


def test_seeded_samples_with_adapters_do_not_depend_on_their_batch(llama, adapters):
    """Seeded n=2 samples (with penalties and top-p) of an adapter request are the same alone and
    in a batch of other adapters and base-model requests."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, n=2, seed=7, repetition_penalty=1.2,
                            ignore_eos=True, logprobs=2)
    alone = LLMEngine(llama, block_size=4, enable_lora=True)
    want = run_jobs(alone, adapters, [(PROMPTS[2], "mlp")], params)[0]
    mixed = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=3)
    jobs = [(PROMPTS[0], "attn"), (PROMPTS[2], "mlp"), (PROMPTS[1], None), (PROMPTS[3], "all")]
    got = run_jobs(mixed, adapters, jobs, params)[1]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.token_ids for c in got.outputs][0] != [c.token_ids for c in got.outputs][1]
    for a, b in zip(got.outputs, want.outputs):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    assert_engine_idle(alone)
    assert_engine_idle(mixed)


def test_beam_search_with_an_adapter_equals_peft_generate(llama, adapters):
    engine = LLMEngine(llama, block_size=4, enable_lora=True)
    params = SamplingParams(max_tokens=6, n=2, num_beams=3, ignore_eos=True, temperature=0)
    out = run_jobs(engine, adapters, [(PROMPTS[0], "attn")], params)[0]
    reference = peft_model(llama, adapters["attn"])
    with torch.no_grad():
        want = reference.generate(input_ids=torch.tensor([PROMPTS[0]]), num_beams=3, num_return_sequences=2,
                                  max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  length_penalty=1.0, early_stopping=False)
    assert [list(c.token_ids) for c in out.outputs] == [row[len(PROMPTS[0]):].tolist() for row in want]
    assert_engine_idle(engine)


def test_speculative_drafts_keep_an_adapters_tokens(llama, adapters, stock):
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=3,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                           "prompt_lookup_min": 1})
    jobs = mixed_jobs(adapters)
    for (p, name), out in zip(jobs, tokens(run_jobs(engine, adapters, jobs))):
        assert out == stock[tuple(p), name], (p, name)
    assert engine.stats()["spec_draft_tokens"] > 0
    assert_engine_idle(engine)


def test_compiled_steps_apply_adapters_through_the_custom_op(llama, adapters, stock):
    """compile=True: steps with adapters run a body compiled with the adapters' op, steps without
    run the plain one; tokens as peft's either way."""
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=3, compile=True)
    assert engine.stats()["compiled"] and engine.stats()["lora_compiled"]
    jobs = mixed_jobs(adapters)
    for (p, name), out in zip(jobs, tokens(run_jobs(engine, adapters, jobs))):
        assert out == stock[tuple(p), name], (p, name)
    plain = engine.runner.compiled.calls
    run_jobs(engine, adapters, [(PROMPTS[1], None)])
    assert engine.runner.compiled.calls > plain  # a base-model-only step took the plain body
    assert engine.runner.compiled_lora.calls > 2
    assert_engine_idle(engine)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_adapters_beside_layers_run_through_onednn(llama, adapters, stock, monkeypatch, compile):
    """``onednn_layers=True``: every layer's base product goes through oneDNN, the adapters' updates
    added to it (their forwards wrap oneDNN's); tokens as peft's."""
    from hf_paged.engine import cpu_linear

    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)  # the tiny model's products go to oneDNN too
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_ROWS", 1)
    seen, real = [], cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, weight, bias: seen.append(weight) or real(x, weight, bias))
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=3, compile=compile, onednn_layers=True)
    assert engine.stats()["lora_compiled"] is compile
    seen.clear()
    jobs = mixed_jobs(adapters)
    for (p, name), out in zip(jobs, tokens(run_jobs(engine, adapters, jobs))):
        assert out == stock[tuple(p), name], (p, name)
    assert {id(w) for w in seen} == {id(m.weight) for m in engine.runner.layer_linears}, "a layer stayed on sgemm"
    assert_engine_idle(engine)


def test_half_precision_adapters_compute_as_peft_does(adapters):
    """bfloat16 model: the update is computed in float32 and the sum rounded, as peft does."""
    model = build("llama").to(torch.bfloat16)
    engine = LLMEngine(model, block_size=4, enable_lora=True, max_loras=2)
    jobs = [(p, n) for p in PROMPTS for n in ("attn", "mlp")]
    for (p, name), out in zip(jobs, tokens(run_jobs(engine, adapters, jobs))):
        assert out == stock_greedy(model, adapters[name], p, GREEDY.max_tokens), (p, name)
    assert_engine_idle(engine)


def test_gpt2s_conv1d_layers_take_adapters(tmp_path):
    model = build("gpt2")
    path = save_adapter(model, str(tmp_path / "gpt2"), seed=4, target_modules=["c_attn", "c_proj"], scale=4.0,
                        fan_in_fan_out=True)
    engine = LLMEngine(model, block_size=4, enable_lora=True)
    request = LoRARequest("g", 1, path)
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)
    want = [stock_greedy(model, path, p, GREEDY.max_tokens) for p in PROMPTS]
    assert tokens(outs) == want
    assert want != [stock_greedy(model, None, p, GREEDY.max_tokens) for p in PROMPTS]
    assert all(out.lora_request == request for out in outs)
    assert_engine_idle(engine)


# ---------------------------------------------------------------- the prefix cache
def test_adapters_never_share_prefix_blocks_with_the_base_model_or_each_other(llama, adapters):
    prompt = list(range(3, 3 + 41))  # ten full blocks of 4
    want = {n: stock_greedy(llama, adapters[n] if n else None, prompt, 6) for n in (None, "attn", "mlp")}
    engine = LLMEngine(llama, block_size=4, num_blocks=128, enable_lora=True, max_loras=2)  # room: no eviction
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = []
    for name in (None, "attn", "mlp", "attn", None):
        out = run_jobs(engine, adapters, [(prompt, name)], params)[0]
        assert list(out.outputs[0].token_ids) == want[name], name
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 40, 40]  # only the same adapter's (or the base model's) blocks are hits
    assert_engine_idle(engine)


def test_snapshots_leave_adapter_blocks_out(llama, adapters, tmp_path):
    engine = LLMEngine(llama, block_size=4, enable_lora=True)
    run_jobs(engine, adapters, [(list(range(3, 44)), "attn")], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.kv.stats()["blocks_cached"] > 0
    assert engine.save_prefix_cache(tmp_path / "snap") == 0
    run_jobs(engine, adapters, [(list(range(3, 44)), None)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.save_prefix_cache(tmp_path / "snap2") > 0
    assert_engine_idle(engine)


# ---------------------------------------------------------------- max_loras, loading and eviction
def test_max_loras_bounds_the_adapters_of_the_running_requests(llama, adapters, stock):
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=1, max_cpu_loras=3)
    jobs = mixed_jobs(adapters)
    ids = [engine.add_request(p, GREEDY, lora_request=lora(adapters, n) if n else None) for p, n in jobs]
    finished, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        running = {r.lora_int_id for r in engine.scheduler.running if r.lora_int_id}
        most = max(most, len(running))
        assert len(running) <= 1
    for rid, (p, name) in zip(ids, jobs):
        assert finished[rid] == stock[tuple(p), name], (p, name)
    assert most == 1
    assert_engine_idle(engine)


def test_adapters_are_loaded_once_kept_while_used_and_evicted_least_recent_first(llama, adapters):
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=1, max_cpu_loras=2)
    a, m, x = lora(adapters, "attn"), lora(adapters, "mlp"), lora(adapters, "all")
    rid = engine.add_request(PROMPTS[0], GREEDY, lora_request=a)
    engine.add_request(PROMPTS[1], GREEDY, lora_request=a)
    assert engine.list_loras() == {1} and engine.stats()["lora_loads"] == 1
    with pytest.raises(ValueError, match="in use by 2 request"):
        engine.remove_lora(1)
    engine.add_lora(m)
    engine.add_lora(x)  # three loaded, two allowed: the least recent unused one (mlp) goes
    assert engine.list_loras() == {1, 3}
    engine.abort(rid)
    engine.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.pin_lora(3)
    engine.add_lora(m)
    engine.add_lora(a)  # mlp (unpinned, least recent) goes; the pinned one stays
    assert engine.list_loras() == {3, 1}
    assert engine.stats()["lora_loads"] == 5  # attn twice: it was removed
    while engine.has_unfinished_requests():  # the second request's output, which generate() stepped past
        engine.step()
    assert_engine_idle(engine)


def test_a_new_adapter_for_a_waiting_request_is_never_the_one_evicted(llama, adapters, stock):
    """max_cpu_loras=1 with a request of another adapter in flight: loading the second adapter for a
    waiting request must not evict it (only unused adapters go), or its step would find it gone."""
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_loras=1, max_cpu_loras=1)
    jobs = [(PROMPTS[0], "attn"), (PROMPTS[1], "mlp"), (PROMPTS[2], "all")]
    for (p, name), out in zip(jobs, tokens(run_jobs(engine, adapters, jobs))):
        assert out == stock[tuple(p), name], (p, name)
    assert len(engine.list_loras()) == 1  # once none is in use, down to max_cpu_loras
    assert_engine_idle(engine)


def test_an_id_names_one_adapter(llama, adapters):
    engine = LLMEngine(llama, block_size=4, enable_lora=True, max_cpu_loras=2)
    engine.add_lora(LoRARequest("attn", 1, adapters["attn"]))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'attn'"):
        engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("mlp", 1, adapters["mlp"]))
    engine.add_lora(LoRARequest("attn", 1, adapters["mlp"], load_inplace=True))  # retrained: read again
    assert engine.lora.adapters[1].rank == 8
    assert_engine_idle(engine)


def test_weights_read_again_under_an_id_never_meet_blocks_cached_with_the_old_ones(llama, adapters):
    """load_inplace (a retrained adapter), or an id removed and added with another folder: the
    prefix cache keys each load apart, so the new weights recompute the prompt."""
    prompt, params = list(range(3, 44)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = LLMEngine(llama, block_size=4, num_blocks=128, enable_lora=True)
    first = engine.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["attn"]))[0]
    again = engine.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["attn"]))[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 40)
    retrained = LoRARequest("a", 1, adapters["mlp"], load_inplace=True)
    out = engine.generate([prompt], params, use_tqdm=False, lora_request=retrained)[0]
    assert out.num_cached_tokens == 0 and list(out.outputs[0].token_ids) == stock_greedy(llama, adapters["mlp"], prompt, 6)
    engine.remove_lora(1)
    out = engine.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["all"]))[0]
    assert out.num_cached_tokens == 0 and list(out.outputs[0].token_ids) == stock_greedy(llama, adapters["all"], prompt, 6)
    assert_engine_idle(engine)


# ---------------------------------------------------------------- refusals
def write_adapter(path, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", **config}, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def q_proj_pair(rank: int = 2, layer: int = 0, module: str = "self_attn.q_proj", width: int = 64) -> dict:
    key = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{key}.lora_A.weight": torch.randn(rank, width), f"{key}.lora_B.weight": torch.randn(64, rank)}


@pytest.mark.parametrize("config, tensors, named", [
    ({"use_dora": True}, q_proj_pair(), "DoRA"),
    ({"modules_to_save": ["lm_head"]}, q_proj_pair(), "modules_to_save"),
    ({"bias": "all"}, q_proj_pair(), "bias='all'"),
    ({"peft_type": "IA3"}, q_proj_pair(), "is a IA3 adapter"),
    ({"target_parameters": ["experts.gate_up_proj"]}, q_proj_pair(), "target_parameters"),
    ({"r": 32}, q_proj_pair(32), "rank 32 .* greater than max_lora_rank 16"),
    ({}, q_proj_pair(layer=7), "targets 'model.layers.7.self_attn.q_proj', which LlamaForCausalLM does not have"),
    ({}, q_proj_pair(module="input_layernorm"), "a LlamaRMSNorm; only linear layers"),
    ({}, {"base_model.model.lm_head.lora_A.weight": torch.randn(2, 64),
          "base_model.model.lm_head.lora_B.weight": torch.randn(VOCAB, 2)}, "LM head"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(2, VOCAB)}, "LoRA on embeddings"),
    ({}, q_proj_pair(width=32), "need A \\(2, 64\\)"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 64)}, "not both"),
])
def test_adapters_the_engine_cannot_run_are_refused_by_name(llama, tmp_path, config, tensors, named):
    path = write_adapter(tmp_path / "bad", config, tensors)
    engine = LLMEngine(llama, block_size=4, enable_lora=True)
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False,
                           lora_request=[LoRARequest("bad", 1, path), None])
    assert outs[0].error is not None and outs[0].error_kind == "rejected"
    assert re.search(named, outs[0].error), outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == GREEDY.max_tokens  # the other is served
    assert engine.list_loras() == set()
    assert_engine_idle(engine)


def test_bad_requests_and_options_are_refused_by_name(llama, adapters, tmp_path):
    plain = LLMEngine(llama, block_size=4)
    with pytest.raises(ValueError, match="LoRA is not enabled: start the engine with enable_lora=True"):
        plain.add_request(PROMPTS[0], GREEDY, lora_request=lora(adapters, "attn"))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_lora(lora(adapters, "attn"))
    engine = LLMEngine(llama, block_size=4, enable_lora=True)
    for bad, named in ((LoRARequest("x", 1, str(tmp_path / "missing")), "is not a folder"),
                       (LoRARequest("x", 1, str(tmp_path)), "has no adapter_config.json"),
                       ("attn", "lora_request must be a LoRARequest")):
        with pytest.raises(ValueError, match=named):
            engine.add_request(PROMPTS[0], GREEDY, lora_request=bad)
    for kwargs, named in ((dict(lora_name="", lora_int_id=1, lora_path="p"), "lora_name"),
                          (dict(lora_name="a", lora_int_id=0, lora_path="p"), "lora_int_id must be an int >= 1"),
                          (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path")):
        with pytest.raises(ValueError, match=named):
            LoRARequest(**kwargs)
    for kwargs, named in ((dict(max_loras=0), "max_loras must be an int >= 1"),
                          (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras \\(1\\) must be >= max_loras \\(2\\)"),
                          (dict(max_lora_rank=1.5), "max_lora_rank")):
        with pytest.raises(ValueError, match=named):
            LLMEngine(llama, block_size=4, enable_lora=True, **kwargs)
    assert_engine_idle(engine)


def test_llm_takes_vllms_lora_request(llama, adapters, stock):
    llm = LLM(llama, enable_lora=True, max_loras=2)
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=lora(adapters, "attn"))
    assert tokens(outs) == [stock[tuple(p), "attn"] for p in PROMPTS[:2]]
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, lora(adapters, "mlp")])
    assert tokens(outs) == [stock[tuple(PROMPTS[0]), None], stock[tuple(PROMPTS[1]), "mlp"]]
    with pytest.raises(ValueError, match="prompt 0: .*is not a folder"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, "/nonexistent"))
    assert_engine_idle(llm.llm_engine)



def test_async_llm_takes_a_lora_request(llama, adapters, stock):
    import asyncio

    from hf_paged import AsyncLLM

    async def main():
        llm = AsyncLLM(llama, block_size=4, enable_lora=True, max_loras=2)
        try:
            async def one(prompt, name):
                out = None
                async for out in llm.generate(prompt, GREEDY, lora_request=lora(adapters, name) if name else None):
                    pass
                return list(out.outputs[0].token_ids), out.lora_request
            got = await asyncio.gather(*(one(p, n) for p in PROMPTS[:2] for n in ("attn", "mlp", None)))
            await asyncio.sleep(0)
            return got, llm.engine
        finally:
            llm.shutdown()

    got, engine = asyncio.run(main())
    jobs = [(p, n) for p in PROMPTS[:2] for n in ("attn", "mlp", None)]
    assert [g[0] for g in got] == [stock[tuple(p), n] for p, n in jobs]
    assert [g[1] and g[1].lora_name for g in got] == [n for _, n in jobs]
    assert_engine_idle(engine)
