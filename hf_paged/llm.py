"""vLLM's offline entry point, ``LLM``, over :class:`~hf_paged.engine.LLMEngine`.

A script written for vLLM (``LLM(model=PATH).generate(prompts, params)``, ``.chat(messages)``,
``.beam_search(prompts, BeamSearchParams(...))``, ``.get_tokenizer()``) runs here with its import
changed: the checkpoint is loaded with transformers (local files only: there is no hub download),
then served by one engine. Everything the engine takes (``block_size``, ``num_blocks``,
``max_num_seqs``, ...) passes through; ``llm_engine`` is it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_paged.engine import LLMEngine, RequestOutput, SamplingParams


@dataclass(kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` for :meth:`LLM.beam_search`: ``beam_width`` beams (and as many
    outputs), up to ``max_tokens`` new tokens each.

    The search is transformers' (``generate(num_beams=...)``, token for token), not vLLM's own
    loop: ``length_penalty`` divides a hypothesis' summed log-prob by its *generated* length (vLLM
    counts the prompt too), so rankings can differ from vLLM's. It is deterministic:
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
                 seed: int | None = None, **engine_kwargs):
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"LLM(seed=...) must be None or an int, got {seed!r}")
            torch.manual_seed(seed)
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

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (strings, token-id lists, or vLLM's prompt dicts), outputs
        in input order. A prompt the engine refuses raises ``ValueError`` naming its index."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"LLM.beam_search takes a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm)
        tokenizer, beams = self.get_tokenizer(), []
        for index, result in enumerate(results):
            if result.error is not None:
                raise ValueError(f"LLM.beam_search: prompt {index}: {result.error}")
            sequences = [_beam_sequence(result.prompt_token_ids, out, params, tokenizer) for out in result.outputs]
            beams.append(BeamSearchOutput(sequences))
        return beams

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


def _tokenizer(source):
    """A tokenizer as given, or loaded from a local directory."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(source), local_files_only=True)
