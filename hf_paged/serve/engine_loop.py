"""The one thread that owns the ``LLMEngine``; HTTP handlers only enqueue and read.

Handlers (on the asyncio event loop) send commands through a queue: add a request, abort one,
run a function on the engine, end everything in flight (shutdown). The engine thread drains that
queue between steps, steps the engine while anything is unfinished, and hands each request's
outputs back to its handler's :class:`RequestStream` (one ``call_soon_threadsafe`` per event loop
and step). Nothing else touches the engine, so it needs no locks, and an abort frees the
request's blocks before the next step.

A stream keeps only the latest output of each of its requests until its handler reads it (an
output holds everything produced so far), so a handler that cannot send (a client that does not
read) holds one output per request, not one per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hf_paged.constraints.compiler import ConstraintCompiler
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.serve.metrics import ServingMetrics

logger = logging.getLogger("hf_paged.serve")
ACCEPTED = "accepted"  # what a stream's admission gets when its requests are queued


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
    the finished outputs. ``abort()`` stops whatever is unfinished (idempotent).
    """

    def __init__(self, owner: EngineLoop, request_ids: list[str], final_only: bool):
        self.request_ids, self.final_only = request_ids, final_only
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._admission: asyncio.Future = self._loop.create_future()  # ACCEPTED or why not
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
class LiveRequest:
    """An engine request in flight: where its outputs go and when it last produced tokens."""

    stream: RequestStream
    index: int
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0
    prompt: list[int] | None = None  # with an engine process: the prompt its first output brought


class EngineLoop:
    """Runs ``engine`` in a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None, metrics: ServingMetrics | None = None):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = metrics or ServingMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, LiveRequest] = {}
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

    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
               final_only: bool = False) -> RequestStream:
        """Queue one engine request per prompt (ids ``{request_id}-{i}``); await ``accepted()``."""
        stream = RequestStream(self, [f"{request_id}-{i}" for i in range(len(prompts))], final_only)
        self._post(("add", stream, prompts, params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        self._post(("abort", stream))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` where the engine runs, between steps (stats, test checks)."""
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
                for request_id in stream.request_ids:
                    if self._live.pop(request_id, None) is not None:
                        self.engine.abort(request_id)
                        self.metrics.finish("abort")
            case ("end_all", error):
                self._end_all(error)
            case ("call", fn, future):
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)
            case ("stop",):
                self._stopping = True

    def _add(self, stream: RequestStream, prompts: list[list[int]], params: SamplingParams) -> None:
        if self.max_waiting is not None and self.engine.stats()["waiting"] + len(prompts) > self.max_waiting:
            self.metrics.reject("overloaded", len(prompts))
            return self._send(stream, Overloaded(f"more than {self.max_waiting} requests are waiting; retry later"))
        now = time.monotonic()
        try:
            for index, (request_id, prompt) in enumerate(zip(stream.request_ids, prompts)):
                self.engine.add_request(prompt, params, request_id=request_id)
                self._live[request_id] = LiveRequest(stream, index, now)
        except Exception as err:  # noqa: BLE001 - ValueError: a bad request (400); else the engine refused (503)
            for request_id in stream.request_ids:
                if self._live.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
            self.metrics.reject("invalid" if isinstance(err, ValueError) else "engine", len(prompts))
            if not isinstance(err, ValueError):  # e.g. a tensor-parallel engine whose group was stopped
                logger.error("the engine refused a request: %s: %s", type(err).__name__, err)
                err = EngineFailure(f"the engine cannot take requests: {err}", code="engine_unhealthy")
            return self._send(stream, err)
        self._send(stream, ACCEPTED)

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
        for request_id, live in list(self._live.items()):
            self.engine.abort(request_id)
            self.metrics.finish("error")
            self._send(live.stream, error)
        self._live.clear()

    def _refuse_queued(self) -> None:
        """After the loop: answer what is still queued, so no handler waits forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._send(command[1], shutting_down())
            elif command[0] == "call":
                command[2].set_exception(shutting_down())

    def _send(self, stream: RequestStream, item: Any) -> None:
        self._outbox.setdefault(stream._loop, []).append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is reading
                pass


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)
