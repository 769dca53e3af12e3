"""Evaluation beyond loss: what a checkpoint does on fixed tasks, away from the training path.

Four kinds of task, each read from local files named in a task list (docs/evaluation.md):

    hellaswag  multiple choice, HellaSwag's JSONL ({"ctx", "endings", "label"})
    choice     multiple choice, MMLU / C-Eval / CMMLU CSV (or JSONL): question, choices A-D, answer letter
    bpb        bits per byte of held-out documents (JSONL {"text"} or one .txt), each read from its start
    generate   greedy continuations (temperature 0) of fixed prompts (JSONL {"prompt"} or .txt, one a line)

A multiple-choice item is scored as lm-eval-harness does: the log-likelihood of each choice's tokens after the
context, `acc` taking the largest sum and `acc_norm` the largest per UTF-8 byte of the choice. A malformed item is
one TaskError line naming the file and line, never a skip. `evaluate_checkpoint(path, tasks)` is the whole
per-checkpoint job: plain arguments in, plain records out, so it can run in-process or as a Ray task.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from . import checkpoint as C
from .bpb import evaluate_documents, token_byte_lengths
from .config import TrainConfig
from .data import file_sha256
from .model import MiniMindForCausalLM
from .safety import check_name
from .tokenizer import BOS_ID, EOS_ID

LETTERS = "ABCD"
# Each kind's options and their defaults; any other key of a task entry is refused.
OPTIONS: dict[str, dict[str, Any]] = {
    "hellaswag": {"fewshot": 0, "fewshot_path": None, "limit": None, "batch_size": 16},
    "choice": {"fewshot": 0, "fewshot_path": None, "limit": None, "batch_size": 16},
    "bpb": {"limit": None, "window": None, "stride": None, "batch_size": 16},
    "generate": {"limit": None, "max_new_tokens": 64},
}
FEWSHOT_SEPARATOR = "\n\n"


class TaskError(ValueError):
    """A task list or task file that cannot be used; one line naming the file (and line) and what is wrong."""


# ---- items --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: `context`, then each of `choices` (with its leading space) as its continuation."""
    context: str
    choices: tuple[str, ...]
    label: int

    def solved(self) -> str:
        """The item with its answer, as a few-shot example."""
        return self.context + self.choices[self.label]


def _jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, object) for each non-blank line; `where` is "file:line" for the item's error messages."""
    for n, line in enumerate(_text(path).split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
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
        if not any(cell.strip() for cell in row):
            continue
        if columns is None and not items:
            names = [c.strip().lower() for c in row]
            if {"question", "a", "b", "c", "d"} <= set(names):
                if "answer" not in names:
                    raise TaskError(f"{where}: the header has no answer column (C-Eval's test split has no answers: "
                                    f"use its dev or val split)")
                columns = {n: names.index(n) for n in ("question", "a", "b", "c", "d", "answer")}
                continue
        width = max(columns.values()) + 1 if columns else 6
        if len(row) < width or (columns is None and len(row) != 6):
            raise TaskError(f"{where}: expected {'question, A, B, C, D, answer' if columns is None else width} "
                            f"columns, got {len(row)}")
        q, a, b, c, d, answer = ([row[columns[n]] for n in ("question", "a", "b", "c", "d", "answer")]
                                 if columns else row)
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
    fingerprint = _sha256_json({"kind": kind, "file": sha, "options": scored, "fewshot_file": shot_sha})
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
    path = _resolve(file, listing)
    if not path.is_file():
        raise TaskError(f"{where}: {path} does not exist")
    return path


def _resolve(file: str, listing: Path) -> Path:
    p = Path(file).expanduser()
    return (p if p.is_absolute() else listing.parent / p).resolve()


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---- scoring ----------------------------------------------------------------------------------------

@torch.no_grad()
def choice_loglikelihoods(model: torch.nn.Module, tokenizer, items: list[ChoiceItem], *, prefix: str = "",
                          max_len: int | None = None, batch_size: int = 16,
                          device: str | torch.device = "cpu") -> list[list[float]]:
    """For each item, the log-likelihood (nats) of each choice's tokens given [BOS] + prefix + context.

    The context is cut from the left when a sequence would pass `max_len` tokens. Sequences are right-padded,
    which a causal model never sees; positions outside the choice have no target (-100).
    """
    max_len = max_len or model.config.max_position_embeddings
    requests = []  # (item, choice, ids, number of choice tokens)
    for i, item in enumerate(items):
        context = tokenizer.encode(prefix + item.context).ids
        for j, choice in enumerate(item.choices):
            cont = tokenizer.encode(choice).ids
            room = max_len - 1 - len(cont)  # context tokens that fit after BOS: the choice is what is scored, whole
            if room < 0:
                raise TaskError(f"item {i + 1}: a choice of {len(cont)} tokens does not fit the window of {max_len} "
                                f"({choice[:40]!r})")
            kept = context[max(0, len(context) - room):] if room else []
            requests.append((i, j, [BOS_ID, *kept, *cont], len(cont)))
    out = [[0.0] * len(item.choices) for item in items]
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(ids) for _, _, ids, _ in batch)
        inputs = torch.zeros(len(batch), width - 1, dtype=torch.long)
        targets = torch.full((len(batch), width - 1), -100, dtype=torch.long)
        for r, (_, _, ids, n) in enumerate(batch):
            row = torch.as_tensor(ids)
            inputs[r, :len(ids) - 1] = row[:-1]
            targets[r, len(ids) - 1 - n:len(ids) - 1] = row[-n:]  # the choice's tokens, predicted one early
        nats = model(inputs.to(device), targets=targets.to(device), reduction="none").loss
        for (i, j, _, _), value in zip(batch, (-nats.double().sum(1)).tolist(), strict=True):
            out[i][j] = value
    return out


