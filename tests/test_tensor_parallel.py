"""Tensor parallelism over torch.distributed (gloo, 2 CPU processes started here with a deadline):
rank 0 decides and broadcasts each step, every rank computes it; outputs equal one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine.tensor_parallel import check_kv_heads
from tests.helpers import tp_worker
from tests.helpers.tiny_models import VOCAB, build, transformers_at_least

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 420


def _run_ranks(tmp_path: Path, nproc: int = 2) -> dict:
    """Start the ranks in their own process group; kill the whole group past the deadline (no orphans)."""
    good, bad = tmp_path / "llama", tmp_path / "three_kv_heads"
    build("llama").save_pretrained(good)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=3)
    transformers.LlamaForCausalLM(config).save_pretrained(bad)
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "tests/helpers/tp_worker.py"), str(good), str(bad), str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish within {DEADLINE_S}s:\n{log[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-4000:]
    report = json.loads(out.read_text())
    report["fault"] = [json.loads((tmp_path / f"fault-rank{rank}.json").read_text()) for rank in range(nproc)]
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _run_ranks(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def single() -> dict:
    """The same requests in one process."""
    model = build("llama")
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True)
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    tiny = {mode: ids(LLMEngine(model, block_size=4, num_blocks=tp_worker.TINY_BUDGET, max_num_seqs=4,
                                preemption_mode=mode).generate(tp_worker.TINY_PROMPTS, greedy, use_tqdm=False))
            for mode in ("recompute", "swap")}
    prompt = torch.tensor([tp_worker.PROMPTS[1]])
    flagged = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    from hf_paged.demo import byte_tokenizer

    constrained = LLMEngine(model, byte_tokenizer(), block_size=4, num_blocks=64)
    return {"greedy": ids(engine.generate(tp_worker.PROMPTS, greedy, use_tqdm=False)),
            "constrained": ids(constrained.generate(tp_worker.PROMPTS[:3], tp_worker.constrained_requests(),
                                                    use_tqdm=False)),
            "sampled": ids(engine.generate(tp_worker.PROMPTS[:2], sampled, use_tqdm=False)),
            "tiny": tiny, "generate": flagged}


def test_engine_greedy_and_seeded_sampling_equal_one_process(report, single):
    assert report["world_size"] == 2
    assert report["greedy"] == single["greedy"]
    assert report["sampled"] == single["sampled"]
    follower = report["ranks"][1]
    assert follower["greedy"] == report["greedy"] and follower["sampled"] == report["sampled"]  # rank 0's outputs


def test_speculative_decoding_equals_one_process(report, single):
    """Drafts travel in the step rank 0 broadcasts; every rank rolls its blocks back alike."""
    assert report["drafted"] == [single["greedy"], single["sampled"]]
    assert report["draft_tokens"] > 0


def test_structured_outputs_and_logit_bias_equal_one_process(report, single):
    """Rank 0 masks and samples; the other ranks only compute: the tokens are one process's."""
    import re

    from hf_paged.demo import byte_tokenizer

    assert report["constrained"] == single["constrained"]
    tokenizer = byte_tokenizer()
    for completion in report["constrained"][0] + report["constrained"][1]:
        assert re.fullmatch(tp_worker.CONSTRAINED_REGEX, tokenizer.decode(completion, skip_special_tokens=True))
    assert report["constrained"][2] == [[40] * 4]


def test_requests_arriving_online_at_rank_0_only(report, single):
    assert report["online"] == {"a": single["greedy"][0][0], "b": single["greedy"][1][0]}
    assert report["blocks_used_after"] == 0
    assert "rank 0" in report["ranks"][1]["follower_refuses_requests"]


def test_preemption_under_a_tiny_budget(report, single):
    for mode in ("recompute", "swap"):
        assert report["tiny_budget"][mode]["preemptions"] > 0, mode
        assert report["tiny_budget"][mode]["tokens"] == single["tiny"][mode], mode


def test_each_rank_holds_its_own_heads(report):
    assert report["stats"] == {"tensor_parallel_size": 2, "kv_heads_per_rank": 1}
    for rank in report["ranks"]:
        assert rank["pools"] and all(shape[2] == 1 for shape in rank["pools"].values()), rank["pools"]  # 2 KV heads / 2


