"""vLLM's offline entry point, ``LLM``, over :class:`~hf_paged.engine.LLMEngine`.

A script written for vLLM (``LLM(model=PATH).generate(prompts, params)``, ``.chat(messages)``,
``.beam_search(prompts, BeamSearchParams(...))``, ``.get_tokenizer()``) runs here with its import
changed: the checkpoint is loaded with transformers (local files only: there is no hub download),
then served by one engine. Everything the engine takes (``block_size``, ``num_blocks``,
``max_num_seqs``, ``max_model_len``, ...) passes through; ``llm_engine`` is it. vLLM's own
constructor keywords are taken where they mean something here (``enforce_eager``,
``trust_remote_code``, ``revision``, ``chat_template``, ``skip_tokenizer_init``, ``max_logprobs``) or
name what they cannot do (a ``tensor_parallel_size`` above 1, a quantized KV cache); others are a
``TypeError`` naming ``LLM``. As vLLM's, ``generate`` and ``chat`` raise ``ValueError`` for a prompt
or parameters the engine refuses, before anything runs; their ``priority`` is honoured under
``LLM(scheduling_policy="priority")``, and their ``lora_request`` (one, or one per prompt) under
``LLM(enable_lora=True)``. Their vLLM keywords for features not built here
(``tokenization_kwargs``, ``mm_processor_kwargs``, ...) are taken at the values that ask for
nothing; another value is a ``ValueError`` naming the keyword.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_paged.engine import LLMEngine, RequestOutput, SamplingParams
from hf_paged.engine.params import generation_defaults


@dataclass(kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` for :meth:`LLM.beam_search`: ``beam_width`` beams (and as many
    outputs), up to ``max_tokens`` new tokens each.

    The search is transformers' (``generate(num_beams=...)``, token for token), not vLLM's own
    loop, so where EOS can end a beam the beams can differ from vLLM's: ``length_penalty`` divides a
    hypothesis' summed log-prob by its *generated* length (vLLM counts the prompt too), and a
    finished hypothesis enters only when EOS ranks among the step's ``beam_width`` best candidates,
    with transformers' stopping rule. It is deterministic:
    ``temperature`` is accepted and changes nothing (vLLM's draws nothing either).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # beams end at tokens: there is no stop string to include
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"BeamSearchParams.temperature must be a number >= 0, got {self.temperature!r}")
        self.sampling_params()  # the rest (length_penalty's bound, the bools) as SamplingParams checks them

    def sampling_params(self) -> SamplingParams:
        """The engine request this search is."""
        return SamplingParams(num_beams=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
                              skip_special_tokens=self.skip_special_tokens)


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM returns it: ``tokens`` and ``text`` hold the prompt and the
    generated tokens; ``cum_logprob`` is the summed log-prob of the generated tokens (the beam's
    score before the length penalty); ``logprobs`` is left empty (per-token log-probs are not
    kept by the engine's beam search)."""

    tokens: list[int]
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class LLM:
    """A model and its tokenizer behind one :class:`LLMEngine`.

    ``model``: a directory saved with ``save_pretrained`` (with its tokenizer, unless ``tokenizer``
    names another directory or is a tokenizer), a loaded ``PreTrainedModel``, or None for the
    built-in demo model and byte-level tokenizer. ``dtype``: ``"auto"`` (the checkpoint's), or a
    torch dtype or its name. ``device``: default CUDA when there is one. ``seed``: seeds torch's
    global generator (``torch.manual_seed``), which requests without a seed of their own draw
    from, so a script's unseeded samples repeat from run to run; None (the default) leaves it as
    it is (vLLM's default is 0, which it sets in its own worker process).
    """

    def __init__(self, model: str | os.PathLike | PreTrainedModel | None = None, tokenizer: Any = None, *,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 seed: int | None = None, enforce_eager: bool = False, trust_remote_code: bool = False,
                 revision: str | None = None, chat_template: str | None = None, skip_tokenizer_init: bool = False,
                 max_logprobs: int | None = None, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 quantization: str | None = None, disable_log_stats: bool = True, **engine_kwargs):
        _check_vllm_options(tensor_parallel_size, kv_cache_dtype, quantization, engine_kwargs)
        del disable_log_stats  # taken as vLLM's scripts pass it: nothing is logged per interval here
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"LLM(seed=...) must be None or an int, got {seed!r}")
            torch.manual_seed(seed)
        self.chat_template = chat_template  # chat()'s when it is given none (vLLM's)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loading = dict(local_files_only=True, trust_remote_code=trust_remote_code, revision=revision)
        if model is None:
            from hf_paged.demo import byte_tokenizer, demo_model

            model = demo_model(dtype=torch.float32 if dtype == "auto" else _dtype(dtype))
            tokenizer = tokenizer or byte_tokenizer()
        elif isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise ValueError(f"LLM(model={path!r}): not a directory with a saved model (config.json, weights); "
                                 "hf_paged loads local checkpoints only")
            tokenizer = None if skip_tokenizer_init else _tokenizer(path if tokenizer is None else tokenizer, loading)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else _dtype(dtype),
                                                         **loading)
        elif not isinstance(model, PreTrainedModel):
            raise TypeError(f"LLM(model=...) takes a checkpoint directory, a PreTrainedModel or None, "
                            f"got {type(model).__name__}")
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _tokenizer(tokenizer, loading)
        if skip_tokenizer_init:
            tokenizer = None  # prompts are token ids, outputs carry no text (vLLM's)
        if enforce_eager:
            engine_kwargs.setdefault("compile", False)  # vLLM's eager mode: no compiled steps, no graphs
            engine_kwargs.setdefault("cuda_graphs", False)
        self.llm_engine = LLMEngine(model.to(device).eval(), tokenizer, max_logprobs=max_logprobs, **engine_kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's recommended sampling values (its generation config's temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), the rest SamplingParams' defaults:
        what ``generate`` and ``chat`` use when given no parameters."""
        defaults = generation_defaults(getattr(self.llm_engine.model, "generation_config", None))
        return SamplingParams.from_optional(**defaults)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (after the weights changed): :meth:`LLMEngine.reset_prefix_cache`."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, lora_request: Any = None, priority: int | list[int] | None = None,
                 tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Every prompt to completion, outputs in input order (see :meth:`LLMEngine.generate`). A
        prompt or parameters the engine refuses raise ``ValueError`` naming the prompt's index,
        before anything runs (as vLLM's); a request that fails while it runs comes back with
        ``error`` set. ``priority``: one for all prompts or one each, honoured under
        ``LLM(scheduling_policy="priority")`` (see :meth:`LLMEngine.add_request`). ``lora_request``:
        a ``LoRARequest`` for all prompts or one (or None) each, under ``LLM(enable_lora=True)``.
        ``tokenization_kwargs`` and ``mm_processor_kwargs`` are vLLM's, taken only where they ask
        for nothing (see :func:`check_unbuilt_options`)."""
        check_unbuilt_options("LLM.generate", tokenization_kwargs=tokenization_kwargs,
                              mm_processor_kwargs=mm_processor_kwargs)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm=use_tqdm, raise_on_invalid=True,
                                        priority=priority, lora_request=lora_request)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (strings, token-id lists, or vLLM's prompt dicts), outputs
        in input order. A prompt the engine refuses raises ``ValueError`` naming its index.
        vLLM's parameters in its order: ``lora_request`` as :meth:`generate` takes it;
        ``concurrency_limit``: at most that many prompts searched at a time (None: all at once; the
        beams are the same either way)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"LLM.beam_search takes a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int)
                                              or isinstance(concurrency_limit, bool) or concurrency_limit < 1):
            raise ValueError(f"LLM.beam_search(concurrency_limit=...) must be None or an int >= 1, "
                             f"got {concurrency_limit!r}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        step = concurrency_limit or max(len(prompts), 1)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        results = []
        try:
            for start in range(0, len(prompts), step):
                results += self.generate(prompts[start : start + step], params.sampling_params(), use_tqdm=use_tqdm,
                                         lora_request=loras[start : start + step])
        except ValueError as err:
            raise ValueError(f"LLM.beam_search: {err}") from None
        tokenizer, beams = self.get_tokenizer(), []
        for index, result in enumerate(results):
            if result.error is not None:
                raise ValueError(f"LLM.beam_search: prompt {index}: {result.error}")
            sequences = [_beam_sequence(result.prompt_token_ids, out, params, tokenizer) for out in result.outputs]
            beams.append(BeamSearchOutput(sequences))
        return beams

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: Any = None, priority: int | list[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the tokenizer's chat template;
        each output's ``prompt`` is the templated text. vLLM's parameters, in its order: message
        content reaches the template as a string (text parts joined: vLLM's ``"string"`` format,
        which ``"auto"`` is here); ``continue_final_message`` needs ``add_generation_prompt=False``
        (transformers and vLLM refuse the pair); ``priority``, ``lora_request``,
        ``tokenization_kwargs`` and ``mm_processor_kwargs`` as :meth:`generate` takes them."""
        check_unbuilt_options("LLM.chat", tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"LLM.chat(chat_template_content_format={chat_template_content_format!r}): message "
                             "content reaches the template as a string (text parts joined by newlines: vLLM's "
                             "'string' format); pass 'auto' or 'string'")
        if continue_final_message and add_generation_prompt:
            raise ValueError("LLM.chat: continue_final_message and add_generation_prompt are not compatible (the "
                             "last message is continued, no new one started): pass add_generation_prompt=False")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        conversations = [[_template_message(m, f"messages[{i}]") for i, m in enumerate(c)] for c in conversations]
        texts = [tokenizer.apply_chat_template(
            conversation, chat_template=chat_template or self.chat_template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}))
            for conversation in conversations]
        ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]  # the template has them
        outputs = self.generate(ids, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs


def _template_message(message: dict, where: str) -> dict:
    """A chat message as the template sees it: OpenAI's content parts become their text, one part
    per line (vLLM's join); a part that is not text is refused (the models served here read text)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ValueError(f"LLM.chat: {where}.content[{j}] is not a text part ({{'type': 'text', 'text': ...}}), "
                             f"got {kind or type(part).__name__!r}: only text reaches the model")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def check_unbuilt_options(method: str, **options: Any) -> None:
    """vLLM's per-call keywords for features not built here, taken at the values that ask for
    nothing (None; an empty dict of keyword arguments); any other value raises ``ValueError``
    naming the keyword and why."""
    for name, value in options.items():
        if value is None or (name.endswith("_kwargs") and value == {}):
            continue
        raise ValueError(f"{method}({name}={value!r}): {UNBUILT_OPTIONS[name]}")


# vLLM LLM.generate / chat / beam_search keywords for features not built here: why a value is refused
UNBUILT_OPTIONS = {
    "tokenization_kwargs": "prompts are tokenized with the tokenizer's defaults; tokenize them yourself and pass "
                           "{'prompt_token_ids': [...]}",
    "mm_processor_kwargs": "multimodal inputs are not supported (the models served here read text)",
}


# vLLM LLM(...) keywords with nothing to do here, and what to do instead
VLLM_ONLY_OPTIONS = {
    "swap_space": "preemption swaps only with preemption_mode='swap', to swap_space_blocks CPU blocks",
    "cpu_offload_gb": "weights are not offloaded; load the model as you need it and pass it as model=",
    "pipeline_parallel_size": "pipeline parallelism is not built; tensor parallelism is (hf-paged serve)",
    "tokenizer_mode": "the tokenizer is transformers' AutoTokenizer (or pass one as tokenizer=)",
    "hf_overrides": "load the model with transformers as you need it and pass it as model=",
}


def _check_vllm_options(tensor_parallel_size: int, kv_cache_dtype: str, quantization: str | None,
                        engine_kwargs: dict) -> None:
    """vLLM's keywords this LLM cannot honour, refused naming what to do; unknown ones a TypeError naming LLM."""
    if tensor_parallel_size != 1:
        raise ValueError(f"LLM(tensor_parallel_size={tensor_parallel_size!r}): LLM runs one process; split a model "
                         "over ranks with hf_paged.engine.tensor_parallel.load_model under torchrun, or serve it "
                         "with hf-paged serve --tensor-parallel-size")
    if kv_cache_dtype != "auto":
        raise ValueError(f"LLM(kv_cache_dtype={kv_cache_dtype!r}): the KV cache holds the model's dtype ('auto')")
    if quantization is not None:
        raise ValueError(f"LLM(quantization={quantization!r}): load a quantized checkpoint with transformers and "
                         "pass the model as model=")
    known = set(inspect.signature(LLMEngine.__init__).parameters) - {"self", "model", "tokenizer"}
    for name in engine_kwargs:
        if name not in known:
            hint = f": {VLLM_ONLY_OPTIONS[name]}" if name in VLLM_ONLY_OPTIONS else ""
            mine = set(inspect.signature(LLM.__init__).parameters) - {"self", "engine_kwargs"}
            raise TypeError(f"LLM() has no parameter {name!r}{hint} (it takes {', '.join(sorted(mine | known))})")


def _beam_sequence(prompt_ids: list[int], out, params: BeamSearchParams, tokenizer) -> BeamSearchSequence:
    """vLLM's view of one finished beam: prompt and output together, the unpenalised sum."""
    tokens = list(prompt_ids) + list(out.token_ids)
    generated = len(out.token_ids)  # transformers' length, EOS included: score = sum / generated ** penalty
    raw_sum = out.cumulative_logprob * generated ** params.length_penalty if generated else 0.0
    text = tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens) if tokenizer is not None else None
    return BeamSearchSequence(tokens=tokens, cum_logprob=raw_sum, text=text, finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"LLM(dtype={dtype!r}): not a torch dtype (float32, bfloat16, float16, or 'auto')")
    return found


def _tokenizer(source, loading: dict):
    """A tokenizer as given, or loaded from a local directory (``loading``: from_pretrained's keywords)."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(source), **loading)
