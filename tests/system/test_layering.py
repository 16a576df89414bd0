"""The layering of the package: the import graph (every `import` of every module,
read with `ast`, function-level ones included) has no cycle between modules or
between packages; the compiler, codegen included, runs without torch;
docs/architecture.md's module table names every module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ppdsl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ppdsl modules `name` imports (a `from X import y` of a submodule y
    counts as importing X.y; anywhere in the file, not only at the top)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _package_of(module: str, packages: set[str]) -> str:
    """The folder a module sits in; a module beside subpackages (at the top of
    ppdsl, of ppdsl.runtime, of ppdsl.analysis) is its own node: the folder's
    face imports its subpackages, and its bottom modules (runtime/errors.py) are
    imported by them, which would otherwise read as a cycle."""
    parent = module.rsplit(".", 1)[0] if "." in module else module
    if module in packages and module != "ppdsl":
        return module
    has_subpackages = any(p.rsplit(".", 1)[0] == parent for p in packages if p != parent)
    return module if has_subpackages else parent


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    """The cycle finder itself: a loop a -> b -> c -> a is found, a DAG is not."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_module_import_graph_has_no_cycle():
    """No module imports itself through others (function-level imports included)."""
    graph = _graph()
    assert len(graph) > 50
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_package_import_graph_has_no_cycle():
    """Folders (frontend, ir, analysis, analysis.checks, lowering, backend, runtime,
    search, commands) and the modules at the top of ppdsl import each other
    without a loop: each phase only uses the phases before it."""
    graph = _graph()
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    folded: dict[str, set[str]] = {}
    for module, imports in graph.items():
        here = _package_of(module, packages)
        folded.setdefault(here, set())
        folded[here].update(_package_of(m, packages) for m in imports)
        folded[here].discard(here)
    assert {"ppdsl.frontend", "ppdsl.analysis.checks", "ppdsl.backend"} <= set(folded)
    assert _cycle(folded) is None, " -> ".join(_cycle(folded) or [])


# The runtime's rooms, bottom to top (docs/architecture.md, "The runtime"): a room
# imports only rooms below it. The bottom modules sit beside them; the runtime's
# face (`ppdsl/runtime/__init__.py`) and the paths generated programs import
# (`program`, `train`) sit above them all.
_RUNTIME_FLOORS = [
    ("ppdsl.runtime.errors", "ppdsl.runtime._lazy", "ppdsl.runtime.choices"),
    ("ppdsl.runtime.worker",),
    ("ppdsl.runtime.execution",),
    ("ppdsl.runtime.models",),
    ("ppdsl.runtime.training",),
    ("ppdsl.runtime.measure",),
    ("ppdsl.runtime", "ppdsl.runtime.program", "ppdsl.runtime.train"),
]


def _runtime_floor(module: str) -> int:
    for floor, names in enumerate(_RUNTIME_FLOORS):
        if module in names or any(module.startswith(f"{n}.") for n in names[1:] + names[:1]
                                  if n != "ppdsl.runtime"):
            return floor
    raise AssertionError(f"{module} is in no room of the runtime; add it to _RUNTIME_FLOORS")


def _upward_runtime_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imports in graph.items():
        if not module.startswith("ppdsl.runtime"):
            continue
        here = _runtime_floor(module)
        for imported in imports:
            if imported.startswith("ppdsl.runtime") and _runtime_floor(imported) > here:
                found.append(f"{module} imports {imported}")
    return sorted(found)


def test_runtime_rooms_import_only_downward():
    """Each runtime module sits in one room, and no room imports a room above it
    (worker < execution < models < training < measure; errors at the bottom)."""
    graph = _graph()
    assert len([m for m in graph if m.startswith("ppdsl.runtime.")]) > 30
    assert _upward_runtime_imports(graph) == []


def test_upward_runtime_import_is_found():
    """The room check itself: an execution module importing training is reported."""
    graph = {"ppdsl.runtime.execution.engine": {"ppdsl.runtime.training.optim"},
             "ppdsl.runtime.training.optim": {"ppdsl.runtime.errors"}}
    assert _upward_runtime_imports(graph) == [
        "ppdsl.runtime.execution.engine imports ppdsl.runtime.training.optim"]


_FACES_WITHOUT_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is made unimportable for this test ({name})")
        return None

sys.meta_path.insert(0, _NoTorch())
import ppdsl.runtime
import ppdsl.runtime.models
import ppdsl.runtime.training
import ppdsl.commands.run
from ppdsl.runtime.training import add_training_options
from ppdsl.runtime.models import PipelineModel, ModelError
assert "torch" not in sys.modules
"""


def test_training_and_models_faces_import_without_torch():
    """`ppdsl run` imports the training and models faces before torchrun starts:
    they import in a process where torch cannot be imported."""
    result = subprocess.run([sys.executable, "-c", _FACES_WITHOUT_TORCH], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_runtime_is_the_only_torch_user():
    """Only ppdsl.runtime imports torch: the compiler, codegen and the manifest
    are plain Python."""
    users = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            if any(n == "torch" or n.startswith("torch.") for n in names):
                users.add(name)
    assert users and all(u.startswith("ppdsl.runtime.") for u in users), sorted(users)


_NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is made unimportable for this test ({name})")
        return None

sys.meta_path.insert(0, _NoTorch())
import ppdsl.backend.codegen
import ppdsl.compiler
from ppdsl.cli import main

code = main(["compile", sys.argv[1], "-o", sys.argv[2]])
assert "torch" not in sys.modules, "torch was imported"
sys.exit(code)
"""


def test_compiler_and_codegen_run_without_torch(tmp_path: Path):
    """`import ppdsl.backend.codegen` and `ppdsl compile` work in a process where
    torch cannot be imported (a sys.meta_path finder refuses it)."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(ROOT / "examples" / "zb_h1.pp"), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "rank0.py").exists() and (out / "manifest.json").exists()


def _named_in_architecture() -> set[str]:
    """The modules docs/architecture.md names: by path (`frontend/parse.py`,
    `ppdsl/cli.py`), or by a bare name in backticks in a table row whose
    first cell names their folder (`ppdsl/runtime/` ... `engine`)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = {m.removeprefix("ppdsl/") for m in re.findall(r"`((?:ppdsl/)?[\w/]+\.py)`", doc)}
    for row in re.findall(r"^\|([^|\n]*)\|([^\n]*)$", doc, flags=re.M):
        folder = re.search(r"`(?:ppdsl/)?([\w/]+)/`", row[0])
        if folder:
            named |= {f"{folder.group(1)}/{word}.py" for word in re.findall(r"`(\w+)`", row[1])}
    return named


def test_architecture_names_every_module():
    """Every module of ppdsl/ (but package __init__ and __main__ files) is named
    in docs/architecture.md's table, so a newcomer finds each module's job."""
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(modules - _named_in_architecture())
    assert not missing, missing
