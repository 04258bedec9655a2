"""The benchmarks on a plain install, without the ``bench`` extra (matplotlib, httpx, openai): each
either runs without the missing module (a plot skipped with a note) or refuses up front, naming what
to install and leaving no server behind; the suite skips the section that needs it and still saves
the others' results; a benchmark whose runs all failed exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hf_paged.bench import local_server, optional, serving, suite, systems, vs_vllm
from tests.helpers.tiny_models import build

ROOT = Path(__file__).resolve().parents[1]
INSTALL = 'pip install "hf_paged[bench]"'
# Started by site.py in every process of a run (the servers and load generators the benchmark starts
# too): the modules named in HF_PAGED_TEST_BLOCK do not import, as if they were not installed.
SITECUSTOMIZE = """\
import os, sys
for _name in filter(None, os.environ.get("HF_PAGED_TEST_BLOCK", "").split(",")):
    sys.modules[_name] = None  # import raises ModuleNotFoundError
"""


def _marked(marker: str) -> list[int]:
    """The live processes whose environment holds ``marker`` (a run's processes and their children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def _kill_server_children() -> list[int]:
    """Kill this process's ``hf_paged serve`` children (what a failed start would leave); their ids."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid():
                continue
            if b"hf_paged\0serve" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
                os.kill(int(proc.name), signal.SIGKILL)
                os.waitpid(int(proc.name), 0)
        except (OSError, ChildProcessError):
            pass
    return found


def _run_without(tmp_path: Path, blocked: str, module: str, *args: str, timeout: float = 300):
    """``python -m module args`` with ``blocked`` (comma-separated) unimportable in it and in every
    process it starts; returns the completed run after checking none of its processes outlived it."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = f"HF_PAGED_TEST_RUN_{uuid.uuid4().hex}"
    env = {**os.environ, "HF_PAGED_TEST_BLOCK": blocked, marker: "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)
    time.sleep(0.5)  # a server told to stop as its parent exits
    left = _marked(marker)
    for pid in left:  # clean up before failing
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}\n{done.stdout}\n{done.stderr}"
    return done


def test_the_blocking_works(tmp_path):
    done = _run_without(tmp_path, "httpx,matplotlib", "json.tool", "--help")  # any module, to check the setup
    assert done.returncode == 0
    check = subprocess.run([sys.executable, "-c", "import httpx"], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "HF_PAGED_TEST_BLOCK": "httpx",
                                "PYTHONPATH": str(tmp_path / "site")})
    assert check.returncode == 1 and "ModuleNotFoundError" in check.stderr


def test_kv_bytes_without_matplotlib_saves_its_json_and_skips_the_plot(tmp_path):
    done = _run_without(tmp_path, "matplotlib", "hf_paged.bench.kv_bytes", "--lengths", "24", "--out", "out")
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "out" / "kv_bytes_vs_context.json").read_text())
    assert results["models"] and all(rows[0]["context"] == 24 for rows in results["models"].values())
    assert "matplotlib not installed" in done.stdout and INSTALL in done.stdout
    assert not (tmp_path / "out" / "kv_bytes_vs_context.png").exists()


def test_serving_without_httpx_refuses_up_front_and_starts_no_server(tmp_path):
    start = time.monotonic()
    done = _run_without(tmp_path, "httpx", "hf_paged.bench.serving", "--num-requests", "2", "--rounds", "1",
                        "--concurrency", "2", "--out", "out")
    assert done.returncode != 0
    assert "httpx" in done.stderr and INSTALL in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - start < 60  # before the engine is built


