"""The package's shape: no import cycles, no Slicer in the backend, no measurement code shipped to Slicer,
no dated notes in the code."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "NeuralRaycastLib"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The package's own modules that ``path`` imports anywhere in its body (lazy imports count: they run
    too), each with the packages above it, whose ``__init__`` an import runs first (except its own
    packages': they are initialised before it)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own_packages = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        for target in targets:
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                candidate = ".".join(parts[:end])
                if candidate in modules and candidate != name and candidate not in own_packages:
                    found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in LIB.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve_to_the_packages_own_modules(tmp_path):
    modules = {"NeuralRaycastLib", "NeuralRaycastLib.train", "NeuralRaycastLib.train.warmup",
               "NeuralRaycastLib.field", "NeuralRaycastLib.field.field"}
    package = tmp_path / "NeuralRaycastLib" / "train"
    package.mkdir(parents=True)
    source = package / "warmup.py"
    source.write_text("from ..field.field import NeuralField\nfrom . import run\n")
    assert imported_modules(source, modules, tmp_path) == {"NeuralRaycastLib.field", "NeuralRaycastLib.field.field"}


def test_the_backend_never_imports_slicer_or_qt():
    for path in LIB.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] not in {"slicer", "qt", "ctk", "vtkSlicer"}, f"{path} imports {name}"


def test_runtime_modules_do_not_use_the_measurement_code():
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("NeuralRaycastLib.bench") or module == "NeuralRaycastLib.app.cli":
            continue  # the CLI's bench command starts it from a clone
        assert not any(i.startswith("NeuralRaycastLib.bench") for i in imports), f"{module} imports the bench"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_the_extension_ships_the_runtime_and_no_measurement_code():
    listed = subprocess.run(["cmake", f"-DNEURALRAYCAST_LIB_DIR={LIB}", "-P",
                             str(ROOT / "NeuralRaycast" / "LibFiles.cmake")],
                            capture_output=True, text=True, check=True)
    shipped = set((listed.stdout + listed.stderr).split())
    every = {str(p.relative_to(LIB)) for pattern in ("*.py", "*.html", "*.safetensors") for p in LIB.rglob(pattern)
             if "__pycache__" not in p.parts}  # the modules, the share page's template, the pretrained weights
    assert "appearance/pretrained.safetensors" in every
    assert shipped == {f for f in every if not f.startswith("bench/")}
    assert "train/trainer.py" in shipped and "gpu/device.py" in shipped


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|earlier that day|\blast (?:week|tuesday|night)\b", re.IGNORECASE)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    if path.suffix == ".slang":
        return [(n, line) for n, line in enumerate(text.splitlines(), 1) if "//" in line or "/*" in line
                or line.lstrip().startswith("*")]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    found += [(n, line) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    return found


def test_code_comments_carry_no_dates():
    dated = [f"{path.relative_to(ROOT)}:{line}: {DATED.search(text).group(0)}"
             for path in [*LIB.rglob("*.py"), *(ROOT / "shaders").glob("*.slang")]
             for line, text in comments_and_docstrings(path) if DATED.search(text)]
    assert not dated, "dated notes in the code (say why, not when):\n" + "\n".join(dated)


def test_the_public_names_load_from_the_package_on_first_use():
    import subprocess
    import sys

    import NeuralRaycastLib

    for name in NeuralRaycastLib.__all__:
        assert getattr(NeuralRaycastLib, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        NeuralRaycastLib.nothing  # noqa: B018
    # importing the package itself loads none of them (Slicer imports it before its dependencies exist)
    loaded = subprocess.run([sys.executable, "-c", "import sys, NeuralRaycastLib; "
                             "print(sorted(m for m in sys.modules if m.startswith('NeuralRaycastLib.')))"],
                            capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]"
