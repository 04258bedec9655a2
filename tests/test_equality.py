"""Token-exact equality: stock ``generate()`` (its default attention + DynamicCache) vs the paged path.

Every architecture × decoding mode × block size {1, 16, 32}, float32, ``torch.equal`` on the ids.
The negative controls at the end prove the comparison fails when copy-on-write or the mask
function is taken away.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.masking_utils import AttentionMaskInterface

import hf_paged
from hf_paged import kernels
from hf_paged.storage import PagedKVStorage
from tests.helpers.tiny_models import ARCHITECTURES, build, left_padded

BLOCK_SIZES = [1, 16, 32]
PROMPT_LENGTHS = [5, 19, 40]  # cross block boundaries at 16 and 32
MAX_NEW = 12


class Collector(BaseStreamer):
    """A streamer that records what generate pushes to it."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.detach().clone())

    def end(self):
        self.ended = True


class StopOnMultipleOf(StoppingCriteria):
    """Per-row stop: a row is done once its newest token is a multiple of ``k``."""

    def __init__(self, k: int, prompt_len: int):
        self.k, self.prompt_len = k, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids[:, -1] % self.k == 0
        return done & (input_ids.shape[1] > self.prompt_len)


def _early_eos(model, ids, mask) -> int:
    """A token that the first row generates third, greedily: as EOS it ends that row early."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None)
    return int(out[0, -1])


MODES = {
    "greedy_single": lambda m, ids, mask: dict(input_ids=ids[2:], attention_mask=mask[2:], do_sample=False),
    "greedy_batch": lambda m, ids, mask: dict(input_ids=ids, attention_mask=mask, do_sample=False),
    "sample_n3": lambda m, ids, mask: dict(
        input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=3, top_k=0
    ),
    "beam4_n2": lambda m, ids, mask: dict(
        input_ids=ids, attention_mask=mask, do_sample=False, num_beams=4, num_return_sequences=2
    ),
    "early_eos": lambda m, ids, mask: dict(
        input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=_early_eos(m, ids, mask)
    ),
    "streamer": lambda m, ids, mask: dict(input_ids=ids, attention_mask=mask, do_sample=False, streamer=Collector()),
    "stopping_criterion": lambda m, ids, mask: dict(
        input_ids=ids, attention_mask=mask, do_sample=False,
        stopping_criteria=StoppingCriteriaList([StopOnMultipleOf(5, ids.shape[1])]),
    ),
}

_models: dict[str, torch.nn.Module] = {}
_stock: dict[tuple[str, str], tuple] = {}


def _model(arch: str):
    if arch not in _models:
        _models[arch] = build(arch)
    return _models[arch]


def _generate(model, mode: str, **extra):
    ids, mask = left_padded(PROMPT_LENGTHS)
    kwargs = MODES[mode](model, ids, mask)
    torch.manual_seed(1234)
    out = model.generate(**kwargs, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **extra)
    streamed = kwargs["streamer"].chunks if "streamer" in kwargs else None
    return out, streamed


def _cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


def stock_output(arch: str, mode: str):
    if (arch, mode) not in _stock:
        model = _model(arch)
        hf_paged.disable(model)
        out, streamed = _generate(model, mode)
        assert type(_cache_of(out)).__name__ == "DynamicCache"
        _stock[(arch, mode)] = (out.sequences, streamed)
    return _stock[(arch, mode)]


def paged_output(arch: str, mode: str, block_size: int):
    model = hf_paged.enable(_model(arch), block_size=block_size)
    try:
        out, streamed = _generate(model, mode, cache_implementation="hf_paged")
    finally:
        hf_paged.disable(model)
    cache = _cache_of(out)
    assert isinstance(cache, hf_paged.PagedKVCache)
    stats = cache.stats()
    assert stats["tokens_stored"] > 0 and stats["block_size"] == block_size
    cache.manager.check_invariants()
    cache.reset()
    assert cache.manager.num_used_blocks == 0
    return out.sequences, streamed


def outputs_match(arch: str, mode: str, block_size: int) -> bool:
    stock_ids, stock_stream = stock_output(arch, mode)
    paged_ids, paged_stream = paged_output(arch, mode, block_size)
    if not torch.equal(stock_ids, paged_ids):
        return False
    if stock_stream is not None:
        return len(stock_stream) == len(paged_stream) and all(map(torch.equal, stock_stream, paged_stream))
    return True


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_paged_generate_is_token_exact(arch, mode, block_size):
    assert outputs_match(arch, mode, block_size)


def logits_bit_identical(arch: str) -> bool:
    model = _model(arch)
    ids, mask = left_padded(PROMPT_LENGTHS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    hf_paged.disable(model)
    stock = model.generate(**kwargs)
    hf_paged.enable(model, block_size=16)
    try:
        paged = model.generate(**kwargs, cache_implementation="hf_paged")
    finally:
        hf_paged.disable(model)
    _cache_of(paged).reset()
    assert len(stock.logits) == len(paged.logits) == MAX_NEW
    return all(torch.equal(a, b) for a, b in zip(stock.logits, paged.logits))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_paged_logits_are_bit_identical_on_cpu(arch):
    """Stronger than token equality: on CPU the reference read path hands the model's own attention
    function the K/V DynamicCache would hold, so every step's logits are the same floats."""
    assert logits_bit_identical(arch)


def test_negative_control_logits_see_a_one_ulp_change(monkeypatch):
    """Keys stored one part in 10^7 off change the logits: the bit-level comparison can fail."""
    write = PagedKVStorage.write
    monkeypatch.setattr(PagedKVStorage, "write", lambda self, layer, k, v, slots: write(self, layer, k * (1 + 1e-7), v,
                                                                                          slots))
    assert not logits_bit_identical("llama")


def test_modes_are_not_trivial():
    """The early-EOS and stopping modes really stop rows early; the streamer really streams."""
    ids, _ = stock_output("llama", "early_eos")
    assert (ids[:, -1] == 0).any(), "no row finished early"
    ids, _ = stock_output("llama", "stopping_criterion")
    assert (ids[:, max(PROMPT_LENGTHS) :] == 0).any(), "no row was stopped by the criterion"
    _, streamed = stock_output("llama", "streamer")
    assert len(streamed) == MAX_NEW + 1  # the prompt, then one chunk per new token


# ---------------------------------------------------------------------------- negative controls
def test_negative_control_without_copy_on_write(monkeypatch):
    """With the copies of copy-on-write skipped, beam search and shared-prompt sampling diverge."""
    monkeypatch.setattr(PagedKVStorage, "copy_blocks", lambda self, pairs, layers=None: None)
    assert not outputs_match("llama", "beam4_n2", 16)
    assert not outputs_match("llama", "sample_n3", 16)


def test_negative_control_without_mask_function(monkeypatch):
    """On the kernel route the padding reaches the attention function through the registered mask
    function: without it, left padding is ignored and outputs change. (On the reference route the
    model's own masks are used and the padding only decides which columns are stored.)"""
    assert outputs_match("llama", "greedy_batch", 16)
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, hf_paged.ATTN_IMPLEMENTATION)
    kernels.set_backend("triton")  # the Triton interpreter on CPU: the route CUDA takes
    try:
        assert not outputs_match("llama", "greedy_batch", 16)
    finally:
        kernels.set_backend("auto")
