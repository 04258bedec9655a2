"""The engine in a process of its own: the server's process keeps HTTP, the engine's keeps the model.

In one process the engine thread and the HTTP side share the GIL: while a step runs compiled
kernels (inductor's C++ kernels hold the GIL) the event loop cannot answer, and while the event
loop encodes events the step waits for the GIL. vLLM runs its engine core in a process of its own
for the same reason, and so does ``hf-paged serve`` (``--no-engine-process`` keeps the thread;
the measurements are in RESULTS.md, "Against vLLM's CPU build").

:class:`EngineProcess` starts the process (spawned, or forked from a fork server: the engine is
built there by a picklable ``build()``, so the model is loaded once, in the process that runs it) and
waits for its :class:`EngineFacts`. :class:`~hf_paged.serve.engine_loop.ProcessEngineLoop` is the engine loop's
interface over it: handlers queue commands exactly as before; the loop's thread forwards them
through a pipe and hands the outputs that come back to the streams. The engine process steps
whenever it has work, sending each step's outputs as it goes, so it never waits for the HTTP side.

What crosses the pipe is small: a request's prompt once (its first output; the server keeps it),
outputs' texts undecoded (the server decodes the few it reads, with its own tokenizer). The engine
process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a service manager's stop reach the whole
process group: the server drains first, then stops it) and exits when the pipe closes, so a server
that dies leaves no engine behind.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import RequestOutput
from hf_paged.engine.params import generation_defaults
from hf_paged.process_exit import exit_process
from hf_paged.serve.engine_loop import add_requests

logger = logging.getLogger("hf_paged.serve")


@dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know of an engine it cannot touch."""

    vocab_size: int
    max_positions: int | None
    kv_tokens: int | None  # tokens one sequence can hold in the KV cache; None: no bound (it grows, or windows)
    kv_block_size: int
    eos_token_ids: list[int]
    max_num_seqs: int  # the widest request (n, beams) a step can hold
    sampling_defaults: dict  # request defaults from the model's generation config (params.generation_defaults)
    scheduling_policy: str = "fcfs"  # whether requests' priority is honoured ("priority")
    max_loras: int | None = None  # LoRA adapters at most among a step's requests; None: it serves none

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        kv = engine.kv
        return cls(engine.config.vocab_size, engine.max_positions,
                   kv.max_tokens_alone(engine.scheduler.prefill_chunk), kv.block_size, list(engine.eos_token_ids),
                   engine.scheduler.max_num_seqs, generation_defaults(getattr(engine.model, "generation_config", None)),
                   engine.scheduler.policy, engine.lora.max_loras if engine.lora is not None else None)


START_METHODS = ("spawn", "forkserver")


class EngineProcess:
    """An ``LLMEngine`` built by ``build()`` and stepped in a child process; ``tokenizer`` is the
    server's copy (the engine process loads its own). ``close()`` stops it (idempotent).

    ``start_method``: ``"spawn"`` (a fresh interpreter that imports torch, transformers and the
    engine: seconds, paid by every engine process) or ``"forkserver"``, for a program that starts
    many engine processes (the tests do, one per served fixture): multiprocessing's fork server
    imports this module and ``build``'s once, and each engine process is forked from it, ready in a
    fraction of a second. The fork server stays for the program's life, memory and all, and its
    environment is the program's when it started (OpenMP reads its settings there), so
    ``hf-paged serve``, which starts one engine process, spawns it."""

    def __init__(self, build: Callable[[], LLMEngine], tokenizer: Any, start_timeout: float = 1800.0,
                 start_method: str = "spawn"):
        if start_method not in START_METHODS:
            raise ValueError(f"EngineProcess start_method must be one of {START_METHODS}, got {start_method!r}")
        self.tokenizer = tokenizer
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":  # taken by the fork server's first start only
            context.set_forkserver_preload(list(dict.fromkeys([__name__, _module_of(build)])))
        self.connection, child = context.Pipe()
        # the parent an engine process must outlive: the server, unless a fork server stands between
        parent = os.getpid() if start_method == "spawn" else None
        self.process = context.Process(target=run_engine_core, args=(build, child, parent),
                                       name="hf-paged-engine-core", daemon=True)
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


