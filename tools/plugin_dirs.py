"""Print the plugin folders whose pyproject.toml admits an ExecuTorch version, each after
the repo's plugins it depends on.

    python3 tools/plugin_dirs.py 1.5.1 plugins/xnnpack plugins/mps ...          # those that admit it
    python3 tools/plugin_dirs.py --excluded 1.5.1 plugins/xnnpack plugins/mps  # those that do not

The Makefile installs into an env only the plugins that admit that env's executorch
(constraints*.txt): a plugin capping executorch below it (plugins/mps: ExecuTorch 1.5
removed MPS) would otherwise make pip downgrade executorch or fail. A plugin with no
executorch requirement admits every version. Runs before any venv exists, so it takes
version specifiers from `packaging`, or from the copy that pip carries.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def _requirement(text: str):
    """``packaging``'s Requirement; before any venv exists, the copy that pip carries."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(text)


def admits(folder: str, version: str) -> bool:
    project = tomllib.loads((Path(folder) / "pyproject.toml").read_text())["project"]
    for dep in map(_requirement, project.get("dependencies", [])):
        if dep.name.lower() == "executorch" and not dep.specifier.contains(version, prereleases=True):
            return False
    return True


def in_dependency_order(folders: list[str]) -> list[str]:
    """``folders`` with each plugin after the repo's plugins it depends on (llmcore-gemma
    after llmcore-llama). pip resolves one ``-e`` list in the order given, and a plugin
    named before the local package it requires sends pip to the index for it."""
    projects = {f: tomllib.loads((Path(f) / "pyproject.toml").read_text())["project"] for f in folders}
    by_name = {p["name"].lower(): f for f, p in projects.items()}
    ordered: list[str] = []

    def visit(folder: str, seen: tuple = ()) -> None:
        if folder in ordered or folder in seen:
            return
        for dep in map(_requirement, projects[folder].get("dependencies", [])):
            if dep.name.lower() in by_name:
                visit(by_name[dep.name.lower()], seen + (folder,))
        ordered.append(folder)

    for folder in folders:
        visit(folder)
    return ordered


def main(argv: list[str]) -> int:
    excluded = argv[:1] == ["--excluded"]
    argv = argv[1:] if excluded else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    version, folders = argv[0], argv[1:]
    print(" ".join(f for f in in_dependency_order(folders) if admits(f, version) != excluded))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
