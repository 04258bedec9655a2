"""The accelerator benchmark (hf_paged.bench.on_device) run on CPU in float32, where the engine and
stock generate() must agree token for token: the harness's own check. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from hf_paged.bench import on_device


def test_on_cpu_every_system_runs_and_the_engine_equals_stock(tmp_path):
    args = on_device.parser().parse_args(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny",
                                          "--sizes", "tiny", "--rounds", "2", "--kv-gib", "0.05",
                                          "--systems", "engine,engine_compiled,stock_generate,transformers_cb",
                                          "--out", str(tmp_path)])
    results = on_device.run(args, log=lambda *_: None)

    assert json.loads((tmp_path / "on_device.json").read_text()) == json.loads(json.dumps(results))
    entry = results["models"]["tiny"]
    assert entry["parameters"] > 0
    for name in ("sharegpt", "long_prompts"):
        section = entry["workloads"][name]
        asked = section["workload"]["output_total"]
        for system in on_device.systems_of(args.systems):
            run = section["runs"][system]
            assert "failed" not in run and len(run["tokens_per_s"]) == 2 and run["median_tokens_per_s"] > 0
            assert run["generated_tokens"] == asked and run["all_requested_tokens"]
        assert section["compile_notes"] == {"engine": "off (compile=False)", "engine_compiled": None}
        assert section["cuda_graphs"] == {"engine": False, "engine_compiled": False}
        # float32 on CPU: both engines' greedy tokens are stock generate()'s, request by request
        for engine in ("engine", "engine_compiled"):
            agree = section["agreement_with_stock"][engine]
            assert agree["identical"] == agree["of"] == section["workload"]["requests"]
        assert set(section["engine_vs"]) == {"stock_generate", "transformers_cb"}
        assert set(section["engine_compiled_vs"]) == {"stock_generate", "transformers_cb", "engine"}
        assert len(section["engine_vs"]["stock_generate"]["per_round"]) == 2
    assert "engine / stock_generate" in on_device.report(results)
    assert "engine_compiled / engine" in on_device.report(results)


def test_systems_can_be_chosen_and_an_unknown_one_is_named():
    assert on_device.systems_of("stock_generate, engine_compiled") == ("engine_compiled", "stock_generate")
    with pytest.raises(ValueError, match=r"unknown \['engine_eager'\]"):
        on_device.systems_of("engine_eager,engine")


def test_the_agreement_it_reports_can_fail():
    section = {"runs": {"engine": {"tokens_per_s": [1.0]}, "stock_generate": {"tokens_per_s": [2.0]}}}
    reqs = [{"prompt": [5], "max_tokens": 3}] * 2
    on_device._summarize(section, {"engine": [[1, 2, 3], [4, 5, 6]], "stock_generate": [[1, 2, 3], [4, 9, 6]]}, reqs)
    assert section["agreement_with_stock"]["engine"]["identical"] == 1
    assert section["engine_vs"]["stock_generate"]["median_ratio"] == 0.5