def test_the_server_process_is_stopped_when_its_start_fails(monkeypatch):
    """Anything failing between starting ``hf-paged serve`` and ``__enter__`` returning (here Ctrl-C
    while waiting for /health) stops the server again."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local_server.urllib.request, "urlopen", interrupted)
    server = serving.ServerProcess(threads=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            with server:
                pass
        assert server.proc is not None and server.proc.poll() is not None
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_a_server_that_fails_to_start_is_killed_at_once(monkeypatch):
    """A start that fails has nothing to drain: the group is killed, not sent SIGINT and waited for
    (a SIGINT that reaches the child between fork and exec is lost: the suite once waited out the
    30-second stop timeout there). The child here ignores SIGINT altogether."""
    def interrupted(*args, **kwargs):
        time.sleep(0.5)  # the shell has set its trap
        raise KeyboardInterrupt

    monkeypatch.setattr(local_server.urllib.request, "urlopen", interrupted)
    server = local_server.LocalServer(["sh", "-c", "trap '' INT; sleep 60"], local_server.free_port(), name="deaf",
                                      stop_timeout=30)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with server:
            pass
    assert server.proc.poll() is not None and time.monotonic() - started < 10


def test_vs_vllm_server_is_stopped_when_its_start_fails(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local_server.urllib.request, "urlopen", interrupted)
    ctx = {"work_dir": str(tmp_path), "ids": iter(range(10)), "model_dir": str(tmp_path / "model"),
           "kv_bytes_per_token": 2048}
    server = vs_vllm.Server(vs_vllm.Config("hf_paged", "equal"), vs_vllm.Options(), ctx)
    try:
        with pytest.raises(KeyboardInterrupt):
            with server:
                pass
        assert server.proc is not None and server.proc.poll() is not None and server.log.closed
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_serving_run_without_httpx_raises_before_anything_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)
    try:
        with pytest.raises(optional.MissingDependency, match=r"httpx.*hf_paged\[bench\]"):
            serving.run(num_requests=2, rounds=1, concurrency=2)
    finally:
        assert not _kill_server_children(), "a server was left running"


def test_vs_vllm_online_without_the_client_refuses_up_front(tmp_path):
    done = _run_without(tmp_path, "httpx,openai", "hf_paged.bench.vs_vllm", "--tiny", "--section", "online",
                        "--settings", "equal", "--max-other-load", "-1", "--out", "out")
    assert done.returncode != 0
    assert "httpx" in done.stderr and "openai" in done.stderr and INSTALL in done.stderr
    assert not (tmp_path / "out" / "vs_vllm.json").exists()


def test_vs_vllm_exits_non_zero_when_every_run_failed(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no measurement today")

    monkeypatch.setattr(vs_vllm, "run_offline", broken)
    rc = vs_vllm.main(["--tiny", "--section", "offline", "--settings", "equal", "--max-other-load", "-1",
                       "--out", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "offline sharegpt" in err and "no measurement today" in err
    saved = json.loads((tmp_path / "vs_vllm.json").read_text())
    assert saved["failures"] == {"offline sharegpt: hf_paged equal": "no measurement today",
                                 "offline long_prompts: hf_paged equal": "no measurement today"}
    assert vs_vllm.unmeasured(saved) == ["offline sharegpt", "offline long_prompts"]


def test_suite_skips_the_serving_section_without_httpx_and_saves_the_rest(tmp_path, monkeypatch):
    """The serving section needs httpx; without it the suite says so at the start, skips it, and a
    section that fails (tensor parallelism here) is recorded alone: bench.json holds the rest."""
    monkeypatch.setitem(sys.modules, "httpx", None)
    # The measurements themselves are stubbed (tests/test_bench.py runs them): only the sections count here.
    def ran(name, extra=None):
        return lambda model, wl, *a, **kw: systems.RunResult(name, 1.0, [[5] * r.max_new_tokens for r in wl.requests],
                                                             extra=dict(extra or {}))

    monkeypatch.setattr(suite.systems, "batched_generate", ran("generate"))
    monkeypatch.setattr(suite.systems, "transformers_cb", ran("transformers_cb"))
    monkeypatch.setattr(suite.systems, "engine_run", ran("engine", {"computed_prompt_tokens": 10}))
    monkeypatch.setattr(suite.memory, "sharing_savings", lambda model, wl: {"saving": 0.5})
    monkeypatch.setattr(suite.generate_speed, "run", lambda **kw: {"stub case": {
        "median": 1.0, "sequences_identical": True}})
    monkeypatch.setattr(suite.prefix_generate, "run", lambda **kw: {})

    def broken(**kwargs):
        raise RuntimeError("no second rank")

    monkeypatch.setattr(suite.tensor_parallel, "run", broken)
    logged = []
    results = suite.run(build("llama"), num_requests=4, scale=0.05, batch_size=4, out_dir=tmp_path, block_size=8,
                        num_blocks=256, quick=True, repeats=1, log=logged.append, generate_new_tokens=3)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert "httpx" in saved["serving"]["skipped"] and INSTALL in saved["serving"]["skipped"]
    assert saved["tensor_parallel"] == {"failed": "RuntimeError: no second rank"}
    assert set(saved["sections_not_run"]) == {"serving", "tensor_parallel"}
    assert saved["generate_flag_vs_stock"] == {"stub case": {"median": 1.0, "sequences_identical": True}}
    assert saved["sharegpt_offline"]["systems"] and saved["kv_utilization"] and saved["sharing_savings"]
    assert any("serving section will be skipped" in line for line in logged[:1])
    report = suite.report(results)
    assert "serving: skipped" in report and "tensor_parallel: failed" in report
