"""Reading prepared data, and the sample order that makes resume exact at any world size.

The resumable iterator Ray Data lacks (ray-project/ray#37633, #48224) is built from three pure
functions instead of iterator state:

* `epoch_order(train_ids, seed, epoch)`: a seeded permutation of the training sample ids;
* optimizer step s of an epoch consumes positions [s*G, (s+1)*G) of that order (G = global batch),
  whatever the world size;
* `rank_sample_ids(...)`: worker r of W takes the r-th contiguous G/W slice of each global batch
  and reads it as accumulation_steps micro-batches.

So the only position to save is the optimizer step (samples_seen = step * G), and a resumed run at
any world size consumes exactly the samples the uninterrupted run would have, step by step.
See docs/data.md for the on-disk format (manifest.json + parquet shards).
"""

from __future__ import annotations

import hashlib
import json
import os
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


def global_batch_ids(order: np.ndarray, step_in_epoch: int, global_batch_size: int) -> np.ndarray:
    start = step_in_epoch * global_batch_size
    return order[start:start + global_batch_size]


def rank_sample_ids(order: np.ndarray, first_step: int, last_step: int, global_batch_size: int,
                    world_size: int, rank: int) -> np.ndarray:
    """Ids rank `rank` consumes for steps [first_step, last_step) of an epoch, in consumption order.

    Per step it is the rank's contiguous G/W slice of the global batch; consecutive chunks of
    micro_batch_size are its micro-batches.
    """
    per_rank = global_batch_size // world_size
    steps = np.arange(first_step, last_step)
    starts = steps * global_batch_size + rank * per_rank
    idx = (starts[:, None] + np.arange(per_rank)[None, :]).reshape(-1)
    return order[idx]


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
