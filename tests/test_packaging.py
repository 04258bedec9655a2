"""The built wheel holds the whole package: a user's ``pip install .`` (not ``-e``) imports every module.

An editable install reads the source tree, so the rest of the suite cannot see a subpackage or data file the wheel
leaves out (the wheel once lacked ``hf_paged.kinds``: every import of hf_paged failed after a plain install).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"hf_paged": ROOT / "hf_paged", "hf_paged/kernels": ROOT / "kernels"}  # place in the wheel -> folder
DATA_SUFFIXES = (".py", ".c", ".h", ".safetensors")


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


def _build_wheel(tmp_path: Path, packages_line: str | None = None) -> Path:
    """Build a wheel from a copy of the project (setuptools writes build/ next to pyproject.toml)."""
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
    subprocess.run([sys.executable, "-c", build, str(out)], cwd=project, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("hf_paged-*.whl")
    return wheel


def _missing(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return _expected_files() - set(archive.namelist())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("built"))


def test_the_wheel_holds_every_module_and_data_file(wheel):
    assert {"hf_paged/kinds/__init__.py", "hf_paged/kernels/__init__.py"} <= _expected_files()
    assert any(name.endswith(".safetensors") for name in _expected_files())  # the demo model's weights
    assert _missing(wheel) == set()


def test_negative_control_a_package_left_out_of_the_list_is_found(tmp_path):
    wheel = _build_wheel(tmp_path, 'packages = ["hf_paged", "hf_paged.bench", "hf_paged.constraints", '
                                   '"hf_paged.engine", "hf_paged.kernels", "hf_paged.serve"]')
    missing = _missing(wheel)
    assert missing and all(name.startswith("hf_paged/kinds/") for name in missing)


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