def choice_metrics(items: list[ChoiceItem], loglik: list[list[float]]) -> dict[str, float]:
    """`acc`: the most likely choice is right; `acc_norm`: the most likely per UTF-8 byte (longer choices are not
    penalised for their length); both averaged over the items."""
    acc = acc_norm = 0
    for item, ll in zip(items, loglik, strict=True):
        per_byte = [v / max(1, len(c.encode("utf-8"))) for v, c in zip(ll, item.choices, strict=True)]
        acc += max(range(len(ll)), key=ll.__getitem__) == item.label
        acc_norm += max(range(len(ll)), key=per_byte.__getitem__) == item.label
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items)}


def fewshot_prefix(examples: list[ChoiceItem]) -> str:
    return "".join(e.solved() + FEWSHOT_SEPARATOR for e in examples)


@torch.no_grad()
def greedy_continuations(model: MiniMindForCausalLM, tokenizer, prompts: list[str], max_new_tokens: int,
                         device: str | torch.device = "cpu") -> list[str]:
    """Each prompt continued greedily from [BOS] + prompt, until EOS or `max_new_tokens`: the text it added."""
    texts = []
    for prompt in prompts:
        ids = [BOS_ID, *tokenizer.encode(prompt).ids]
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, temperature=0,
                             eos_token_id=EOS_ID)[0, len(ids):].tolist()
        texts.append(tokenizer.decode([t for t in out if t != EOS_ID]))
    return texts


