"""The paged text-generation pipeline returns what the stock pipeline returns (greedy, float32)."""

from __future__ import annotations

import pytest
import transformers

import hf_paged
from hf_paged.demo import byte_tokenizer, demo_model

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3)


@pytest.fixture(scope="module")
def pipes():
    tok = byte_tokenizer()
    stock = transformers.pipeline("text-generation", model=demo_model(**SMALL), tokenizer=tok)
    paged = hf_paged.pipeline("text-generation", model=demo_model(**SMALL), tokenizer=tok, num_blocks=256,
                              block_size=8)
    return stock, paged


@pytest.mark.parametrize("inputs, kwargs", [
    ("Hello", dict(max_new_tokens=10, do_sample=False)),
    (["Hi", "Once upon a time", "x"], dict(max_new_tokens=8, do_sample=False)),
    ([{"role": "user", "content": "hey there"}], dict(max_new_tokens=6, do_sample=False)),
    ([[{"role": "user", "content": "a"}], [{"role": "user", "content": "bcd"}]], dict(max_new_tokens=5, do_sample=False)),
    ("Beam me up", dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)),
    ("new text only", dict(max_new_tokens=5, do_sample=False, return_full_text=False)),
])
def test_paged_pipeline_matches_the_stock_pipeline(pipes, inputs, kwargs):
    stock, paged = pipes
    assert paged(inputs, **kwargs) == stock(inputs, **kwargs)
    paged.engine.kv.check_invariants()
    assert paged.engine.kv.num_used_blocks() == 0


def test_registered_task_and_sampling(pipes):
    stock, paged = pipes
    registered = transformers.pipeline("paged-text-generation", model=paged.model, tokenizer=paged.tokenizer)
    assert isinstance(registered, hf_paged.PagedTextGenerationPipeline)
    assert registered("Hello", max_new_tokens=7, do_sample=False) == stock("Hello", max_new_tokens=7, do_sample=False)
    sampled = paged("Hello", max_new_tokens=7, do_sample=True, temperature=0.9, top_p=0.9, num_return_sequences=3)
    assert len(sampled) == 3 and all(r["generated_text"].startswith("Hello") for r in sampled)
    with pytest.raises(ValueError, match="text-generation"):
        hf_paged.pipeline("summarization", model=paged.model, tokenizer=paged.tokenizer)
