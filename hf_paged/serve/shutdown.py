"""Graceful shutdown of the HTTP side (the first SIGTERM or SIGINT).

From the signal on, new generation requests get a 503 (``server_shutting_down``) and ``/health``
says so; the requests in flight have ``timeout_s`` seconds to finish. Then the rest are ended:
streams get an error event and ``data: [DONE]``, waiting non-streaming clients a 503 in OpenAI's
error shape. Once nothing is in flight (or ``flush_s`` after the end, for clients that do not read
their last bytes) uvicorn shuts down. A second signal ends what is in flight at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("hf_paged.serve")
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


class Drain:
    """Counts the generation requests being answered and runs the shutdown's three phases
    (serving, draining, ended). Used on the event loop only (``begin`` may come from a signal
    handler or another thread: it only sets a time)."""

    def __init__(self, end_all: Callable[[], None], timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 flush_s: float = 5.0):
        self._end_all, self.timeout_s, self.flush_s = end_all, timeout_s, flush_s
        self.active = 0
        self._deadline: float | None = None  # set by the first signal: in-flight requests end then
        self._ended_at: float | None = None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self) -> None:
        """The first signal: stop taking requests; a second one: end what is in flight now."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.timeout_s
            logger.info("shutting down: %d request(s) in flight get %.0f s to finish", self.active, self.timeout_s)
        else:
            self._deadline = now

    def admit(self) -> Ticket:
        """A generation request starts (the app refuses new ones once :attr:`draining`). Release
        the ticket when its response is over."""
        self.active += 1
        return Ticket(self)

    def finished(self) -> bool:
        """Polled by the server while draining: True once it may shut down."""
        if self.active == 0:
            return True
        now = time.monotonic()
        if self._ended_at is None and now >= self._deadline:
            logger.info("shutdown timeout: ending %d request(s) still in flight", self.active)
            self._end_all()
            self._ended_at = now
        return self._ended_at is not None and now >= self._ended_at + self.flush_s


class Ticket:
    """One admitted request's place in :attr:`Drain.active`; releasing twice is harmless."""

    def __init__(self, drain: Drain):
        self._drain: Drain | None = drain

    def release(self) -> None:
        if self._drain is not None:
            self._drain.active -= 1
            self._drain = None
