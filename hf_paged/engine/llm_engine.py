"""``LLMEngine``: continuous batching on the paged KV cache (vLLM's API, in plain PyTorch).

A step = schedule (who computes which tokens, with preemption), one packed forward, then
sampling: tokens appended, stops checked, finished requests freed at once. ``generate`` runs
steps until every request is done; ``add_request``/``step``/``abort``/``stream`` serve online.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

import hf_paged.attention  # noqa: F401  (registers the "hf_paged" attention function)
from hf_paged.engine import sampler
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.model_runner import ModelRunner, StepInput
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Request, Sequence
from hf_paged.generate import _check_supported
from hf_paged.generate import enable as _enable


class LLMEngine:
    """Serve many requests at once on one model.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        tokenizer: optional; needed for string prompts, ``text`` outputs and ``stop`` strings.
        block_size: tokens per KV block.
        num_blocks: KV blocks on the model's device. ``None``: on CUDA, derived from free memory
            (``gpu_memory_utilization``); elsewhere from ``kv_cache_bytes`` or, without it, a pool
            that grows on demand (no preemption then).
        max_num_seqs / max_num_batched_tokens: per-step limits (sequences, tokens).
        enable_prefix_caching: reuse cached full blocks of earlier prompts.
        preemption_mode: ``"recompute"`` or ``"swap"`` (to ``swap_space_blocks`` CPU blocks).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any = None, *, block_size: int = 16, num_blocks: int | None = None,
        max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute", swap_space_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9, kv_cache_bytes: int | None = None,
    ):
        _check_supported(model)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.model = _enable(model, block_size=block_size, num_blocks=num_blocks).eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        num_blocks = self._block_budget(num_blocks, block_size, gpu_memory_utilization, kv_cache_bytes)
        if swap_space_blocks is None:
            swap_space_blocks = (num_blocks or 0) if preemption_mode == "swap" else 0
        self.kv = KVCacheManager(
            block_size, num_blocks, enable_prefix_caching=enable_prefix_caching,
            swap_space_blocks=swap_space_blocks, pin_memory=model.device.type == "cuda",
        )
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
        )
        self.runner = ModelRunner(model, self.kv)
        self.eos_token_ids = self._eos_ids()
        self.max_positions = getattr(self.config, "max_position_embeddings", None) or getattr(
            self.config, "n_positions", None)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._counters = {"steps": 0, "generated_tokens": 0, "computed_prompt_tokens": 0, "busy_s": 0.0}

    # ------------------------------------------------------------------ setup
    def _bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        element = torch.finfo(self.model.dtype).bits // 8
        return 2 * cfg.num_hidden_layers * block_size * heads * head_dim * element

    def _block_budget(self, num_blocks, block_size, utilization, kv_cache_bytes) -> int | None:
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
            return num_blocks
        per_block = self._bytes_per_block(block_size)
        if kv_cache_bytes is not None:
            return max(1, kv_cache_bytes // per_block)
        if self.model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.model.device)
            usable = total * utilization - (total - free)
            return max(1, int(usable * 0.9 // per_block))  # 10% left for activations
        return None

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    # ------------------------------------------------------------------ requests
    def _tokens(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer (pass tokenizer= to LLMEngine)")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Bad input raises ``ValueError`` and queues nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._tokens(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary (size {vocab}): {bad[:5]}")
        if self.max_positions and len(ids) >= self.max_positions:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's {self.max_positions} positions")
        if not self.kv.blocks.growable and self.kv.blocks_for(len(ids) + 1) > self.kv.num_blocks:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the whole KV cache "
                             f"({self.kv.num_blocks} blocks of {self.kv.block_size})")
        request = Request(request_id, ids, params, prompt=text)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        if params.beam_search:
            from hf_paged.engine.beam_search import BeamSearchState

            request.beam = BeamSearchState(
                num_beams=params.num_beams, num_return_sequences=params.n, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                prompt_len=len(ids), max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
            )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    @torch.inference_mode()
    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks."""
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self.scheduler.remove(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample. Returns outputs of requests that changed."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for request, reason in batch.rejected:
            self._fail(request, reason)
            changed[request.request_id] = request
        if batch.work:
            inputs = [StepInput(seq, seq.num_computed_tokens, n) for _, seq, n in batch.work]
            owner = {seq.seq_id: request for request, seq, _ in batch.work}
            ordered, logits = self.runner.execute(inputs)
            row = 0
            ready: dict[str, list[tuple[Sequence, torch.Tensor]]] = {}
            plain: list[tuple[Request, Sequence, int]] = []  # greedy rows that need nothing but the argmax
            for x in ordered:
                x.seq.num_computed_tokens += x.count
                self.kv.commit(x.seq)
                request = owner[x.seq.seq_id]
                if x.start < x.seq.num_prompt_tokens:
                    self._counters["computed_prompt_tokens"] += min(x.count, x.seq.num_prompt_tokens - x.start)
                if x.needs_logits:
                    if self._is_plain_greedy(request, x.seq):
                        plain.append((request, x.seq, row))
                    else:
                        ready.setdefault(request.request_id, []).append((x.seq, logits[row]))
                    row += 1
                changed[request.request_id] = request
            self._advance_plain_greedy(plain, logits)
            for request_id, got in ready.items():
                self._advance(self.requests[request_id], got)
            self._counters["steps"] += 1
        self._counters["busy_s"] += time.perf_counter() - start
        return [self._output(r) for r in changed.values() if r.request_id in self.requests or r.is_finished]

    @staticmethod
    def _is_plain_greedy(request: Request, seq: Sequence) -> bool:
        params = request.params
        return (request.beam is None and request.forked and params.greedy and params.repetition_penalty == 1.0
                and params.logprobs is None and len(seq.output_token_ids) >= params.min_new_tokens)

    def _advance_plain_greedy(self, plain: list[tuple[Request, Sequence, int]], logits: torch.Tensor) -> None:
        """All plain greedy rows of a step at once: one argmax and one log-softmax for the batch."""
        if not plain:
            return
        rows = logits[torch.tensor([r for _, _, r in plain], device=logits.device)]
        tokens = rows.argmax(-1)
        chosen = torch.log_softmax(rows, -1).gather(1, tokens[:, None])[:, 0]
        for (request, seq, _), token, logprob in zip(plain, tokens.tolist(), chosen.tolist()):
            self._append(request, seq, token, logprob)
            if not request.live_seqs:
                self._finish(request)

    def _advance(self, request: Request, got: list[tuple[Sequence, torch.Tensor]]) -> None:
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if request.beam is not None:
            self._advance_beams(request, got)
        else:
            for seq, logits in got:
                self._sample(request, seq, logits)
        if not request.live_seqs:
            self._finish(request)

    def _sample(self, request: Request, seq: Sequence, logits: torch.Tensor) -> None:
        params = request.params
        processed = sampler.process(logits, params, seq.token_ids, len(seq.output_token_ids), self.eos_token_ids)
        width = params.n if not request.forked else 1
        tokens = sampler.choose(processed, params, request.generator, width)
        raw = torch.log_softmax(logits, -1)
        if not request.forked:
            request.forked = True
            children = [seq] + [seq.fork(i) for i in range(1, width)]
            for child in children[1:]:
                self.kv.fork(seq, child)
            request.seqs = children
        else:
            children = [seq]
        for child, token in zip(children, tokens):
            self._append(request, child, token, float(raw[token]), raw)

    def _append(self, request: Request, seq: Sequence, token: int, logprob: float,
                raw_logprobs: torch.Tensor | None = None) -> None:
        params = request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + [sampler.top_logprobs(raw_logprobs, token, params.logprobs)]
        self._counters["generated_tokens"] += 1
        generated = len(seq.output_token_ids)
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif generated >= params.max_new_tokens or (self.max_positions and seq.num_tokens >= self.max_positions):
            seq.finish_reason = "length"
        if params.stop and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            hits = [seq.text.find(s) for s in params.stop if s in seq.text]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
        if seq.is_finished:
            self._retire(request, seq)

    def _retire(self, request: Request, seq: Sequence) -> None:
        """A finished sequence gives its blocks back at once."""
        self.kv.free(seq)
        request.seqs.remove(seq)
        request.finished_seqs.append(seq)

    def _advance_beams(self, request: Request, got: list[tuple[Sequence, torch.Tensor]]) -> None:
        state = request.beam
        pending = request.beam_rows
        for seq, logits in got:
            pending[seq.seq_id] = torch.log_softmax(logits.float(), -1)
        beams = request.live_seqs
        if any(seq.seq_id not in pending for seq in beams):
            return  # some beams are still being recomputed after a preemption
        if not request.forked:  # the prompt: every beam starts from it
            rows = pending[beams[0].seq_id].expand(state.num_beams, -1)
            parents_src = [beams[0]] * state.num_beams
        else:
            rows = torch.stack([pending[seq.seq_id] for seq in beams])
            parents_src = beams
        pending.clear()
        choices = state.step(rows)
        new_seqs = []
        for i, (parent_row, token) in enumerate(choices):
            parent = parents_src[parent_row]
            child = parent.fork(i)
            self.kv.fork(parent, child)
            child.token_ids.append(token)
            self._counters["generated_tokens"] += 1
            new_seqs.append(child)
        for seq in beams:
            self.kv.free(seq)
        request.forked = True
        request.seqs = new_seqs
        if state.done:
            for seq in new_seqs:
                self.kv.free(seq)
            request.seqs = []
            request.finished_seqs = []
            for index, (tokens, score) in enumerate(state.finalize()):
                seq = Sequence(request.prompt_token_ids + tokens, len(request.prompt_token_ids), index=index)
                seq.cumulative_logprob = score  # the length-penalised beam score (generate's sequences_scores)
                seq.finish_reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
                request.finished_seqs.append(seq)

    def _finish(self, request: Request) -> None:
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, reason: str) -> None:
        request.error = reason
        for seq in request.live_seqs:
            seq.finish_reason = "error"
        self._finish(request)

    # ------------------------------------------------------------------ outputs
    def _text(self, seq: Sequence) -> str:
        if seq.text or self.tokenizer is None:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def _output(self, request: Request) -> RequestOutput:
        seqs = sorted(request.seqs + request.finished_seqs, key=lambda s: s.index)
        outputs = [
            CompletionOutput(
                index=s.index, token_ids=s.output_token_ids, text=self._text(s), finish_reason=s.finish_reason,
                cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
            )
            for s in seqs
        ]
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, finished=request.is_finished,
            prompt=request.prompt, error=request.error,
        )

    # ------------------------------------------------------------------ offline and streaming use
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in input order. A bad prompt or bad parameters
        give that request an output with ``error`` set; the others are served."""
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            try:
                order.append(self.add_request(prompt, p))
            except ValueError as err:
                rid = f"rejected-{next(self._ids)}"
                order.append(rid)
                ids = prompt if isinstance(prompt, list) else []
                results[rid] = RequestOutput(rid, ids, [], finished=True,
                                             prompt=prompt if isinstance(prompt, str) else None, error=str(err))
        progress = _progress(len(order), use_tqdm)
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id not in results:
                    results[out.request_id] = out
                    progress.update(1)
        progress.close()
        return [results[rid] for rid in order]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[dict]:
        """Serve one request (alongside any others queued) and yield its new tokens as they come:
        ``{"index", "token_ids", "text", "finished"}`` deltas per completion."""
        request_id = self.add_request(prompt, params)
        sent: dict[int, tuple[int, int]] = {}
        while True:
            outputs = [o for o in self.step() if o.request_id == request_id]
            for out in outputs:
                for c in out.outputs:
                    n_tok, n_txt = sent.get(c.index, (0, 0))
                    if len(c.token_ids) > n_tok or c.finished:
                        yield {"index": c.index, "token_ids": c.token_ids[n_tok:], "text": c.text[n_txt:],
                               "finished": c.finished, "finish_reason": c.finish_reason}
                        sent[c.index] = (len(c.token_ids), len(c.text))
                if out.finished:
                    return
            if request_id not in self.requests and not outputs:
                return

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float | int]:
        s = self.scheduler
        busy = self._counters["busy_s"]
        queried = self.kv.prefix_queried_tokens
        return {
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "blocks_total": self.kv.num_blocks, "blocks_used": self.kv.blocks.num_used_blocks,
            "blocks_free": self.kv.num_free_blocks, "blocks_cached": self.kv.blocks.num_cached_blocks,
            "swap_blocks_used": self.kv.swap.num_used_blocks if self.kv.swap else 0,
            "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": self.kv.prefix_hit_tokens,
            "prefix_cache_hit_rate": self.kv.prefix_hit_tokens / queried if queried else 0.0,
            "computed_prompt_tokens": self._counters["computed_prompt_tokens"],
            "preemptions_recompute": s.preemptions["recompute"], "preemptions_swap": s.preemptions["swap"],
            "steps": self._counters["steps"], "generated_tokens": self._counters["generated_tokens"],
            "tokens_per_second": self._counters["generated_tokens"] / busy if busy else 0.0,
        }


class _NoProgress:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc="requests", unit="req")
