"""How tokenized documents become training rows of `row_len` (seq_len + 1) ids: the layouts, as pure functions.
Packed rows, and BOS-aligned best-fit rows (each document read from its BOS, as prompted).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .safety import redact
from .tokenizer import BOS_ID, EOS_ID


def pack_documents(docs: Iterable[Sequence[int]], seq_len: int, eos_id: int = EOS_ID) -> tuple[np.ndarray, int]:
    """(rows, dropped_tail_tokens): `docs` each followed by `eos_id`, concatenated, cut into rows: the in-memory
    reference of what `minilm.packing.ShardWriter` writes to disk."""
    parts = []
    for doc in docs:
        parts.append(np.asarray(doc, dtype=np.int32))
        parts.append(np.array([eos_id], dtype=np.int32))
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1), len(stream) - n * (seq_len + 1)


@dataclass
class BestFitStats:
    rows: int = 0
    documents: int = 0  # documents placed (whole or cropped)
    cropped_documents: int = 0
    cropped_tokens: int = 0  # tokens cut off cropped documents (never trained on)
    split_documents: int = 0  # split_long: documents longer than a row, split into rows of their own
    leftover_documents: int = 0  # documents still waiting when the input ran out (they fill no whole row)
    leftover_tokens: int = 0


class BestFitRows:
    """BOS-aligned best-fit rows from documents pushed one at a time (`add`): each row takes the longest waiting
    document that fits; when none fits, the shortest is cropped (`split_long`: the longest split, its rest waits)."""

    def __init__(self, row_len: int, *, bos_id: int = BOS_ID, eos_id: int = EOS_ID, buffer_docs: int = 1000,
                 stats: BestFitStats | None = None, split_long: bool = False):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2 (BOS and EOS), got {row_len}")
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs must be >= 1, got {buffer_docs}")
        self.row_len, self.bos_id, self.eos_id, self.buffer_docs = row_len, bos_id, eos_id, buffer_docs
        self.split_long = split_long
        self.stats = stats if stats is not None else BestFitStats()
        self.keys: list[tuple[int, int]] = []  # (length, arrival number), sorted: bisect finds the best fit
        self.waiting: dict[int, np.ndarray] = {}
        self.arrivals = self.waiting_tokens = 0

    def add(self, doc: Sequence[int]) -> list[np.ndarray]:
        ids = np.asarray([self.bos_id, *doc, self.eos_id], dtype=np.int32)
        rows = []
        if self.split_long and len(ids) > self.row_len:
            whole = (len(ids) - 1) // self.row_len  # leave a non-empty last piece to place best-fit
            rows = [ids[i * self.row_len:(i + 1) * self.row_len] for i in range(whole)]
            ids = ids[whole * self.row_len:]
            self.stats.rows += whole
            self.stats.split_documents += 1
            self.stats.documents += 1  # placed here; its last piece starts with no BOS and is not counted again
        self._wait(ids)
        while len(self.keys) >= self.buffer_docs and self.waiting_tokens >= self.row_len:
            rows.append(self._row())
        return rows

    def _wait(self, ids: np.ndarray) -> None:
        bisect.insort(self.keys, (len(ids), self.arrivals))
        self.waiting[self.arrivals] = ids
        self.waiting_tokens += len(ids)
        self.arrivals += 1

    def finish(self) -> list[np.ndarray]:
        rows = []
        while self.waiting_tokens >= self.row_len:
            rows.append(self._row())
        self.stats.leftover_documents += len(self.keys)
        self.stats.leftover_tokens += self.waiting_tokens
        self.keys, self.waiting, self.waiting_tokens = [], {}, 0
        return rows

    def _row(self) -> np.ndarray:
        row = np.empty(self.row_len, dtype=np.int32)
        filled = 0
        while filled < self.row_len:
            space = self.row_len - filled
            # The longest document of length <= space: the last key before (space + 1, -1).
            i = bisect.bisect_left(self.keys, (space + 1, -1)) - 1
            if i >= 0:
                length, n = self.keys.pop(i)
                ids = self.waiting.pop(n)
                row[filled:filled + length] = ids
                filled += length
            else:  # nothing fits: waiting_tokens >= space guarantees a document is waiting
                # Cropping the shortest wastes the fewest tokens; when the rest waits, splitting the
                # longest leaves short documents whole.
                length, n = self.keys.pop(-1 if self.split_long else 0)
                ids = self.waiting.pop(n)
                row[filled:] = ids[:space]
                filled = self.row_len
                if self.split_long:  # the rest waits for a later row
                    self._wait(ids[space:])
                else:
                    self.stats.cropped_documents += 1
                    self.stats.cropped_tokens += length - space
            self.waiting_tokens -= length
            self.stats.documents += int(ids[0] == self.bos_id)  # a rest piece is not a new document
        self.stats.rows += 1
        return row


def iter_bos_aligned_rows(docs: Iterable[Sequence[int]], row_len: int, *, bos_id: int = BOS_ID,
                          eos_id: int = EOS_ID, buffer_docs: int = 1000,
                          stats: BestFitStats | None = None, split_long: bool = False) -> Iterator[np.ndarray]:
    """Yield BOS-aligned rows (int32, row_len) of `docs` (`BestFitRows`), with memory flat in the corpus size."""
    packer = BestFitRows(row_len, bos_id=bos_id, eos_id=eos_id, buffer_docs=buffer_docs, stats=stats,
                         split_long=split_long)
    for doc in docs:
        yield from packer.add(doc)
    yield from packer.finish()


def bos_aligned_rows(docs: Iterable[Sequence[int]], row_len: int, *, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                     buffer_docs: int = 1000, split_long: bool = False) -> tuple[np.ndarray, BestFitStats]:
    """All BOS-aligned rows of `docs` as one int32 array (n, row_len), and what was cropped or left over."""
    stats = BestFitStats()
    rows = list(iter_bos_aligned_rows(docs, row_len, bos_id=bos_id, eos_id=eos_id, buffer_docs=buffer_docs,
                                      stats=stats, split_long=split_long))
    return (np.stack(rows) if rows else np.zeros((0, row_len), np.int32)), stats


def best_fit_rows(docs: Iterable[Sequence[int]], row_len: int, *, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                  buffer_docs: int = 1000) -> tuple[np.ndarray, BestFitStats]:
    """minilm's default rows: BOS-aligned best-fit, long documents split into rows of their own, nothing dropped."""
    return bos_aligned_rows(docs, row_len, bos_id=bos_id, eos_id=eos_id, buffer_docs=buffer_docs, split_long=True)


def rows_note(manifest: dict, where: str) -> str | None:
    """The start line's note for data prepared without BOS (`--rows packed`, and every prepare before best-fit)."""
    rows = manifest.get("rows", "packed")
    if rows != "packed":
        return None
    return (f"note: {redact(where)} was prepared with --rows packed: no document starts with BOS, as the model is prompted; "
            f"it trains, but `python -m ray_jobs.prepare` (--rows best-fit, the default) is the recommended "
            f"format (docs/quality.md)")

