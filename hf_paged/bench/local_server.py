"""An HTTP server the benchmarks start as a child process and never leave behind.

``LocalServer`` runs a command (``hf-paged serve``, vLLM's OpenAI server) in a process group of
its own on a loopback port chosen by :func:`free_port`, and is up once ``GET /health`` answers 200.
It starts in ``__enter__``, which kills it again if anything fails before it returns (a server
that exits or never answers, Ctrl-C while waiting); ``__exit__`` sends SIGINT, waits, then kills
the whole group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file, for an error message."""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


class LocalServer:
    """``cmd`` (which must listen on ``port``) with ``env``; its output goes to ``log_path``
    (discarded when None). ``start_timeout``: seconds to wait for /health; ``stop_timeout``:
    seconds to wait after SIGINT before SIGKILL."""

    def __init__(self, cmd: list[str], port: int, *, name: str, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, start_timeout: float = 600, stop_timeout: float = 60):
        self.cmd, self.port, self.name, self.env = cmd, port, name, env
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path) if log_path is not None else None
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.log = self.proc = None  # set by __enter__

    def __enter__(self) -> LocalServer:
        try:
            self.log = open(self.log_path, "w") if self.log_path is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._healthy():
                    return self
                time.sleep(0.2)
            end = f"; the end of {self.log_path}:\n{tail(self.log_path)}" if self.log_path is not None else ""
            state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "did not answer /health"
            raise RuntimeError(f"{self.name}: the server {state}{end}")
        except BaseException:
            self._kill()  # nothing to drain; and a SIGINT sent between fork and exec would be lost
            raise

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        """SIGKILL the group this class started (the server and what it started) while the server
        runs (an unreaped server keeps its pid, so the group is never another's), then close the log."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        if self.log is not None and self.log is not subprocess.DEVNULL:
            self.log.close()