# ---- a checkpoint --------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """What a record names a checkpoint by: its folder, optimizer step (None for a weights export outside a
    checkpoint) and the SHA-256 of its weights (from its marker: no hashing here)."""
    path: Path
    step: int | None
    weights_sha256: str
    resume: bool  # a resume checkpoint (state.json), else a weights export


def identify(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint's identity from its marker and state.json, read without loading it (CheckpointError if it is
    not a checkpoint or export folder); `verify` still runs before it is loaded."""
    path = Path(path)
    if not path.is_dir():
        raise C.CheckpointError(f"checkpoint {path} does not exist")
    raw = (path / C.MARKER).read_bytes() if (path / C.MARKER).is_file() else None
    files = C.files.parse_marker(raw, path)
    if "state.json" in files:
        step = C.read_state(path, ("optimizer_step",))["optimizer_step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise C.CheckpointError(f"checkpoint {path}: state.json's optimizer_step is {step!r}, not a step")
        return Checkpoint(path, step, files["model.safetensors"], True)
    if "config.json" not in files:
        raise C.CheckpointError(f"{path} is neither a resume checkpoint (state.json) nor a weights export "
                                f"(config.json)")
    parent = path.parent / "state.json"  # a checkpoint's own weights/ export: the step is its checkpoint's
    step = C.read_state(path.parent, ("optimizer_step",))["optimizer_step"] if parent.is_file() else None
    return Checkpoint(path, step, files["model.safetensors"], False)


def find_tokenizer(checkpoint: Checkpoint, given: str | os.PathLike | None) -> Path:
    """--tokenizer, else the checkpoint's own tokenizer.json (in its weights/ export, or the export's), else that of
    another checkpoint of its run folder: with --export-every N only every N-th has one, and a run keeps its
    tokenizer (`checkpoint.open_tokenizer` holds it to the checkpoint's SHA-256)."""
    if given:
        return Path(given)
    own = [checkpoint.path / "weights" / "tokenizer.json", checkpoint.path / "tokenizer.json"]
    run = sorted(checkpoint.path.parent.glob("checkpoint_*/weights/tokenizer.json"), reverse=True)
    for candidate in [*own, *(run if checkpoint.resume else [])]:
        if candidate.is_file():
            return candidate
    raise TaskError(f"{checkpoint.path} has no tokenizer.json, nor has its weights/ or another checkpoint of its "
                    f"run: give --tokenizer, the tokenizer.json of the data the model was trained on")


def evaluate_checkpoint(path: str | os.PathLike, tasks: list[Task], *, tokenizer: str | os.PathLike | None = None,
                        device: str | torch.device = "cpu") -> list[dict]:
    """Every task on one checkpoint (a resume checkpoint folder or a weights export): one record each."""
    checkpoint = identify(path)
    tokenizer_path = find_tokenizer(checkpoint, tokenizer)
    model, state = C.open_weights(checkpoint.path, device)
    tok = C.open_tokenizer(tokenizer_path, model.config, (state or {}).get("tokenizer_sha256"))
    seq_len = ((state or {}).get("train_config") or {}).get("seq_len") or TrainConfig().seq_len
    records = []
    for task in tasks:
        start = time.perf_counter()
        result = run_task(task, model, tok, tokenizer_path, seq_len + 1, device)
        records.append({"task": task.name, "kind": task.kind, "fingerprint": task.fingerprint,
                        "file": str(task.path), "file_sha256": task.file_sha256, "checkpoint": str(checkpoint.path),
                        "step": checkpoint.step, "weights_sha256": checkpoint.weights_sha256, **result,
                        "seconds": round(time.perf_counter() - start, 3),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return records


def run_task(task: Task, model: MiniMindForCausalLM, tokenizer, tokenizer_path: Path, window: int,
             device: str | torch.device) -> dict:
    """{"metrics": {...}, "items": n} (+ "generations" for a generate task)."""
    opts = task.options
    if task.kind in ("hellaswag", "choice"):
        try:
            loglik = choice_loglikelihoods(model, tokenizer, task.items, prefix=fewshot_prefix(task.fewshot),
                                           max_len=window, batch_size=opts["batch_size"], device=device)
        except TaskError as e:
            raise TaskError(f"task {task.name!r} ({task.path}): {e}") from None
        return {"metrics": choice_metrics(task.items, loglik), "items": len(task.items)}
    if task.kind == "bpb":
        try:
            lengths = token_byte_lengths(tokenizer_path)
        except ValueError as e:
            raise TaskError(f"task {task.name!r}: {e}") from None
        docs = [tokenizer.encode(text).ids for text in task.items]
        window = min(opts["window"] or window, model.config.max_position_embeddings)
        if opts["stride"] is not None and not opts["stride"] < window:
            raise TaskError(f"task {task.name!r}: stride {opts['stride']} must be less than the window {window}")
        r = evaluate_documents(model, docs, lengths, prefix=[BOS_ID], window=window, stride=opts["stride"],
                               batch_size=opts["batch_size"], device=device)
        return {"metrics": {"bpb": r["bpb"], "nats_per_token": r["nats"] / max(1, r["tokens"])},
                "items": len(docs), "bytes": r["bytes"], "tokens": r["tokens"]}
    texts = greedy_continuations(model, tokenizer, task.items, opts["max_new_tokens"], device)
    return {"metrics": {"prompts": len(texts)}, "items": len(texts),
            "generations": [{"prompt": p, "text": t} for p, t in zip(task.items, texts, strict=True)]}


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" if isinstance(v, float) and not math.isnan(v) else f"{k} {v}"
                     for k, v in metrics.items())


__all__ = ["ChoiceItem", "Checkpoint", "Task", "TaskError", "choice_loglikelihoods", "choice_metrics",
           "evaluate_checkpoint", "fewshot_prefix", "find_tokenizer", "format_metrics", "greedy_continuations",
           "identify", "load_tasks", "read_choice", "read_documents", "read_hellaswag", "read_prompts"]
