"""The top-level name ``kernels`` belongs to Hugging Face's kernels package, never to this folder.

This folder installs as ``hf_paged.kernels``. But where a checkout's root is on ``sys.path``
(``python -m pytest``, a REPL or script started there), ``import kernels`` finds this folder
before the installed package, and transformers >= 5.25, which requires Hugging Face's ``kernels``
and imports it from ``modeling_utils``, fails on our module. :func:`give_name_to_installed_package`
runs when this folder was imported under the top-level name: it drops what was loaded from here
under that name and puts the installed package in its place, or, where none is installed, an empty
namespace package (nothing to import from it).
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


def _nothing_installed():
    """An empty namespace package, as Python makes for a folder without ``__init__.py``: no file, no
    version, nothing to import from it. transformers < 5.25 imports the name to probe for the package
    and reads such a module as "not installed"; raising here would break that probe."""
    spec = importlib.machinery.ModuleSpec(NAME, None, is_package=True)
    spec.submodule_search_locations = []
    return importlib.util.module_from_spec(spec)


def give_name_to_installed_package() -> None:
    """Replace ``sys.modules["kernels"]`` (this folder, mid-import) with the installed package, or
    with an empty namespace package where none is installed."""
    checkout_root = os.path.dirname(_FOLDER)
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout_root]
    spec = importlib.machinery.PathFinder.find_spec(NAME, path)
    for name in [n for n, m in sys.modules.items() if n.startswith(NAME + ".") and _ours(m)]:
        del sys.modules[name]
    if spec is None or spec.loader is None:
        sys.modules[NAME] = _nothing_installed()
        return
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
