"""Tokenization off the event loop: a few worker threads, each with its own tokenizer copy.

Tokenizing a 4 MiB prompt takes seconds; on the event loop it would freeze every other stream
for that long. Fast tokenizers keep mutable settings behind a borrow check and are not safe to
share between threads, so each worker tokenizes with a private copy (made on first use).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, tokenizer: Any, workers: int = 2):
        self._base = tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf-paged-tokenize")

    def _own(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._base)
        return tokenizer

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tokenizer, *args)`` on a worker thread; exceptions come back to the awaiting handler."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._own(), *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
