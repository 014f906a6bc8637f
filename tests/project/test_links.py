"""Every reference in the docs and in the code's comments resolves, so that none can rot.

* Markdown (README.md, docs/*.md, bench/README.md, collector/README.md): every relative link
  (a file, a folder, and the ``#anchor`` of a Markdown target) and every backticked repository
  path (`otel_llm/...`, `tests/...`, or a path from the document's own folder) outside code
  blocks.
* Code comments and docstrings, makefiles and configs: every Markdown file and every path under
  docs/ they mention, from the repository root or the file's own folder.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
    ROOT / "collector" / "README.md",
]
CODE_SUFFIXES = {".py", ".mk", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".sh"}
CODE_NAMES = {"Makefile", "run"}  # .ci/run

FENCE = re.compile(r"(?ms)^ *```.*?^ *```")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH_LIKE = re.compile(r"[\w.\-/]+")
FILE_SUFFIX = re.compile(r"\.(md|py|mk|ya?ml|toml|txt|sh)$")  # a bare file name taken as a path
DOC_REF = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md|docs/(?:[\w./-]*[\w/])?)(?![\w/-])")


def top_level_entries(folder: Path) -> set[str]:
    """What a backticked path may start with: the folder's entries, less the local ones
    (virtualenvs, caches, build output) a fresh checkout does not have."""
    return {
        p.name
        for p in folder.iterdir()
        if not (p.name.startswith(".") and p.name != ".ci")
        and not p.name.endswith(".egg-info")
        and p.name not in ("__pycache__", "build")
    }


def prose(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
        return True
    except ValueError:
        return False


def broken_links(doc: Path) -> Iterator[str]:
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part) if path_part else doc
        if not (path.exists() and inside_repo(path)):
            yield f"{target}: no such file in the repository"
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            yield f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}"


def broken_paths(doc: Path) -> Iterator[str]:
    roots = {ROOT: top_level_entries(ROOT), doc.parent: top_level_entries(doc.parent)}
    for span in CODE_SPAN.findall(prose(doc.read_text())):
        span = span.split("::")[0]  # tests/x.py::test_name
        if not PATH_LIKE.fullmatch(span):
            continue
        first = span.split("/")[0]
        is_path = ("/" in span and any(first in entries for entries in roots.values())) or (
            "/" not in span and FILE_SUFFIX.search(span) is not None
        )
        if is_path and not any((base / span).exists() for base in roots):
            yield f"`{span}`: no such file (from the repository root or {doc.parent.relative_to(ROOT) or '.'})"


def code_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if (not d.startswith(".") or d == ".ci")
            and d != "__pycache__"
            and not d.endswith(".egg-info")
            and d != "build"
        ]
        for name in files:
            path = Path(folder) / name
            if path.suffix in CODE_SUFFIXES or name in CODE_NAMES:
                yield path


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert doc.exists()
    assert not list(broken_links(doc))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repository_path_exists(doc: Path) -> None:
    assert not list(broken_paths(doc))


def commentary(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of what speaks about the code: a Python file's comments and
    docstrings; every line of a makefile or config."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first.lineno, first.value.value


def test_every_doc_the_code_mentions_exists() -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{number}: {ref}"
        for path in code_files()
        for number, text in commentary(path)
        for ref in DOC_REF.findall(text)
        if not ((ROOT / ref).exists() or (path.parent / ref).exists())
    ]
    assert not broken, "\n".join(broken)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    doc = ROOT / "docs" / "architecture.md"
    text = "[gone](missing.md) [bad anchor](#no-such-heading) `otel_llm/gone.py` `DESIGN.md`\n```\n`x/y.py`\n```"
    fake = doc.with_name("_probe.md")
    fake.write_text("# Probe\n" + text)
    try:
        assert len(list(broken_links(fake))) == 2
        assert [p.split(":")[0] for p in broken_paths(fake)] == ["`otel_llm/gone.py`", "`DESIGN.md`"]
    finally:
        fake.unlink()
    assert DOC_REF.findall("see DESIGN.md §8, docs/vllm.md, docs/ and ../collector/README.md.") == [
        "DESIGN.md",
        "docs/vllm.md",
        "docs/",
        "../collector/README.md",
    ]
    probe = tmp_path / "probe.py"
    probe.write_text('"""See DESIGN.md."""\nx = "README.md"  # and docs/gone.md\n')
    assert [text for _, text in commentary(probe)] == ["# and docs/gone.md", "See DESIGN.md."]
