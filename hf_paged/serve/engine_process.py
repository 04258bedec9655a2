"""The engine in a process of its own: the server's process keeps HTTP, the engine's keeps the model.

In one process the engine thread and the HTTP side share the GIL: while a step runs compiled
kernels (inductor's C++ kernels hold the GIL, and each opens an OpenMP region) the event loop cannot
answer, and while the event loop encodes events the step's OpenMP workers wait for it. On a small
machine that halves throughput; vLLM runs its engine core in a process of its own for the same
reason, and so does ``hf-paged serve`` (``--no-engine-process`` keeps the thread).

:class:`EngineProcess` starts the process (``spawn``: the engine is built there by a picklable
``build()``, so the model is loaded once, in the process that runs it) and waits for its
:class:`EngineFacts`. :class:`ProcessEngineLoop` is :class:`~hf_paged.serve.engine_loop.EngineLoop`'s
interface over it: handlers queue commands exactly as before; the loop's thread forwards them
through a pipe and hands the outputs that come back to the streams. The engine process steps
whenever it has work, sending each step's outputs as it goes, so it never waits for the HTTP side.

What crosses the pipe is small: a request's prompt once (its first output; the server keeps it),
outputs' texts undecoded (the server decodes the few it reads, with its own tokenizer). The engine
process ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the server drains
first, then stops it) and exits when the pipe closes, so a server that dies leaves no engine
behind.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hf_paged.constraints.compiler import ConstraintCompiler, compiler_for
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import RequestOutput
from hf_paged.serve.engine_loop import (ACCEPTED, EngineFailure, EngineLoop, LiveRequest, Overloaded, RequestStream,
                                        shutting_down)
from hf_paged.serve.metrics import ServingMetrics

logger = logging.getLogger("hf_paged.serve")


@dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know of an engine it cannot touch."""

    vocab_size: int
    max_positions: int | None
    kv_tokens: int | None  # tokens the KV cache holds; None when it grows
    eos_token_ids: list[int]
    pid: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        kv = engine.kv
        return cls(engine.config.vocab_size, engine.max_positions,
                   None if kv.growable else kv.num_blocks * kv.block_size, list(engine.eos_token_ids), os.getpid())


class EngineProcess:
    """An ``LLMEngine`` built by ``build()`` and stepped in a child process; ``tokenizer`` is the
    server's copy (the engine process loads its own). ``close()`` stops it (idempotent)."""

    def __init__(self, build: Callable[[], LLMEngine], tokenizer: Any, start_timeout: float = 1800.0):
        self.tokenizer = tokenizer
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=run_engine_core, args=(build, child), name="hf-paged-engine-core",
                                       daemon=True)
        self.process.start()
        child.close()
        self.facts = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> EngineFacts:
        try:
            if not self.connection.poll(timeout):
                raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")
            kind, payload = self.connection.recv()
        except EOFError:
            self.process.join(5)
            kind, payload = "failed", f"it exited with code {self.process.exitcode}"
        except BaseException:
            self.close()
            raise
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the engine process failed to start: {payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop, then wait for it (killed after ``timeout``)."""
        if self.process.pid is None or self.process.exitcode is not None:
            return
        try:
            self.connection.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine process did not stop within %.0f s: killed", timeout)
            self.process.kill()
            self.process.join(5)
        self.connection.close()


# ---------------------------------------------------------------------------- the engine's process
def run_engine_core(build: Callable[[], LLMEngine], connection: Connection) -> None:
    """The engine process: build the engine, report its facts, serve commands and step until told
    to stop or the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="hf-paged engine: %(levelname)s %(message)s")
    try:
        engine = build()
        facts = EngineFacts.of(engine)
    except BaseException as err:  # noqa: BLE001 - reported to the server, which raises it
        connection.send(("failed", f"{type(err).__name__}: {err}"))
        return
    connection.send(("ready", facts))
    try:
        _EngineCore(engine, connection).run()
    finally:
        engine.close()


