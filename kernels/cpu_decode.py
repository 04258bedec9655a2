"""CPU paged decode read in C (``cpu_decode.c``): one query token per sequence attends over its
blocks where they lie in the pools, float32, built by the system's C compiler for one layout.

Why C rather than torch ops: the gather-then-SDPA read copies every context key and value out of
the blocks before attending (the keys and values move three times), and FlexAttention compiled by
inductor (this read's predecessor) reads the blocks in place but spends most of its time on
per-block tiles and guards. This loop reads each block once, while it is in cache, for all K/V
heads of the sequence, with an online softmax: on 2 cores at 32 sequences of ~1,100 tokens, keys
coming from DRAM, 1.8-2.0 ms per layer against 2.6-3.0 ms for the compiled FlexAttention read and
~4 ms for the gather read.

Building takes well under a second; the library is cached on disk (``HF_PAGED_CACHE``, else
``$XDG_CACHE_HOME/hf_paged``, else ``~/.cache/hf_paged``) under a key of the source, the flags and
this CPU's feature flags (it is built with ``-march=native``), so a cached build needs no
compiler. It is compiled with ``-ffast-math`` but linked without it, so loading it leaves the
process's floating-point mode (denormals) alone; it runs on torch's OpenMP runtime with
``torch.get_num_threads()`` threads. Where no compiler works, :func:`failure` says why and
:func:`ready` answers False: callers keep their own read.

The torch reference of this read is ``reference.paged_attention_decode_ref``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
_libraries: dict[tuple, ctypes.CDLL | None] = {}
_failure: str | None = None
_lock = threading.Lock()


def failure() -> str | None:
    """Why the C read cannot be built in this process (None while it can)."""
    return _failure


def ready(kv_heads: int, heads_per_kv: int, head_dim: int, block_size: int) -> bool:
    """Whether the read is built for this layout; builds it (or loads the cached build) on the
    first ask."""
    return _library((kv_heads, heads_per_kv, head_dim, block_size)) is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors can go to :func:`paged_decode_cpu`: float32 on the CPU, pools in their
    plain ``[blocks, block_size, kv_heads, head_dim]`` layout, and the read built for it."""
    if _mismatch(q, k_cache, v_cache) is not None:
        return False
    _, block_size, kv_heads, head_dim = k_cache.shape
    return ready(kv_heads, q.shape[1] // kv_heads, head_dim, block_size)


def _mismatch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the C loop cannot read these tensors (it trusts their sizes and layout), or None."""
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


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[seqs, heads, head_dim]`` over pools ``[blocks, block_size, kv_heads, head_dim]`` through
    ``block_tables`` ``[seqs, width]`` (entries past a sequence's blocks are never read; one that
    is read and lies outside the pool is a ValueError, as is a length outside the table);
    sequence ``i`` sees its last ``sliding_window`` (or all) of ``context_lens[i]`` keys, and
    ``sinks`` (``[heads]``) add a logit per head whose value is zero. Returns ``[seqs, heads,
    head_dim]``. Callers ask :func:`supports` first."""
    mismatch = _mismatch(q, k_cache, v_cache)
    if mismatch is not None:
        raise ValueError(f"paged_decode_cpu: {mismatch}")
    seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    library = _library((kv_heads, heads // kv_heads, head_dim, block_size))
    if library is None:
        raise RuntimeError(f"the C decode read is not available: {_failure}")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sink_logits = None if sinks is None else sinks.to(torch.float32).contiguous()
    if tables.shape[0] != seqs or lens.shape != (seqs,) or (sink_logits is not None and sink_logits.shape != (heads,)):
        raise ValueError(f"paged_decode_cpu: {seqs} queries of {heads} heads, but block_tables {tuple(tables.shape)}, "
                         f"context_lens {tuple(lens.shape)}"
                         + ("" if sink_logits is None else f", sinks {tuple(sink_logits.shape)}"))
    out = torch.empty_like(q)
    if seqs:
        bad = library.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                   lens.data_ptr(), None if sink_logits is None else sink_logits.data_ptr(),
                                   out.data_ptr(), seqs, tables.shape[1], k_cache.shape[0], sliding_window or 0,
                                   scale, torch.get_num_threads())
        if bad:
            raise ValueError(_refusal(bad, tables, lens, block_size, k_cache.shape[0], sliding_window))
    return out


def _refusal(code: int, tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int,
             window: int | None) -> str:
    """What the C read's check found (its return ``code``), in words."""
    seq = abs(code) - 1
    n = int(lens[seq])
    if code > 0:
        return (f"paged_decode_cpu: sequence {seq} has context length {n}; its table holds {tables.shape[1]} "
                f"blocks of {block_size}")
    first = max(0, n - window) if window else 0
    row = tables[seq].tolist()
    entry = next(b for b in range(first // block_size, -(-n // block_size)) if not 0 <= row[b] < num_blocks)
    return (f"paged_decode_cpu: sequence {seq} reads block {row[entry]} (entry {entry} of its table), outside the "
            f"pool of {num_blocks} blocks")


def _library(layout: tuple) -> ctypes.CDLL | None:
    global _failure
    if layout in _libraries:
        return _libraries[layout]
    with _lock:
        if layout not in _libraries:
            library = None
            if _failure is None:
                try:
                    library = _load(_build(layout))
                except (OSError, subprocess.SubprocessError, RuntimeError) as error:
                    _failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
            _libraries[layout] = library
    return _libraries[layout]


def _load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    fn = library.paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
    return library


def _build(layout: tuple) -> Path:
    """The shared library for ``layout``, compiled unless the cache already has it (a cached build
    needs no compiler)."""
    kv_heads, group, head_dim, block_size = layout
    defines = [f"-DKV_HEADS={kv_heads}", f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}", f"-DBLOCK_SIZE={block_size}"]
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), _cpu_flags(), " ".join(FLAGS + tuple(defines)).encode()]))
    path = _cache_dir() / f"cpu_decode-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        obj, lib = Path(work) / "cpu_decode.o", Path(work) / "cpu_decode.so"
        for march in (["-march=native"], []):  # a compiler without -march=native still builds
            compiled = subprocess.run([compiler, *FLAGS, *march, *defines, "-c", str(SOURCE), "-o", str(obj)],
                                      capture_output=True, text=True, timeout=120)
            if compiled.returncode == 0:
                break
        if compiled.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {compiled.stderr.strip()}")
        # linked without -ffast-math: gcc would add crtfastmath.o, which turns on flush-to-zero for the process
        linked = subprocess.run([compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if linked.returncode != 0:
            raise RuntimeError(f"{compiler} failed to link: {linked.stderr.strip()}")
        os.replace(lib, path)  # atomic: another process building the same key ends with the same file
    return path


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
    path = Path(tempfile.gettempdir()) / f"hf_paged-{os.getuid()}" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""
