"""Ending the processes this package owns (the CLI, the engine process) without a slow teardown."""

from __future__ import annotations

import atexit
import os
import sys


def exit_process(code: int) -> None:
    """Exit now, without the interpreter's final garbage collection: it walks the whole heap of
    torch, transformers and inductor objects (1-2 s at the end of every command and of the engine
    process) to free memory the operating system takes back anyway. Exit handlers still run
    (multiprocessing's unlink named semaphores, logging flushes), then the standard streams are
    flushed. For processes this package owns: the CLI and the engine process."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``) or a closed stream: nothing to keep
            pass
    os._exit(code)
