"""The built-in demo model: trained weights shipped in the package, loaded by default; random-init on request."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

from hf_paged import demo
from hf_paged.demo import DEMO_WEIGHTS, byte_tokenizer, demo_model, describe_model

SAMPLE = ("Return a list of the words in the string, using sep as the delimiter string. If maxsplit is given, "
          "at most maxsplit splits are done. If sep is not specified or is None, any whitespace string is a separator.")


def _loss(model, text: str) -> float:
    ids = torch.tensor([byte_tokenizer()(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_the_trained_weights_ship_with_the_package_and_load_by_default():
    assert DEMO_WEIGHTS.exists() and DEMO_WEIGHTS.stat().st_size < 8e6
    trained, random = demo_model(), demo_model(trained=False)
    assert trained.hf_paged_demo == "trained" and random.hf_paged_demo == "random"
    assert "trained" in describe_model(trained) and "random" in describe_model(random)
    assert demo_model(num_hidden_layers=2).hf_paged_demo == "random"  # another shape: random init
    with pytest.raises(ValueError, match="default shape"):
        demo_model(trained=True, num_hidden_layers=2)
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()  # still tied


def test_a_missing_weights_file_is_said_not_hidden(monkeypatch, tmp_path):
    """An install without its data file gives random weights, with a warning naming the file."""
    monkeypatch.setattr(demo, "DEMO_WEIGHTS", tmp_path / "demo_model.safetensors")
    with pytest.warns(UserWarning, match="demo_model.safetensors is missing"):
        assert demo_model().hf_paged_demo == "random"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        demo_model(trained=False)  # asked for: no warning
        demo_model(num_hidden_layers=2)  # another shape: random by design


def test_the_trained_model_models_english_text_and_the_random_one_does_not():
    trained, random = _loss(demo_model(), SAMPLE), _loss(demo_model(trained=False), SAMPLE)
    assert random > 5.0  # about log(259): uniform over bytes
    assert trained < 2.2, trained  # nats per byte on a docstring it never saw verbatim


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def test_greedy_text_is_made_of_words():
    """Most of what the trained model writes are common English words (the random model writes bytes)."""
    common = set(_words(SAMPLE.lower())) | {"the", "a", "an", "of", "to", "is", "in", "and", "or", "for", "be", "if",
                                            "this", "that", "it", "as", "are", "not", "with", "by", "on", "return",
                                            "returns", "file", "object", "value", "list", "name", "string", "used",
                                            "none", "default", "new", "can", "will", "from", "which", "set", "when"}
    tok = byte_tokenizer()
    outputs = {}
    for kind, model in (("trained", demo_model()), ("random", demo_model(trained=False))):
        enc = tok(["Return the", "This module provides"], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=60, do_sample=False, repetition_penalty=1.3)
        outputs[kind] = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    for kind, texts in outputs.items():
        words = [w.lower() for t in texts for w in _words(t)]
        outputs[kind] = sum(w in common for w in words) / max(len(words), 1)
    assert outputs["trained"] > 0.3, outputs
    assert outputs["random"] < 0.1, outputs


def test_the_command_line_says_which_model_is_in_use():
    result = subprocess.run([sys.executable, "-m", "hf_paged", "generate", "Return the", "--max-new-tokens", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained briefly on Python's docstrings" in result.stderr
