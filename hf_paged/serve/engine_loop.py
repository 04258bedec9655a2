"""The one thread that owns the ``LLMEngine`` (or, with :class:`ProcessEngineLoop`, talks to it in
an engine process: :mod:`.engine_process`); HTTP handlers only enqueue and read.

Handlers (on the asyncio event loop) send commands through a queue: add a request (with its LoRA
adapter, if any), abort one, run a function on the engine (stats, loading an adapter), end
everything in flight (shutdown). The engine thread drains that queue between steps, steps the
engine while anything is unfinished, and hands each request's outputs back to its handler's
:class:`RequestStream` (one ``call_soon_threadsafe`` per event loop and step). Nothing else
touches the engine, so it needs no locks, and an abort frees the request's blocks before the
next step.

A stream keeps only the latest output of each of its requests until its handler reads it (an
output holds everything produced so far), so a handler that cannot send (a client that does not
read) holds one output per request, not one per step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from hf_paged.constraints.compiler import ConstraintCompiler, compiler_for
from hf_paged.engine.detokenize import text_decoder
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.lora import LoRARequest
from hf_paged.serve.metrics import ServingMetrics

if TYPE_CHECKING:
    from hf_paged.serve.engine_process import EngineProcess

logger = logging.getLogger("hf_paged.serve")
_ACCEPTED = "accepted"


class Overloaded(Exception):
    """More requests are waiting than ``max_waiting`` allows (answered 503)."""


class EngineFailure(RuntimeError):
    """The engine failed a request, or the server is stopping; answered 503 with ``code``."""

    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.code = code


def shutting_down() -> EngineFailure:
    return EngineFailure("the server is shutting down", code="server_shutting_down")


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt), read on its event loop.

    Iterating yields ``(prompt index, RequestOutput)``: every change, or with ``final_only`` just
    the finished outputs. ``abort()`` stops whatever is unfinished (idempotent). ``params(i)``:
    the ``SamplingParams`` of prompt ``i``'s request (what its text shows: a stream's deltas are
    decoded as its final text is). ``priority`` and ``lora_request``: its requests'
    (``LLMEngine.add_request``).
    """

    def __init__(self, owner: EngineLoop, request_ids: list[str], final_only: bool,
                 params: SamplingParams | list[SamplingParams] | None = None, priority: int = 0,
                 lora_request: LoRARequest | None = None):
        self.request_ids, self.final_only, self.priority = request_ids, final_only, priority
        self.lora_request = lora_request
        self._params = params
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._admission: asyncio.Future = self._loop.create_future()  # _ACCEPTED or why not
        self._latest: dict[int, RequestOutput] = {}  # per prompt index: the newest unread output
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._unfinished = len(request_ids)
        self._aborted = False

    async def accepted(self) -> None:
        """Wait for the engine to queue the requests; raises ``ValueError`` (bad prompt or
        parameters) or :class:`Overloaded`, in which case nothing was queued."""
        item = await self._admission
        if isinstance(item, BaseException):
            self._unfinished = 0
            raise item

    def put(self, item: Any) -> None:
        """From the engine thread (on this stream's event loop): admission, an output or an error.
        An output replaces the unread one of its request: outputs are cumulative."""
        if not self._admission.done():
            self._admission.set_result(item)
            return
        if isinstance(item, BaseException):
            self._error = item
        else:
            index, output = item
            self._latest[index] = output
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished and not self._aborted:
            if self._latest:
                index = next(iter(self._latest))
                output = self._latest.pop(index)
                self._unfinished -= output.finished
                yield index, output
            elif self._error is not None:
                self._unfinished = 0
                raise self._error
            else:
                self._wake.clear()
                await self._wake.wait()

    def params(self, index: int) -> SamplingParams:
        """The parameters prompt ``index``'s request was submitted with."""
        params = self._params[index] if isinstance(self._params, list) else self._params
        return SamplingParams() if params is None else params

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def abort(self) -> None:
        """Stop the unfinished requests (their blocks are freed before the next step) and end the
        iteration; call it on the stream's event loop."""
        if not self.done and not self._aborted:
            self._aborted = True
            self._unfinished = 0
            self._wake.set()
            self._owner.abort(self)


@dataclass
class _Live:
    """An engine request in flight: where its outputs go and when it last produced tokens."""

    stream: RequestStream
    index: int
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0
    prompt: list[int] | None = None  # with an engine process: the prompt its first output brought
    prompt_logprobs: list | None = None  # ... and the whole prompt log-probs, once they came