class _EngineCore:
    def __init__(self, engine: LLMEngine, connection: Connection):
        self.engine, self.connection = engine, connection
        self.live: set[str] = set()  # added, not finished
        self.prompt_sent: set[str] = set()
        self.stopping = False

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            if not engine.has_unfinished_requests():
                self.connection.poll(None)  # idle: wait for a command (or the pipe's end)
            try:
                while self.connection.poll(0):
                    self._execute(self.connection.recv())
            except (EOFError, OSError):  # the server is gone
                return
            if self.stopping or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # a bug: end what is in flight, keep serving
                logger.exception("engine step failed")
                for request_id in self.live:
                    engine.abort(request_id)
                self.live.clear()
                self.prompt_sent.clear()
                self._send(("step_failed", f"the engine failed: {type(err).__name__}: {err}", engine.healthy))
            else:
                self._send(("outputs", [self._slim(o) for o in outputs], engine.healthy))

    def _slim(self, output: RequestOutput) -> RequestOutput:
        """The prompt goes with a request's first output only; the finished leave ``live``."""
        if output.request_id in self.prompt_sent:
            output.prompt_token_ids = None
        if output.finished:
            self.live.discard(output.request_id)
            self.prompt_sent.discard(output.request_id)
        else:
            self.prompt_sent.add(output.request_id)
        return output

    def _send(self, message: tuple) -> None:
        try:
            self.connection.send(message)
        except (OSError, ValueError):  # the server is gone
            self.stopping = True

    def _execute(self, command: tuple) -> None:
        match command:
            case ("add", key, request_ids, prompts, params, max_waiting):
                self._send(("added", key, *self._add(request_ids, prompts, params, max_waiting)))
            case ("abort", request_ids):
                for request_id in request_ids:
                    if request_id in self.live:
                        self.engine.abort(request_id)
                        self.live.discard(request_id)
                        self.prompt_sent.discard(request_id)
            case ("call", key, fn):
                try:
                    reply = ("called", key, True, fn(self.engine))
                except Exception as err:  # noqa: BLE001 - handed to the caller
                    reply = ("called", key, False, err)
                try:
                    self.connection.send(reply)
                except Exception as err:  # noqa: BLE001 - the result does not pickle
                    self._send(("called", key, False, RuntimeError(f"the result cannot be sent back: {err}")))
            case ("stop",):
                self.stopping = True

    def _add(self, request_ids: list[str], prompts: list[list[int]], params, max_waiting: int | None):
        """``(None, "")`` when queued, else ``(kind, message)``: nothing of the request is queued."""
        if max_waiting is not None and self.engine.stats()["waiting"] + len(prompts) > max_waiting:
            return "overloaded", f"more than {max_waiting} requests are waiting; retry later"
        added = []
        try:
            for request_id, prompt in zip(request_ids, prompts):
                self.engine.add_request(prompt, params, request_id=request_id)
                added.append(request_id)
        except Exception as err:  # noqa: BLE001 - ValueError: a bad request (400); else the engine refused (503)
            for request_id in added:
                self.engine.abort(request_id)
            if not isinstance(err, ValueError):
                logger.error("the engine refused a request: %s: %s", type(err).__name__, err)
            return ("invalid" if isinstance(err, ValueError) else "engine"), str(err)
        self.live.update(added)
        return None, ""


# ---------------------------------------------------------------------------- the server's process
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
            case ("added", key, kind, text):
                self._added(key, kind, text)
            case ("step_failed", text, healthy):
                self._healthy = healthy
                self._end_all(EngineFailure(text), engine_ended_them=True)
            case ("called", key, ok, value):
                future = self._calls.pop(key)
                future.set_result(value) if ok else future.set_exception(value)

    def _restore(self, output: RequestOutput) -> RequestOutput:
        """Give the output back what was left out of the pipe: its prompt, a decoder for its text."""
        live = self._live.get(output.request_id)
        if output.prompt_token_ids is None:
            output.prompt_token_ids = live.prompt if live is not None else []
        elif live is not None:
            live.prompt = output.prompt_token_ids
        for completion in output.outputs:
            if completion.needs_decoder:
                completion.set_decoder(self._decode)
        return output

    def _decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _added(self, key: str, kind: str | None, text: str) -> None:
        entry = self._pending.pop(key, None)
        if entry is None:  # aborted before the engine answered (the engine aborted it too)
            return
        stream, num_prompts = entry
        if kind is None:
            now = time.monotonic()
            for index, request_id in enumerate(stream.request_ids):
                self._live[request_id] = LiveRequest(stream, index, now)
            return self._send(stream, ACCEPTED)
        self.metrics.reject(kind, num_prompts)
        if kind == "overloaded":
            return self._send(stream, Overloaded(text))
        if kind == "invalid":
            return self._send(stream, ValueError(text))
        self._send(stream, EngineFailure(f"the engine cannot take requests: {text}", code="engine_unhealthy"))

    def _execute(self, command: tuple) -> None:
        if self._engine_gone is not None and command[0] in ("add", "call"):
            return self._refuse(command, self._engine_gone)
        match command:
            case ("add", stream, prompts, params):
                key = stream.request_ids[0]
                self._pending[key] = (stream, len(prompts))
                problem = self._forward(("add", key, stream.request_ids, prompts, params, self.max_waiting))
                if problem is not None:
                    del self._pending[key]
                    self._send(stream, problem)
            case ("abort", stream):
                self._pending.pop(stream.request_ids[0], None)
                for request_id in stream.request_ids:
                    if self._live.pop(request_id, None) is not None:
                        self.metrics.finish("abort")
                self._forward(("abort", stream.request_ids))
            case ("end_all", error):
                self._end_all(error)
            case ("call", fn, future):
                key = next(self._call_ids)
                self._calls[key] = future
                problem = self._forward(("call", key, fn))
                if problem is not None:
                    del self._calls[key]
                    future.set_exception(problem)
            case ("stop",):
                self._stopping = True

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

    def _refuse(self, command: tuple, error: EngineFailure) -> None:
        if command[0] == "add":
            self._send(command[1], error)
        else:
            command[2].set_exception(error)

    def _end_all(self, error: EngineFailure, engine_ended_them: bool = False) -> None:
        request_ids = list(self._live)
        for live in self._live.values():
            self.metrics.finish("error")
            self._send(live.stream, error)
        self._live.clear()
        if request_ids and not engine_ended_them:
            self._forward(("abort", request_ids))
