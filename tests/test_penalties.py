"""OpenAI's presence and frequency penalties in the engine: equal to a reference logits processor."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged import LLMEngine, SamplingParams
from tests.helpers.tiny_models import VOCAB, build


class _Reference(LogitsProcessor):
    """The penalties as OpenAI documents them, over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 2.0), (-1.0, 0.7)])
def test_penalties_equal_the_reference(model, presence, frequency):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 17)]
    engine = LLMEngine(model, num_blocks=64)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    outs = engine.generate(prompts, params, use_tqdm=False)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(prompts, outs, plain):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             logits_processor=LogitsProcessorList([_Reference(len(prompt), presence, frequency)]))
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        changed += out.outputs[0].token_ids != base.outputs[0].token_ids
    assert changed, "the penalty changed no output: the test would not see it missing"
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_out_of_range_penalties_name_the_field(field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: 2.5})