def _module_of(build: Callable) -> str:
    """The module ``build`` comes from (through partials): the fork server imports it ahead too."""
    while isinstance(build, functools.partial):
        build = build.func
    return getattr(build, "__module__", None) or __name__


# ---------------------------------------------------------------------------- the engine's process
def run_engine_core(build: Callable[[], LLMEngine], connection: Connection, server_pid: int | None = None) -> None:
    """The engine process: build the engine, report its facts, serve commands and step until told
    to stop or the server's end of the pipe closes. ``server_pid``: its parent as the server gave it
    (spawned), None when forked from a fork server (its parent then, which leaves with the server)."""
    for name in ("SIGINT", "SIGTERM"):  # the server stops it; a service manager signals the whole group
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="hf-paged engine: %(levelname)s %(message)s")
    built = threading.Event()
    threading.Thread(target=_exit_if_orphaned, args=(server_pid or os.getppid(), built),
                     name="hf-paged-build-watch", daemon=True).start()
    try:
        engine = build()
        facts = EngineFacts.of(engine)
    except BaseException as err:  # noqa: BLE001 - reported to the server, which raises it
        connection.send(("failed", f"{type(err).__name__}: {err}"))
        return
    finally:
        built.set()
    try:
        connection.send(("ready", facts))
    except OSError:  # the server is gone (BrokenPipeError): nobody to serve
        exit_process(0)
    try:
        _EngineCore(engine, connection).run()
    finally:
        engine.close()
    exit_process(0)


def _exit_if_orphaned(parent: int, built: threading.Event) -> None:
    """While the engine builds (minutes for a large model) nothing reads the pipe, so a server killed
    then (SIGKILL, or SIGTERM before its handlers are in place) would leave this process building for
    nobody, then failing on the pipe: it leaves as soon as its parent is gone instead (``parent`` is the
    server's pid as the server gave it: one killed while this process was still importing is gone already)."""
    while not built.wait(0.5):
        if os.getppid() != parent:
            os._exit(0)


class _EngineCore:
    def __init__(self, engine: LLMEngine, connection: Connection):
        self.engine, self.connection = engine, connection
        self.live: set[str] = set()  # added, not finished
        self.prompt_sent: set[str] = set()
        self.prompt_logprobs_sent: set[str] = set()  # their whole prompt_logprobs went out already
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
                self.prompt_logprobs_sent.clear()
                self._send(("step_failed", f"the engine failed: {type(err).__name__}: {err}", engine.healthy))
            else:
                self._send(("outputs", [self._slim(o) for o in outputs], engine.healthy))

    def _slim(self, output: RequestOutput) -> RequestOutput:
        """The prompt goes with a request's first output only, its prompt log-probs with the first
        that has them whole (one with tokens, or finished); the finished leave ``live``."""
        rid = output.request_id
        if rid in self.prompt_sent:
            output.prompt_token_ids = None
        if rid in self.prompt_logprobs_sent:
            output.prompt_logprobs = None  # the server keeps the copy it got (ProcessEngineLoop)
        elif output.has_whole_prompt_logprobs:
            self.prompt_logprobs_sent.add(rid)
        if output.finished:
            self.live.discard(rid)
            self.prompt_sent.discard(rid)
            self.prompt_logprobs_sent.discard(rid)
        else:
            self.prompt_sent.add(rid)
        return output

    def _send(self, message: tuple) -> None:
        try:
            self.connection.send(message)
        except (OSError, ValueError):  # the server is gone
            self.stopping = True

    def _execute(self, command: tuple) -> None:
        match command:
            case ("add", key, request_ids, prompts, params, max_waiting, priority, lora_request):
                refusal = add_requests(self.engine, request_ids, prompts, params, max_waiting, priority, lora_request)
                if refusal is None:
                    self.live.update(request_ids)
                self._send(("added", key, refusal))
            case ("abort", request_ids):
                for request_id in request_ids:
                    if request_id in self.live:
                        self.engine.abort(request_id)
                        self.live.discard(request_id)
                        self.prompt_sent.discard(request_id)
                        self.prompt_logprobs_sent.discard(request_id)
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
