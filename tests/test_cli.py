"""The command line: the demo runs and checks itself; bad arguments get one clear line."""

from __future__ import annotations

import pytest

from hf_paged.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu0"], "--device 'tpu0'"),
    (["--dtype", "float7"], "--dtype 'float7'"),
    (["--model", "/no/such/dir"], "--model '/no/such/dir'"),
    (["generate"], "no prompts"),
    (["generate", "--file", "/no/such/file"], "--file"),
    (["serve", "--no-engine-process", "--cuda-graphs", "--num-blocks", "64"], "CUDA graphs need a model on a CUDA"),
])
def test_bad_arguments_are_reported(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-paged: error:") and message in err


def test_demo_runs_and_finds_equal_tokens(capsys):
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("True") >= 3 and "hf_paged LLMEngine" in out


def test_generate_streams(capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
