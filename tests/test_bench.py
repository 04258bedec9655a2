"""The benchmark harness itself (hf_paged.bench): workloads, the memory figures, the simulated clock
and batching policies, and a whole quick run. No timing is asserted here; speed is measured by
``python -m hf_paged bench`` (results in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged.bench import memory, systems, workloads
from hf_paged.bench.suite import run, sustainable_rates
from hf_paged.bench.workloads import Request, Workload
from tests.helpers.tiny_models import build


@pytest.fixture(scope="module")
def model():
    return build("llama").eval()


def test_workloads_follow_the_paper_means_and_are_reproducible():
    for kind, (mean_in, mean_out) in workloads.PAPER_MEANS.items():
        w = workloads.dataset(kind, 4000, scale=1.0, max_len=100_000, seed=3)
        assert abs(w.mean_prompt / mean_in - 1) < 0.06, (kind, w.mean_prompt)
        assert abs(w.mean_output / mean_out - 1) < 0.06, (kind, w.mean_output)
    a = workloads.dataset("sharegpt", 20, scale=0.25, vocab=96)
    b = workloads.dataset("sharegpt", 20, scale=0.25, vocab=96)
    c = workloads.dataset("sharegpt", 20, scale=0.25, vocab=96, seed=1)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert all(3 <= t < 96 for r in a.requests for t in r.prompt)
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        workloads.dataset("nope", 1)


def test_shared_prefix_and_sampling_variants():
    w = workloads.shared_prefix(6, 5, shot_len=10, vocab=96)
    prefix = w.requests[0].prompt[:50]
    assert all(r.prompt[:50] == prefix and len(r.prompt) > 50 for r in w.requests)
    beams = workloads.with_sampling(w, num_beams=4)
    assert [r.num_beams for r in beams.requests] == [4] * 6 and beams.requests[0].prompt == w.requests[0].prompt


def test_poisson_arrivals_have_the_requested_rate():
    base = workloads.dataset("alpaca", 4000, vocab=96)
    online = workloads.poisson(base, rate=4.0)
    arrivals = [r.arrival for r in online.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert abs(arrivals[-1] / len(arrivals) - 0.25) < 0.25 * 0.05
    assert [r.prompt for r in online.requests] == [r.prompt for r in base.requests]


def test_kv_utilization_by_hand():
    w = Workload("hand", [Request([5] * 4, 6), Request([5] * 10, 7)])  # final lengths 10 and 17
    u = memory.kv_utilization(w, max_len=32)
    assert u["contiguous, reserve max length"] == 27 / 64
    assert u["contiguous, reserve next power of two"] == 27 / (16 + 32)
    assert u["contiguous, reserve exact final length (oracle)"] == 1.0
    assert u["paged, block size 8"] == 27 / (16 + 24)
    assert u["paged, block size 16"] == 27 / (16 + 32)
    assert u["paged, block size 32"] == 27 / 64


def test_sharing_savings_are_zero_without_sharing_and_large_for_beams(model):
    small = workloads.dataset("alpaca", 3, scale=0.5, vocab=96)
    none = memory.sharing_savings(model, small)
    assert none["saving"] == 0.0 and none["blocks_with_sharing"] == none["blocks_without_sharing"] > 0
    n4 = memory.sharing_savings(model, workloads.with_sampling(small, n=4))
    beams = memory.sharing_savings(model, workloads.with_sampling(small, num_beams=4))
    assert 0 < n4["saving"] < beams["saving"] < 1


def test_static_batching_starts_with_what_has_arrived(model):
    """Two requests at t=0 and one at t=1000 s: the first batch must not wait for the third."""
    reqs = [Request([7, 8, 9], 5, 0.0), Request([10, 11], 4, 0.0), Request([12, 13, 14, 15], 6, 1000.0)]
    w = Workload("gaps", reqs)
    padded = systems.batched_generate(model, w, batch_size=8, paged=False)
    engine = systems.engine_run(model, w, block_size=4, num_blocks=64)
    for result in (padded, engine):
        assert all(lat < 100 for lat in result.latency), result.latency  # nobody waited for a later arrival
        assert all(0 < t <= lat for t, lat in zip(result.ttft, result.latency))
    assert [len(t) for t in padded.tokens] == [5, 4, 6]
    assert engine.tokens == padded.tokens  # greedy: the engine reproduces stock generate


def test_online_workload_waits_for_arrivals(model):
    reqs = [Request([7, 8, 9], 3, 0.0), Request([10, 11], 3, 50.0)]
    result = systems.engine_run(model, Workload("late", reqs), block_size=4, num_blocks=64)
    assert result.wall_s >= 50.0  # the simulated clock jumped to the second arrival
    assert result.summary(Workload("late", reqs))["requests_per_s"] <= 2 / 50


def test_sustainable_rate_is_the_last_rate_before_the_curve_turns_up():
    def row(rate, padded, engine):
        return {"rate": rate, "padded_generate": {"normalized_latency_s_per_token": padded},
                "engine": {"normalized_latency_s_per_token": engine}}

    rows = [row(1, 0.10, 0.010), row(2, 0.15, 0.011), row(4, 0.50, 0.012), row(8, 0.15, 0.030)]
    assert sustainable_rates(rows) == {"padded_generate": 2, "engine": 4}
    assert sustainable_rates([]) == {}


def test_quick_run_writes_results(model, tmp_path):
    """Every section but the tensor-parallel one (tests/test_tensor_parallel.py starts ranks), which
    is recorded as skipped; none fails."""
    results = run(model, num_requests=6, scale=0.05, batch_size=4, out_dir=tmp_path, block_size=8, num_blocks=256,
                  quick=True, repeats=2, log=lambda *a: None, generate_new_tokens=3, skip=("tensor_parallel",))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["sections_not_run"] == {"tensor_parallel": {"skipped": "not asked for (skip)"}}
    serving = saved["serving"]
    assert serving["token_mismatches_server_vs_engine"] == 0 and serving["server_vs_engine_throughput"] > 0
    offline = saved["sharegpt_offline"]
    assert set(offline["systems"]) == {"padded_generate", "paged_generate", "transformers_cb", "engine"}
    assert offline["greedy_mismatches_vs_padded_generate"] == {
        "padded_generate": 0, "paged_generate": 0, "transformers_cb": 0, "engine": 0}
    assert all(v > 0 for v in offline["throughput_vs_padded_generate"].values())
    assert all(len(s["tokens_per_s_all_runs"]) == 2 for s in offline["systems"].values())
    assert offline["systems"]["transformers_cb"]["max_running"] is None
    assert [v["decoding"] for v in saved["decoding_variants"]] == [
        "parallel sampling n=2", "parallel sampling n=4", "parallel sampling n=6",
        "beam search width 2", "beam search width 4", "beam search width 6"]
    assert len(offline["engine_vs_padded_generate_per_round"]) == 2
    assert saved["kv_utilization"]["paged, block size 16"] > 0.95
    assert results["shared_prefix"][1]["computed_prompt_tokens_saved"] > 0
    flag_vs_stock = saved["generate_flag_vs_stock"]
    assert len(flag_vs_stock) == 5 and all(r["sequences_identical"] for r in flag_vs_stock.values())
    assert all(len(r["stock_over_flag_per_round"]) == 2 and r["median"] > 0 for r in flag_vs_stock.values())
    pytest.importorskip("matplotlib")
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_an_unknown_section_to_skip_is_named_before_anything_runs(model, tmp_path):
    with pytest.raises(ValueError, match=r"unknown sections to skip \['servers'\]: the sections are .*'serving'"):
        run(model, out_dir=tmp_path, skip=("servers",))
    assert not (tmp_path / "bench.json").exists()


def test_transformers_cb_online_is_fed_in_real_time(model):
    reqs = [Request([7, 8, 9], 4, 0.0), Request([10, 11], 3, 0.6)]
    w = Workload("cb online", reqs)
    result = systems.transformers_cb(model, w, num_blocks=64, max_batch_tokens=64)
    assert result.wall_s >= 0.6  # the second request was added at its arrival, not before
    assert result.tokens == systems.batched_generate(model, w, batch_size=8, paged=False).tokens
    assert len(result.ttft) == 2 and all(0 < t <= lat < 30 for t, lat in zip(result.ttft, result.latency))


def test_beam_search_and_parallel_sampling_runs(model):
    """The decoding variants: beam search equals stock beam search; sampling returns every request."""
    base = Workload("equal lengths", [Request([7 + i, 8, 9, 10 + i], 6) for i in range(3)])
    beams = workloads.with_sampling(base, num_beams=3)
    padded = systems.batched_generate(model, beams, batch_size=8, paged=False)
    engine = systems.engine_run(model, beams, block_size=4, num_blocks=128)
    assert padded.tokens == engine.tokens and all(len(t) == 6 for t in padded.tokens)
    assert padded.latency == [] and padded.summary(beams)["requests_per_s"] > 0
    sampled = workloads.with_sampling(base, n=3)
    for result in (systems.batched_generate(model, sampled, batch_size=8, paged=False),
                   systems.engine_run(model, sampled, block_size=4, num_blocks=128)):
        assert [len(t) for t in result.tokens] == [6, 6, 6]
        summary = result.summary(sampled)
        assert summary["tpot_s_p50"] > 0 and summary["normalized_latency_s_p99"] >= summary["normalized_latency_s_p50"]


def test_decode_step_times_both_sides_and_profiles_where_their_host_time_goes():
    from hf_paged import LLMEngine
    from hf_paged.bench import decode_step

    result = decode_step.run(num_seqs=4, steps=2, rounds=1, shape="tiny", profile=2, log=lambda *_: None)
    assert result["engine_step_ms"] > 0 and result["plain_forward_ms"] > 0 and result["ratio"] > 0
    for side in ("profile_engine", "profile_plain"):  # no device on the CPU: nothing launched, synced or copied
        prof = result[side]
        assert prof["steps"] == 2
        assert prof["launches_per_step"] == prof["syncs_per_step"] == prof["copies_per_step"] == 0
        assert 0 < len(prof["host_ops"]) <= 15
    assert "busiest operators" in decode_step.profile_report(result)

    # every operator, per step: the engine (eager here, HF_PAGED_COMPILE=0) writes each layer's new K and V
    # into its pools (index_copy_) and reads them with the C read, no SDPA; the plain forward grows its
    # DynamicCache by concatenation (K and V of each layer) and reads it through SDPA
    model = decode_step.bench_model("tiny", torch.device("cpu"), torch.float32)
    layers = model.config.num_hidden_layers
    prompts = decode_step.random_prompts(4, 16, 40, model.config.vocab_size)

    def calls(step) -> dict[str, float]:
        ops = decode_step.profile_steps(step, 2, model.device, top=1000)["host_ops"]
        return {op["name"]: op["calls_per_step"] for op in ops}

    c_read = LLMEngine(model, block_size=16)
    c_read.runner.decode_read = "c"  # the default read on x86 CPUs with AVX2 or AVX-512
    with decode_step.engine_decoding(c_read, prompts, 2) as step:
        engine = calls(step)
    with decode_step.plain_decoding(model, prompts) as forward:
        plain = calls(forward)
    assert engine["aten::index_copy_"] == 2 * layers and not any("scaled_dot_product" in name for name in engine)
    assert plain["aten::cat"] >= 2 * layers and plain["aten::scaled_dot_product_attention"] == layers
    assert "aten::index_copy_" not in plain
    # --temperature: the engine's requests draw their tokens (the batched sampler's CDF search), greedy ones do not
    with decode_step.engine_decoding(LLMEngine(model, block_size=16), prompts, 2, {"temperature": 0.8}) as step:
        sampled = calls(step)
    assert sampled["aten::searchsorted"] == 2 and "aten::searchsorted" not in engine
