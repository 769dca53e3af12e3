"""Evaluation tasks: the files of the four kinds (hellaswag, choice, bpb, generate) read and checked, and the task
list (docs/evaluation.md). A malformed item is one TaskError line naming the file and line, never a skip."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .data import file_sha256
from .fsio import loads
from .safety import check_name

LETTERS = "ABCD"
# Each kind's options and their defaults; any other key of a task entry is refused.
OPTIONS: dict[str, dict[str, Any]] = {
    "hellaswag": {"fewshot": 0, "fewshot_path": None, "limit": None, "batch_size": 16},
    "choice": {"fewshot": 0, "fewshot_path": None, "limit": None, "batch_size": 16},
    "bpb": {"limit": None, "window": None, "stride": None, "batch_size": 16},
    "generate": {"limit": None, "max_new_tokens": 64},
}


class TaskError(ValueError):
    """A task list or task file that cannot be used; one line naming the file (and line) and what is wrong."""


# ---- items --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: `context`, then each of `choices` (with its leading space) as its continuation."""
    context: str
    choices: tuple[str, ...]
    label: int


def _jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, object) for each non-blank line; `where` is "file:line" for the item's error messages."""
    for n, line in enumerate(_text(path).split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = loads(line)
        except (ValueError, RecursionError) as e:
            raise TaskError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TaskError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror or e})") from None


