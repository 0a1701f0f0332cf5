"""The files the module's CMake installs into Slicer (NeuralRaycast/CMakeLists.txt, LibFiles.cmake) are exactly the
files that exist: none listed that is gone, none left out that the module needs, and no measurement code."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_DIR = ROOT / "NeuralRaycast"
LIB_DIR = ROOT / "NeuralRaycastLib"
#: What the module's folder holds besides the installed files: its build scripts.
BUILD_FILES = {"CMakeLists.txt", "LibFiles.cmake"}


def cmake_list(name: str) -> list[str]:
    """The entries of ``set(name ...)`` in the module's CMakeLists.txt, ``${MODULE_NAME}`` expanded."""
    text = (MODULE_DIR / "CMakeLists.txt").read_text()
    module_name = re.search(r"set\(MODULE_NAME\s+(\S+)\)", text).group(1)
    body = re.search(rf"set\({name}\s+(.*?)\)", text, re.S).group(1)
    return [entry.replace("${MODULE_NAME}", module_name) for entry in body.split()]


def files_under(folder: Path) -> set[str]:
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def installed_lib_files() -> list[str]:
    """LibFiles.cmake's list, as CMake computes it."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    result = subprocess.run([cmake, f"-DNEURALRAYCAST_LIB_DIR={LIB_DIR}", "-P", str(MODULE_DIR / "LibFiles.cmake")],
                            capture_output=True, text=True, check=True)
    return [line.strip() for line in result.stderr.splitlines() if line.strip()]  # message() writes to stderr


def test_the_module_installs_every_file_of_its_folder_and_lists_none_that_is_gone():
    listed = cmake_list("MODULE_PYTHON_SCRIPTS") + cmake_list("MODULE_PYTHON_RESOURCES")
    present = files_under(MODULE_DIR) - BUILD_FILES
    assert sorted(set(listed) - present) == [], "listed in CMakeLists.txt but not there"
    assert sorted(present - set(listed)) == [], "there but not installed"


def test_the_library_is_installed_whole_without_its_measurement_code():
    lib = installed_lib_files()
    python_files = {name for name in files_under(LIB_DIR) if name.endswith(".py")}
    assert [name for name in lib if name.startswith("bench/")] == []
    assert set(lib) == {name for name in python_files if not name.startswith("bench/")}
    data = sorted(name for name in files_under(LIB_DIR) - python_files if not name.startswith("bench/"))
    assert data == [], "files the library has that are not Python, which the install leaves out"


def _imported_modules(path: Path, package: str) -> list[tuple[str, str]]:
    """(absolute module, enclosing function or '') of every import statement in ``path``."""
    found = []

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                found.extend((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")
                if child.level:
                    base = base[:len(base) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.extend((f"{module}.{alias.name}" if not child.module or child.level else module, function)
                             for alias in child.names)
                found.append((module, function))
            visit(child, inside)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_installed_file_imports_the_measurement_code():
    """The command line's bench command reaches it only where it is present (HAS_BENCH); nothing else does."""
    users = []
    for name in installed_lib_files():
        path = LIB_DIR / name
        package = "NeuralRaycastLib." + ".".join(Path(name).with_suffix("").parts)
        if path.name != "__init__.py":
            package = package.rpartition(".")[0]
        for module, function in _imported_modules(path, package):
            if module == "NeuralRaycastLib.bench" or module.startswith("NeuralRaycastLib.bench."):
                users.append((name, function))
    for module, function in _imported_modules(MODULE_DIR / "NeuralRaycast.py", ""):
        if "bench" in module.split("."):
            users.append(("NeuralRaycast.py", function))
    assert sorted(set(users)) == [("app/cli.py", "cmd_bench")]


def test_the_installed_layout_imports_and_runs_without_the_measurement_code(tmp_path):
    """The files CMake installs, laid out as in Slicer's qt-scripted-modules folder: every module imports, and
    the command line works and does not offer bench."""
    modules = tmp_path / "qt-scripted-modules"
    names = installed_lib_files()
    for name in names:
        target = modules / "NeuralRaycastLib" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(LIB_DIR / name, target)
    shutil.copytree(ROOT / "shaders", modules / "shaders", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    imports = sorted("NeuralRaycastLib." + ".".join(Path(name).with_suffix("").parts).removesuffix(".__init__")
                     for name in names)
    script = (
        "import importlib, sys\n"
        # a development install's finder would find the clone's files (Slicer has none)
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in str(getattr(f, '__module__', ''))]\n"
        f"for name in {imports!r}:\n"
        "    importlib.import_module(name)\n"
        "import NeuralRaycastLib\n"
        f"assert NeuralRaycastLib.__file__.startswith({str(modules)!r}), NeuralRaycastLib.__file__\n"
        "assert not [m for m in sys.modules if m.startswith('NeuralRaycastLib.bench')]\n"
        "from NeuralRaycastLib.app import cli\n"
        "assert not cli.HAS_BENCH\n"
        "print(sorted(cli.build_parser()._subparsers._group_actions[0].choices))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(modules))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    commands = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert "fit" in commands and "bench" not in commands


def test_the_icon_and_screenshot_urls_name_files_of_this_repository():
    """The Extensions Index downloads them: each raw URL's path must be a file here (on the default branch)."""
    text = (ROOT / "CMakeLists.txt").read_text()
    for variable in ("EXTENSION_ICONURL", "EXTENSION_SCREENSHOTURLS"):
        urls = re.search(rf'set\({variable}\s+"([^"]+)"\)', text).group(1).split()
        assert urls, variable
        for url in urls:
            match = re.fullmatch(r"https://raw\.githubusercontent\.com/[^/]+/[^/]+/main/(.+)", url)
            assert match, url
            assert (ROOT / match.group(1)).is_file(), f"{variable}: {match.group(1)} is not in the repository"
