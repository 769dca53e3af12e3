"""Reading prepared data, and the sample order that makes resume exact at any world size.

The resumable iterator Ray Data lacks (ray-project/ray#37633, #48224) is built from three pure
functions instead of iterator state:

* `epoch_order(train_ids, seed, epoch)`: a seeded permutation of the training sample ids;
* optimizer step s of an epoch consumes positions [s*G, (s+1)*G) of that order (G = global batch),
  whatever the world size;
* worker r of W takes the r-th contiguous G/W slice of each global batch and reads it as
  accumulation_steps micro-batches (`RankOrder`, the one place this arithmetic lives).

So the only position to save is the optimizer step (samples_seen = step * G), and a resumed run at
any world size consumes exactly the samples the uninterrupted run would have, step by step.
See docs/data.md for the on-disk format (manifest.json + parquet shards).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "minilm-packed-v1"
VAL_SEED = 0x5EED  # the held-out slice is fixed, independent of the training seed


class DataError(ValueError):
    """Prepared data is missing, incomplete, or does not fit the run; the message says what and where."""


# ---- the prepared dataset -----------------------------------------------------------------------

@dataclass(frozen=True)
class PreparedData:
    path: Path
    manifest: dict

    @property
    def num_sequences(self) -> int:
        return int(self.manifest["num_sequences"])

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.manifest["tokenizer"]["sha256"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def shard_paths(self) -> list[Path]:
        return [self.path / s["file"] for s in self.manifest["shards"]]


def open_prepared(path: str | os.PathLike) -> PreparedData:
    """Open a directory written by `ray_jobs.prepare`, checking it is complete."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"data directory {path} does not exist (make one with `python -m ray_jobs.prepare`)")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{path} has no {MANIFEST}: not a prepared dataset, or its prepare did not finish")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{mpath}: format {got!r} is not {FORMAT!r}")
    missing = [k for k in ("seq_len", "num_sequences", "shards", "tokenizer", "fingerprint") if k not in manifest]
    if missing:
        raise DataError(f"{mpath}: missing {', '.join(missing)}")
    data = PreparedData(path, manifest)
    expected_first = 0
    for shard in manifest["shards"]:
        if int(shard["first_sample_id"]) != expected_first:
            raise DataError(f"{mpath}: shard {shard['file']} starts at sample {shard['first_sample_id']}, "
                            f"expected {expected_first} (sample ids must be contiguous across shards)")
        expected_first += int(shard["num_sequences"])
    for shard in data.shard_paths:
        if not shard.is_file():
            raise DataError(f"{path}: shard {shard.name} listed in {MANIFEST} is missing")
    if not (path / "tokenizer.json").is_file():
        raise DataError(f"{path}: tokenizer.json is missing")
    if sum(int(s["num_sequences"]) for s in manifest["shards"]) != data.num_sequences:
        raise DataError(f"{mpath}: shard sizes do not add up to num_sequences {data.num_sequences}")
    return data


def check_compatible(data: PreparedData, *, vocab_size: int, seq_len: int) -> None:
    """Refuse data that does not fit the model before any worker starts."""
    problems = []
    if data.vocab_size > vocab_size:
        problems.append(f"its tokenizer has {data.vocab_size} tokens but the model's vocab_size is {vocab_size} "
                        f"(set --vocab-size {data.vocab_size})")
    if data.seq_len != seq_len:
        problems.append(f"it was packed with seq_len {data.seq_len} but the run asks for seq_len {seq_len} "
                        f"(set --seq-len {data.seq_len} or prepare again)")
    if problems:
        raise DataError(f"data {data.path} does not fit this run: " + "; ".join(problems))


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class SequenceStore:
    """Random access to packed sequences by sample_id; shards are loaded lazily and kept."""

    def __init__(self, data: PreparedData):
        self.data = data
        self._starts = np.array([int(s["first_sample_id"]) for s in data.manifest["shards"]], dtype=np.int64)
        self._shards: dict[int, np.ndarray] = {}

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._shards:
            import pyarrow.parquet as pq

            table = pq.read_table(self.data.shard_paths[i], columns=["sample_id", "input_ids"], memory_map=True)
            col = table.column("input_ids").combine_chunks()
            rows = np.asarray(col.flatten()).reshape(len(col), -1)
            if rows.shape[1] != self.data.seq_len + 1:
                raise DataError(f"{self.data.shard_paths[i]}: rows have {rows.shape[1]} tokens, the manifest says "
                                f"seq_len + 1 = {self.data.seq_len + 1}")
            ids = table.column("sample_id").to_numpy()
            if len(ids) and (ids[0] != self._starts[i] or np.any(np.diff(ids) != 1)):
                raise DataError(f"{self.data.shard_paths[i]}: sample_id column is not the contiguous range "
                                f"starting at {self._starts[i]} that the manifest lists")
            self._shards[i] = rows
        return self._shards[i]

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        """Rows for `sample_ids`, in that order: (len(sample_ids), seq_len + 1) int32."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if len(sample_ids) and (sample_ids.min() < 0 or sample_ids.max() >= self.data.num_sequences):
            raise DataError(f"{self.data.path}: sample ids must be in [0, {self.data.num_sequences}), got "
                            f"{sample_ids.min()}..{sample_ids.max()}")
        shard_of = np.searchsorted(self._starts, sample_ids, side="right") - 1
        out = np.empty((len(sample_ids), self.data.seq_len + 1), dtype=np.int32)
        for i in np.unique(shard_of):
            sel = shard_of == i
            out[sel] = self._shard(int(i))[sample_ids[sel] - self._starts[i]]
        return out


# ---- the order ------------------------------------------------------------------------------------

def split_ids(num_sequences: int, val_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, val_ids): a fixed held-out slice, disjoint from training, same for every seed."""
    if val_samples < 0 or val_samples >= num_sequences:
        raise DataError(f"val_samples {val_samples} must be in [0, {num_sequences}) for a dataset of "
                        f"{num_sequences} sequences")
    rng = np.random.default_rng(VAL_SEED)
    val = np.sort(rng.choice(num_sequences, size=val_samples, replace=False)) if val_samples else np.array([], np.int64)
    mask = np.ones(num_sequences, dtype=bool)
    mask[val] = False
    return np.flatnonzero(mask).astype(np.int64), val.astype(np.int64)