def _string(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in obj else f"{value!r}"[:60]
        raise TaskError(f"{where}: {key!r} must be a non-empty string, got {got}")
    return value


def read_hellaswag(path: Path) -> list[ChoiceItem]:
    """HellaSwag's JSONL: `ctx`, `endings` (a list of strings), `label` (the right ending's index; HF's copy
    writes it as a string)."""
    items = []
    for where, obj in _jsonl(path):
        ctx = _string(obj, "ctx", where)
        endings = obj.get("endings")
        if not (isinstance(endings, list) and len(endings) >= 2
                and all(isinstance(e, str) and e.strip() for e in endings)):
            raise TaskError(f"{where}: 'endings' must be a list of at least 2 non-empty strings")
        label = obj.get("label")
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
            raise TaskError(f"{where}: 'label' must be an index of 'endings' (0 to {len(endings) - 1}), got {label!r}")
        items.append(ChoiceItem(ctx.strip(), tuple(" " + e.strip() for e in endings), label))
    return items


def _question(question: str, choices: list[str], answer: Any, where: str) -> ChoiceItem:
    """A question scored cloze-style: the choice texts after "Answer:", as small models are best compared."""
    if not isinstance(answer, str) or answer.strip() not in tuple(LETTERS):
        hint = " (C-Eval's test split has no answers: use its dev or val split)" if answer in ("", None) else ""
        raise TaskError(f"{where}: answer must be one of A, B, C, D, got {answer!r}{hint}"[:300])
    return ChoiceItem(f"Question: {question.strip()}\nAnswer:", tuple(" " + c.strip() for c in choices),
                      LETTERS.index(answer.strip()))


def _csv_questions(path: Path) -> list[ChoiceItem]:
    """MMLU's CSVs (no header: question, A, B, C, D, answer), or C-Eval's and CMMLU's (a header naming
    question, A, B, C, D and answer, in any case, among other columns)."""
    reader = csv.reader(io.StringIO(_text(path), newline=""))
    items, columns, line = [], None, 1
    for row in reader:
        where, line = f"{path}:{line}", reader.line_num + 1  # a quoted field may span lines: its first one
        names = [c.strip().lower() for c in row]
        if not any(names):
            continue
        if columns is None and not items and {"question", "a", "b", "c", "d"} <= set(names):
            if "answer" not in names:
                raise TaskError(f"{where}: the header has no answer column (C-Eval's test split has no answers: "
                                f"use its dev or val split)")
            columns = [names.index(n) for n in ("question", "a", "b", "c", "d", "answer")]
            continue
        width = max(columns) + 1 if columns else 6
        if len(row) < width or (columns is None and len(row) != 6):
            raise TaskError(f"{where}: expected {'question, A, B, C, D, answer' if columns is None else width} "
                            f"columns, got {len(row)}")
        q, a, b, c, d, answer = [row[i] for i in columns or range(6)]
        for name, value in zip(("question", "A", "B", "C", "D"), (q, a, b, c, d), strict=True):
            if not value.strip():
                raise TaskError(f"{where}: {name} is empty")
        items.append(_question(q, [a, b, c, d], answer, where))
    return items


def read_choice(path: Path) -> list[ChoiceItem]:
    """MMLU-style questions from a CSV, or a JSONL of {"question", "choices": [4 strings] (or "A".."D"), "answer"}."""
    if path.suffix.lower() == ".csv":
        return _csv_questions(path)
    items = []
    for where, obj in _jsonl(path):
        question = _string(obj, "question", where)
        choices = obj.get("choices") if "choices" in obj else [obj.get(k) for k in LETTERS]
        if not (isinstance(choices, list) and len(choices) == 4 and all(isinstance(c, str) and c.strip()
                                                                        for c in choices)):
            raise TaskError(f"{where}: needs 4 non-empty choices, as 'choices': [...] or keys 'A' to 'D'")
        items.append(_question(question, choices, obj.get("answer"), where))
    return items


def read_documents(path: Path) -> list[str]:
    """Held-out documents: a JSONL of {"text"}, or a .txt that is one document (as `ray_jobs.prepare` reads it)."""
    if path.suffix.lower() == ".txt":
        text = _text(path)
        if not text.strip():
            raise TaskError(f"{path}: the document is empty")
        return [text]
    return [_string(obj, "text", where) for where, obj in _jsonl(path)]


def read_prompts(path: Path) -> list[str]:
    """Prompts: a JSONL of {"prompt"}, or a .txt with one prompt a line (blank lines skipped)."""
    if path.suffix.lower() == ".txt":
        return [line for line in _text(path).splitlines() if line.strip()]
    return [_string(obj, "prompt", where) for where, obj in _jsonl(path)]


READERS = {"hellaswag": read_hellaswag, "choice": read_choice, "bpb": read_documents, "generate": read_prompts}


# ---- the task list ------------------------------------------------------------------------------------

@dataclass
class Task:
    """One entry of the task list, its items read and checked. `fingerprint`: SHA-256 of the task file's bytes,
    and of the options and the few-shot file, so a record names exactly what was scored."""
    name: str
    kind: str
    path: Path
    options: dict[str, Any]
    items: list = field(repr=False)
    fewshot: list[ChoiceItem] = field(default_factory=list, repr=False)
    file_sha256: str = ""
    fingerprint: str = ""


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """The tasks of a YAML (or JSON) task list: `tasks:` a list of {name, kind, path, options...}; relative paths
    are relative to the list's folder."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task list {path} does not exist")
    try:
        spec = yaml.safe_load(_text(path))
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: a bad date
        raise TaskError(f"task list {path}: not valid YAML or JSON ({' '.join(str(e).split())[:200]})") from None
    entries = spec.get("tasks") if isinstance(spec, dict) else spec
    if not isinstance(entries, list) or not entries:
        raise TaskError(f"task list {path}: expected 'tasks:' and a list of tasks (name, kind, path)")
    tasks = [load_task(entry, path, i) for i, entry in enumerate(entries, 1)]
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TaskError(f"task list {path}: task names must be unique, {repeated[0]!r} repeats")
    return tasks


def load_task(entry: Any, listing: Path, number: int) -> Task:
    """One entry of the task list: its options checked, its file (and few-shot file) read, its fingerprint."""
    where = f"task list {listing}, task {number}"
    if not isinstance(entry, dict):
        raise TaskError(f"{where}: expected a mapping with name, kind and path")
    entry = dict(entry)
    name, kind, file = entry.pop("name", None), entry.pop("kind", None), entry.pop("path", None)
    # the name keys scores as eval/<name>/<metric> (and --eval-best): one path part, the rule for names
    check_name(name, f"{where}: 'name'", TaskError)
    where = f"task list {listing}, task {name!r}"
    if not isinstance(kind, str) or kind not in OPTIONS:
        raise TaskError(f"{where}: 'kind' must be one of {', '.join(OPTIONS)}, got {kind!r}")
    options = task_options(kind, entry, where)
    if not isinstance(file, str) or not file:
        raise TaskError(f"{where}: 'path' must name the task's file")
    file_path = _existing(file, listing, where)
    items, fewshot, shot_sha = READERS[kind](file_path), [], None
    shots = options.get("fewshot") or 0
    if shots and options.get("fewshot_path"):  # a separate dev split
        shot_path = _existing(str(options["fewshot_path"]), listing, f"{where}: fewshot_path")
        fewshot, shot_sha = READERS[kind](shot_path)[:shots], file_sha256(shot_path)
    elif shots:  # the file's first items, then not scored
        fewshot, items = items[:shots], items[shots:]
    if len(fewshot) < shots:
        raise TaskError(f"{where}: fewshot {shots} needs {shots} examples, the file has {len(fewshot)}")
    items = items[:options["limit"] or None]
    if not items:
        raise TaskError(f"{where}: {file_path} has no items to score")
    sha = file_sha256(file_path)
    scored = {k: v for k, v in options.items() if k not in ("batch_size", "fewshot_path")}  # what moves the scores
    identity = {"kind": kind, "file": sha, "options": scored, "fewshot_file": shot_sha}
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return Task(name, kind, file_path, options, items, fewshot, sha, fingerprint)


def task_options(kind: str, entry: dict, where: str) -> dict[str, Any]:
    """The kind's options, defaults filled in; an unknown option or a count that is not a whole number refused."""
    unknown = sorted(set(entry) - set(OPTIONS[kind]))
    if unknown:
        raise TaskError(f"{where}: unknown option {unknown[0]!r} for kind {kind} (options: {', '.join(OPTIONS[kind])})")
    options = {**OPTIONS[kind], **entry}
    if options.get("fewshot_path") is not None and not isinstance(options["fewshot_path"], str):
        # never str() of what YAML built: an alias bomb there would expand until memory is gone
        raise TaskError(f"{where}: fewshot_path must name a file, got a {type(options['fewshot_path']).__name__}")
    for key in ("fewshot", "limit", "batch_size", "window", "stride", "max_new_tokens"):
        value, least = options.get(key), {"fewshot": 0, "window": 2}.get(key, 1)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise TaskError(f"{where}: {key} must be an integer >= {least}, got {value!r}")
    return options


def _existing(file: str, listing: Path, where: str) -> Path:
    path = Path(file).expanduser()
    path = (path if path.is_absolute() else listing.parent / path).resolve()
    if not path.is_file():
        raise TaskError(f"{where}: {path} does not exist")
    return path

