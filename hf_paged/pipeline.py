"""A transformers ``text-generation`` pipeline that runs every input of a call through the engine.

It accepts what ``TextGenerationPipeline`` accepts (strings, lists of strings, chats, lists of
chats, generate options in the call, at construction or as a ``generation_config``) and returns
the same structure, reusing the stock pre- and post-processing; only the generation step differs:
all inputs of a call are queued at once in an :class:`LLMEngine` (continuous batching, shared
prompts, paged KV).

    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, num_blocks=1024)
    pipe(["Hello", "Once upon a time"], max_new_tokens=32)

The options a call resolves to are the ones stock would hand to ``generate()``: the stock
``_forward`` runs up to that call, against a stand-in model that records it (so the pipeline's
defaults, ``max_length`` and ``prefix`` arithmetic stay transformers' own, in every version).
They become :class:`SamplingParams` (:func:`_sampling_params`); an option the engine cannot honor
is an error naming it, never ignored. Greedy decoding and beam search give stock's tokens; sampled
tokens are the engine's draws, reproducible under ``torch.manual_seed`` but not stock's draws. A
stop string ends an output when the output holds it (stock also stops at one that begins in the
prompt's last characters).

After ``import hf_paged`` it is also ``transformers.pipeline("paged-text-generation", model=...)``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, TextGenerationPipeline
from transformers import pipeline as _hf_pipeline
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.text_generation import Chat

from hf_paged.engine import LLMEngine, SamplingParams
from hf_paged.engine.beam_search import generate_fill_token
from hf_paged.model_info import token_id_list

TASK = "paged-text-generation"
ENGINE_KWARGS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                 "preemption_mode", "swap_space_blocks", "gpu_memory_utilization", "kv_cache_bytes")
# GenerationConfig fields that :func:`_sampling_params` reads, or that change nothing the engine does
HONORED = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k",
           "top_p", "min_p", "repetition_penalty", "num_return_sequences", "num_beams", "length_penalty",
           "early_stopping", "eos_token_id", "stop_strings"}
INERT = {"pad_token_id", "bos_token_id", "use_cache", "cache_implementation", "cache_config", "return_dict_in_generate",
         "transformers_version", "compile_config", "disable_compile", "prefill_chunk_size"}
# generate() arguments besides the config and the streamer that the engine has no use for
IGNORED_GENERATE_ARGS = {"input_ids", "attention_mask", "tokenizer", "use_model_defaults"}


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


@dataclass
class _Call:
    """One input's generation: its parameters, the streamer if any, the token that fills the
    shorter of its sequences in the result (``generate()``'s padding), and what the engine gets
    for an empty prompt."""

    params: SamplingParams
    streamer: Any
    fill: int
    start: list[int]  # an empty prompt's stand-in, as in generate(): the BOS token


def _fill_token(config: GenerationConfig, beam_search: bool) -> int:
    """What ``generate()`` writes after a sequence's end: the pad id, which defaults to the first
    EOS id (beam search also skips a pad id of 0)."""
    eos = token_id_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    fill = generate_fill_token(pad, eos) if beam_search else pad
    return 0 if fill is None or fill < 0 else fill


class _GenerateCall(Exception):
    """Raised by :class:`_RecordingModel` to stop the stock ``_forward`` at its ``generate()``."""

    def __init__(self, kwargs: dict):
        super().__init__("generate() call recorded")
        self.kwargs = kwargs


class _RecordingModel:
    """The pipeline's model with ``generate`` recording its arguments instead of generating."""

    def __init__(self, model):
        self._model = model

    def generate(self, *args, **kwargs):
        raise _GenerateCall(kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def _unsupported(name: str, why: str = "the engine cannot honor it") -> ValueError:
    return ValueError(f"paged-text-generation: generate option {name!r} is not supported ({why}); use "
                      f"transformers' text-generation pipeline, with cache_implementation='hf_paged' for paged KV")


def _sampling_params(config: GenerationConfig, prompt_len: int, engine_eos: list[int]) -> SamplingParams:
    """The :class:`SamplingParams` that decode as ``generate()`` with ``config`` (resolved: the
    model's and transformers' defaults filled in) would on a prompt of ``prompt_len`` tokens.
    ``engine_eos``: the ids the engine stops at; another ``eos_token_id`` replaces them."""
    defaults = GenerationConfig()._get_default_generation_params()
    for name, value in config.to_dict().items():
        if name in HONORED or name in INERT or name.startswith("_"):  # output_scores etc. are refused too
            continue
        if value is not None and value is not False and value != defaults.get(name, None):
            raise _unsupported(name)
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
    if max_new < 1:  # as generate() refuses it
        raise ValueError(f"paged-text-generation: max_length={config.max_length} leaves no room to generate after "
                         f"a prompt of {prompt_len} tokens; set max_new_tokens")
    min_new = config.min_new_tokens
    if min_new is None:
        min_new = max(0, (config.min_length or 0) - prompt_len)
    eos = token_id_list(config.eos_token_id)
    own_eos = sorted(set(eos)) != sorted(set(engine_eos))
    sampling = bool(config.do_sample)
    if sampling and (config.num_beams or 1) > 1:
        raise _unsupported("do_sample", "with num_beams > 1 it is beam sampling; the engine's beam search is "
                                        "deterministic")
    temperature = 1.0 if config.temperature is None else config.temperature
    if sampling and temperature <= 0:
        raise ValueError(f"paged-text-generation: temperature={temperature!r} with do_sample=True; pass "
                         f"do_sample=False for greedy decoding, as generate() asks")
    if config.stop_strings and min_new:
        raise _unsupported("stop_strings", "with min_new_tokens: generate() stops at a stop string before "
                                           "min_new_tokens, the engine does not")
    return SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min(min_new, max_new),
        temperature=temperature if sampling else 0.0,
        top_p=config.top_p if sampling and config.top_p is not None else 1.0,
        top_k=config.top_k if sampling and config.top_k else 0,
        min_p=config.min_p if sampling and config.min_p is not None else 0.0,
        repetition_penalty=config.repetition_penalty or 1.0, n=config.num_return_sequences or 1,
        num_beams=config.num_beams or 1,
        length_penalty=1.0 if config.length_penalty is None else config.length_penalty,
        early_stopping=config.early_stopping if config.early_stopping == "never" else bool(config.early_stopping),
        ignore_eos=own_eos, stop_token_ids=eos if own_eos else [],
        stop=[config.stop_strings] if isinstance(config.stop_strings, str) else list(config.stop_strings or []),
        seed=int(torch.randint(0, 2**62, ())) if sampling else None,  # torch.manual_seed makes a call repeatable
    )


class PagedTextGenerationPipeline(TextGenerationPipeline):
    def __init__(self, *args, engine: LLMEngine | None = None, **kwargs):
        engine_kwargs = {k: kwargs.pop(k) for k in ENGINE_KWARGS if k in kwargs}
        super().__init__(*args, **kwargs)
        self.engine = engine or LLMEngine(self.model, self.tokenizer, **engine_kwargs)

    def __call__(self, text_inputs, num_workers: int | None = None, batch_size: int | None = None, **kwargs):
        """As stock's call; ``batch_size`` and ``num_workers`` change nothing: every input of the
        call is queued in the engine at once."""
        single = isinstance(text_inputs, str) or _is_chat(text_inputs)
        items = [text_inputs] if single else list(text_inputs)
        items = [Chat(x) if _is_chat(x) else x for x in items]
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        model_inputs = [self.preprocess(x, **preprocess_params) for x in items]
        calls = [self._generate_call(mi, forward_params) for mi in model_inputs]
        prompts = [mi["input_ids"][0].tolist() or call.start for mi, call in zip(model_inputs, calls)]
        if calls[0].streamer is None:
            outputs = self.engine.generate(prompts, [call.params for call in calls], use_tqdm=False)
            completions = [self._token_ids(out) for out in outputs]
        else:  # as stock: one input after another, each streamed
            completions = [[self._streamed(prompt, call)] for prompt, call in zip(prompts, calls)]
        results = [self._postprocess_one(mi, prompt, ids, call.fill, postprocess_params)
                   for mi, prompt, ids, call in zip(model_inputs, prompts, completions, calls)]
        return results[0] if single else results

    def _generate_call(self, model_inputs: dict, forward_params: dict) -> _Call:
        """The engine's version of the ``generate()`` call stock would make for this input."""
        shadow = copy.copy(self)  # not self: another thread may be calling this pipeline
        shadow.model = _RecordingModel(self.model)
        try:
            shadow._forward(dict(model_inputs), **forward_params)
        except _GenerateCall as call:
            kwargs = call.kwargs
        else:
            raise RuntimeError("paged-text-generation: the stock pipeline step did not call generate()")
        config, rest = self.model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
        streamer = rest.pop("streamer", None)
        for name, value in rest.items():
            if name not in IGNORED_GENERATE_ARGS and value is not None:
                raise _unsupported(name)
        prompt_len = model_inputs["input_ids"].shape[-1] or 1  # an empty prompt starts from BOS
        params = _sampling_params(config, prompt_len, list(self.engine.eos_token_ids))
        if streamer is not None and (params.beam_search or params.n > 1):
            raise ValueError("paged-text-generation: a streamer needs one sequence per input (as in generate(): "
                             "no beam search, num_return_sequences=1)")
        start = [] if config.bos_token_id is None else [config.bos_token_id]
        return _Call(params, streamer, _fill_token(config, params.beam_search), start)

    def _streamed(self, prompt: list[int], call: _Call) -> list[int]:
        """One input through the engine, its tokens handed to ``streamer`` as ``generate()`` does:
        the prompt first, then each new token, then ``end()``. Returns the new tokens."""
        streamer = call.streamer
        streamer.put(torch.tensor([prompt]))
        token_ids: list[int] = []
        try:
            for delta in self.engine.stream(prompt, call.params):
                for token in delta["token_ids"]:
                    streamer.put(torch.tensor([token]))
                token_ids += delta["token_ids"]
        finally:
            streamer.end()
        return token_ids

    @staticmethod
    def _token_ids(output) -> list[list[int]]:
        if output.error:
            raise ValueError(f"paged-text-generation: {output.error}")
        return [c.token_ids for c in output.outputs]

    def _postprocess_one(self, model_inputs: dict, prompt: list[int], completions: list[list[int]], fill: int,
                         postprocess_params: dict):
        sequences = [prompt + ids for ids in completions]
        width = max(map(len, sequences))
        padded = torch.tensor([s + [fill] * (width - len(s)) for s in sequences])
        input_ids = model_inputs["input_ids"] if model_inputs["input_ids"].numel() else None  # as stock's _forward
        model_outputs = {"generated_sequence": padded[None], "input_ids": input_ids,
                         "prompt_text": model_inputs["prompt_text"]}
        return self.postprocess(model_outputs, **postprocess_params)


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> PagedTextGenerationPipeline:
    """``transformers.pipeline`` for text generation, served by the paged engine.

    Engine options (``block_size``, ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``preemption_mode``, ...) go to the :class:`LLMEngine`.
    """
    if task not in ("text-generation", TASK):
        raise ValueError(f"hf_paged.pipeline serves 'text-generation', not {task!r}")
    return _hf_pipeline(TASK, model=model, tokenizer=tokenizer, pipeline_class=PagedTextGenerationPipeline, **kwargs)


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=PagedTextGenerationPipeline, pt_model=AutoModelForCausalLM)
