"""vLLM's ``AsyncLLM`` (``AsyncLLMEngine``) over :class:`~hf_paged.engine.LLMEngine`: requests from
asyncio code (an application's own web handlers, a notebook's ``await``), batched continuously by
one engine that steps on a background thread, or in an engine process of its own.

``generate(prompt, params, request_id)`` is an async generator of the request's outputs as its
``SamplingParams.output_kind`` asks (``CUMULATIVE``: everything so far, each step it changed;
``DELTA``: what is new; ``FINAL_ONLY``: the finished output) and its ``stream_interval``. The engine
hands over the newest whole output, which is cut here to what the consumer has not seen, so a
consumer slower than the engine misses nothing (deltas join up). Prompts are tokenized, and texts
decoded, on the caller's thread with a copy of the tokenizer (a fast tokenizer is not safe to share
between threads): the engine only steps. Leaving the loop early (``break``, an exception,
the task cancelled) aborts the request and frees its blocks; ``await abort(request_id)`` from
elsewhere ends its generator with a last output whose unfinished completions say
``finish_reason="abort"`` (as vLLM's). A request the engine fails raises ``RuntimeError``
(``ValueError`` when it can never be served here, e.g. more KV blocks than the cache has), as
``LLMEngine.stream()`` does; bad input raises ``ValueError`` before anything is queued.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_paged.engine import LLMEngine, RequestOutput, SamplingParams
from hf_paged.lora import LoRARequest
from hf_paged.engine.detokenize import text_decoder
from hf_paged.engine.intake import prompt_tokens
from hf_paged.engine.output_shaper import OutputShaper
from hf_paged.engine.outputs import CompletionOutput, request_failure
from hf_paged.engine.params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_paged.serve.engine_loop import RequestStream
    from hf_paged.serve.engine_process import EngineProcess


@dataclass
class _InFlight:
    """One ``generate()`` call's request: where its outputs come from and what it last received."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    num_completions: int
    last: RequestOutput | None = None
    aborted: bool = False


