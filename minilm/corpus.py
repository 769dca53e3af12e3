"""A built-in demo corpus that needs no download: the standard library's docstrings and pydoc's topics, read with
`ast` in sorted order, so the same on every run of one Python (tests, short docstrings and repeats skipped)."""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from .fsio import write_atomic

MIN_CHARS = 80
MAX_BYTES = 4 << 20  # UTF-8 bytes of text, all documents together
SKIP_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages", "dist-packages",
    "__pycache__", "lib-dynload", "_bundled", "__phello__",
})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of `node` and of the classes and functions inside it, in source order."""
    if isinstance(node, _DOC_NODES):
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
            yield doc.strip()
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def _pydoc_topics(tree: ast.Module) -> Iterator[str]:
    """The values of the `topics = {...}` dict literal in pydoc_data/topics.py, in source order."""
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "topics" for t in stmt.targets)):
            for value in stmt.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value.strip()


def _file_documents(path: Path, root: Path) -> Iterator[str]:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old modules
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    yield from _docstrings(tree)
    if path.relative_to(root).as_posix() == "pydoc_data/topics.py":
        yield from _pydoc_topics(tree)


def demo_corpus_documents(max_bytes: int = MAX_BYTES, min_chars: int = MIN_CHARS,
                          root: str | os.PathLike | None = None) -> Iterator[str]:
    """The demo corpus, one document (a docstring or a pydoc topic) per item, deterministically."""
    root = Path(root) if root is not None else stdlib_dir()
    seen: set[str] = set()
    used = 0
    for path in _source_files(root):
        for doc in _file_documents(path, root):
            if len(doc) < min_chars or doc in seen:
                continue
            n = len(doc.encode("utf-8", "surrogatepass"))
            if used + n > max_bytes:
                return
            try:
                doc.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate written as an escape: not text
                continue
            seen.add(doc)
            used += n
            yield doc


def write_demo_corpus(path: str | os.PathLike, max_bytes: int = MAX_BYTES) -> dict:
    """Write the demo corpus as MiniMind-style JSONL to `path`; {"path", "documents", "text_bytes", "bytes"}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = list(demo_corpus_documents(max_bytes=max_bytes))  # a few MB: written whole, then renamed into place
    write_atomic(path, "".join(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs))
    return {"path": str(path), "documents": len(docs), "text_bytes": sum(len(d.encode("utf-8")) for d in docs),
            "bytes": path.stat().st_size}
