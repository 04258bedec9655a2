"""The command line: the demo runs and checks itself; bad arguments get one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_paged.__main__ as cli_module
from hf_paged.__main__ import main, parser
from hf_paged.serve.serving_models import LoRAModulePath, parse_lora_modules


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu0"], "--device 'tpu0'"),
    (["--dtype", "float7"], "--dtype 'float7'"),
    (["--model", "/no/such/dir"], "--model '/no/such/dir'"),
    (["generate"], "no prompts"),
    (["generate", "--file", "/no/such/file"], "--file"),
    (["serve", "--no-engine-process", "--cuda-graphs", "--num-blocks", "64"], "CUDA graphs need a model on a CUDA"),
    (["--model", "/no/such/dir", "generate", "Hi"], "--model '/no/such/dir'"),  # given before the command
    (["--max-new-tokens", "3", "serve"], "serve does not read it"),
    (["generate", "Hi", "--num-blocks", "1"], "out of KV cache blocks"),  # one line, not a traceback
    (["serve", "--lora-modules", "a=/x"], "--lora-modules a=/x: the engine serves adapters only with --enable-lora"),
    (["serve", "--enable-lora", "--lora-modules", "nopath"], "--lora-modules 'nopath': expected name=path"),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a"'], """--lora-modules '{"name": "a"': not valid JSON"""),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 4}'], "unknown field(s) rank"),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a", "path": ""}'], "name and path must be non-empty"),
    (["serve", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "another adapter's name too"),
    (["serve", "--enable-lora", "--lora-modules", "hf-paged-demo=/x"], "the served model's name"),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "b"}'],
     "base_model_name 'b' is not the served model 'hf-paged-demo'"),
    (["serve", "--enable-lora", "--max-loras", "0"], "--max-loras must be positive"),
    (["serve", "--no-engine-process", "--enforce-eager", "--num-blocks", "64", "--enable-lora", "--lora-modules",
      "a=/no/such/adapter"], "--lora-modules a=/no/such/adapter: LoRA adapter path '/no/such/adapter' is not a folder"),
])
def test_bad_arguments_are_reported(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the model line, where one was loaded
    assert err.startswith("hf-paged: error:") and message in err


def test_demo_runs_and_finds_equal_tokens(capsys):
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("True") >= 3 and "hf_paged LLMEngine" in out


def test_generate_streams(capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


@pytest.mark.parametrize("argv", [
    ["--model", "ckpt", "--block-size", "8", "--dtype", "bf16", "serve"],
    ["serve", "--model", "ckpt", "--block-size", "8", "--dtype", "bf16"],
    ["--model", "other", "serve", "--model", "ckpt", "--block-size", "8", "--dtype", "bf16"],  # the later wins
])
def test_common_options_count_before_or_after_the_command(argv):
    """A subcommand's own defaults once overwrote what was given before its name (the demo model
    was served for --model PATH serve)."""
    args = parser().parse_args(argv)
    assert (args.model, args.block_size, args.dtype) == ("ckpt", 8, "bf16")


def test_lora_flags_take_vllms_forms():
    """``--lora-modules`` as vLLM's: ``name=path`` or JSON items (an object, or a list of them),
    several after one flag or the flag again."""
    args = parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                '{"name": "b", "path": "/y", "base_model_name": "m"}', "--lora-modules",
                                '[{"name": "c", "path": "/z=1"}]', "--max-loras", "2", "--max-lora-rank", "8",
                                "--max-cpu-loras", "3", "--allow-runtime-lora-updating"])
    assert parse_lora_modules(args.lora_modules) == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m"),
                                                     LoRAModulePath("c", "/z=1")]
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras,
            args.allow_runtime_lora_updating) == (True, 2, 8, 3, True)
    bare = parser().parse_args(["serve"])
    assert (bare.enable_lora, bare.lora_modules, bare.max_loras, bare.max_lora_rank, bare.max_cpu_loras,
            bare.allow_runtime_lora_updating) == (False, None, 1, 16, None, False)


def test_serve_loads_the_lora_modules_into_the_engine_and_serves_them(tmp_path, monkeypatch, capsys):
    """Without a server (its run replaced): the flags reach the engine, which reads each adapter at
    start, and the app, which serves them under their names (ids 1, 2 in order)."""
    from hf_paged.demo import demo_model
    from hf_paged.serve import server
    from tests.helpers.lora_adapters import save_adapter

    model = demo_model()
    paths = [save_adapter(model, str(tmp_path / name), seed=i) for i, name in enumerate(("a", "b"))]
    apps = []
    monkeypatch.setattr(server, "run", lambda app, *rest: apps.append(app) or 0)
    assert main(["serve", "--no-engine-process", "--enforce-eager", "--num-blocks", "64", "--enable-lora",
                 "--max-loras", "2", "--max-cpu-loras", "2", "--lora-modules", f"a={paths[0]}",
                 f'{{"name": "b", "path": "{paths[1]}", "base_model_name": "hf-paged-demo"}}']) == 0
    served = apps[0].state.models
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in served.lora_requests.values()] == \
        [("a", 1, paths[0], "hf-paged-demo"), ("b", 2, paths[1], "hf-paged-demo")]
    engine = apps[0].state.engine_loop.engine
    assert engine.list_loras() == {1, 2} and engine.lora.max_loras == 2
    assert f"LoRA adapter 'b' from {paths[1]}" in capsys.readouterr().out


def test_max_new_tokens_is_only_for_the_commands_that_generate(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--max-new-tokens", "3"])
    assert "unrecognized arguments: --max-new-tokens" in capsys.readouterr().err
    assert parser().parse_args(["--max-new-tokens", "3", "generate", "x"]).max_new_tokens == 3
    assert parser().parse_args(["generate", "x", "--max-new-tokens", "3"]).max_new_tokens == 3


def test_the_command_exits_with_mains_code_through_the_quick_exit(monkeypatch):
    codes: list[int] = []
    monkeypatch.setattr(cli_module, "main", lambda: 7)
    monkeypatch.setattr(cli_module, "exit_process", codes.append)
    cli_module.cli()
    assert codes == [7]


def test_the_quick_exit_runs_exit_handlers_and_flushes_but_skips_the_final_collection():
    """The interpreter's last full collection (1-2 s with torch and transformers loaded) is what
    :func:`exit_process` skips; exit handlers and buffered output are kept."""
    script = """
import atexit, gc, sys
from hf_paged.process_exit import exit_process
atexit.register(lambda: print("exit handler ran", end=""))
gc.collect()  # the counts start from zero: a collection after this is the final one
print("buffered, ", end="")
gc.callbacks.append(lambda phase, info: phase == "start" and sys.__stderr__.write("collected "))
exit_process(3)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (3, "buffered, exit handler ran"), done
    assert "collected" not in done.stderr, done.stderr
