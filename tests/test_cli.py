"""The command line: the demo runs and checks itself; bad arguments get one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_paged.__main__ as cli_module
from hf_paged.__main__ import main, parser


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
