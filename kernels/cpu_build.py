"""Builds the float32 CPU attention reads in C (``cpu_decode.c``, ``cpu_prefill.c``) into one shared
library per layout (K/V heads, query heads per K/V head, head dim, block size: compile-time
constants, so the compiler unrolls and vectorizes for them), with the system's C compiler.

Building takes about a second; the library is cached on disk (``HF_PAGED_CACHE``, else
``$XDG_CACHE_HOME/hf_paged``, else ``~/.cache/hf_paged``) under a key of the sources, the flags and
this CPU's feature flags (it is built with ``-march=native``), so a cached build needs no compiler.
It is compiled with ``-ffast-math`` but linked without it, so loading it leaves the process's
floating-point mode (denormals) alone; the reads run on torch's OpenMP runtime (one libgomp in the
process). Where no compiler works, :func:`failure` says why and :func:`library` answers None:
callers keep their torch reads.
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
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # included by both sources: part of the cache key
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
_libraries: dict[tuple, ctypes.CDLL | None] = {}
_failure: str | None = None
_lock = threading.Lock()


def failure() -> str | None:
    """Why the C reads cannot be built in this process (None while they can)."""
    return _failure


def library(layout: tuple[int, int, int, int]) -> ctypes.CDLL | None:
    """The library for ``(kv_heads, heads_per_kv, head_dim, block_size)``: built (or loaded from the
    disk cache) on the first ask, None when that fails (:func:`failure` says why)."""
    global _failure
    if layout in _libraries:
        return _libraries[layout]
    with _lock:
        if layout not in _libraries:
            loaded = None
            if _failure is None:
                try:
                    loaded = _load(_build(layout))
                except (OSError, subprocess.SubprocessError, RuntimeError) as error:
                    _failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
            _libraries[layout] = loaded
    return _libraries[layout]


def mismatch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the C reads cannot read these tensors (they trust their sizes and layout), or None."""
    if not (q.device.type == k_cache.device.type == v_cache.device.type == "cpu"):
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
    return mismatch(q, k_cache, v_cache) is None and library(_layout(q, k_cache)) is not None


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


def _load(path: Path) -> ctypes.CDLL:
    loaded = ctypes.CDLL(str(path))
    decode, prefill = loaded.paged_decode, loaded.paged_prefill
    decode.restype = prefill.restype = ctypes.c_int
    decode.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
    prefill.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
    return loaded


def _build(layout: tuple) -> Path:
    """The shared library for ``layout``, compiled unless the cache already has it."""
    kv_heads, group, head_dim, block_size = layout
    defines = [f"-DKV_HEADS={kv_heads}", f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}", f"-DBLOCK_SIZE={block_size}"]
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in SOURCES + HEADERS), _cpu_flags(),
                                     " ".join(FLAGS + tuple(defines)).encode()]))
    path = _cache_dir() / f"cpu_attention-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objects = [str(Path(work) / f"{source.stem}.o") for source in SOURCES]
        for source, obj in zip(SOURCES, objects):
            _compile(compiler, defines, source, obj)
        lib = Path(work) / "cpu_attention.so"
        # linked without -ffast-math: gcc would add crtfastmath.o, which turns on flush-to-zero for the process
        linked = subprocess.run([compiler, "-shared", "-fopenmp", *objects, "-o", str(lib), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if linked.returncode != 0:
            raise RuntimeError(f"{compiler} failed to link: {linked.stderr.strip()}")
        os.replace(lib, path)  # atomic: another process building the same key ends with the same file
    return path


def _compile(compiler: str, defines: list[str], source: Path, obj: str) -> None:
    for march in (["-march=native"], []):  # a compiler without -march=native still builds
        compiled = subprocess.run([compiler, *FLAGS, *march, *defines, "-c", str(source), "-o", obj],
                                  capture_output=True, text=True, timeout=120)
        if compiled.returncode == 0:
            return
    raise RuntimeError(f"{compiler} failed: {compiled.stderr.strip()}")


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
def wide_vectors() -> bool:
    """Whether this CPU has 512-bit vectors (AVX-512F). The reads' register blocking is written for
    them (32 vector registers of 16 floats); on an AVX2-only CPU (16 registers of 8 floats) the
    compiler splits every vector in two and spills, and the reads ran slower than torch's gather +
    SDPA: prefill 7x, decode 2x (an AMD EPYC, 2 cores, the issue-22 model, 2026-12-07). Engines
    read with them by default only where this is True (``"auto"`` reads, :mod:`hf_paged.attention`)."""
    return b" avx512f" in _cpu_flags()


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""
