"""The benchmarks' optional dependencies (the ``bench`` extra): plots need matplotlib, the HTTP
benchmarks need httpx (and vs_vllm's load generator openai). A benchmark checks what it needs
before it starts anything, and a plot is skipped with a note when matplotlib is missing."""

from __future__ import annotations

import importlib

INSTALL = 'pip install "hf_paged[bench]" (from a checkout: pip install -e ".[bench]")'


class MissingDependency(ImportError):
    """An optional module a benchmark (or one of its sections) needs is not installed."""


def missing(*modules: str) -> list[str]:
    """Those of ``modules`` that do not import."""
    out = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def require(what: str, *modules: str) -> None:
    """Raise :class:`MissingDependency` naming ``what`` needs, of ``modules``, and how to install it."""
    gone = missing(*modules)
    if gone:
        raise MissingDependency(f"{what} needs {' and '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} "
                                f"not installed: {INSTALL}")


def plot_or_note(plot, *args, log=print) -> bool:
    """``plot(*args)``; without matplotlib a note instead (the results are already saved)."""
    if missing("matplotlib"):
        log(f"(matplotlib not installed: no plot; {INSTALL})")
        return False
    plot(*args)
    return True
