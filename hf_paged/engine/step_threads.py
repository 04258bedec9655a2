"""Small steps run on one thread when the engine's OpenMP threads wait passively.

Where the engine's OpenMP threads take every core beside a server's process and its clients,
``hf-paged serve`` makes them wait passively (``OMP_WAIT_POLICY=PASSIVE``, see
``hf_paged.__main__.engine_process_env``): an idle thread sleeps and gives its core back. Every
parallel region then begins by waking the sleeping threads, about 50 us each on the 2-core VM of
issue 22. A decode step of the issue-22 model opens ~70 regions: 56 from MKL (two per sgemm call, 28
layer GEMMs of 17-120 us each), the rest from the compiled kernels, the C reads and the LM head,
each region costing about what splitting its work saves. A step of at most ``max_tokens`` tokens
therefore runs on the stepping thread alone (OpenMP's and MKL's thread counts of that thread),
leaving the other cores to the server and the clients, while prompt-sized steps keep every thread.
Served to 32 streaming clients on 2 cores, the engine on both cores then streams as fast as on one
and answers a burst of new prompts ~35% sooner (benchmarks/RESULTS.md, tenth run). Alone on the
machine such steps are slower (32 sequences, passive waits: 14.5 ms against 11.8 ms with only
MKL on one thread and ~13 ms with every op split): the gain is the core left to the others.

The LM head is the exception: inside a one-thread step it still runs on every thread the process
has (``head_threads``, passed to :func:`hf_paged.engine.cpu_linear.onednn_linears`). It is one
oneDNN region per step and the step's largest op (32 rows against the issue-22 model's
32,000-wide prepacked head, passive waits: 5.8 ms on one thread, 3.0 ms on two, in a ~19 ms
served step), so one wake-up buys up to half of it.
Served to 32 streaming clients (greedy, equal settings), 1,846 against 1,723 tok/s, 1,785 against
1,693 (medians of 3 and 4 interleaved rounds, every round faster: RESULTS.md, sixteenth session);
the C decode reads on both threads as well were slower (1,678).

Which steps: those whose largest layer GEMM multiplies at most ``SERIAL_STEP_MAX_MACS`` (95 tokens
for the issue-22 model; with only MKL on one thread, split GEMMs were 7-9% faster in-process at 128
sequences and more). With active waits (the OpenMP default, an engine alone in its process) split
steps are faster, so by default nothing switches then. Dynamo's global-state guard records the
thread count, so a compiled body is warmed up at both counts as the engine is built (nothing
compiles while serving: tested). Results are those of the same operations in another order, as a
compiled step's are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch

SERIAL_STEP_MAX_MACS = 16 * 2**20  # a step runs on one thread while its largest layer GEMM multiplies at most this


def _loaded(name: str) -> ctypes.CDLL | None:
    """One of torch's own libraries, as torch loaded it (no second copy), or None."""
    try:  # elsewhere (macOS, Windows, a torch without them) the names differ: nothing switches
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name),
                           mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):
        return None


def _bind() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """torch's OpenMP runtime and the library carrying its MKL (x86 builds link MKL into libtorch_cpu)."""
    gomp, mkl = _loaded("libgomp.so.1"), _loaded("libtorch_cpu.so")
    try:
        # MKL's Fortran-style entry point, which takes its argument by reference in every MKL build
        mkl.mkl_set_num_threads_local_.restype = ctypes.c_int
        mkl.mkl_get_max_threads.restype = ctypes.c_int
        gomp.omp_set_num_threads.restype = None
        gomp.omp_get_max_threads.restype = ctypes.c_int
    except AttributeError:
        return None
    return gomp, mkl


_LIBS = _bind()


def available() -> bool:
    """Whether this torch's OpenMP and MKL thread counts can be set for one thread."""
    return _LIBS is not None and torch.backends.mkl.is_available() and torch.backends.openmp.is_available()


def current_threads() -> tuple[int, int]:
    """(OpenMP, MKL) threads that regions and GEMMs started from this thread may use; (0, 0) where
    not :func:`available`."""
    if not available():
        return 0, 0
    gomp, mkl = _LIBS
    return gomp.omp_get_max_threads(), mkl.mkl_get_max_threads()


def passive_waits() -> bool:
    """Whether this process's OpenMP threads sleep while idle (read as the OpenMP runtime started)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


@contextlib.contextmanager
def with_threads(count: int) -> Iterator[None]:
    """OpenMP regions and MKL GEMMs started from this thread use ``count`` threads inside the block."""
    gomp, mkl = _LIBS
    threads = gomp.omp_get_max_threads()
    # 0 from MKL: no thread-local setting was made, the process's applies again afterwards
    previous = ctypes.c_int(mkl.mkl_set_num_threads_local_(ctypes.byref(ctypes.c_int(count))))
    gomp.omp_set_num_threads(count)
    try:
        yield
    finally:
        gomp.omp_set_num_threads(threads)
        mkl.mkl_set_num_threads_local_(ctypes.byref(previous))


def one_thread() -> contextlib.AbstractContextManager:
    """OpenMP regions and MKL GEMMs started from this thread run on it alone inside the block."""
    return with_threads(1)


def largest_gemm_macs_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds per token of the largest ``nn.Linear`` in ``model``'s decoder body (not the LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    return max((m.in_features * m.out_features for m in body.modules()
                if isinstance(m, torch.nn.Linear) and m is not head), default=0)


class SerialSmallSteps:
    """Which steps of a model run on one thread: those of at most ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int, head_threads: int = 1):
        self.max_tokens = max_tokens
        self.head_threads = head_threads  # the LM head's threads inside a serial step (see the module's docstring)

    @classmethod
    def of(cls, model: torch.nn.Module, enabled: bool | None = None) -> SerialSmallSteps | None:
        """For ``model`` on CPU where :func:`available`, and torch runs more than one thread:
        ``enabled`` None when OpenMP waits are passive, True always, False never."""
        if enabled is False or model.device.type != "cpu" or not available() or torch.get_num_threads() < 2:
            return None
        if enabled is None and not passive_waits():
            return None
        macs = largest_gemm_macs_per_token(model)
        return cls(SERIAL_STEP_MAX_MACS // macs if macs else 0, torch.get_num_threads())

    def applies(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs on one thread."""
        return tokens <= self.max_tokens
