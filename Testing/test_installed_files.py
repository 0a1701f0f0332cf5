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
#: What the library ships: its modules and the share page's template (NeuralRaycastLib/app/share_page.html).
LIB_SUFFIXES = (".py", ".html", ".safetensors")
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


#: Stand-ins for what Slicer's build tree gives an extension's CMake: its install folder and the scripted module
#: macro, which (as Slicer's, CMake/SlicerMacroBuildScriptedModule.cmake) refuses a listed file that does not exist
#: and installs scripts and resources under the scripted modules folder, keeping their relative paths.
SLICER_STAND_IN = """
cmake_minimum_required(VERSION 3.16)
project(InstalledFilesCheck NONE)
set(Slicer_QTSCRIPTEDMODULES_LIB_DIR lib/Slicer/qt-scripted-modules)
set(Slicer_INSTALL_QTSCRIPTEDMODULES_LIB_DIR lib/Slicer/qt-scripted-modules)
set(BUILD_TESTING OFF)
macro(slicerMacroBuildScriptedModule)
  cmake_parse_arguments(MY "WITH_GENERIC_TESTS;WITH_SUBDIR" "NAME" "SCRIPTS;RESOURCES" ${ARGN})
  foreach(_file IN LISTS MY_SCRIPTS MY_RESOURCES)
    if(NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${_file})
      message(FATAL_ERROR "slicerMacroBuildScriptedModule given nonexistent file '${_file}'")
    endif()
    get_filename_component(_dir ${_file} DIRECTORY)
    install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/${_file} DESTINATION ${Slicer_INSTALL_QTSCRIPTEDMODULES_LIB_DIR}/${_dir})
  endforeach()
endmacro()
add_subdirectory(@MODULE_DIR@ NeuralRaycast)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The scripted modules folder as the module's own CMake installs it (configure, then install)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    work = tmp_path_factory.mktemp("cmake")
    (work / "CMakeLists.txt").write_text(SLICER_STAND_IN.replace("@MODULE_DIR@", MODULE_DIR.as_posix()))
    for step in ([cmake, "-S", str(work), "-B", str(work / "build")],
                 [cmake, "--install", str(work / "build"), "--prefix", str(work / "install")]):
        result = subprocess.run(step, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return work / "install" / "lib" / "Slicer" / "qt-scripted-modules"


def installed_lib_files(installed: Path, suffix: str = "") -> list[str]:
    return sorted(name.removeprefix("NeuralRaycastLib/") for name in files_under(installed)
                  if name.startswith("NeuralRaycastLib/") and name.endswith(suffix))


def test_the_module_installs_every_file_of_its_folder_and_lists_none_that_is_gone():
    listed = cmake_list("MODULE_PYTHON_SCRIPTS") + cmake_list("MODULE_PYTHON_RESOURCES")
    present = files_under(MODULE_DIR) - BUILD_FILES
    assert sorted(set(listed) - present) == [], "listed in CMakeLists.txt but not there"
    assert sorted(present - set(listed)) == [], "there but not installed"


def test_cmake_installs_the_module_its_resources_the_library_and_the_shaders_and_nothing_else(installed):
    expected = ({"NeuralRaycast.py"} | {f"Resources/{name}" for name in files_under(MODULE_DIR / "Resources")}
                | {f"NeuralRaycastLib/{name}" for name in files_under(LIB_DIR)
                   if name.endswith(LIB_SUFFIXES) and not name.startswith("bench/")}
                | {f"shaders/{path.name}" for path in (ROOT / "shaders").glob("*.slang")})
    assert sorted(files_under(installed) - expected) == [], "installed, but not a file of the module"
    assert sorted(expected - files_under(installed)) == [], "a file of the module, not installed"


def test_the_library_is_installed_whole_without_its_measurement_code(installed):
    lib = installed_lib_files(installed)
    shipped = {name for name in files_under(LIB_DIR) if name.endswith(LIB_SUFFIXES)}
    assert [name for name in lib if name.startswith("bench/")] == []
    assert set(lib) == {name for name in shipped if not name.startswith("bench/")}
    data = sorted(name for name in files_under(LIB_DIR) - shipped if not name.startswith("bench/"))
    assert data == [], "files the library has that the install leaves out"


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


def test_no_installed_file_imports_the_measurement_code(installed):
    """The command line's bench command reaches it only where it is present (HAS_BENCH); nothing else does."""
    users = []
    for name in installed_lib_files(installed, ".py"):
        path = installed / "NeuralRaycastLib" / name
        package = "NeuralRaycastLib." + ".".join(Path(name).with_suffix("").parts)
        if path.name != "__init__.py":
            package = package.rpartition(".")[0]
        for module, function in _imported_modules(path, package):
            if module == "NeuralRaycastLib.bench" or module.startswith("NeuralRaycastLib.bench."):
                users.append((name, function))
    for module, function in _imported_modules(installed / "NeuralRaycast.py", ""):
        if "bench" in module.split("."):
            users.append(("NeuralRaycast.py", function))
    assert sorted(set(users)) == [("app/cli.py", "cmd_bench")]


def test_the_installed_layout_imports_and_runs_without_the_measurement_code(installed, tmp_path):
    """The files CMake installs, as in Slicer's qt-scripted-modules folder: every module imports, and the
    command line works and does not offer bench."""
    modules = installed
    names = installed_lib_files(installed, ".py")
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
