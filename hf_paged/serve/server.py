"""Running the app: ``hf-paged serve`` (uvicorn in the foreground) and :class:`ServerThread`
(uvicorn in a background thread on a socket bound first, for tests and benchmarks).

Both run :class:`DrainingServer`: uvicorn, with the first SIGTERM/SIGINT starting the app's
graceful shutdown (:mod:`hf_paged.serve.shutdown`) instead of cutting requests off after a fixed
grace period."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from hf_paged.serve.shutdown import Drain

logger = logging.getLogger("hf_paged.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when the server listens beyond this machine with no key."""
    if is_loopback(host) or api_key:
        return None
    return (f"WARNING: listening on {host} (beyond loopback) without --api-key: anyone who can reach this port "
            f"can use the model. Set --api-key (or HF_PAGED_API_KEY), or bind 127.0.0.1.")


class DrainingServer(uvicorn.Server):
    """uvicorn whose exit signals drain the app first (``app.state.drain``): the first signal
    starts the drain, a second ends what is in flight at once, uvicorn's own shutdown (closing
    the connections) follows once the drain is over. The signal is not raised again afterwards,
    so ``hf-paged serve`` returns normally and exits 0 (the caller's ``finally`` blocks run: a
    tensor-parallel rank 0 releases the other ranks there)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.drain: Drain | None = getattr(app.state, "drain", None)

    def handle_exit(self, sig, frame) -> None:
        if self.drain is None:
            return super().handle_exit(sig, frame)
        self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain is not None and self.drain.draining and not self.should_exit:
            self.should_exit = self.drain.finished()
        return await super().on_tick(counter)


def run(app: FastAPI, host: str, port: int, api_key: str | None) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (see :class:`DrainingServer`)."""
    warning = exposure_warning(host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    DrainingServer(config, app).run()
    return 0


class ServerThread:
    """``with ServerThread(app) as server:`` serves ``app`` on ``server.url`` (a free loopback port)
    from a daemon thread; leaving the block shuts uvicorn down and joins the thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0,
                 send_buffer_bytes: int | None = None):
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes is not None:  # connections inherit it: a slow reader blocks sends sooner
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.start_timeout = start_timeout
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on")
        self.server = DrainingServer(config, app)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                        name="hf-paged-uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def begin_shutdown(self) -> None:
        """What SIGTERM does to ``hf-paged serve``: drain, then stop (``__exit__`` still joins)."""
        self.server.handle_exit(None, None)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.socket.close()
        if self._thread.is_alive():
            raise RuntimeError("the server thread did not stop within 30 s")
