"""Small steps run MKL's GEMMs on one thread when the engine's OpenMP threads wait passively.

Where the engine's OpenMP threads take every core beside a server's process and its clients,
``hf-paged serve`` makes them wait passively (``OMP_WAIT_POLICY=PASSIVE``, see
``hf_paged.__main__.engine_process_env``): an idle thread sleeps and gives its core back. Every
parallel region then begins by waking the sleeping threads, about 50 us each on the 2-core VM of
issue 22, and MKL's sgemm opens two regions per call. A decode step of the issue-22 model calls 28
layer GEMMs of 17-120 us each: 56 of the step's ~70 wake-ups, each costing about what splitting the
GEMM saves. Run on the stepping thread alone (MKL's thread-local setting, ``mkl_set_num_threads_local``),
those GEMMs leave the other cores to the server and the clients: 32 streaming clients on 2 cores
were served 10-14% faster in an A/B (benchmarks/RESULTS.md, ninth run), while in-process decode steps of 32
sequences took as long as before (11.8 against 11.9 ms).

Only steps whose largest layer GEMM is small switch (``SERIAL_GEMM_MAX_MACS``: at 128 sequences and
more the split GEMMs were 7-9% faster in-process); the LM head runs through oneDNN
(:mod:`hf_paged.engine.cpu_linear`), which this setting does not touch, and every other op keeps
torch's threads. With active waits (the OpenMP default, an engine alone in its process) the split
GEMMs are faster (10.0 against 11.2 ms a step), so by default nothing switches then. Results are
those of MKL on one thread: the same operations in another order, as a compiled step's are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch

SERIAL_GEMM_MAX_MACS = 16 * 2**20  # a step runs serial GEMMs while its largest layer GEMM multiplies at most this
_ONE = ctypes.c_int(1)


def _mkl() -> ctypes.CDLL | None:
    """torch's CPU library where it carries MKL's thread-local setter (x86 builds link MKL into it)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:  # already loaded by torch: no second copy (elsewhere, as on macOS or Windows, no MKL here)
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        # the Fortran-style entry points, which take their argument by reference in every MKL build
        lib.mkl_set_num_threads_local_.restype = ctypes.c_int
        lib.mkl_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


_LIB = _mkl()


def available() -> bool:
    """Whether this torch's GEMMs run through an MKL whose thread count can be set per thread."""
    return _LIB is not None and torch.backends.mkl.is_available()


def current_threads() -> int:
    """The threads MKL's next GEMM called from this thread may use (0 where MKL is not available)."""
    return _LIB.mkl_get_max_threads() if available() else 0


def passive_waits(environ: dict | None = None) -> bool:
    """Whether this process's OpenMP threads sleep while idle (read as the OpenMP runtime started)."""
    return (os.environ if environ is None else environ).get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """MKL's GEMMs called from this thread run on it alone inside the block (then the thread's
    earlier setting again; 0, none, lets the process-wide count apply)."""
    previous = ctypes.c_int(_LIB.mkl_set_num_threads_local_(ctypes.byref(_ONE)))
    try:
        yield
    finally:
        _LIB.mkl_set_num_threads_local_(ctypes.byref(previous))


def largest_gemm_macs_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds per token of the largest ``nn.Linear`` in ``model``'s decoder body (not the LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    return max((m.in_features * m.out_features for m in body.modules()
                if isinstance(m, torch.nn.Linear) and m is not head), default=0)


class SerialGemms:
    """Which steps of a model run MKL's GEMMs on one thread: those of at most ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    @classmethod
    def of(cls, model: torch.nn.Module, enabled: bool | None = None) -> SerialGemms | None:
        """For ``model`` (on CPU, MKL available): ``enabled`` None when OpenMP waits are passive and
        torch runs more than one thread, True always, False never."""
        if enabled is False or model.device.type != "cpu" or not available():
            return None
        if enabled is None and not (passive_waits() and torch.get_num_threads() > 1):
            return None
        macs = largest_gemm_macs_per_token(model)
        return cls(SERIAL_GEMM_MAX_MACS // macs if macs else 0)

    def step(self, tokens: int) -> contextlib.AbstractContextManager:
        """The context a step of ``tokens`` tokens runs in."""
        return one_thread() if tokens <= self.max_tokens else contextlib.nullcontext()