def test_prefix_cache_snapshots_one_file_per_rank(report):
    """Saved and loaded under tensor parallelism (each rank its own heads' file), the loaded prefix
    is hit and the tokens equal one process; a damaged file of rank 1 is refused on every rank and
    nothing is loaded."""
    model = build("llama")
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in
            LLMEngine(model, block_size=4, num_blocks=64).generate([list(range(50, 66)) + [11, 12]], greedy,
                                                                    use_tqdm=False)]
    for rank in report["ranks"]:
        assert rank["snapshot_saved"] >= 4 and rank["snapshot_loaded"] >= 4
        assert rank["snapshot_tokens"] == want
        assert "rank 1" in rank["snapshot_refused"] and "damaged" in rank["snapshot_refused"]
    assert report["snapshot_hits"] >= 16
    assert report["blocks_cached_after_refusal"] == 0


def test_a_derived_kv_budget_is_agreed_across_ranks(report):
    """Rank 0 was given 64 KiB, rank 1 128 KiB: both size their pools for 64 KiB of their own heads
    (1 KV head x 16 dims x 2 layers x K and V x 4 bytes x block size 4 = 1 KiB per block)."""
    sizes = [rank["agreed_pool_sizes"] for rank in report["ranks"]]
    assert sizes[0] == sizes[1] == [64], sizes


def test_the_flag_in_generate_under_tensor_parallelism(report, single):
    assert report["generate_flag"] == single["generate"]
    assert report["ranks"][1]["generate_flag"] == single["generate"]


def test_a_fault_in_rank_1_stops_every_rank_without_a_hang(report):
    """Rank 1's forward raises (tp_worker.fault_in_rank_1): it stops the group and leaves
    run_worker with an error naming the cause; rank 0, blocked in the forward's all-reduce, fails
    every request within seconds, is unhealthy and refuses more work; both processes exit (the
    ranks' run ended with status 0 within the deadline)."""
    rank0, rank1 = report["fault"]
    assert "injected fault in rank 1's forward" in rank1["error"] and "group is stopped" in rank1["error"]
    assert rank0["finished"] and all(kind == "fault" and "tensor-parallel" in error
                                     for error, kind in rank0["finished"].values()), rank0["finished"]
    assert sorted(rank0["finished"]) == ["0", "1", "2"]  # every request came back, failed
    assert rank0["healthy"] is False and rank0["stats_healthy"] is False
    for what in ("add_request", "step"):
        assert "stopped" in rank0[f"refused_{what}"], rank0
    assert rank0["seconds"] < 30 and rank1["seconds"] < 30, (rank0["seconds"], rank1["seconds"])


def test_heads_that_do_not_divide_are_refused(report):
    for rank in report["ranks"]:
        assert "num_key_value_heads=3" in rank["bad_heads_error"] and "size 2" in rank["bad_heads_error"]
    model = build("llama")
    model._tp_size = 3  # as a tp_plan load over 3 ranks marks it (read through model.tp_size): 2 KV heads do not split
    with pytest.raises(ValueError, match="does not divide"):
        LLMEngine(model)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_kv_heads(model.config, 4)


@pytest.mark.skipif(not transformers_at_least("5.24"),
                    reason="transformers before 5.24 cannot split an LM head of 259 rows (the demo's vocabulary) "
                           "over 2 ranks; the server says so and exits")
def test_the_server_with_two_ranks_answers_like_one_process():
    """``hf-paged serve --tensor-parallel-size 2`` starts both ranks itself; the openai client gets
    what the single-process engine gives; SIGTERM stops every rank."""
    import openai

    from hf_paged.demo import byte_tokenizer, demo_model
    from tests.helpers.serving import free_port, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--tensor-parallel-size", "2", "--port", str(port),
           "--num-blocks", "256", "--served-model-name", "demo"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until_healthy(proc, port, timeout=180, poll=0.3)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as client:
            got = [client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
                   for prompt in ("Paged attention", "Once upon a time, ")]
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, log[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    engine = LLMEngine(demo_model(), byte_tokenizer(), num_blocks=256)
    want = [out.outputs[0].text for out in engine.generate(["Paged attention", "Once upon a time, "],
                                                           SamplingParams(max_new_tokens=12, temperature=0),
                                                           use_tqdm=False)]
    assert got == want
    assert subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True).returncode == 1, "a rank is left"


LIFECYCLE_DEADLINE_S = 90
STARTUP_WAIT_S = 1


