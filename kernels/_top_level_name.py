"""The top-level name ``kernels`` belongs to Hugging Face's kernels package, never to this folder.

This folder installs as ``hf_paged.kernels``. But where a checkout's root is on ``sys.path``
(``python -m pytest``, a REPL or script started there), ``import kernels`` finds this folder
before the installed package, and transformers >= 5.25, which requires Hugging Face's ``kernels``
and imports it from ``modeling_utils``, fails on our module. :func:`give_name_to_installed_package`
runs when this folder was imported under the top-level name: it drops what was loaded from here
under that name and puts the installed package in its place, or raises ModuleNotFoundError as a
Python without this checkout on its path would.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

NAME = "kernels"
_FOLDER = os.path.dirname(os.path.abspath(__file__))


def _ours(module: object) -> bool:
    path = getattr(module, "__file__", None)
    return bool(path) and os.path.dirname(os.path.abspath(path)) == _FOLDER


def give_name_to_installed_package() -> None:
    """Replace ``sys.modules["kernels"]`` (this folder, mid-import) with the installed package."""
    checkout_root = os.path.dirname(_FOLDER)
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout_root]
    spec = importlib.machinery.PathFinder.find_spec(NAME, path)
    for name in [n for n, m in sys.modules.items() if n.startswith(NAME + ".") and _ours(m)]:
        del sys.modules[name]
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {NAME!r} (this checkout's kernels/ folder is hf_paged.kernels, not Hugging Face's "
            f"kernels package)", name=NAME)
    module = importlib.util.module_from_spec(spec)
    # The import system takes whatever sys.modules holds under the name once this folder's
    # __init__ returns (documented: a module may replace itself there).
    sys.modules[NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
            del sys.modules[name]
        raise
