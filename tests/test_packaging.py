"""The built wheel holds the whole package: a user's ``pip install .`` (not ``-e``) imports every module.

An editable install reads the source tree, so the rest of the suite cannot see a subpackage or data file the wheel
leaves out (the wheel once lacked ``hf_paged.kinds``: every import of hf_paged failed after a plain install).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"hf_paged": ROOT / "hf_paged", "hf_paged/kernels": ROOT / "kernels"}  # place in the wheel -> folder
DATA_SUFFIXES = (".py", ".c", ".h", ".cpp", ".safetensors")


def _expected_files() -> set[str]:
    """What the wheel must hold: every module and every file the package reads at run time, by its place there."""
    expected = set()
    for place, folder in SOURCES.items():
        for path in folder.rglob("*"):
            relative = path.relative_to(folder)
            if place == "hf_paged" and relative.parts[0] == "kernels":
                continue  # not a folder of hf_paged/
            if path.is_file() and path.suffix in DATA_SUFFIXES and "__pycache__" not in relative.parts:
                expected.add(f"{place}/{relative.as_posix()}")
    return expected


def _build_wheel(tmp_path: Path, packages_line: str | None = None) -> tuple[Path, str]:
    """Build a wheel from a copy of the project (setuptools writes build/ next to pyproject.toml): the
    wheel and what the build printed on stderr."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "hf_paged", project / "hf_paged", ignore=ignore)
    shutil.copytree(ROOT / "kernels", project / "kernels", ignore=ignore)
    if packages_line is not None:
        pyproject = project / "pyproject.toml"
        text = pyproject.read_text()
        start = text.index("packages = [")
        end = text.index("]", start) + 1
        pyproject.write_text(text[:start] + packages_line + text[end:])
    out = tmp_path / "wheel"
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    built = subprocess.run([sys.executable, "-c", build, str(out)], cwd=project, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("hf_paged-*.whl")
    return wheel, built.stderr


def _missing_and_extra(wheel: Path) -> tuple[set[str], set[str]]:
    """Files the wheel lacks, and package files it has that the source does not (a stale build/)."""
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.startswith("hf_paged-")}  # not dist-info
    return _expected_files() - names, names - _expected_files()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    return _build_wheel(tmp_path_factory.mktemp("built"))


@pytest.fixture(scope="module")
def wheel(built) -> Path:
    return built[0]


def test_the_wheel_holds_every_module_and_data_file_and_nothing_else(wheel):
    assert {"hf_paged/kinds/__init__.py", "hf_paged/kernels/__init__.py"} <= _expected_files()
    assert any(name.endswith(".safetensors") for name in _expected_files())  # the demo model's weights
    assert _missing_and_extra(wheel) == (set(), set())


def test_the_build_warns_of_nothing(built):
    """setuptools' deprecations become errors on a date it names (the license table: 2027-02-18), and
    a data folder outside ``packages`` is shipped today only by a fallback it warns will go."""
    assert "Warning" not in built[1], built[1][-3000:]


def test_negative_control_a_package_left_out_of_the_list_is_found(tmp_path):
    wheel, _ = _build_wheel(tmp_path, 'packages = ["hf_paged", "hf_paged.bench", "hf_paged.constraints", '
                                      '"hf_paged.data", "hf_paged.engine", "hf_paged.kernels", "hf_paged.lora", '
                                      '"hf_paged.serve"]')
    missing, extra = _missing_and_extra(wheel)
    assert missing and all(name.startswith("hf_paged/kinds/") for name in missing) and not extra


def test_every_module_imports_from_the_unpacked_wheel_alone(wheel, tmp_path):
    """Import the whole package from the wheel's files, with the editable install's finder taken away."""
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, sys.argv[1])
        import hf_paged
        names = [m.name for m in pkgutil.walk_packages(hf_paged.__path__, "hf_paged.")]
        for name in names:
            importlib.import_module(name)
        outside = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "hf_paged"
                         and getattr(m, "__file__", None) and not m.__file__.startswith(sys.argv[1]))
        assert not outside, outside
        print(len(names))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(unpacked)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    source_modules = [path for place, folder in SOURCES.items() for path in folder.rglob("*.py")
                      if not (place == "hf_paged" and path.relative_to(folder).parts[0] == "kernels")]
    assert int(done.stdout.split()[-1]) == len(source_modules) - 1  # all but hf_paged/__init__.py itself


# --- every Python pyproject allows compiles the package -------------------------------------------

def _undecodable_docstrings(source: str, filename: str) -> list[str]:
    """Docstrings holding a lone surrogate (a ``"\\ud800"`` escape): Python 3.13+ dedents docstrings
    while compiling, through UTF-8, so such a module does not even compile there (3.10-3.12 do)."""
    bad = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            try:
                (doc or "").encode("utf-8")
            except UnicodeEncodeError:
                bad.append(f"{filename}:{node.body[0].lineno}")
    return bad


def test_no_docstring_stops_python_3_13_from_compiling_a_module():
    files = [p for folder in (*SOURCES.values(), ROOT / "tests", ROOT / "benchmarks") for p in folder.rglob("*.py")]
    bad = [b for path in files for b in _undecodable_docstrings(path.read_text(), str(path.relative_to(ROOT)))]
    assert not bad, bad


def test_negative_control_a_lone_surrogate_in_a_docstring_is_found():
    source = 'def f():\n    """From ``"\\ud800"``."""\n\n\ndef g():\n    """From ``"\\\\ud800"``."""\n    return "\\ud800"\n'
    assert _undecodable_docstrings(source, "probe.py") == ["probe.py:2"]
