"""Builds the float32 CPU attention reads in C (``cpu_decode.c``, ``cpu_prefill.c``) into one shared
library per layout (K/V heads, query heads per K/V head, head dim, block size: compile-time
constants, so the compiler unrolls and vectorizes for them), and the kernels of a step's few rows
(the linear products of ``cpu_gemv.c``, the greedy picks of ``cpu_argmax.c``) into one more, with
the system's C compiler; that one also holds torch operators in C++ against torch's stable ABI
(``cpu_ops.cpp``: the products' and a decode step's attention, :mod:`cpu_ops`) where the C++ compiler
and torch's headers build them, and goes without them where they do not (:func:`ops_failure` says why).

Building takes about a second; the library is cached on disk (``HF_PAGED_CACHE``, else
``$XDG_CACHE_HOME/hf_paged``, else ``~/.cache/hf_paged``) under a key of the sources, the flags and
the target, so a cached build needs no compiler. The target is this CPU (``-march=native``; the key
holds its feature flags) unless ``HF_PAGED_CPU_MARCH`` names another (a ``-march`` value such as
``x86-64-v3``: AVX2, for a cache shared by several machines, or to test the 8-lane build on a CPU
with AVX-512). It is compiled with ``-ffast-math`` but linked without it, so loading it leaves the
process's floating-point mode (denormals) alone; the reads run on torch's OpenMP runtime (one
libgomp in the process). Where no compiler works, :func:`failure` says why and :func:`library`
answers None: callers keep their torch reads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_decode.c", "cpu_prefill.c"))
ROW_SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_gemv.c", "cpu_argmax.c"))
OPS_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # included by every source: part of the cache key
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
CXX_FLAGS = ("-O2", "-std=c++17", "-fPIC")  # glue around the C loops: no vector code of its own
MARCH_VARIABLE = "HF_PAGED_CPU_MARCH"
_libraries: dict[tuple, ctypes.CDLL | None] = {}
_failure: str | None = None
_ops_failure: str | None = None
_lock = threading.Lock()


def failure() -> str | None:
    """Why the C reads cannot be built in this process (None while they can)."""
    return _failure


def ops_failure() -> str | None:
    """Why the few-row library was built without its torch operators (``cpu_ops.cpp``), or None."""
    return _ops_failure


def target() -> str:
    """The ``-march`` the reads are built for: ``$HF_PAGED_CPU_MARCH``, else ``"native"``."""
    return os.environ.get(MARCH_VARIABLE) or "native"


def library(layout: tuple[int, int, int, int]) -> ctypes.CDLL | None:
    """The library for ``(kv_heads, heads_per_kv, head_dim, block_size)`` on the :func:`target`:
    built (or loaded from the disk cache) on the first ask, None when that fails (:func:`failure`
    says why)."""
    loaded = _libraries.get((target(), "attention", *layout), _UNSEEN)  # each layer of each step asks
    if loaded is not _UNSEEN:
        return loaded
    kv_heads, group, head_dim, block_size = layout
    defines = [f"-DKV_HEADS={kv_heads}", f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}", f"-DBLOCK_SIZE={block_size}"]
    return _library(("attention", *layout), SOURCES, defines, _bind_reads)


def rows_library() -> ctypes.CDLL | None:
    """The library of the few-row kernels (``cpu_gemv.c``, ``cpu_argmax.c``) on the :func:`target`,
    as :func:`library` builds the reads'."""
    return _library(("rows",), ROW_SOURCES, [], _bind_rows, with_ops=True)


_BUILD_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError)
_UNSEEN = object()


def _library(kind: tuple, sources: tuple[Path, ...], defines: list[str], bind,
             with_ops: bool = False) -> ctypes.CDLL | None:
    global _failure
    key = (target(), *kind)
    if key in _libraries:
        return _libraries[key]
    with _lock:
        if key not in _libraries:
            loaded = None
            if _failure is None:
                try:
                    loaded = bind(_load_with_ops(sources, defines, key[0], kind[0]) if with_ops
                                  else ctypes.CDLL(str(_build(sources, defines, key[0], kind[0]))))
                except _BUILD_ERRORS as error:
                    _failure = _reason(error)
            _libraries[key] = loaded
    return _libraries[key]


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"