class AsyncLLM:
    """See the module docstring. ``AsyncLLM(model, tokenizer, **engine_kwargs)`` builds the engine
    (``LLMEngine``'s keywords: ``block_size``, ``num_blocks``, ``max_num_seqs``, ...);
    ``AsyncLLM(engine)`` serves one already built (nothing else may step it meanwhile).
    ``AsyncLLM(hf_paged.serve.EngineProcess(build, tokenizer))`` serves an engine in a process of
    its own, as ``hf-paged serve`` does by default and vLLM's ``AsyncLLM`` always: its steps then
    never hold this process's interpreter lock, which stays the application's (``build``: a
    picklable function, e.g. a ``functools.partial`` of a module-level one, that returns the
    ``LLMEngine``; ``tokenizer``: this side's). Call :meth:`shutdown` when done (or drop it):
    requests still in flight then raise, and an engine process ends."""

    def __init__(self, model: PreTrainedModel | LLMEngine | EngineProcess, tokenizer: Any = None, **engine_kwargs):
        from hf_paged.serve.engine_loop import EngineLoop, ProcessEngineLoop  # hf_paged.serve loads FastAPI
        from hf_paged.serve.engine_process import EngineProcess

        if isinstance(model, (LLMEngine, EngineProcess)):
            if tokenizer is not None or engine_kwargs:
                raise TypeError("AsyncLLM(engine) takes the engine alone: its tokenizer and options are the engine's")
            self.engine = model
        else:
            self.engine = LLMEngine(model, tokenizer, **engine_kwargs)
        # the callers' side tokenizes and decodes with its own copy (the engine thread uses the engine's)
        self._tokenizer = copy.deepcopy(self.engine.tokenizer)
        in_process = isinstance(self.engine, EngineProcess)
        self._loop = ProcessEngineLoop(self.engine) if in_process else EngineLoop(self.engine)
        self._loop.start()
        # an AsyncLLM dropped without shutdown() still ends its thread (and engine process)
        self._finalizer = weakref.finalize(self, self._loop.stop, 5.0)
        self._requests: dict[str, _InFlight] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Serve ``prompt`` (a string, token ids or vLLM's prompt dicts, as ``LLMEngine.add_request``
        takes) and yield its outputs; see the module docstring. ``request_id``: a fresh one when
        None; one of a request still in flight is a ``ValueError``. ``lora_request``: its LoRA
        adapter (an engine built with ``enable_lora=True``)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request_id = self._fresh_id() if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_tokens(self._tokenizer, prompt)
        # the engine hands over whole outputs; what the consumer asked for is cut from them here
        whole = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE, stream_interval=None)
        stream = self._loop.submit([{"prompt_token_ids": ids, "prompt": text}], whole, request_id, priority=priority,
                                   exact_id=True, lora_request=lora_request)
        request = self._requests[request_id] = _InFlight(stream, text, ids, max(params.n, 1))
        shaper = OutputShaper(params, self._tokenizer, ids)
        decode = text_decoder(self._tokenizer, params, ids) if self._tokenizer is not None and params.detokenize \
            else None
        try:
            await stream.accepted()
            async for _, out in stream:
                if out.error:
                    raise request_failure(out)
                request.last = out
                for c in out.outputs if decode is not None else ():
                    if not c.finished():  # decoded when read, on this thread (a finished one was, by the engine)
                        c.set_decoder(decode)
                if (shaped := shaper.shape(out)) is not None:
                    yield shaped
            if request.aborted:  # finished: there is always something to hand out
                yield shaper.shape(self._aborted_output(request_id, request))
        finally:
            self._requests.pop(request_id, None)
            if not stream.done:
                stream.abort()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests in flight (one id or several; others are ignored): their blocks are
        freed before the next step, and each one's generator ends with a last output whose
        unfinished completions say ``finish_reason="abort"``. Call it on the generators' event loop."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self._requests.get(str(rid))
            if request is not None and not request.stream.done:
                request.aborted = True
                request.stream.abort()

    @staticmethod
    def _aborted_output(request_id: str, request: _InFlight) -> RequestOutput:
        """vLLM's last output of an aborted request: what it had, its unfinished completions ended."""
        last = request.last
        if last is None:
            completions = [CompletionOutput(i, [], finish_reason="abort") for i in range(request.num_completions)]
            return RequestOutput(request_id, request.prompt_token_ids, completions, finished=True,
                                 prompt=request.prompt, num_cached_tokens=0)
        completions = [c if c.finished() else
                       CompletionOutput(c.index, c.token_ids, finish_reason="abort",
                                        cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                                        decode=lambda c=c: c.text)
                       for c in last.outputs]
        return dataclasses.replace(last, outputs=completions, finished=True)

    def _fresh_id(self) -> str:
        request_id = f"async-{next(self._ids)}"
        while request_id in self._requests:
            request_id = f"async-{next(self._ids)}"
        return request_id

    # ------------------------------------------------------------------ the engine
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """The ``generate()`` calls in flight."""
        return len(self._requests)

    @property
    def is_running(self) -> bool:
        """The engine thread runs (until :meth:`shutdown`)."""
        return self._loop.alive

    @property
    def errored(self) -> bool:
        """The engine cannot serve: its thread ended, or its steps keep failing (``LLMEngine.healthy``)."""
        return not self._loop.alive or not self._loop.healthy

    async def check_health(self) -> None:
        """Raises ``RuntimeError`` when :attr:`errored`."""
        if self.errored:
            raise RuntimeError("the engine is not running" if not self._loop.alive else
                               "the engine is unhealthy: its recent steps failed")

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache``, run between steps (False while requests are unfinished)."""
        return await asyncio.wrap_future(self._loop.call(LLMEngine.reset_prefix_cache))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (and the engine process: see the class docstring); requests in
        flight end with ``RuntimeError`` (the engine is shutting down), their blocks freed."""
        self._finalizer.detach()
        self._loop.stop(timeout)


AsyncLLMEngine = AsyncLLM  # vLLM's other name of it
