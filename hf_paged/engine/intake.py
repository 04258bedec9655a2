"""From a user's prompt and ``SamplingParams`` to a validated :class:`Request`.

Everything that can be wrong with a request is found here, before it is queued, and raised as a
``ValueError`` that names the problem; the engine turns it into that request's error alone.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Container

import torch

from hf_paged.engine.beam_search import BeamSearchState
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.sampler import sample_generator
from hf_paged.engine.sequence import Request


def prompt_tokens(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a string, a list of ids, a 1-D tensor of ids, or vLLM's prompt
    dicts: ``{"prompt_token_ids": ids}`` (``TokensPrompt``, its optional ``"prompt"`` text kept for
    the output) and ``{"prompt": text}`` (``TextPrompt``). A string needs ``tokenizer``."""
    if isinstance(prompt, dict):
        return _dict_tokens(tokenizer, prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer (pass tokenizer= to LLMEngine)")
        return prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    odd = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if odd is not None:
        raise ValueError(f"a prompt's token ids must be integers, got {type(odd).__name__} {odd!r}")
    return None, [int(t) for t in prompt]  # numpy integers too


def _dict_tokens(tokenizer, prompt: dict) -> tuple[str | None, list[int]]:
    """The other keys of vLLM's prompt dicts (``multi_modal_data``, ``cache_salt``, ...) ask for
    what this engine does not do: refused by name, not ignored (None values ask for nothing)."""
    other = sorted(str(k) for k, v in prompt.items() if k not in ("prompt", "prompt_token_ids") and v is not None)
    if other:
        raise ValueError(f"prompt dict key(s) {other} are not supported: a prompt dict is "
                         "{'prompt_token_ids': [...]} or {'prompt': '...'}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
    if prompt.get("prompt_token_ids") is not None:
        if isinstance(prompt["prompt_token_ids"], (str, dict)):
            raise ValueError("a prompt dict's 'prompt_token_ids' must be a list of token ids")
        return text, prompt_tokens(tokenizer, prompt["prompt_token_ids"])[1]
    if text is None:
        raise ValueError("a prompt dict needs 'prompt_token_ids' (vLLM's TokensPrompt) or 'prompt' (TextPrompt)")
    return prompt_tokens(tokenizer, text)


class RequestIntake:
    def __init__(self, tokenizer, *, vocab_size: int, max_positions: int | None, eos_token_ids: list[int],
                 kv: KVCacheManager, device: torch.device, max_num_seqs: int, max_logprobs: int | None = None,
                 prefill_chunk: int | None = None):
        self.tokenizer, self.vocab_size, self.max_positions = tokenizer, vocab_size, max_positions
        self.eos_token_ids, self.kv, self.device = eos_token_ids, kv, device
        self.prefill_chunk = prefill_chunk  # the scheduler's (a window's blocks and a chunk's fit a prompt)
        self.max_num_seqs, self.max_logprobs = max_num_seqs, max_logprobs

    def check_params(self, params: SamplingParams) -> None:
        """The checks that depend on this engine (``SamplingParams`` checks the rest itself): one
        step never runs more than ``max_num_seqs`` sequences, so a request wider than that could
        never be scheduled; log-probabilities, biases and allowed tokens exist for the vocabulary's
        tokens only, and log-probabilities are bounded by ``max_logprobs`` (vLLM's) too; what is text
        (stop strings, bad words, grammars) needs the tokenizer. The
        bad words' own checks (each tokenizes to something inside the vocabulary) come when the
        request is admitted (:func:`hf_paged.engine.structured.bad_words_token_ids`)."""
        for name in ("n", "num_beams"):
            value = getattr(params, name)
            if value > self.max_num_seqs:
                raise ValueError(f"SamplingParams.{name} must be at most the engine's max_num_seqs="
                                 f"{self.max_num_seqs}, got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"SamplingParams.{name} must be at most the vocabulary size {self.vocab_size}, "
                                 f"got {value!r}")
            asked = self.vocab_size if value == -1 else value
            if self.max_logprobs is not None and asked is not None and asked > self.max_logprobs:
                whole = " (the whole vocabulary)" if value == -1 else ""
                raise ValueError(f"SamplingParams.{name} must be at most the engine's max_logprobs="
                                 f"{self.max_logprobs} (LLM(max_logprobs=...)), got {value!r}{whole}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"SamplingParams.logit_bias token ids must be below the vocabulary size {self.vocab_size}, "
                             f"got {max(params.logit_bias)}")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"SamplingParams.allowed_token_ids token ids must be below the vocabulary size "
                             f"{self.vocab_size}, got {max(params.allowed_token_ids)}")
        if params.bad_words and self.tokenizer is None:  # tokenized when the request is admitted
            raise ValueError("SamplingParams.bad_words needs a tokenizer (pass tokenizer= to LLMEngine); "
                             "allowed_token_ids or logit_bias ban token ids without one")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer (pass tokenizer= to LLMEngine)")
        if params.stop and self.tokenizer is None:  # else they would never match: refused, not ignored
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer (pass tokenizer= to LLMEngine); "
                             "stop_token_ids need none")

    def _whole_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """``logprobs=-1`` / ``prompt_logprobs=-1`` as the number they stand for (vLLM's)."""
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        return dataclasses.replace(params, **whole) if whole else params

    def request(self, request_id: str, prompt, params: SamplingParams | None, taken: Container[str],
                lora_request=None) -> Request:
        """A new request; ``taken`` holds the ids of the requests in flight; ``lora_request`` its
        adapter (checked by the engine's LoRA manager)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.check_params(params)
        params = self._whole_vocabulary(params)
        text, ids = prompt_tokens(self.tokenizer, prompt)
        if request_id in taken:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if self.max_positions and len(ids) >= self.max_positions:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's {self.max_positions} positions")
        if not self.kv.fits_alone([len(ids) + 1], chunk=self.prefill_chunk):
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the whole KV cache "
                             f"({self.kv.num_blocks} blocks of {self.kv.block_size})")
        if params.max_new_tokens is None:
            params = self._fill_positions(params, len(ids))
        request = Request(request_id, ids, params, prompt=text, lora_request=lora_request)
        if params.seed is not None:
            request.generator = sample_generator(params.seed, 0, self.device)
            if params.n > 1 and not params.beam_search:  # one generator per sample from the first token on
                request.sample_generators = [request.generator] + [
                    sample_generator(params.seed, i, self.device) for i in range(1, params.n)]
        if params.beam_search:
            request.beam = BeamSearchState(
                num_beams=params.num_beams, num_return_sequences=params.n, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, eos_token_ids=self._beam_ends(params),
                prompt_len=len(ids), max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
            )
        return request

    def _fill_positions(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """``max_new_tokens=None`` (vLLM's ``max_tokens=None``): as many as fit in the model's
        positions after this prompt, as a copy for this request (the caller's may serve several
        prompts); checked again with that number (``min_new_tokens``, a beam ``length_penalty``)."""
        if self.max_positions is None:
            raise ValueError("SamplingParams.max_new_tokens=None (as many as fit) needs a model whose config gives "
                             "its length (max_position_embeddings); pass a number")
        room = self.max_positions - prompt_len
        return dataclasses.replace(params, max_new_tokens=room, max_tokens=room)  # replace() passes both

    def _beam_ends(self, params: SamplingParams) -> list[int]:
        """The tokens that finish a beam: ``stop_token_ids`` and (unless ignored) EOS."""
        ends = [*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)]
        return list(dict.fromkeys(ends))
