"""Backpressure for streamed responses: a send that stays blocked too long ends the stream.

uvicorn stops accepting writes once a connection's transport holds 64 KiB that the client has not
read (``send`` then waits), and the stream's own unsent output is one cumulative output per request
(:class:`~hf_paged.serve.engine_loop.RequestStream`), so a client that reads nothing costs bounded
memory. It would still hold its KV blocks and keep generating until ``max_tokens``:
:class:`BoundedStreamingResponse` gives every send ``send_timeout`` seconds, then closes the body
iterator (whose ``finally`` aborts the engine requests and frees their blocks) and returns, and
uvicorn closes the connection (it logs "ASGI callable returned without completing response." for
each, after this module's warning that says why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

logger = logging.getLogger("hf_paged.serve")


class SendTimeout(Exception):
    """The client read nothing for ``send_timeout`` seconds while the stream had output to send."""


class BoundedStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` whose sends each must finish within ``send_timeout`` seconds.

    ``on_timeout()`` runs when one does not (metrics); ``on_close()`` always runs once the response
    is over, however it ended (the caller's in-flight accounting)."""

    def __init__(self, content: AsyncIterator[str], *, send_timeout: float, on_timeout: Callable[[], None],
                 on_close: Callable[[], None], media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type)
        self.send_timeout, self.on_timeout, self.on_close = send_timeout, on_timeout, on_close

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise SendTimeout from None

        await super().stream_response(timed_send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeout:
            logger.warning("a stream's client read nothing for %.0f s: its requests are aborted and the "
                           "connection closed", self.send_timeout)
            self.on_timeout()
        finally:
            await self.body_iterator.aclose()
            self.on_close()