def _lifecycle_rank(checkpoint: str, out: str) -> None:
    """One rank of the lifecycle tests (started by :func:`_lifecycle_ranks`, not torchrun: its agent would
    stop the others when one fails, hiding a hang). It writes what it saw to ``lifecycle-rank<R>.json`` as it
    goes. 1: joining a group whose other rank never comes (it died before joining) fails within seconds.
    2: the real group's timeout is the serving one. 3: rank 0 drops engine A unclosed and builds B; rank 1,
    in A's run_worker, follows into B. 4: rank 0 exits without closing B; rank 1 leaves B's run_worker."""
    import time

    import torch.distributed as dist

    from hf_paged.engine import tensor_parallel

    rank = int(os.environ["RANK"])
    seen: dict = {}
    path = Path(out) / f"lifecycle-rank{rank}.json"

    def note(**values) -> None:
        seen.update(values)
        path.write_text(json.dumps(seen))

    real_port = os.environ["MASTER_PORT"]
    os.environ.update(MASTER_PORT=os.environ[f"DEAD_PEER_PORT_{rank}"],
                      HF_PAGED_TP_STARTUP_TIMEOUT_S=str(STARTUP_WAIT_S))
    start = time.monotonic()
    try:
        tensor_parallel.init_from_env()
    except RuntimeError as err:
        note(startup_error=str(err))
    note(startup_s=time.monotonic() - start)
    os.environ.update(MASTER_PORT=real_port, HF_PAGED_TP_STARTUP_TIMEOUT_S="60")
    model = tensor_parallel.load_model(checkpoint)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    note(group_timeout_s=backend.options._timeout.total_seconds())

    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    first = LLMEngine(model, block_size=4, num_blocks=32)
    if rank == 0:
        tokens = []
        for engine in (first, None):  # the first one is never closed
            engine = engine or LLMEngine(model, block_size=4, num_blocks=32)
            engine.add_request(tp_worker.PROMPTS[0], greedy, request_id="r")
            while engine.has_unfinished_requests():
                tokens += [out.outputs[0].token_ids for out in engine.step() if out.finished]
        try:
            first.step()
        except RuntimeError as err:
            note(first_refused=str(err))
        note(tokens=tokens, exiting=True)  # and exits with the second engine open
    else:
        first.run_worker()
        note(left_first=True)
        second = LLMEngine(model, block_size=4, num_blocks=32)
        second.run_worker()
        note(left_second=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory) -> dict:
    """Two ranks started directly, each in a session of its own; past the deadline every one is killed,
    and every one is reaped."""
    import time

    tmp = tmp_path_factory.mktemp("tp_lifecycle")
    build("llama").save_pretrained(tmp / "llama")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "DEAD_PEER_PORT_0": str(_free_port()), "DEAD_PEER_PORT_1": str(_free_port())}
    code = (f"from tests.test_tensor_parallel import _lifecycle_rank; "
            f"_lifecycle_rank({str(tmp / 'llama')!r}, {str(tmp)!r})")
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(2)]
    deadline, logs = time.monotonic() + LIFECYCLE_DEADLINE_S, []
    try:
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
            except subprocess.TimeoutExpired:
                logs.append(f"(killed at the {LIFECYCLE_DEADLINE_S} s deadline)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    seen = [json.loads(p.read_text()) if (p := tmp / f"lifecycle-rank{r}.json").exists() else {} for r in range(2)]
    return {"codes": [proc.returncode for proc in procs], "logs": [log[-3000:] for log in logs], "ranks": seen}


def test_startup_fails_within_seconds_when_a_rank_never_joins(lifecycle):
    """A group whose other rank died before joining: rank 0 (which hosts the rendezvous) and rank 1 (a
    client of a rank 0 that is gone) fail after the startup wait, naming it, not the serving timeout's 7
    days. Then the real group's collectives wait the serving timeout (an idle server's followers)."""
    for rank, seen in enumerate(lifecycle["ranks"]):
        assert "did not all join within 1 s" in seen.get("startup_error", ""), (seen, lifecycle["logs"][rank])
        assert seen["startup_s"] < STARTUP_WAIT_S + 8, seen
        assert seen["group_timeout_s"] == 7 * 24 * 3600, seen


def test_rank_0_dropping_an_engine_unclosed_and_building_another(lifecycle):
    """Rank 1, in the first engine's run_worker, leaves it when rank 0 builds the second, and follows that
    one: both give one process's tokens; rank 0 refuses the first engine (its followers have left)."""
    rank0, rank1 = lifecycle["ranks"]
    assert rank1.get("left_first"), lifecycle["logs"][1]
    assert len(rank0.get("tokens", [])) == 2 and rank0["tokens"][0] == rank0["tokens"][1], lifecycle["logs"][0]
    assert len(rank0["tokens"][0]) == 4
    assert "closed" in rank0["first_refused"], rank0


def test_rank_0_exiting_without_close_releases_the_others(lifecycle):
    """Rank 0 exits with an engine open: its exit releases rank 1 from run_worker, and every process exits 0
    (rank 1 used to fail with 'lost rank 0'; a rank aborted at times)."""
    assert lifecycle["ranks"][0].get("exiting") and lifecycle["ranks"][1].get("left_second"), lifecycle["logs"]
    assert lifecycle["codes"] == [0, 0], lifecycle["logs"]
