"""The import graph flows one way: files -> formats -> weights -> backends -> engine -> server and CLI.

Every `import`/`from … import` of quantserve code, at module level or inside a function, is read with `ast`
and checked against LAYERS: a package may import its own modules and those of lower layers, never a sibling
on its own layer or anything above. docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each installed package's sources are (pyproject's package-dir).
SOURCES = {"quantserve": "quantserve", "quantserve.kernels": "kernels", "quantserve.converters": "converters"}
LAYERS = (
    ("errors", "kernels"),  # kernels import nothing from quantserve
    ("formats", "structured", "registry"),
    ("quant", "gguf", "core", "chat"),
    ("insitu", "vision"),
    ("backends",),
    ("engine",),
    ("submission",),  # the request pipeline's types: what LLM.submit takes and gives back
    ("llm",),
    ("evaluate", "rerank"),
    ("conversion_quality",),  # scores with evaluate
    ("server", "converters"),
    ("cli", "__main__"),  # python -m quantserve runs the cli
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
# Lower layers a unit must still not import: the server reaches a model through quantserve.llm (LLM and its
# ModelPlan) and the shared types in core, never a backend or the engine directly.
SKIPS = {"server": ("backends", "engine")}


def _unit(module: str) -> str:
    """quantserve.formats.gguf -> formats; quantserve -> the package root."""
    return module.split(".")[1] if "." in module else ""


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every quantserve import; `package` resolves relative ones."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base == "quantserve":  # `from quantserve import x`: x is a subpackage or a root name
                found += [(node.lineno, f"quantserve.{a.name}") for a in node.names]
            elif base.startswith("quantserve."):
                found.append((node.lineno, base))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("quantserve.")]
    return found


def violations(repo: Path) -> list[str]:
    """Every import against LAYERS in the tree at `repo`, as 'file:line: what'."""
    bad = []
    for package, folder in SOURCES.items():
        root = repo / folder
        for path in sorted(root.rglob("*.py")):
            name = _module_name(path, root, package)
            own = _unit(name)
            where = f"{path.relative_to(repo)}"
            if own and own not in RANK:
                bad.append(
                    f"{where}: {own!r} is on no layer; add it to LAYERS (and to docs/architecture.md's drawing)"
                )
                continue
            here = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for line, target in _imports(ast.parse(path.read_text(encoding="utf-8")), here):
                to = _unit(target)
                if not own or to in ("", own, "__version__"):
                    continue  # the package root's lazy re-exports, and a package's own modules
                if to not in RANK:
                    bad.append(f"{where}:{line}: imports {target}, which is on no layer")
                elif RANK[to] >= RANK[own]:
                    bad.append(
                        f"{where}:{line}: {own} (layer {RANK[own]}) imports {target} (layer {RANK[to]})"
                    )
                elif to in SKIPS.get(own, ()):
                    bad.append(f"{where}:{line}: {own} imports {target}; it goes through quantserve.llm")
    return bad


def test_imports_flow_one_way():
    assert violations(REPO) == []


def test_a_planted_back_import_is_caught(tmp_path):
    for folder in SOURCES.values():
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path) == []
    formats = tmp_path / "quantserve" / "formats" / "gguf.py"
    formats.write_text(
        formats.read_text() + "\n\ndef _late():\n    from quantserve.server.app import create_app\n"
    )
    backend = tmp_path / "quantserve" / "backends" / "select.py"
    backend.write_text(backend.read_text() + "\nimport quantserve.engine.scheduler\n")
    kernels = tmp_path / "kernels" / "packing.py"
    kernels.write_text(kernels.read_text() + "\nfrom quantserve.converters import gguf_to_hf\n")
    server = tmp_path / "quantserve" / "server" / "catalog.py"
    server.write_text(
        server.read_text() + "\n\ndef _late():\n    from quantserve.backends.select import BACKENDS\n"
    )
    found = violations(tmp_path)
    assert len(found) == 4, found
    assert any("server/catalog.py" in v and "goes through quantserve.llm" in v for v in found)
    assert any("formats/gguf.py" in v and "imports quantserve.server.app" in v for v in found)
    assert any("backends/select.py" in v and "quantserve.engine.scheduler" in v for v in found)
    assert any("kernels/packing.py" in v and "quantserve.converters" in v for v in found)


def test_every_package_is_installed():
    """A subpackage missing from pyproject's list works from the checkout and is absent from the wheel."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for package, folder in SOURCES.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            on_disk.add(_module_name(init, root, package))
    assert on_disk == listed
