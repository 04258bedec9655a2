"""Test-wide settings and the leak check.

Triton kernels run under the interpreter on CPU tensors; the variable must be set before
``triton.jit`` decorates anything, so it is set here, before any test module imports the kernels.
Engines run their steps eager here unless a test passes ``compile=True`` (``HF_PAGED_COMPILE=0``),
and their layers' linears on sgemm unless it passes ``onednn_layers=True`` (``HF_PAGED_ONEDNN_LAYERS=0``).
"""

import os
import weakref

os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines compile their steps by default (seconds each); the suite builds hundreds of engines, so
# they run eager unless a test asks for compile=True (tests/test_compiled_body.py).
os.environ.setdefault("HF_PAGED_COMPILE", "0")
# Where oneDNN is much faster than sgemm, engines run the layers' float32 linears through it by
# default, which changes their last bits on some machines and not others; the suite keeps sgemm
# unless a test passes onednn_layers=True (tests/test_engine_fast_paths.py).
os.environ.setdefault("HF_PAGED_ONEDNN_LAYERS", "0")
# On pytest-xdist's workers (README's test command runs two on two cores) OpenMP threads that spin
# while they wait for work take the core the other worker needs (the 5.17 phase of CI: 101 s against
# 52 s sleeping instead). libgomp reads this when torch loads it, below.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_paged import PagedKVCache, kernels  # noqa: E402


@pytest.fixture
def triton_launches(monkeypatch):
    """Force the Triton kernels (the interpreter on CPU: the route CUDA takes) and count their
    launches, so a silent fallback to the reference path fails the test."""
    counts = {"paged_attention_decode": 0, "paged_attention_prefill": 0}
    for name in counts:
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += kwargs.get("backend") == "triton"
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    kernels.set_backend("triton")
    yield counts
    kernels.set_backend("auto")


@pytest.fixture(params=["native", "x86-64-v3"])
def c_target(request, monkeypatch):
    """Each C read test once for this CPU and, on a CPU with AVX-512, once more built for AVX2
    (``x86-64-v3``: the reads' 8-lane build, which that CPU can run and would not build for itself)."""
    from hf_paged.kernels import cpu_build

    if request.param != "native":
        flags = cpu_build.cpu_flags().split()
        if b"avx512f" not in flags or b"avx2" not in flags:
            pytest.skip("the AVX2 build is this CPU's own build (or this CPU cannot run it)")
        monkeypatch.setenv(cpu_build.MARCH_VARIABLE, request.param)
    return request.param


@pytest.fixture
def rows_built(c_target):
    """:func:`c_target`, where the few-row C kernels build (else the test is skipped, naming why)."""
    from hf_paged.kernels import cpu_build, cpu_gemv

    if not cpu_gemv.ready():
        pytest.skip(f"no C compiler works here: {cpu_build.failure()}")
    return c_target


@pytest.fixture
def llm(engine):
    """The module's ``engine`` fixture; after the test nothing is in flight and every KV block is free
    (a module with an ``llm`` of its own uses that)."""
    from tests.helpers.tiny_models import assert_engine_idle

    yield engine
    assert_engine_idle(engine)


@pytest.fixture
def threads():
    """``torch.set_num_threads`` for the test; the count before it is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_block_leaks(monkeypatch):
    """Every PagedKVCache a test creates (forks included) must have consistent books, and give every
    block back. A cache nobody holds any more gave its rows back when it was freed."""
    created = []
    original_init, original_fork = PagedKVCache.__init__, PagedKVCache.fork

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    def tracking_fork(self):
        clone = original_fork(self)
        created.append(weakref.ref(clone))
        return clone

    monkeypatch.setattr(PagedKVCache, "__init__", tracking_init)
    monkeypatch.setattr(PagedKVCache, "fork", tracking_fork)
    yield
    alive = [cache for cache in (ref() for ref in created) if cache is not None]
    for cache in alive:
        cache.manager.check_invariants()
    for cache in alive:  # forks share a block manager: every one of them resets before the books are read
        cache.reset()
    for cache in alive:
        assert cache.manager.num_used_blocks == 0 and cache.manager.sequences == []
