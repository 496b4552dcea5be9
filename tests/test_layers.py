"""The layers of the package: the core (the extension API and the export pipeline) and the
runtime never import the applications (``llmcore.apps``) or the command line
(``llmcore.cli``), not even inside a function. The applications sit on top of both; the
command line on top of everything, and it finds the applications' commands through the
``llmcore_commands`` hook, not by importing them."""

from __future__ import annotations

import ast
from pathlib import Path

import llmcore

PACKAGE = Path(llmcore.__file__).parent
ABOVE = ("llmcore.apps", "llmcore.cli")


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in the file names (relative imports
    resolved), with ``from package import name`` also as ``package.name``."""
    module = _module_name(path, package)
    parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = parent.split(".")[: len(parent.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _below_the_applications() -> list[Path]:
    """The core's and the runtime's source files: all of llmcore but apps/, cli.py, __main__.py."""
    return [
        path for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in ("apps", "cli.py", "__main__.py")
    ]


def _reaches_above(name: str) -> bool:
    return any(name == top or name.startswith(top + ".") for top in ABOVE)


def test_the_core_and_the_runtime_never_import_the_applications_or_the_cli():
    files = _below_the_applications()
    names = {_module_name(p) for p in files}
    assert {"llmcore.hookspecs", "llmcore.pipeline", "llmcore.runtime.program", "llmcore.runtime.session",
            "llmcore.builtins.commands"} <= names  # the walk sees both layers
    upward = {
        _module_name(path): sorted(name for name in _imported(path) if _reaches_above(name))
        for path in files
    }
    assert {module: names for module, names in upward.items() if names} == {}


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The check itself: an import of the applications hidden in a function, or written
    relative to the package, is found."""
    package = tmp_path / "llmcore"
    runtime = package / "runtime"
    runtime.mkdir(parents=True)
    (runtime / "sneaky.py").write_text("def f():\n    from llmcore.apps import serve\n")
    (runtime / "relative.py").write_text("from ..cli import main\n")
    (runtime / "fine.py").write_text("from llmcore.runtime import pte\nimport llmcore.errors\n")

    def upward(name: str) -> set[str]:
        return {n for n in _imported(runtime / name, package) if _reaches_above(n)}

    assert upward("sneaky.py") == {"llmcore.apps", "llmcore.apps.serve"}
    assert upward("relative.py") == {"llmcore.cli", "llmcore.cli.main"}
    assert upward("fine.py") == set()
