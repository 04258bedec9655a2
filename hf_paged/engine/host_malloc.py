"""glibc's malloc thresholds for a process that runs engine steps on CPU.

Every CPU step allocates buffers of megabytes (activations of a prefill chunk, the decode read's
gathered keys and values) whose sizes change from step to step. With glibc's defaults such sizes
get fresh ``mmap``s, or grow a heap that is trimmed back as soon as they are freed, so each step
faults its buffers' pages in again: 0.7-1.0 M minor page faults and 2-2.5 s of system time in
the first 32-request, 1,000-token-prompt run of a process on 2 cores, 20% of its wall time
(RESULTS.md, "Against vLLM's CPU build — 2026-12-04, second run"). Fixed thresholds keep freed
memory for the next step: the same run takes ~50 k faults. vLLM's CPU worker preloads tcmalloc for
the same reason; a running Python process cannot change its allocator, but it can set glibc's
thresholds (``mallopt``). They are process-wide, hence an engine option (``LLMEngine(tune_malloc=...)``).
"""

from __future__ import annotations

import ctypes
import platform
import sys

MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap (glibc's own ceiling for its dynamic threshold)
TRIM_THRESHOLD = 1 << 30  # free memory the heap keeps at its top before giving it back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_tuned = False


def tune_malloc() -> bool:
    """Set this process's glibc malloc thresholds (once). False where the C library is not glibc."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    results = [libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD), libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    _tuned = all(result == 1 for result in results)  # mallopt answers 1 when it took the value
    return _tuned
