"""vLLM's offline entry point, ``LLM``, over :class:`~hf_paged.engine.LLMEngine`.

A script written for vLLM (``LLM(model=PATH).generate(prompts, params)``, ``.chat(messages)``,
``.get_tokenizer()``) runs here with its import changed: the checkpoint is loaded with transformers
(local files only: there is no hub download), then served by one engine. Everything the engine
takes (``block_size``, ``num_blocks``, ``max_num_seqs``, ...) passes through; ``llm_engine`` is it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_paged.engine import LLMEngine, RequestOutput, SamplingParams


class LLM:
    """A model and its tokenizer behind one :class:`LLMEngine`.

    ``model``: a directory saved with ``save_pretrained`` (with its tokenizer, unless ``tokenizer``
    names another directory or is a tokenizer), a loaded ``PreTrainedModel``, or None for the
    built-in demo model and byte-level tokenizer. ``dtype``: ``"auto"`` (the checkpoint's), or a
    torch dtype or its name. ``device``: default CUDA when there is one.
    """

    def __init__(self, model: str | os.PathLike | PreTrainedModel | None = None, tokenizer: Any = None, *,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, **engine_kwargs):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None:
            from hf_paged.demo import byte_tokenizer, demo_model

            model = demo_model(dtype=torch.float32 if dtype == "auto" else _dtype(dtype))
            tokenizer = tokenizer or byte_tokenizer()
        elif isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise ValueError(f"LLM(model={path!r}): not a directory with a saved model (config.json, weights); "
                                 "hf_paged loads local checkpoints only")
            tokenizer = _tokenizer(path if tokenizer is None else tokenizer)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else _dtype(dtype),
                                                         local_files_only=True)
        elif not isinstance(model, PreTrainedModel):
            raise TypeError(f"LLM(model=...) takes a checkpoint directory, a PreTrainedModel or None, "
                            f"got {type(model).__name__}")
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _tokenizer(tokenizer)
        self.llm_engine = LLMEngine(model.to(device).eval(), tokenizer, **engine_kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Every prompt to completion, outputs in input order (see :meth:`LLMEngine.generate`)."""
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the tokenizer's chat template;
        each output's ``prompt`` is the templated text."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            for conversation in conversations]
        ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]  # the template has them
        outputs = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"LLM(dtype={dtype!r}): not a torch dtype (float32, bfloat16, float16, or 'auto')")
    return found


def _tokenizer(source):
    """A tokenizer as given, or loaded from a local directory."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(source), local_files_only=True)
