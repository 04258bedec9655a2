"""The package's layout rules, read from its source: a module's private names stay in it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hf_paged": ROOT / "hf_paged", "hf_paged.kernels": ROOT / "kernels"}  # import name -> folder


def _modules() -> list[tuple[str, Path]]:
    """(dotted module name, file) of every module of the package, ``kernels/`` as ``hf_paged.kernels``."""
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "hf_paged" and parts[:1] == ("kernels",):
                continue  # not a folder of hf_paged/
            found.append((".".join((package, *parts)), path))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _violations(module: str, path: Path) -> list[str]:
    """Imports of another module's ``_private`` name, or of a private module from outside its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(module, path)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            source, names = "", [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            dotted = f"{source}.{name}" if source else name
            parts = dotted.split(".")
            for i, part in enumerate(parts):
                if not _private(part):
                    continue
                owner = ".".join(parts[:i])
                if not (package == owner or package.startswith(owner + ".")):
                    bad.append(f"{module} (line {node.lineno}) imports {dotted}")
                break
    return bad


def test_the_walk_sees_the_whole_package():
    names = {m for m, _ in _modules()}
    assert {"hf_paged.cache", "hf_paged.channel", "hf_paged.engine.scheduler", "hf_paged.kernels",
            "hf_paged.kernels.prefill"} <= names


def test_no_module_imports_another_modules_private_names():
    bad = [v for module, path in _modules() for v in _violations(module, path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from hf_paged.cache import _layer_structure\n", 1),  # another module's private name
    ("from .decode import _dot\n", 1),
    ("from hf_paged.kernels._common import dot\n", 1),  # a private module, from outside its package
    ("from ._common import dot\n", 0),  # ... from inside it
    ("from hf_paged.cache import PagedKVCache\nimport torch\n", 0),
])
def test_negative_control_the_check_finds_private_imports(tmp_path, source, expected):
    inside_kernels = source.startswith("from .")
    folder = tmp_path / ("kernels" if inside_kernels else "hf_paged")
    folder.mkdir()
    path = folder / "probe.py"
    path.write_text(source)
    module = "hf_paged.kernels.probe" if inside_kernels else "hf_paged.probe"
    assert len(_violations(module, path)) == expected


# --- the top-level name ``kernels`` is Hugging Face's package, even from a checkout's root ---------

def _python_at_root(code: str, path: list[str], isolated: bool = False) -> subprocess.CompletedProcess:
    """Run ``code`` from the checkout's root with ``sys.path`` = the root, then ``path``."""
    setup = f"import sys; sys.path[:] = [{str(ROOT)!r}] + {path!r}\n"
    flags = ["-S"] if isolated else []
    return subprocess.run([sys.executable, *flags, "-c", setup + code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_import_kernels_at_the_root_gets_the_installed_package(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("INSTALLED = True\n")
    (fake / "layer.py").write_text("from kernels import INSTALLED\n")
    result = _python_at_root(
        "import kernels, kernels.layer\n"
        "print(kernels.INSTALLED, kernels.layer.INSTALLED, sorted(n for n in sys.modules if n.startswith('kernels')))\n",
        [str(tmp_path / "site"), *sys.path])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "['kernels',", "'kernels.layer']"]


def test_import_kernels_at_the_root_without_the_package_finds_nothing_in_it(tmp_path):
    site = tmp_path / "site"  # this environment's packages, less Hugging Face's kernels
    site.mkdir()
    for entry in sys.path:
        if entry.endswith("site-packages") and Path(entry).is_dir():
            for item in Path(entry).iterdir():
                if item.name != "kernels" and not item.name.startswith("kernels-") and not (site / item.name).exists():
                    (site / item.name).symlink_to(item)
    stdlib = [p for p in sys.path if p and "site-packages" not in p and Path(p).exists() and p != str(ROOT)]
    result = _python_at_root(
        "import kernels\n"
        "print(getattr(kernels, '__file__', None), list(kernels.__path__), getattr(kernels, '__version__', 'N/A'),\n"
        "      sorted(n for n in sys.modules if n.startswith('kernels')))\n"
        "from kernels import paged_attention_decode\n", [str(site), *stdlib], isolated=True)
    # what transformers < 5.25 reads as "not installed" (no file, no version), with nothing of ours in it
    assert result.stdout.split() == ["None", "[]", "N/A", "['kernels']"], result.stderr
    assert result.returncode == 1 and "ImportError: cannot import name 'paged_attention_decode'" in result.stderr


def test_transformers_models_load_at_the_root():
    # transformers >= 5.25 imports Hugging Face's kernels package from modeling_utils
    result = _python_at_root(
        "import transformers.modeling_utils, hf_paged, kernels\n"
        "print(kernels is not hf_paged.kernels, not kernels.__name__.startswith('hf_paged'))\n", sys.path[1:])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
