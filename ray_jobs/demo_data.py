"""The built-in demo corpus, prepared once into a cache directory."""

from __future__ import annotations

import sys
from pathlib import Path

from minilm import data as D
from minilm.data import cache_root


def demo_data_dir(seq_len: int, vocab_size: int) -> Path:
    """The demo corpus (stdlib docstrings) prepared once per (Python, seq_len, vocab); again if it does not open."""
    from minilm.corpus import write_demo_corpus

    from . import prepare

    # The rows format is in the name: a cache of an older default is never trained on again.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-seq{seq_len}-vocab{vocab_size}-best-fit"
    out = cache_root() / "demo" / tag
    try:
        D.open_prepared(out)
        return out
    except D.DataError:
        pass
    corpus = cache_root() / "demo" / f"corpus-py{sys.version_info.major}{sys.version_info.minor}.jsonl"
    if not corpus.is_file():
        corpus.parent.mkdir(parents=True, exist_ok=True)
        write_demo_corpus(corpus)
    print(f"preparing the built-in demo corpus into {out} (once)", flush=True)
    code = prepare.main(["--input", str(corpus), "--output", str(out), "--seq-len", str(seq_len),
                         "--vocab-size", str(vocab_size), "--overwrite"])
    if code != 0:
        raise D.DataError(f"preparing the demo corpus into {out} failed (exit {code})")
    return out