class EngineLoop:
    """Runs ``engine`` in a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None, metrics: ServingMetrics | None = None):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = metrics or ServingMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ the handlers' side
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread; requests still in flight are aborted and their streams get an error."""
        if self._thread is not None:
            self._post(("stop",))
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """Engine requests queued or running for a client (read it in ``call`` for an exact value)."""
        return len(self._live)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """The engine's own health (``LLMEngine.healthy``)."""
        return self.engine.healthy

    @property
    def compiler(self) -> ConstraintCompiler:
        """The constraint compiler the engine uses (the server compiles a request's constraint
        before queueing it, so that a bad one is a 400 before its stream starts)."""
        return self.engine.structured.compiler

    def submit(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], request_id: str,
               final_only: bool = False, priority: int = 0, exact_id: bool = False,
               lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue one engine request per prompt (ids ``{request_id}-{i}``, or with ``exact_id`` the one
        prompt's ``request_id`` itself; ``params`` for all, or one per prompt; all with ``priority``
        and the LoRA adapter ``lora_request``, None: the base model); await ``accepted()``."""
        if exact_id and len(prompts) != 1:
            raise ValueError(f"exact_id: one prompt has one id, got {len(prompts)} prompts")
        request_ids = [request_id] if exact_id else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, request_ids, final_only, params, priority, lora_request)
        self._post(("add", stream, prompts, params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        self._post(("abort", stream))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` where the engine runs, between steps (stats, test checks, LoRA
        adapters). A caller that stops waiting may cancel the future: ``fn`` then does not run, if
        it has not started."""
        future: Future = Future()
        self._post(("call", fn, future))
        return future

    def end_all(self, error: EngineFailure) -> None:
        """End every request in flight with ``error`` (their streams get it), freeing their blocks."""
        self._post(("end_all", error))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests() and not self._stopping:
                try:
                    outputs = self.engine.step()
                except Exception as err:  # a bug: end what is in flight, keep serving
                    logger.exception("engine step failed")
                    self._end_all(EngineFailure(f"the engine failed: {type(err).__name__}: {err}"))
                else:
                    self._dispatch(outputs)
            self._flush()
        self._end_all(shutting_down())
        self._refuse_queued()
        self._flush()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
            while True:
                self._execute(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _execute(self, command: tuple) -> None:
        match command:
            case ("add", stream, prompts, params):
                self._add(stream, prompts, params)
            case ("abort", stream):
                ended = [request_id for request_id in stream.request_ids if self._live.pop(request_id, None)]
                for _ in ended:
                    self.metrics.finish("abort")
                self._abort_in_engine(ended)
            case ("end_all", error):
                self._end_all(error)
            case ("call", fn, future):
                if not future.set_running_or_notify_cancel():  # its caller gave up waiting
                    return
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)
            case ("stop",):
                self._stopping = True

    def _add(self, stream: RequestStream, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams]) -> None:
        refusal = add_requests(self.engine, stream.request_ids, prompts, params, self.max_waiting, stream.priority,
                               stream.lora_request)
        self._admit(stream, len(prompts), refusal)

    def _admit(self, stream: RequestStream, num_prompts: int, refusal: tuple[str, str] | None) -> None:
        """The stream's requests are live now, or it learns why they were refused (see
        :func:`add_requests`): 400 for a bad request, 503 when overloaded or the engine refused."""
        if refusal is None:
            now = time.monotonic()
            for index, request_id in enumerate(stream.request_ids):
                self._live[request_id] = _Live(stream, index, now)
            return self._send(stream, _ACCEPTED)
        why, message = refusal
        self.metrics.reject(why, num_prompts)
        if why == "overloaded":
            return self._send(stream, Overloaded(message))
        if why == "invalid":
            return self._send(stream, ValueError(message))
        self._send(stream, EngineFailure(f"the engine cannot take requests: {message}", code="engine_unhealthy"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens > live.num_tokens:
                if live.last_token is None:
                    self.metrics.first_token(now - live.arrival)
                else:
                    self.metrics.next_token(now - live.last_token)
                live.last_token, live.num_tokens = now, tokens
            if out.finished:
                del self._live[out.request_id]
                first = out.outputs[0].finish_reason if out.outputs else None
                self.metrics.finish("error" if out.error else first or "stop")
            if out.finished or not live.stream.final_only:
                self._send(live.stream, (live.index, out))

    def _end_all(self, error: EngineFailure) -> None:
        request_ids = list(self._live)
        for live in self._live.values():
            self.metrics.finish("error")
            self._send(live.stream, error)
        self._live.clear()
        self._abort_in_engine(request_ids)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)

    def _refuse_queued(self) -> None:
        """After the loop: answer what is still queued, so no handler waits forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._refuse(command, shutting_down())

    def _refuse(self, command: tuple, error: EngineFailure) -> None:
        """Answer a queued add or call with ``error`` instead of running it."""
        if command[0] == "add":
            self._send(command[1], error)
        elif command[0] == "call" and command[2].set_running_or_notify_cancel():
            command[2].set_exception(error)

    def _send(self, stream: RequestStream, item: Any) -> None:
        self._outbox.setdefault(stream._loop, []).append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is reading
                pass


def add_requests(engine: LLMEngine, request_ids: list[str], prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams], max_waiting: int | None,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> tuple[str, str] | None:
    """Queue one engine request per prompt, all or none (in the engine's thread or process), with
    ``params``, or one of them per prompt (a completion's default ``max_tokens`` is what fits after
    its own prompt), ``priority`` and ``lora_request``. None when queued, else ``(why, message)``:
    "overloaded" (more than ``max_waiting`` would wait), "invalid" (``ValueError``: a bad prompt or
    parameters, or an adapter that cannot be read) or "engine" (the engine refused, e.g. a
    tensor-parallel engine whose group was stopped; logged)."""
    if max_waiting is not None and engine.stats()["waiting"] + len(prompts) > max_waiting:
        return "overloaded", f"more than {max_waiting} requests are waiting; retry later"
    added = []
    try:
        each = params if isinstance(params, list) else [params] * len(prompts)
        for request_id, prompt, prompt_params in zip(request_ids, prompts, each):
            engine.add_request(prompt, prompt_params, request_id=request_id, priority=priority,
                               lora_request=lora_request)
            added.append(request_id)
    except Exception as err:  # noqa: BLE001 - the caller answers 400 or 503
        for request_id in added:
            engine.abort(request_id)
        if isinstance(err, ValueError):
            return "invalid", str(err)
        logger.error("the engine refused a request: %s: %s", type(err).__name__, err)
        return "engine", str(err)
    return None


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)


class ProcessEngineLoop(EngineLoop):
    """:class:`EngineLoop` over an :class:`EngineProcess`: same handlers' side, and ``call(fn)``
    runs ``fn(engine)`` in the engine process (``fn`` and its result must pickle: a module-level
    function such as ``LLMEngine.stats``)."""

    def __init__(self, engine: EngineProcess, *, max_waiting: int | None = None,
                 metrics: ServingMetrics | None = None):
        super().__init__(engine, max_waiting=max_waiting, metrics=metrics)  # type: ignore[arg-type]
        self.connection = engine.connection
        self._wake_read, self._wake_write = socket.socketpair()  # wakes the thread when a command is queued
        self._wake_write.setblocking(False)
        self._pending: dict[str, tuple[RequestStream, int]] = {}  # first request id -> (stream, prompts)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._healthy = True
        self._engine_gone: EngineFailure | None = None
        self._compiler: ConstraintCompiler | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy and self._engine_gone is None

    @property
    def alive(self) -> bool:
        return super().alive and self._engine_gone is None

    @property
    def compiler(self) -> ConstraintCompiler:
        """A compiler like the engine's (same tokenizer, vocabulary and stop tokens): the server's
        check of a constraint; the engine process compiles it again for its own cache."""
        if self._compiler is None:
            facts = self.engine.facts
            self._compiler = compiler_for(self.engine.tokenizer, facts.vocab_size, facts.eos_token_ids)
        return self._compiler

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        try:
            self._wake_write.send(b"\0")
        except OSError:  # full of wake-ups (the thread drains the queue anyway), or stopped
            pass

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        self.engine.close(timeout)
        self._wake_read.close()
        self._wake_write.close()

    # ------------------------------------------------------------------ the loop's thread
    def _run(self) -> None:
        while not self._stopping:
            watched = [self._wake_read] if self._engine_gone else [self._wake_read, self.connection]
            ready = wait(watched, timeout=1.0)
            if self._wake_read in ready:
                self._wake_read.recv(65536)
                self._drain(block=False)
            if self.connection in ready:
                self._receive_all()
            self._flush()
        self._end_all(shutting_down())
        self._refuse_queued()
        self._flush()

    def _receive_all(self) -> None:
        try:
            while self._engine_gone is None and self.connection.poll(0):
                self._receive(self.connection.recv())
        except (EOFError, OSError):
            self._lost_engine()

    def _lost_engine(self) -> None:
        self.engine.process.join(1)
        self._engine_gone = EngineFailure(f"the engine process exited (code {self.engine.process.exitcode})",
                                          code="engine_unhealthy")
        logger.error("%s: requests in flight end with an error; /health answers 503", self._engine_gone)
        self._end_all(self._engine_gone)
        for stream, _ in self._pending.values():
            self._send(stream, self._engine_gone)
        self._pending.clear()
        for future in self._calls.values():
            future.set_exception(self._engine_gone)
        self._calls.clear()

    def _receive(self, message: tuple) -> None:
        match message:
            case ("outputs", outputs, healthy):
                self._healthy = healthy
                self._dispatch([self._restore(o) for o in outputs])
            case ("added", key, refusal):
                entry = self._pending.pop(key, None)
                if entry is not None:  # else aborted before the engine answered (the engine aborted it too)
                    self._admit(*entry, refusal)
            case ("step_failed", text, healthy):
                self._healthy = healthy
                self._end_all(EngineFailure(text))
            case ("called", key, ok, value):
                future = self._calls.pop(key)
                future.set_result(value) if ok else future.set_exception(value)

    def _restore(self, output: RequestOutput) -> RequestOutput:
        """Give the output back what was left out of the pipe: its prompt, a decoder for its text
        (with its request's text options, as the engine process decodes a final text)."""
        live = self._live.get(output.request_id)
        if output.prompt_token_ids is None:
            output.prompt_token_ids = live.prompt if live is not None else []
        elif live is not None:
            live.prompt = output.prompt_token_ids
        if live is not None:  # sent whole once (EngineProcess._slim)
            if output.prompt_logprobs is None:
                output.prompt_logprobs = live.prompt_logprobs
            elif output.has_whole_prompt_logprobs:
                live.prompt_logprobs = output.prompt_logprobs
        decode = None  # the defaults where the request is no longer live
        for completion in output.outputs:
            if completion.needs_decoder:
                params = live.stream.params(live.index) if live is not None else None
                decode = decode or text_decoder(self.engine.tokenizer, params, output.prompt_token_ids)
                completion.set_decoder(decode)
        return output

    def _execute(self, command: tuple) -> None:
        if self._engine_gone is not None and command[0] in ("add", "call"):
            return self._refuse(command, self._engine_gone)
        match command:
            case ("add", stream, prompts, params):
                key = stream.request_ids[0]
                self._pending[key] = (stream, len(prompts))
                problem = self._forward(("add", key, stream.request_ids, prompts, params, self.max_waiting,
                                         stream.priority, stream.lora_request))
                if problem is not None:
                    del self._pending[key]
                    self._send(stream, problem)
            case ("abort", stream) if stream.request_ids[0] in self._pending:  # the engine has not answered
                del self._pending[stream.request_ids[0]]
                self._forward(("abort", stream.request_ids))  # it aborts the requests right after adding them
            case ("call", fn, future):
                if not future.set_running_or_notify_cancel():  # its caller gave up waiting
                    return None
                key = next(self._call_ids)
                self._calls[key] = future
                problem = self._forward(("call", key, fn))
                if problem is not None:
                    del self._calls[key]
                    future.set_exception(problem)
            case _:  # abort of live requests, end_all, stop
                super()._execute(command)

    def _forward(self, message: tuple) -> BaseException | None:
        """Send ``message`` to the engine process; what went wrong, if anything."""
        try:
            data = ForkingPickler.dumps(message)
        except Exception as err:  # noqa: BLE001 - pickling fails with several types
            return ValueError(f"cannot be sent to the engine process: {type(err).__name__}: {err}")
        if self._engine_gone is not None:
            return self._engine_gone
        try:
            self.connection.send_bytes(data)
        except OSError:  # it exited: the thread reads the end of the pipe next
            return EngineFailure("the engine process exited", code="engine_unhealthy")
        return None

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        if request_ids and self._engine_gone is None:
            self._forward(("abort", request_ids))
