"""docs/architecture.md is the map: its module table lists exactly the modules of otel_llm/, each
with its layer, and every import in otel_llm/ follows the layers table (a module imports from its
own layer and the layers its row names). engine_stub imports only the vocabulary it publishes."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "otel_llm"
ENGINE_STUB_MAY_IMPORT = {"otel_llm.events", "otel_llm.hooks"}


def _table(heading: str) -> list[list[str]]:
    text = DOC.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def _paths(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def layers() -> dict[str, tuple[list[str], set[str]]]:
    """layer -> (the paths it holds, the layers and packages it may import besides its own)."""
    out = {}
    for name, where, may in _table("Layers"):
        allowed = set() if may.startswith("nothing") else {p.strip() for p in re.split(r",| and ", may) if p.strip()}
        out[name] = (_paths(where), {a.strip("`") for a in allowed if not a.startswith("anything")})
    return out


def module_layers() -> dict[str, str]:
    """module path (otel_llm/...) -> layer, from the module table."""
    return {_paths(module)[0]: layer for module, layer, _ in _table("Modules")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    listed = module_layers().get(rel)
    if listed is not None:
        return listed
    for name, (where, _) in layers().items():  # a package's __init__.py / __main__.py: its folder's layer
        if any(w.endswith("/") and rel.startswith(w) for w in where):
            return name
    raise AssertionError(f"{rel}: in no layer of docs/architecture.md")


def imported_modules(source: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every module that ``source`` (of the file at ``path``) imports, anywhere in it."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield node.lineno, full if _file_of(full) is not None else base


def violations(path: Path, source: str) -> list[str]:
    own = layer_of(path)
    if own == "facade":
        return []
    allowed = layers()[own][1] | {own}
    found = []
    for line, target in imported_modules(source, path):
        top = target.split(".")[0]
        if top == "engine_stub":
            if "engine_stub" not in allowed:
                found.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {target}")
            continue
        if top != "otel_llm":
            continue
        file = _file_of(target)
        assert file is not None, f"{path.relative_to(ROOT)}:{line} imports {target}, which does not exist"
        theirs = layer_of(file)
        if theirs not in allowed:
            found.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {target} ({theirs})")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_module_table_lists_exactly_the_modules_there_are():
    listed = set(module_layers())
    missing = [str(p) for p in listed if not (ROOT / p).is_file()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    packages = {"__init__.py", "__main__.py"}
    unlisted = [
        p.relative_to(ROOT).as_posix()
        for p in _modules()
        if p.relative_to(ROOT).as_posix() not in listed and not (p.name in packages and _trivial(p))
    ]
    assert not unlisted, f"modules missing from docs/architecture.md's module table: {unlisted}"
    unknown = {layer for layer in module_layers().values()} - set(layers())
    assert not unknown, f"layers not in the layers table: {unknown}"


def _trivial(init: Path) -> bool:
    """A package's __init__ or __main__ that only documents or re-exports (no code of its own)."""
    return _only_documents_or_reexports(init.read_text())


def _only_documents_or_reexports(source: str) -> bool:
    # An expression statement is code unless it is the docstring (``main()`` is one too).
    def docstring(node: ast.stmt) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    return all(
        docstring(node)
        or isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign))
        or (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        for node in ast.parse(source).body
    )


def test_every_import_in_otel_llm_follows_the_layers():
    found = [v for path in _modules() for v in violations(path, path.read_text())]
    assert not found, "imports against docs/architecture.md's layers:\n" + "\n".join(found)


def test_engine_stub_imports_only_the_vocabulary():
    found = []
    for path in sorted((ROOT / "engine_stub").rglob("*.py")):
        for line, target in imported_modules(path.read_text(), path):
            if target.split(".")[0] == "otel_llm" and target not in ENGINE_STUB_MAY_IMPORT:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, found


def test_the_check_catches_an_import_against_the_layers():
    # A recorder that reached up into the core, and a config module that imported the catalogue.
    recorder = PACKAGE / "recording" / "recorder.py"
    assert violations(recorder, "from otel_llm.core.telemetry import EngineTelemetry\n") == [
        "otel_llm/recording/recorder.py:1 (recording) imports otel_llm.core.telemetry (core)"
    ]
    settings = PACKAGE / "config" / "settings.py"
    assert violations(settings, "def f():\n    from otel_llm.catalogue import metrics\n") == [
        "otel_llm/config/settings.py:2 (config) imports otel_llm.catalogue.metrics (catalogue)"
    ]
    assert violations(settings, "from otel_llm.config import buckets\nfrom otel_llm.events import EventType\n") == []
    demo = PACKAGE / "cli" / "demo.py"
    assert violations(demo, "from engine_stub import Engine\n") == []
    assert violations(recorder, "import engine_stub\n") == [
        "otel_llm/recording/recorder.py:1 (recording) imports engine_stub"
    ]


def test_a_package_module_that_runs_code_must_be_listed():
    assert _only_documents_or_reexports('"""The package."""\nfrom otel_llm.cli.main import main\n__all__ = ["main"]\n')
    assert not _only_documents_or_reexports("import sys\nfrom otel_llm.cli.main import main\nsys.exit(main())\n")