def epoch_order(train_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The training ids in this epoch's order: a permutation seeded by (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return train_ids[rng.permutation(len(train_ids))]


def steps_per_epoch(num_train: int, global_batch_size: int) -> int:
    """Whole global batches per epoch; the remainder (< one batch) waits for the next epoch's order."""
    return num_train // global_batch_size


@dataclass
class DataPosition:
    """Where the run is in its data, derived from the optimizer step alone."""

    epoch: int
    step_in_epoch: int
    samples_seen: int

    @classmethod
    def at(cls, optimizer_step: int, steps_per_epoch: int, global_batch_size: int) -> DataPosition:
        return cls(epoch=optimizer_step // steps_per_epoch, step_in_epoch=optimizer_step % steps_per_epoch,
                   samples_seen=optimizer_step * global_batch_size)


@dataclass
class RankOrder:
    """The sample id at each position of one rank's stream that starts at optimizer step `start_step`.

    Position p belongs to optimizer step s = start_step + p // (G/W), as its k-th id, k = p % (G/W):
    the id at index (s mod steps_per_epoch) * G + rank * G/W + k of epoch (s // steps_per_epoch)'s
    order. The Ray stream (`ray_jobs.stream`) and the in-process stream (`LocalRankStream`) both
    read through it, so the order is coded once.
    """

    train_ids: np.ndarray
    seed: int
    steps_per_epoch: int
    global_batch_size: int
    world_size: int
    rank: int
    start_step: int

    def __post_init__(self):
        self._orders: dict[int, np.ndarray] = {}

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        per_rank = self.global_batch_size // self.world_size
        absolute = self.start_step * per_rank + np.asarray(positions, dtype=np.int64)
        step, k = absolute // per_rank, absolute % per_rank
        epoch, step_in_epoch = step // self.steps_per_epoch, step % self.steps_per_epoch
        index = step_in_epoch * self.global_batch_size + self.rank * per_rank + k  # into the epoch's order
        out = np.empty(len(absolute), dtype=np.int64)
        for e in np.unique(epoch):
            selected = epoch == e
            out[selected] = self._order(int(e))[index[selected]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.train_ids, self.seed, epoch)
        return self._orders[epoch]


class LocalRankStream:
    """One rank's micro-batches read in this process (no Ray): `python -m minilm.train`, torchrun, tests.

    The same interface as the Ray stream (`ray_jobs.stream.RankStream`): `next_step()` returns the
    accumulation_steps micro-batches of the next optimizer step, on `device`, and the sample ids
    they hold (a host array: no device round trip); `data_wait_s` is the time spent reading.
    `store` is anything with `take(sample_ids) -> (n, seq_len + 1) array` (a `SequenceStore`, or rows
    held in memory).
    """

    def __init__(self, store, order: RankOrder, micro_batch_size: int, device="cpu"):
        import torch

        self.store, self.order, self.m, self.device = store, order, micro_batch_size, torch.device(device)
        self.per_rank = order.global_batch_size // order.world_size
        self.position = 0
        self.data_wait_s = 0.0

    def next_step(self):
        import torch

        t0 = time.perf_counter()
        ids = self.order.sample_ids(np.arange(self.position, self.position + self.per_rank))
        self.position += self.per_rank
        rows = torch.from_numpy(np.ascontiguousarray(self.store.take(ids)))
        batches = [chunk.to(self.device, non_blocking=True).long() for chunk in rows.split(self.m)]
        self.data_wait_s += time.perf_counter() - t0
        return batches, ids


class RowsInMemory:
    """Rows held in memory, read by sample id like a `SequenceStore` (tests, benchmarks, `--tokens`)."""

    def __init__(self, rows):
        self.rows = np.asarray(rows)

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        return self.rows[np.asarray(sample_ids, dtype=np.int64)]
