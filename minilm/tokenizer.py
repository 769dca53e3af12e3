"""Byte-level BPE tokenizers with MiniMind's special tokens at ids 0-2: trained deterministically like MiniMind's,
or loaded from any `tokenizer.json` that has them. Every string encodes and decodes back unchanged."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2, as in MiniMind
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")  # the manifest's and the configs' names, id order

DEFAULT_VOCAB_SIZE = 6400
# The special tokens plus the 256 byte symbols every byte-level BPE starts from.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
# Training reads at most this much text, in input order: enough for a 6400-token vocabulary, and it keeps
# training short whatever the size of the corpus.
DEFAULT_MAX_TRAIN_BYTES = 8 << 20


class TokenizerError(ValueError):
    """A tokenizer cannot be trained or loaded, or lacks MiniMind's special tokens; the message says why."""


def _capped(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    used = 0
    for text in texts:
        if max_bytes is not None:
            n = len(text.encode("utf-8", "surrogatepass"))
            if used and used + n > max_bytes:
                return
            used += n
        yield text


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *,
                    max_bytes: int | None = DEFAULT_MAX_TRAIN_BYTES) -> Tokenizer:
    """Train a byte-level BPE on `texts` (in order, up to `max_bytes`): the same texts give the same `to_str()`."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab size {vocab_size} is too small: a byte-level BPE needs at least "
                             f"{MIN_VOCAB_SIZE} (3 special tokens + 256 bytes); MiniMind uses {DEFAULT_VOCAB_SIZE}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_capped(texts, max_bytes), trainer=trainer)
    check_special_ids(tok, "the trained tokenizer")
    return tok


def tokenizer_to_str(tok: Tokenizer) -> str:
    """The canonical JSON text of a tokenizer (what `save_tokenizer` writes)."""
    return tok.to_str(pretty=True)


def tokenizer_file(path: str | os.PathLike) -> Path:
    """`path`, or the tokenizer.json in it when it is a folder."""
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write `tok` as `tokenizer.json` at `path` (a file path, or a directory to write it into)."""
    path = tokenizer_file(path)
    path.write_text(tokenizer_to_str(tok), encoding="utf-8")
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a `tokenizer.json` (or a directory holding one) and check its special tokens."""
    path = tokenizer_file(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception for any parse error
        raise TokenizerError(f"{path} is not a tokenizers JSON file ({str(e).strip()})") from None
    check_special_ids(tok, str(path))
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int | None]:
    """{"pad_token_id", "bos_token_id", "eos_token_id"} as `tok` has them (None where missing)."""
    return {key: tok.token_to_id(name) for key, name in zip(SPECIAL_KEYS, SPECIAL_TOKENS, strict=True)}


def check_special_ids(tok: Tokenizer, where: str) -> None:
    """Refuse a tokenizer whose special tokens are not MiniMind's (packing and training rely on them)."""
    found = list(special_ids(tok).values())
    bad = [f"{name} is {'missing' if found[i] is None else f'id {found[i]}'}"
           for i, name in enumerate(SPECIAL_TOKENS) if found[i] != i]
    if bad:
        raise TokenizerError(f"{where}: MiniMind's special tokens must be {PAD_TOKEN}=0, {BOS_TOKEN}=1, "
                             f"{EOS_TOKEN}=2, but " + ", ".join(bad))


def vocab_size_of(tok: Tokenizer) -> int:
    """Ids the model must embed: one more than the largest id (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1
