"""The corpora of bench.minimind: the built-in demo corpus, the King James Bible as passages or as chapters
(Debian's bible-kjv, or --kjv FILE), and Chinese fortunes (Debian's fortunes-zh); a seeded held-out split."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minilm.corpus import demo_corpus_documents

CORPORA = ("demo", "kjv-passages", "kjv-chapters", "zh-fortunes")
ZH_FORTUNES = Path("/usr/share/games/fortunes")  # Debian's fortunes-zh (GPL-3.0+)
ZH_FILES = ("chinese", "tang300", "song100")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
KJV_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
PASSAGE_CHARS = 900
CHAPTERS_PER_DOC = 3


class BenchError(ValueError):
    """A bad flag, a missing checkout or corpus, or a run that failed: one line, exit 2."""


def kjv_chapters(kjv_file: str | None) -> list[tuple[str, list[str]]]:
    """[(book, [verse text, ...]) per chapter] of the KJV, in order."""
    if kjv_file:
        text = Path(kjv_file).read_text(encoding="utf-8")
    elif shutil.which("bible"):
        text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                              check=True).stdout
    else:
        raise BenchError("the kjv corpora need Debian's bible-kjv (apt-get install bible-kjv) or --kjv FILE")
    chapters: list[tuple[str, list[str]]] = []
    last = None
    for line in text.splitlines():
        m = KJV_VERSE.match(line.strip())
        if not m:
            continue
        key = (m.group(1), m.group(2))
        if key != last:
            chapters.append((m.group(1), []))
            last = key
        chapters[-1][1].append(m.group(4).strip())
    if len(chapters) < 100:
        raise BenchError(f"--kjv: found {len(chapters)} chapters, expected the whole KJV (1,189)")
    return chapters


def zh_fortunes(folder: Path = ZH_FORTUNES) -> list[str]:
    """Debian's fortunes-zh: Chinese prose (quotations, essays, jokes, Debian's code of conduct), the 300 Tang poems
    and 100 Song lyrics, one document per fortune (a few characters to ~9,000), colour escapes removed."""
    if not all((folder / f).is_file() for f in ZH_FILES):
        raise BenchError("the zh-fortunes corpus needs Debian's fortunes-zh (apt-get install fortunes-zh)")
    docs = []
    for name in ZH_FILES:
        for part in (folder / name).read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = ANSI.sub("", part).strip()
            if len(text) >= 8:
                docs.append(text)
    return docs


def corpus_documents(name: str, kjv_file: str | None) -> list[str]:
    if name == "demo":
        return list(demo_corpus_documents())
    if name == "zh-fortunes":
        return zh_fortunes()
    chapters = kjv_chapters(kjv_file)
    if name == "kjv-passages":
        docs = []
        for _, verses in chapters:
            passage: list[str] = []
            for v in verses:
                passage.append(v)
                if sum(map(len, passage)) >= PASSAGE_CHARS:
                    docs.append(" ".join(passage))
                    passage = []
            if passage:
                docs.append(" ".join(passage))
        return docs
    if name == "kjv-chapters":
        docs, book, group = [], None, []
        for b, verses in chapters:
            if b != book or len(group) == CHAPTERS_PER_DOC:
                if group:
                    docs.append("\n\n".join(group))
                book, group = b, []
            group.append(" ".join(verses))
        docs.append("\n\n".join(group))
        return docs
    raise BenchError(f"--corpus: unknown corpus {name!r}; choose from {', '.join(CORPORA)}")


@dataclass
class Split:
    train: list[str]
    held_out: list[str]
    epochs: int  # MiniMind's --epochs that make `steps` optimizer steps over `train`
    steps: int


def split_corpus(docs: list[str], steps: int, batch_size: int, held_out: int, seed: int) -> Split:
    """A seeded held-out set, then the training documents for `steps` MiniMind steps (whole epochs of whole batches)."""
    order = np.random.default_rng(seed).permutation(len(docs))
    held_out = min(held_out, len(docs) // 5)
    available = len(docs) - held_out
    epochs = max(1, math.ceil(steps * batch_size / available))
    per_epoch = max(1, (steps // epochs))
    n_train = per_epoch * batch_size
    if n_train > available:
        raise BenchError(f"{len(docs)} documents are too few for {steps} steps of {batch_size}")
    train = [docs[i] for i in sorted(order[held_out:held_out + n_train])]
    held = [docs[i] for i in sorted(order[:held_out])]
    return Split(train, held, epochs, epochs * per_epoch)
