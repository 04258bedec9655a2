"""A transformers ``text-generation`` pipeline that runs every input of a call through the engine.

It accepts what ``TextGenerationPipeline`` accepts (strings, lists of strings, chats, lists of
chats; ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``,
``num_return_sequences``, ``num_beams``, ``return_full_text``, ...) and returns the same structure,
reusing the stock pre- and post-processing; only the generation step differs: all inputs of a
call are queued at once in an :class:`LLMEngine` (continuous batching, shared prompts, paged KV).

    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, num_blocks=1024)
    pipe(["Hello", "Once upon a time"], max_new_tokens=32)

After ``import hf_paged`` it is also ``transformers.pipeline("paged-text-generation", model=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, TextGenerationPipeline
from transformers import pipeline as _hf_pipeline
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.text_generation import Chat

from hf_paged.engine import LLMEngine, SamplingParams

TASK = "paged-text-generation"
ENGINE_KWARGS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                 "preemption_mode", "swap_space_blocks", "gpu_memory_utilization", "kv_cache_bytes")


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


class PagedTextGenerationPipeline(TextGenerationPipeline):
    def __init__(self, *args, engine: LLMEngine | None = None, **kwargs):
        engine_kwargs = {k: kwargs.pop(k) for k in ENGINE_KWARGS if k in kwargs}
        super().__init__(*args, **kwargs)
        self.engine = engine or LLMEngine(self.model, self.tokenizer, **engine_kwargs)

    def __call__(self, text_inputs, **kwargs):
        single = isinstance(text_inputs, str) or _is_chat(text_inputs)
        items = [text_inputs] if single else list(text_inputs)
        items = [Chat(x) if _is_chat(x) else x for x in items]
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        model_inputs = [self.preprocess(x, **preprocess_params) for x in items]
        params = self._sampling_params(forward_params)
        prompts = [mi["input_ids"][0].tolist() for mi in model_inputs]
        outputs = self.engine.generate(prompts, params, use_tqdm=False)
        results = []
        for mi, prompt, out in zip(model_inputs, prompts, outputs):
            if out.error:
                raise ValueError(f"paged-text-generation: {out.error}")
            sequences = [prompt + c.token_ids for c in out.outputs]
            width = max(map(len, sequences))
            fill = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            padded = torch.tensor([s + [fill] * (width - len(s)) for s in sequences])
            model_outputs = {"generated_sequence": padded[None], "input_ids": mi["input_ids"],
                             "prompt_text": mi["prompt_text"]}
            results.append(self.postprocess(model_outputs, **postprocess_params))
        return results[0] if single else results

    def _sampling_params(self, forward_params: dict) -> SamplingParams:
        """SamplingParams equivalent to the generate kwargs (and the model's generation config)."""
        generate_kwargs = dict(forward_params.get("generate_kwargs", {}), **{
            k: v for k, v in forward_params.items() if k != "generate_kwargs"})
        config = GenerationConfig.from_dict({**self.model.generation_config.to_dict(), **{
            k: v for k, v in generate_kwargs.items() if k not in ("generation_config",)}})
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = max(1, (config.max_length or 20) - 1)
        beams = config.num_beams or 1
        return SamplingParams(
            max_new_tokens=max_new, temperature=(config.temperature or 1.0) if config.do_sample else 0.0,
            top_p=config.top_p if config.do_sample and config.top_p is not None else 1.0,
            top_k=config.top_k if config.do_sample and config.top_k else 0,
            repetition_penalty=config.repetition_penalty or 1.0, n=config.num_return_sequences or 1,
            num_beams=beams, length_penalty=1.0 if config.length_penalty is None else config.length_penalty,
            early_stopping=bool(config.early_stopping) if config.early_stopping != "never" else "never",
            min_new_tokens=config.min_new_tokens or 0,
        )


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> PagedTextGenerationPipeline:
    """``transformers.pipeline`` for text generation, served by the paged engine.

    Engine options (``block_size``, ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``preemption_mode``, ...) go to the :class:`LLMEngine`.
    """
    if task not in ("text-generation", TASK):
        raise ValueError(f"hf_paged.pipeline serves 'text-generation', not {task!r}")
    return _hf_pipeline(TASK, model=model, tokenizer=tokenizer, pipeline_class=PagedTextGenerationPipeline, **kwargs)


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=PagedTextGenerationPipeline, pt_model=AutoModelForCausalLM)
