"""Test-wide settings and the leak check.

Triton kernels run under the interpreter on CPU tensors; the variable must be set before
``triton.jit`` decorates anything, so it is set here, before any test module imports the kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hf_paged import PagedKVCache  # noqa: E402


@pytest.fixture(autouse=True)
def no_block_leaks(monkeypatch):
    """Every PagedKVCache a test creates must have consistent books, and give every block back."""
    created = []
    original_init = PagedKVCache.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(PagedKVCache, "__init__", tracking_init)
    yield
    for cache in created:
        cache.manager.check_invariants()
        cache.reset()
        assert cache.manager.num_used_blocks == 0 and cache.manager.sequences == []
