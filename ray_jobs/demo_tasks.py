"""A task list for the demo corpus, made here (no download): what `--eval-tasks` scores in the demo.

    python -m ray_jobs.demo_tasks --output tasks/demo
    python -m ray_jobs.pretrain --eval-tasks tasks/demo/tasks.yaml

- `cloze` (hellaswag kind): the first sentence of a standard-library docstring cut in two; the right second half
  among three taken from other sentences. The demo trains on these docstrings: it measures what the model took in.
- `comments` (bpb kind): blocks of `#` comments of the standard library's source, text the demo corpus (docstrings
  only) never holds: held-out prose of the same domain.
- `samples` (generate kind): four prompts, continued greedily.

The flags every command shares: minilm.cli.
"""

from __future__ import annotations

import functools
import json
import random
import re
import sys
from pathlib import Path

from minilm import checkpoint as C
from minilm.corpus import _source_files, demo_corpus_documents, stdlib_dir

from .cli import ArgumentParser, command, fail

PROMPTS = ["Return the", "The os module", "Raise ValueError if", "This class"]


@functools.cache
def first_sentences() -> tuple[tuple[str, ...], ...]:
    """The first sentence of each docstring of the demo corpus with 8-30 words, as words."""
    sentences = []
    for doc in demo_corpus_documents():
        first = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0]
        if 8 <= len(first.split()) <= 30 and first.endswith("."):
            sentences.append(tuple(first.split()))
    return tuple(sentences)


def cloze_items(n: int) -> list[dict]:
    """`n` items: a docstring's first sentence cut after its first half; 4 endings, one right."""
    sentences = list(first_sentences())
    rng = random.Random(0)  # the same items every time: rewritten files keep their fingerprints
    rng.shuffle(sentences)
    items = []
    for words in sentences[:n]:
        cut = len(words) // 2
        others = [s[len(s) // 2:] for s in rng.sample(sentences, 4) if s is not words][:3]
        endings = [" ".join(e) for e in others]
        label = rng.randrange(len(endings) + 1)
        endings.insert(label, " ".join(words[cut:]))
        items.append({"ctx": " ".join(words[:cut]), "endings": endings, "label": label})
    return items


def comment_documents(n: int) -> list[str]:
    """`n` blocks of 200+ characters of `#` comment lines of the standard library (prose the docstrings lack)."""
    docs, root = [], stdlib_dir()
    for path in _source_files(root):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        block: list[str] = []
        for line in [*lines, ""]:
            text = line.strip()
            if text.startswith("#") and not text.startswith("#!"):
                block.append(text.lstrip("#").strip())
                continue
            doc = " ".join(w for w in block if w)
            if len(doc) >= 200 and re.search(r"[a-z]{3,} [a-z]{3,}", doc):
                docs.append(doc)
                if len(docs) == n:
                    return docs
            block = []
    return docs


TASKS_YAML = ("# made by python -m ray_jobs.demo_tasks from this Python's standard library\n"
              "tasks:\n"
              "  - {name: cloze, kind: hellaswag, path: cloze.jsonl}\n"
              "  - {name: comments, kind: bpb, path: comments.jsonl}\n"
              "  - {name: samples, kind: generate, path: prompts.txt, max_new_tokens: 24}\n")


def write_tasks(out: Path, items: int = 200, documents: int = 100) -> Path:
    """The task files in `out` by the export rule: a new or empty folder, or one holding exactly an earlier output
    of this command (its marker says so: a user's own tasks.yaml there is never replaced)."""
    C.check_output(out)  # refused before the standard library is read

    def lines(rows):
        return "".join(json.dumps(r) + "\n" for r in rows).encode()

    files = {"cloze.jsonl": lines(cloze_items(items)),
             "comments.jsonl": lines({"text": doc} for doc in comment_documents(documents)),
             "prompts.txt": "".join(p + "\n" for p in PROMPTS).encode(), "tasks.yaml": TASKS_YAML.encode()}
    C.write_export(out, {name: lambda f, data=data: C.write_bytes(f, data) for name, data in files.items()},
                   "demo-tasks")
    return out / "tasks.yaml"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m ray_jobs.demo_tasks", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--output", required=True, help="the folder to write the task files and tasks.yaml into")
    p.add_argument("--items", type=int, default=200, help="cloze items (default 200)")
    p.add_argument("--documents", type=int, default=100, help="comment blocks for bits per byte (default 100)")
    return p


@command(C.CheckpointError)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.items < 1 or args.documents < 1:
        return fail("--items and --documents must be >= 1")
    try:
        print(f"tasks: {write_tasks(Path(args.output), args.items, args.documents)}")
    except OSError as e:
        return fail(f"cannot write {args.output}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