def _load_with_ops(sources: tuple[Path, ...], defines: list[str], march: str, name: str) -> ctypes.CDLL:
    """The library of ``sources`` and the C++ operators (``OPS_SOURCE``), or of ``sources`` alone where
    those do not build or load (:func:`ops_failure` says why)."""
    global _ops_failure
    try:
        return ctypes.CDLL(str(_build(sources + (OPS_SOURCE,), defines, march, name)))
    except _BUILD_ERRORS as error:
        _ops_failure = _reason(error)
    return ctypes.CDLL(str(_build(sources, defines, march, name)))


def mismatch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the C reads cannot read these tensors (they trust their sizes and layout), or None."""
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu):
        return "tensors not on the CPU"
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32):
        return f"dtypes {q.dtype}, {k_cache.dtype}, {v_cache.dtype}, not float32"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return f"shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "pools not in the contiguous [blocks, block_size, kv_heads, head_dim] layout"
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        return f"q {tuple(q.shape)} does not fit pools of {k_cache.shape[2]} heads of {k_cache.shape[3]}"
    return None


def _layout(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _, block_size, kv_heads, head_dim = k_cache.shape
    return kv_heads, q.shape[1] // kv_heads, head_dim, block_size


def readable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C reads can take these tensors: no :func:`mismatch`, and the library for their
    layout built (built on the first ask)."""
    return readable_library(q, k_cache, v_cache) is not None


def readable_library(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The library that reads these tensors where :func:`readable`, else None."""
    return library(_layout(q, k_cache)) if mismatch(q, k_cache, v_cache) is None else None


def library_for(read: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ctypes.CDLL:
    """The library for these tensors' layout; a ValueError naming ``read`` when they do not fit
    (:func:`mismatch`), a RuntimeError when the library cannot be built."""
    problem = mismatch(q, k_cache, v_cache)
    if problem is not None:
        raise ValueError(f"{read}: {problem}")
    loaded = library(_layout(q, k_cache))
    if loaded is None:
        raise RuntimeError(f"{read}: the C reads are not available: {_failure}")
    return loaded


def _bind_reads(loaded: ctypes.CDLL) -> ctypes.CDLL:
    decode, prefill = loaded.paged_decode, loaded.paged_prefill
    decode.restype = prefill.restype = ctypes.c_int
    decode.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
    prefill.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
    loaded.vector_lanes.restype = ctypes.c_int  # the float lanes the build's vectors hold (cpu_vec.h)
    loaded.vector_lanes.argtypes = []
    return loaded


def _bind_rows(loaded: ctypes.CDLL) -> ctypes.CDLL:
    loaded.linear_rows.restype = loaded.max_rows.restype = ctypes.c_int
    loaded.linear_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    loaded.max_rows.argtypes = []
    loaded.greedy_rows.restype = None
    loaded.greedy_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    if hasattr(loaded, "register_ops"):  # built with cpu_ops.cpp
        loaded.register_ops.restype = ctypes.c_int
        loaded.register_ops.argtypes = [ctypes.c_char_p]
        loaded.few_row_products_in_c.restype = loaded.decode_layers_in_c.restype = ctypes.c_uint64
        loaded.few_row_products_in_c.argtypes = loaded.decode_layers_in_c.argtypes = []
        loaded.set_decode_plan.restype = None
        loaded.set_decode_plan.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        loaded.end_decode_plan.restype = loaded.decode_plan_fields.restype = ctypes.c_int
        loaded.end_decode_plan.argtypes = loaded.decode_plan_fields.argtypes = []
    return loaded


def _build(sources: tuple[Path, ...], defines: list[str], march: str, name: str) -> Path:
    """The shared library of ``sources`` built with ``defines`` for ``-march=march``, compiled
    unless the cache already has it. C++ sources build against this torch's headers and link
    against its libraries (their version is part of the key)."""
    machine = cpu_flags() if march == "native" else march.encode()
    cxx = any(source.suffix == ".cpp" for source in sources)
    linked_torch = f"torch {torch.__version__} {_torch_dir()} {' '.join(CXX_FLAGS)}".encode() if cxx else b""
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in sources + HEADERS), machine,
                                     " ".join(FLAGS + tuple(defines)).encode(), linked_torch]))
    path = _cache_dir() / f"cpu_{name}-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    compiler = _compiler("CC", "cc", "gcc", "clang")
    cxx_compiler = _compiler("CXX", "c++", "g++", "clang++") if cxx else None
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objects = [str(Path(work) / f"{source.stem}.o") for source in sources]
        for source, obj in zip(sources, objects):
            if source.suffix == ".cpp":
                include = f"-I{_torch_dir() / 'include'}"
                _run(cxx_compiler, "compile", [*CXX_FLAGS, include, "-c", str(source), "-o", obj])
            else:
                _compile(compiler, march, defines, source, obj)
        lib = Path(work) / f"cpu_{name}.so"
        # linked without -ffast-math: gcc would add crtfastmath.o, which turns on flush-to-zero for the process
        torch_libs = [f"-L{_torch_dir() / 'lib'}", f"-Wl,-rpath,{_torch_dir() / 'lib'}", "-ltorch_cpu", "-lc10"]
        _run(cxx_compiler or compiler, "link", ["-shared", "-fopenmp", *objects, "-o", str(lib), "-lm",
                                                *(torch_libs if cxx else [])])
        os.replace(lib, path)  # atomic: another process building the same key ends with the same file
    return path


def _compiler(variable: str, *names: str) -> str:
    """``$variable``, else the first of ``names`` on the PATH; a RuntimeError where none is."""
    found = os.environ.get(variable) or next((shutil.which(n) for n in names if shutil.which(n)), None)
    if found is None:
        raise RuntimeError(f"no {'C++' if variable == 'CXX' else 'C'} compiler found (set {variable})")
    return found


def _run(compiler: str, what: str, arguments: list[str]) -> None:
    done = subprocess.run([compiler, *arguments], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        error = next((line for line in lines if "error" in line), lines[-1] if lines else "")
        raise RuntimeError(f"{compiler} failed to {what}: {error.strip()}")


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _compile(compiler: str, march: str, defines: list[str], source: Path, obj: str) -> None:
    # a compiler without -march=native still builds; a target asked for by name is built or refused
    for flags in ([f"-march={march}"], []) if march == "native" else ([f"-march={march}"],):
        compiled = subprocess.run([compiler, *FLAGS, *flags, *defines, "-c", str(source), "-o", obj],
                                  capture_output=True, text=True, timeout=120)
        if compiled.returncode == 0:
            return
    lines = compiled.stderr.strip().splitlines()
    error = next((line for line in lines if "error" in line), lines[-1] if lines else "")
    raise RuntimeError(f"{compiler} failed to build for -march={march}: {error.strip()}")


def _cache_dir() -> Path:
    base = os.environ.get("HF_PAGED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_paged")
    path = Path(base) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = _private_temp_dir() / "kernels"
    path.mkdir(exist_ok=True)
    return path


def _private_temp_dir() -> Path:
    """``$TMPDIR/hf_paged-<uid>``, made ours alone (mode 0700): the libraries built there get loaded,
    so a folder another user made or can write to (its name is predictable) is not used; a fresh
    private one is, then (no reuse across processes)."""
    path = Path(tempfile.gettempdir()) / f"hf_paged-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="hf_paged-"))


@functools.cache
def auto_reads() -> bool:
    """Whether engines read with the C reads by default (``"auto"`` reads, :mod:`hf_paged.attention`):
    on x86 CPUs with AVX-512, or AVX2 and FMA, where they were measured faster than torch's gather +
    SDPA reads (16 float lanes for AVX-512, 8 for AVX2: ``cpu_vec.h``; the 8-lane build was measured
    as built for ``x86-64-v3`` on an AVX-512 CPU, benchmarks/cpu_reads_ab.py). Elsewhere, unmeasured,
    torch's reads stay the default; ``"c"`` asks for the C reads anywhere."""
    flags = cpu_flags().split()
    return b"avx512f" in flags or (b"avx2" in flags and b"fma" in flags)


def cpu_flags() -> bytes:
    """This CPU's feature flags, the ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""
